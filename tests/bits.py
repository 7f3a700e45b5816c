"""Exact byte comparison helpers for the bit-equality properties."""
import numpy as np


def as_bytes(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()


def assert_same_bits(a, b, what=""):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a32.shape == b32.shape, f"{what}: shapes {a32.shape} != {b32.shape}"
    if as_bytes(a32) != as_bytes(b32):
        diff = np.flatnonzero(a32.view(np.uint32).ravel() != b32.view(np.uint32).ravel())
        raise AssertionError(f"{what}: {diff.size} of {a32.size} values differ in their "
                             f"bits, first at flat index {diff[0]}")


def assert_bits_differ(a, b, what=""):
    """Negative control: the comparison above is able to fail."""
    assert as_bytes(a) != as_bytes(b), f"{what}: expected different bits"


def nudge(a, index=0):
    """A copy of float32 array a with one value moved by one ulp."""
    out = np.array(a, dtype=np.float32, copy=True)
    flat = out.reshape(-1)
    flat[index] = np.nextafter(flat[index], np.float32(np.inf))
    return out


# The input norm's weight of each block (a per-channel weight on d_model).
_INPUT_NORM = {"mamba1": "norm.weight", "mamba2": "block_norm.weight",
               "mamba3": "block_norm.weight"}


class Reordered:
    """The same block function with its sums over d_model run in another
    order (see reordered_reduction). x, weights: the permuted inputs;
    inputs(a): permute another (..., d_model) input the same way (a
    backward's grad_output); output(y), grads(g): results put back in the
    original order, to compare with the unpermuted run."""

    def __init__(self, weights, x, perm, norm):
        self.weights, self.x, self.perm, self._norm = weights, x, perm, norm
        self._inv = np.argsort(perm)

    def inputs(self, a):
        return np.ascontiguousarray(np.asarray(a)[..., self.perm])

    def output(self, y):
        return np.ascontiguousarray(np.asarray(y)[..., self._inv])

    def grads(self, g):
        out = {k: np.asarray(v) for k, v in g.items()}
        out["x"] = self.output(out["x"])
        out[self._norm] = out[self._norm][self._inv]
        out["in_proj.weight"] = np.ascontiguousarray(out["in_proj.weight"][:, self._inv])
        out["out_proj.weight"] = np.ascontiguousarray(out["out_proj.weight"][self._inv])
        return out


def reordered_reduction(weights, x, block_kind, seed=0):
    """Negative control for "the reduction order never depends on the thread
    count (batch, budget, ...)": the d_model axis of x is permuted together
    with the input axis of in_proj and the input norm's weight, and the
    output axis of out_proj (the residual adds x itself). The block computes
    the same function, up to the output's channel order, but the norm's sum
    of squares and every in_proj dot product run their fma chains over
    d_model in another order. A bit comparison that passes for thread counts
    must fail here. block_kind: 'mamba1', 'mamba2' or 'mamba3'."""
    norm = _INPUT_NORM[block_kind]
    d = np.shape(x)[-1]
    perm = np.random.default_rng(seed).permutation(d)
    if d > 1 and (perm == np.arange(d)).all():
        perm = np.roll(perm, 1)
    w = dict(weights)
    w[norm] = np.ascontiguousarray(np.asarray(weights[norm])[perm])
    w["in_proj.weight"] = np.ascontiguousarray(np.asarray(weights["in_proj.weight"])[:, perm])
    w["out_proj.weight"] = np.ascontiguousarray(np.asarray(weights["out_proj.weight"])[perm])
    return Reordered(w, np.ascontiguousarray(np.asarray(x)[..., perm]), perm, norm)


def assert_only_rounding_differs(a, b, what="", rel=1e-5):
    """Negative control of a reordered_reduction run: the values agree to
    rounding (the same function), yet the bits differ (the bit comparison
    sees a change of summation order)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(b64).max()), 1e-30)
    assert float(np.abs(a64 - b64).max()) <= rel * scale, f"{what}: not the same function"
    assert_bits_differ(a, b, what)


def assert_reordered_backward_differs(make_block, weights, x, g, block_kind, grads, what=""):
    """The backward form of the control above: the gradients of the
    reordered function (reordered_reduction; grad_output permuted with the
    output), put back in order, agree with `grads` (the same block's, as
    NumPy arrays) to rounding, yet differ in bits, for x and for every
    weight the reordering touches."""
    r = reordered_reduction(weights, x, block_kind)
    other = r.grads(make_block(r.weights).backward(r.x, r.inputs(g)))
    for name in ("x", r._norm, "in_proj.weight", "out_proj.weight"):
        assert_only_rounding_differs(other[name], grads[name], f"{what} reordered: {name}",
                                     rel=1e-4)


def assert_shared_workspace_changes_bits(monkeypatch, run, want, nthreads, rounds=20):
    """Negative control for "concurrent calls keep their bits": the same
    concurrent run with ONE workspace seen by every thread (what the
    thread-local workspace prevents) must change some result's bits.
    run(k): thread k's results (a list; every thread's calls of one size),
    want[k]: their bits alone. run(0) first sizes the shared workspace, so
    it is never reallocated under a running call. Timing decides whether
    calls overlap, so up to `rounds` rounds."""
    import types
    from mojolearn.mamba import _base
    from tests.threads import run_in_threads
    monkeypatch.setattr(_base, "_THREAD_WORK", types.SimpleNamespace(array=None))
    run(0)
    for _ in range(rounds):
        got = run_in_threads(run, nthreads)
        if any(as_bytes(a) != as_bytes(b) for k in range(nthreads)
               for a, b in zip(got[k], want[k])):
            return
    raise AssertionError("a workspace shared by threads never changed a bit")
