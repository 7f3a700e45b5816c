"""Contract: backward of the trainable blocks (Mamba1Block, Mamba2Block,
Mamba3Block): the intake of x and grad_output, and the bit properties of
identical mode, each with a negative control. The inference classes refuse
backward (test_weight_errors.py, test_backward_or_forward_only).

The per-block files (tests/test_mamba{1,2,3}_backward.py) keep what one
block has: the gradients against a float64 reference (tests/tolerance.py),
block-specific shapes and conditions. Lengths are spelled in chunks (c,
tests/contract/cases.py `at`): every bit property crosses a fold.
"""
import numpy as np
import pytest

from mojolearn.reference.weights import random_input
from tests.bits import (assert_bits_differ, assert_reordered_backward_differs, assert_same_bits,
                        nudge)
from tests.contract.cases import BAD_DTYPES, CASES, as_bytes, at, fails, snapshot
from tests.errors import assert_not_names

TRAINABLE = [c for c in CASES if not c.inference]


@pytest.fixture(scope="module", params=TRAINABLE, ids=lambda c: c.label)
def case(request):
    """One of the three trainable block classes (overrides conftest's six)."""
    yield request.param
    request.param.__dict__.pop("shared", None)


def names(case):
    return ["x"] + case.weight_names


def grad_arrays(grads):
    """Copies of a backward result (dict of mojolearn.Array) as NumPy arrays."""
    return {k: np.asarray(v).copy() for k, v in grads.items()}


def assert_same_grads(case, a, b, what):
    assert set(a) == set(b) == set(names(case)), what
    for name in names(case):
        assert_same_bits(a[name], b[name], f"{what}: {name}")


def inputs(case, b, l, seed):
    """(x, grad_output) of shape (b, l, d_model), l spelled in chunks."""
    l = at(l, case.chunk)
    return case.x(b, l, seed=seed), case.x(b, l, seed=seed + 1)


# ===================================================================== errors
_INT32 = pytest.param(lambda s: np.ones(s, np.int32), ["int32"], id="int32")


@pytest.mark.parametrize("make,words", BAD_DTYPES + [_INT32])
def test_bad_dtype(block, x, make, words):
    """grad_output, then x, of a dtype other than float32: TypeError naming
    the argument, float32 and the dtype; no caller buffer changes."""
    g = make(x.shape)
    fails(TypeError, block.backward, x, g, keep=[x, g], match=["grad_output", "float32"] + words)
    bad = make(x.shape)
    fails(TypeError, block.backward, bad, x, keep=[x, bad], match=["x", "float32"] + words)


@pytest.mark.parametrize("bad", [None, [[[0.0] * 4] * 5] * 2, "text", 3.0, {"a": 1}],
                         ids=["None", "list", "str", "float", "dict"])
def test_not_a_buffer(block, x, bad):
    match = [type(bad).__name__]
    fails(TypeError, block.backward, x, bad, keep=[x], match=["grad_output"] + match)
    fails(TypeError, block.backward, bad, x, keep=[x], match=["x"] + match)


def test_grad_output_shape_other_than_x(case, block, x):
    B, L, d = x.shape
    for shape in [(B, L, d + 1), (B, L, d - 1), (B, L + 1, d), (B, L - 1, d), (1, L, d),
                  (B + 1, L, d)]:
        g = np.ones(shape, np.float32)
        fails(ValueError, block.backward, x, g, keep=[x, g],
              match=["grad_output", "shape of x", str(x.shape), str(shape)])
    for shape in [(L, d), (B, L * d), (B * L * d,), (1, B, L, d), (B, L, d, 1)]:
        g = np.ones(shape, np.float32)
        fails(ValueError, block.backward, x, g, keep=[x, g], match=["grad_output", str(shape)])
    # control: the same call with a grad_output of x's shape works
    assert block.backward(x, np.ones_like(x))["x"].shape == x.shape


def test_x_shapes(case, block):
    """x is checked first (grad_output of the same shape): its dimensions,
    B >= 1 and L >= 1, and d_model."""
    d = case.d
    for shape in [(5, d), (2, 5, d, 1)]:
        bad = np.ones(shape, np.float32)
        fails(ValueError, block.backward, bad, bad, keep=[bad], match=["x", str(shape)])
    for shape in [(0, 5, d), (2, 0, d), (0, 0, d)]:
        bad = np.zeros(shape, np.float32)
        fails(ValueError, block.backward, bad, bad, match=["x", "B >= 1", "L >= 1", str(shape)])
    for d_bad in (d - 1, d + 1, 2 * d):
        bad = random_input(2, 5, d_bad, seed=1)
        fails(ValueError, block.backward, bad, bad, keep=[bad],
              match=["x", f"d_model {d_bad}", f"block has {d}"])


@pytest.mark.parametrize("which", ["grad_output", "x"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [(0, 0, 0), (1, 3, 7), (1, 4, -1), (0, 2, 5)],
                         ids=["first", "1-3-7", "last", "0-2-5"])
def test_nonfinite_named_with_first_index(case, block, which, value, pos):
    """A non-finite value in grad_output or x: ValueError naming the argument
    and the flat index of the first one (a later one is not named)."""
    x = case.x(seed=4)
    g = case.x(seed=5)
    bad = g if which == "grad_output" else x
    pos = (pos[0], pos[1], pos[2] % case.d)
    idx = int(np.ravel_multi_index(pos, bad.shape))
    bad.reshape(-1)[idx] = value
    if idx + 7 < bad.size:  # a later non-finite value: the first index is reported
        bad.reshape(-1)[idx + 7] = np.nan
    msg = fails(ValueError, block.backward, x, g, keep=[x, g],
                match=[which, f"flat index {idx}"])
    assert_not_names(msg, f"index {idx + 7}")


# ======================================================================= bits
@pytest.mark.parametrize("shape", [(1, 1), (3, "2c+6"), (2, "c"), (2, "c+1")],
                         ids=["1x1", "3x2c+6", "2xc", "2xc+1"])
def test_thread_count_does_not_change_bits(case, threads, shape):
    """Gradients at 2..5 threads equal 1 thread's, bit for bit. Controls: a
    one-ulp change of grad_output changes them; the same function with its
    d_model sums in another order (what a thread-dependent reduction would
    do) has other bits."""
    blk = case.shared
    x, g = inputs(case, shape[0], shape[1], seed=31)
    threads(1)
    ref = grad_arrays(blk.backward(x, g))
    for n in (2, 3, 4, 5):
        threads(n)
        assert_same_grads(case, grad_arrays(blk.backward(x, g)), ref, f"{n} threads vs 1")
    nudged = grad_arrays(blk.backward(x, nudge(g, index=g.size - 1)))
    assert_bits_differ(nudged["x"], ref["x"], "nudged grad_output")
    assert_reordered_backward_differs(case.cls, case.weights(seed=21), x, g, case.block_kind,
                                      ref)


def test_repeated_calls_are_identical(case):
    """A repeated call, after other shapes and a forward dirtied the shared
    workspace, and a fresh block give the first call's bits. Control: a
    one-ulp change of x changes them."""
    blk = case.shared
    x, g = inputs(case, 2, "2c+11", seed=33)
    first = grad_arrays(blk.backward(x, g))
    blk.backward(*inputs(case, 3, "2c+12", seed=1))
    blk.forward(case.x(4, at("c+26", case.chunk), seed=3))
    assert_same_grads(case, grad_arrays(blk.backward(x, g)), first, "repeated call")
    fresh = case.block(case.weights(seed=21))
    assert_same_grads(case, grad_arrays(fresh.backward(x, g)), first, "fresh block")
    assert_bits_differ(np.asarray(blk.backward(nudge(x, 7), g)["x"]), first["x"], "nudged x")


def test_x_gradient_of_a_row_equals_the_row_alone(case):
    """Each row's x gradient equals the row run alone, bit for bit. Control:
    one ulp of row 1's grad_output (its first token) in the same batch moves
    row 1's x gradient, and rows 0 and 2 keep their bits."""
    blk = case.shared
    x, g = inputs(case, 3, "2c+6", seed=35)
    full = grad_arrays(blk.backward(x, g))
    for i in range(3):
        alone = grad_arrays(blk.backward(np.ascontiguousarray(x[i:i + 1]),
                                         np.ascontiguousarray(g[i:i + 1])))
        assert_same_bits(full["x"][i], alone["x"][0], f"x gradient of row {i}")
    other = grad_arrays(blk.backward(x, nudge(g, index=g[0].size + 5)))
    assert_bits_differ(other["x"][1], full["x"][1], "row 1 with a nudged grad_output")
    assert_same_bits(other["x"][0], full["x"][0], "row 0 beside it")
    assert_same_bits(other["x"][2], full["x"][2], "row 2 beside it")


def test_zero_grad_output_gives_exact_zeros(case):
    """grad_output all zero: every gradient exactly +0.0 (no -0.0). Control:
    the tiny 2**-60 in one place (row 1, last token) reaches every array, and
    row 0's x gradient stays zero."""
    blk = case.shared
    x = case.x(2, at("c+13", case.chunk), seed=37)
    got = grad_arrays(blk.backward(x, np.zeros_like(x)))
    assert set(got) == set(names(case))
    for name in names(case):
        assert (got[name].view(np.uint32) == 0).all(), f"{name}: not all +0.0"
    g = np.zeros_like(x)
    g[1, -1, 3] = np.float32(2.0 ** -60)
    got = grad_arrays(blk.backward(x, g))
    for name in names(case):
        assert (got[name] != 0).any(), f"{name} stayed zero"
    assert (got["x"][1, -1] != 0).any() and (got["x"][0] == 0).all()


def test_backward_reads_and_changes_nothing(case):
    """backward neither reads nor changes x, grad_output, a state the block
    filled (every array and value), the block's reports or later forwards:
    the gradients equal a fresh block's."""
    blk = case.shared
    x, g = inputs(case, 2, 20, seed=38)
    y0 = as_bytes(blk.forward(x))
    state = blk.allocate_state(2)
    blk.forward(x, state)
    before = snapshot(x, g, state)
    reports = case.reports_of(blk)
    got = grad_arrays(blk.backward(x, g))
    assert snapshot(x, g, state) == before, "backward changed x, grad_output or the state"
    for name, a, b in zip(case.reports, case.reports_of(blk), reports):
        assert_same_bits(a, b, f"{name} report")
    fresh = case.block(case.weights(seed=21))
    assert_same_grads(case, got, grad_arrays(fresh.backward(x, g)), "after a stateful forward")
    assert as_bytes(blk.forward(x)) == y0, "forward after backward"


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_packed_weights_give_the_bits_of_their_float32_expansion(case, fmt):
    """Control: the other format's expansion gives other bits."""
    lowbit = pytest.importorskip("mojolearn.lowbit")
    w = case.weights(seed=21)
    x, g = inputs(case, 2, 40, seed=40)

    def expanded(f):
        return case.cls({k: np.asarray(v) for k, v in lowbit.unpack(lowbit.pack(w, f))[0].items()})

    a = grad_arrays(case.cls(lowbit.pack(w, fmt)).backward(x, g))
    assert_same_grads(case, a, grad_arrays(expanded(fmt).backward(x, g)),
                      f"{fmt} packed vs expanded")
    other = "int8" if fmt == "bfloat16" else "bfloat16"
    assert_bits_differ(a["x"], grad_arrays(expanded(other).backward(x, g))["x"],
                       f"{fmt} packed vs {other} expanded")
