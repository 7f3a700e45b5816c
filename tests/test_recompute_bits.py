"""The backward's recomputed forward activations have the forward's bits.

A backward recomputes the forward (from per-chunk checkpoints) before it
differentiates it; if the recompute rounded differently, the gradients would
be those of a slightly different function. Each test runs the public
backward and forward ops, then reads both ops' activations out of the
calling thread's workspace (the ops leave them there) at the offsets the
binary's own layouts give (ml_workspace_offset, mojo/.../probe.mojo), and
compares bytes:
  * the first chunk's activations (the last the backward recomputes) with
    a forward over those tokens;
  * the state checkpoints at every later chunk start (the backward's pass
    A) with the state at the end of a forward over the tokens before it.
Controls: one value nudged by one ulp fails the comparison, and a forward
over an input moved by 1e-3 gives other bits.
"""
import ctypes

import numpy as np
import pytest

import mojolearn
from mojolearn import _abi
from mojolearn.mamba import _base
from mojolearn.reference.weights import (
    mamba1_weights, mamba2_weights, mamba3_weights, random_input,
)
from tests.bits import assert_same_bits, assert_bits_differ, nudge
from tests.native_calls import watching_runs

# probe.mojo's activation ids
(PR_TOKENS, PR_XN, PR_HG, PR_U, PR_DBC, PR_DL, PR_YG, PR_WIN, PR_H, PR_DA, PR_CB,
 PR_BCN, PR_QKR, PR_THETA, PR_KLAST, PR_VLAST, PR_ROWS) = range(17)


@pytest.fixture(scope="module")
def probe():
    from mojolearn import _loader
    lib = ctypes.CDLL(str(_loader.library_path("cpu")))
    fn = lib.ml_workspace_offset
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return fn


class Ran:
    """One op run through the public API: its workspace bytes afterwards and
    the offsets of its activations (probe.mojo)."""

    def __init__(self, blk, op, call, probe):
        op = _abi.op_spec(blk._lib, op).op  # the spec names the op
        calls = []
        with watching_runs(blk, lambda o, args: calls.append((o, list(args)))):
            call()
        runs = [args for o, args in calls if o == op]
        assert len(runs) == 1, f"op {op} ran {len(runs)} times"
        self.args = (ctypes.c_int64 * len(runs[0]))(*runs[0])
        self.op, self.probe = op, probe
        work = _base._THREAD_WORK.array  # the calling thread's workspace, kept
        assert work is not None and work.address in runs[0], "the op's workspace was not kept"
        self.work = np.frombuffer(memoryview(work).cast("B"), dtype=np.float32).copy()

    def at(self, which, count):
        off = self.probe(self.op, ctypes.addressof(self.args), which)
        assert off >= 0, f"op {self.op} has no activation {which}"
        assert off + count <= self.work.size
        return self.work[off:off + count]

    def tokens(self):
        return self.probe(self.op, ctypes.addressof(self.args), PR_TOKENS)


def _backward(blk, x, g, probe):
    return Ran(blk, blk._runner.spec.backward_op, lambda: blk.backward(x, g), probe)


def _forward(blk, x, probe, state=None):
    return Ran(blk, blk._runner.spec.forward_op, lambda: blk.forward(x, state), probe)


def _head(x, n):
    """The first n tokens of every row of x, contiguous."""
    return np.ascontiguousarray(x[:, :n])


def _check(pairs, what):
    for name, got, want in pairs:
        assert_same_bits(got, want, f"{what} {name}")


def _controls(pairs_of):
    """pairs_of(x_fwd): the pairs with the forwards run on x_fwd (None: on
    the backward's x). One value one ulp off fails the comparison; a forward
    on an input moved by 1e-3 gives other bits in every pair."""
    pairs = pairs_of(None)
    for name, got, want in pairs:
        with pytest.raises(AssertionError):
            assert_same_bits(nudge(got, got.size // 2), want, name)
    for name, got, want in pairs_of(np.float32(1e-3)):
        assert_bits_differ(got, want, name)
    return pairs


def _moved(x, shift):
    return x if shift is None else x + shift * random_input(*x.shape, seed=5)


def _controls_of(pairs_fn, d, B, L, probe):
    """_controls of pairs_fn(d, B, L, probe, x, x_fwd) on one x (seed L)."""
    x = random_input(B, L, d, seed=L)
    return _controls(lambda shift: pairs_fn(d, B, L, probe, x=x, x_fwd=_moved(x, shift)))


def _backward_case(block_cls, make_weights, d, B, L, probe, x, x_fwd, chunk):
    """The start of every *_pairs: (weights (seed d + 1), the block, the
    forwards' input (x_fwd, default x), the backward's run on x (seed L
    unless given) and g (seed L + 1), the tokens of its first recomputed
    chunk, checked to be min(chunk, L))."""
    w = make_weights(d, seed=d + 1)
    x = random_input(B, L, d, seed=L) if x is None else x
    g = random_input(B, L, d, seed=L + 1)
    blk = block_cls(w)
    bw = _backward(blk, x, g, probe)
    n = bw.tokens()
    assert n == min(chunk, L)
    return w, blk, x if x_fwd is None else x_fwd, bw, n


# --------------------------------------------------------------------------- Mamba-1
def m1_pairs(d, B, L, probe, x=None, x_fwd=None):
    """(what, backward's values, forward's values) of every compared array
    (x_fwd: the forwards' input, default x). Chunk 0 (32 tokens): in_proj's,
    the conv's, x_proj's and dt's outputs and the gated scan output; at
    every later chunk start: the conv window and h."""
    _, blk, x_fwd, bw, tc = _backward_case(mojolearn.Mamba1Block, mamba1_weights, d, B, L, probe,
                                           x, x_fwd, 32)
    fw = _forward(blk, _head(x_fwd, tc), probe)
    assert fw.tokens() == tc  # one forward chunk: the same (b, t) row order
    di, rows = blk.d_inner, B * tc
    sizes = {"in_proj": (PR_HG, rows * 2 * di), "conv": (PR_U, rows * di),
             "x_proj": (PR_DBC, rows * (blk.dt_rank + 32)), "dt": (PR_DL, rows * di),
             "yg": (PR_YG, rows * di)}
    out = [(f"chunk 0 {name}", bw.at(k, n), fw.at(k, n)) for name, (k, n) in sizes.items()]
    win, hs = B * 4 * di, B * 16 * di
    for c in range(1, -(-L // tc)):
        fc = _forward(blk, _head(x_fwd, c * tc), probe)
        out.append((f"conv window at chunk {c}", bw.at(PR_WIN, (c + 1) * win)[c * win:],
                    fc.at(PR_WIN, win)))
        out.append((f"h at chunk {c}", bw.at(PR_H, (c + 1) * hs)[c * hs:], fc.at(PR_H, hs)))
    return out


@pytest.mark.parametrize("d,B,L", [(16, 2, 70), (5, 3, 33), (24, 1, 96), (16, 2, 9)])
def test_mamba1_recompute_has_the_forward_bits(d, B, L, probe):
    _check(m1_pairs(d, B, L, probe), f"Mamba-1 d={d} B={B} L={L}")


def test_mamba1_recompute_check_can_fail(probe):
    assert len(_controls_of(m1_pairs, 16, 2, 70, probe)) == 5 + 2 * 2


# --------------------------------------------------------------------------- Mamba-3
def m3_pairs(d, B, L, probe, x=None, x_fwd=None):
    """Chunk 0 (64 tokens): v and the normed B | C columns of in_proj's
    output, o, the rotated q | k rows (the forward keeps them in its state's
    buffers); at every later chunk start: h, the angles, the last rotated k
    and v of the chunk before (a forward's state over the tokens before it;
    h after one more token, as the forward folds a full chunk only when the
    next token arrives)."""
    w, blk, x_fwd, bw, n = _backward_case(mojolearn.Mamba3Block, mamba3_weights, d, B, L, probe,
                                          x, x_fwd, 64)
    nh, di = blk.nheads, 2 * d
    npj = w["in_proj.weight"].shape[0]  # z | v | B | C | dt | A | trap | angles
    st = blk.allocate_state(B)
    fw = _forward(blk, _head(x_fwd, n), probe, st)
    assert fw.tokens() == n
    rows = B * n
    fproj = fw.at(PR_HG, rows * npj).reshape(rows, npj)  # o replaced z; B, C normed
    bproj = bw.at(PR_HG, rows * npj).reshape(rows, npj)
    rmax = bw.probe(bw.op, ctypes.addressof(bw.args), PR_ROWS)
    qkr = bw.at(PR_QKR, nh * rmax * 256).reshape(nh, rmax, 256)[:, :rows]
    qkr = qkr.reshape(nh, B, n, 256).transpose(1, 2, 0, 3)  # (B, n, H, 256)
    out = [("chunk 0 v", bproj[:, di:2 * di], fproj[:, di:2 * di]),
           ("chunk 0 B|C norms", bw.at(PR_BCN, rows * 256), fproj[:, 2 * di:2 * di + 256]),
           ("chunk 0 o", bw.at(PR_YG, rows * di), fproj[:, :di]),
           ("chunk 0 rotated q", qkr[..., :128], np.asarray(st.buffer_qrot)[:, :n]),
           ("chunk 0 rotated k", qkr[..., 128:], np.asarray(st.buffer_krot)[:, :n])]
    bh = B * nh
    for c in range(1, -(-L // 64)):
        st = blk.allocate_state(B)
        blk.forward(_head(x_fwd, 64 * c), st)
        out.append((f"angles at chunk {c}", bw.at(PR_THETA, (c + 1) * bh * 32)[c * bh * 32:],
                    np.asarray(st.theta)))
        out.append((f"last k before chunk {c}", bw.at(PR_KLAST, (c + 1) * bh * 128)[c * bh * 128:],
                    np.asarray(st.buffer_krot)[:, 63]))
        out.append((f"last v before chunk {c}", bw.at(PR_VLAST, (c + 1) * bh * 64)[c * bh * 64:],
                    np.asarray(st.buffer_v)[:, 63]))
        st = blk.allocate_state(B)
        blk.forward(_head(x_fwd, 64 * c + 1), st)
        hs = bh * 64 * 128
        out.append((f"h at chunk {c}", bw.at(PR_H, (c + 1) * hs)[c * hs:], np.asarray(st.h)))
    return [(nm, np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel())
            for nm, a, b in out]


@pytest.mark.parametrize("d,B,L", [(32, 2, 150), (64, 1, 130), (32, 3, 40)])
def test_mamba3_recompute_has_the_forward_bits(d, B, L, probe):
    _check(m3_pairs(d, B, L, probe), f"Mamba-3 d={d} B={B} L={L}")


def test_mamba3_recompute_check_can_fail(probe):
    assert len(_controls_of(m3_pairs, 32, 2, 150, probe)) == 5 + 2 * 4


# --------------------------------------------------------------------------- Mamba-2
def m2_pairs(d, B, L, probe, x=None, x_fwd=None):
    """Chunk 0 (256 tokens): the conv output xBC, dt and dA; when the
    forward ran the chunk as one group (B = 1), also in_proj's output, CB
    (j <= i) and the gated norm's output. At every later chunk start: h (a
    forward over the tokens before it)."""
    w, blk, x_fwd, bw, n = _backward_case(mojolearn.Mamba2Block, mamba2_weights, d, B, L, probe,
                                          x, x_fwd, 256)
    di = 2 * d
    nh, npj = di // 64, w["in_proj.weight"].shape[0]
    cd = di + 256
    fw = _forward(blk, _head(x_fwd, n), probe)
    rows = B * n
    out = [("chunk 0 xBC", bw.at(PR_U, rows * cd), fw.at(PR_U, rows * cd))]
    for k, name in ((PR_DL, "dt"), (PR_DA, "dA")):
        out.append((f"chunk 0 {name}", bw.at(k, B * nh * 256).reshape(B, nh, 256)[..., :n],
                    fw.at(k, B * nh * 256).reshape(B, nh, 256)[..., :n]))
    if fw.tokens() == n:  # one group: the row arrays hold the whole chunk
        out.append(("chunk 0 in_proj", bw.at(PR_HG, rows * npj), fw.at(PR_HG, rows * npj)))
        low = np.tril(np.ones((n, n), dtype=bool))
        bcb = bw.at(PR_CB, B * 256 * 256).reshape(B, 256, 256)[:, :n, :n]
        fcb = fw.at(PR_CB, rows * 256).reshape(B, n, 256)[:, :, :n]
        out.append(("chunk 0 CB", bcb[:, low], fcb[:, low]))
        out.append(("chunk 0 gated norm", bw.at(PR_YG, rows * di), fw.at(PR_YG, rows * di)))
    hs = B * nh * 64 * 128
    for c in range(1, -(-L // 256)):
        fc = _forward(blk, _head(x_fwd, 256 * c), probe)
        out.append((f"h at chunk {c}", bw.at(PR_H, (c + 1) * hs)[c * hs:], fc.at(PR_H, hs)))
    return [(nm, np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel())
            for nm, a, b in out]


@pytest.mark.parametrize("d,B,L", [(32, 1, 600), (64, 2, 300), (64, 1, 300), (32, 1, 77)])
def test_mamba2_recompute_has_the_forward_bits(d, B, L, probe):
    _check(m2_pairs(d, B, L, probe), f"Mamba-2 d={d} B={B} L={L}")


def test_mamba2_recompute_check_can_fail(probe):
    assert len(_controls_of(m2_pairs, 32, 1, 600, probe)) == 6 + 2
