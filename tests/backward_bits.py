"""The bit-equality checks every block's backward must pass, shared by
tests/test_mamba{1,2,3}_backward.py (each with its own block, width,
shapes and seeds; each keeps its own negative controls where they differ)."""
import numpy as np

from tests.bits import assert_bits_differ, assert_same_bits, nudge
from mojolearn.reference.weights import random_input


def grad_arrays(grads):
    """Copies of a backward result (dict of mojolearn.Array) as NumPy arrays."""
    return {k: np.asarray(v).copy() for k, v in grads.items()}


def assert_same_grads(a, b, names, what):
    for name in names:
        assert_same_bits(a[name], b[name], f"{what}: {name}")


def check_thread_count(block, names, d, shape, seeds, counts, threads):
    """Gradients at each thread count in counts equal 1 thread's, bit for
    bit; negative control: a one-ulp change of grad_output changes them."""
    B, L = shape
    x, g = random_input(B, L, d, seed=seeds[0]), random_input(B, L, d, seed=seeds[1])
    threads(1)
    ref = grad_arrays(block.backward(x, g))
    for n in counts:
        threads(n)
        assert_same_grads(grad_arrays(block.backward(x, g)), ref, names, f"{n} threads vs 1")
    nudged = grad_arrays(block.backward(x, nudge(g, index=g.size - 1)))
    assert_bits_differ(nudged["x"], ref["x"], "nudged grad_output")


def check_repeated_calls(block, fresh_block, names, d, L, seeds, dirty_L):
    """A repeated call, after other shapes and a forward dirtied the shared
    workspace, and a fresh block give the first call's bits; negative
    control: a one-ulp change of x changes them."""
    x, g = random_input(2, L, d, seed=seeds[0]), random_input(2, L, d, seed=seeds[1])
    first = grad_arrays(block.backward(x, g))
    block.backward(random_input(3, dirty_L, d, seed=1), random_input(3, dirty_L, d, seed=2))
    block.forward(random_input(4, 90, d, seed=3))
    assert_same_grads(grad_arrays(block.backward(x, g)), first, names, "repeated call")
    assert_same_grads(grad_arrays(fresh_block.backward(x, g)), first, names, "fresh block")
    assert_bits_differ(np.asarray(block.backward(nudge(x, 7), g)["x"]), first["x"], "nudged x")


def check_rows_alone(block, d, B, L, seeds):
    """Each row's x gradient equals the row run alone, bit for bit. Returns
    (x, g, full gradients, the last row's gradients alone) for the caller's
    negative control."""
    x, g = random_input(B, L, d, seed=seeds[0]), random_input(B, L, d, seed=seeds[1])
    full = grad_arrays(block.backward(x, g))
    for i in range(B):
        alone = grad_arrays(block.backward(np.ascontiguousarray(x[i:i + 1]),
                                           np.ascontiguousarray(g[i:i + 1])))
        assert_same_bits(full["x"][i], alone["x"][0], f"x gradient of row {i}")
    return x, g, full, alone
