"""Mamba-2 bad input (docs/guide/errors.rst) and weights/params.

Every error test checks the exception class and that the message names the
thing at fault; every failing call that was given a state also checks that
the state (its four arrays and buffered_tokens) and the caller's x kept
their bytes exactly: "a failed call changes nothing".
"""
from __future__ import annotations

import array as pyarray
import math

import ml_dtypes
import numpy as np
import pytest

import mojolearn
from mojolearn.mamba import Mamba2Block, Mamba2BlockInference, Mamba2State
from tests.errors import assert_names, raises_naming
from mojolearn.reference.weights import mamba2_weights, random_input

D = 64
DI, H, CD = 128, 2, 384
NPJ = 2 * DI + 256 + H
B, L = 2, 5
NAMES = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
SHAPES = {"conv_window": (B, CD, 4), "h": (B, H, 64, 128), "buffer_xbc": (B, 256, CD),
          "buffer_dtraw": (B, 256, H)}
WEIGHT_NAMES = ["block_norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def weights():
    return mamba2_weights(D, seed=3)


@pytest.fixture(scope="module")
def block(weights):
    return Mamba2Block(weights)


@pytest.fixture
def x():
    return random_input(B, L, D, seed=11)


def _bytes(buf) -> bytes:
    return memoryview(buf).tobytes()


def filled_state(block, batch=B, seed=5, tokens=3):
    st = block.allocate_state(batch)
    block.forward(random_input(batch, tokens, D, seed=seed), st)
    return st


def numpy_state(block, batch=B, seed=5, tokens=3):
    st = filled_state(block, batch, seed, tokens)
    return Mamba2State(*[np.array(getattr(st, n)) for n in NAMES],
                       buffered_tokens=st.buffered_tokens)


def snapshot(*objs):
    out = []
    for o in objs:
        if isinstance(o, Mamba2State):
            out.append(tuple(_bytes(getattr(o, n)) for n in NAMES) + (o.buffered_tokens,))
        else:
            out.append(_bytes(o))
    return out


def fails(exc, fn, *args, keep=(), match=(), **kwargs):
    before = snapshot(*keep)
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = assert_names(str(info.value), *match)   # whole tokens: tests/errors.py
    assert snapshot(*keep) == before, "a failed call changed a caller buffer"
    return msg


def _with(state, **override):
    parts = {n: getattr(state, n) for n in NAMES}
    parts.update(override)
    return Mamba2State(*[parts[n] for n in NAMES], buffered_tokens=state.buffered_tokens)


# ---------------------------------------------------------- bad dtypes
def _bf16_bits(shape):
    n = int(np.prod(shape))
    buf = pyarray.array("H", [0x3F80] * n)
    return memoryview(buf).cast("B").cast("H", shape)


BAD_DTYPES = [
    pytest.param("float64", lambda s: np.ones(s, np.float64), ["float64"], id="float64"),
    pytest.param("float16", lambda s: np.ones(s, np.float16), ["float16"], id="float16"),
    pytest.param("bf16-bits", _bf16_bits, ["uint16", "bfloat16"], id="bf16-bits"),
    pytest.param("float64-Array", lambda s: mojolearn.Array(s, "float64"), ["float64"],
                 id="float64-Array"),
    pytest.param("bfloat16", lambda s: np.ones(s, ml_dtypes.bfloat16), ["bfloat16"],
                 id="bfloat16"),
]


@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_x_bad_dtype(block, case, make, words):
    fails(TypeError, block.forward, make((B, L, D)), match=["x"] + words)
    st = filled_state(block)
    fails(TypeError, block.forward, make((B, L, D)), st, keep=[st], match=["x"] + words)
    fails(TypeError, block.step, make((B, D)), st, keep=[st], match=["x"] + words)


@pytest.mark.parametrize("name", WEIGHT_NAMES)
@pytest.mark.parametrize("case,make,words", BAD_DTYPES[:3])
def test_weight_bad_dtype(weights, name, case, make, words):
    w = dict(weights)
    w[name] = make(weights[name].shape)
    fails(TypeError, Mamba2Block, w, match=[name] + words)


@pytest.mark.parametrize("which", NAMES)
@pytest.mark.parametrize("case,make,words", BAD_DTYPES[:3])
def test_state_bad_dtype(block, x, which, case, make, words):
    good = numpy_state(block)
    st = _with(good, **{which: make(SHAPES[which])})
    keep = [good, x]
    fails(TypeError, block.forward, x, st, keep=keep, match=[f"state.{which}"] + words)
    fails(TypeError, block.step, x[:, 0], st, keep=keep, match=[f"state.{which}"] + words)


# ------------------------------------------------- not a buffer, shapes
@pytest.mark.parametrize("bad", [None, [[[0.0] * D] * L] * B, "text", 3.0],
                         ids=["None", "list", "str", "float"])
def test_x_not_a_buffer(block, bad):
    match = ["x", type(bad).__name__]
    fails(TypeError, block.forward, bad, match=match)
    st = filled_state(block)
    fails(TypeError, block.forward, bad, st, keep=[st], match=match)
    fails(TypeError, block.step, bad, st, keep=[st], match=match)


@pytest.mark.parametrize("shape", [(L, D), (B * L * D,), (1, B, L, D)])
def test_x_wrong_ndim(block, shape):
    bad = np.zeros(shape, np.float32)
    fails(ValueError, block.forward, bad, match=["x", str(tuple(shape))])
    st = filled_state(block)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=["x", str(tuple(shape))])


@pytest.mark.parametrize("shape", [(0, L, D), (B, 0, D)])
def test_x_zero_batch_or_length(block, shape):
    fails(ValueError, block.forward, np.zeros(shape, np.float32), match=["x", str(shape)])
    st = filled_state(block)
    fails(ValueError, block.forward, np.zeros(shape, np.float32), st, keep=[st],
          match=["x", str(shape)])
    fails(ValueError, block.step, np.zeros((0, D), np.float32), st, keep=[st],
          match=["x", "B >= 1", str((0, D))])


@pytest.mark.parametrize("d_bad", [D - 32, D + 1, 2 * D])
def test_x_wrong_d_model(block, d_bad):
    bad = random_input(B, L, d_bad, seed=1)
    match = ["x", f"d_model {d_bad}", f"block has {D}"]
    fails(ValueError, block.forward, bad, match=match)
    st = filled_state(block)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=match)
    fails(ValueError, block.step, bad[:, 0], st, keep=[st], match=match)


@pytest.mark.parametrize("d", [16, 48, 100])
def test_d_model_not_a_multiple_of_32(d):
    w = mamba2_weights(64, seed=1)
    w["block_norm.weight"] = np.ones(d, np.float32)
    fails(ValueError, Mamba2Block, w, match=["multiple of 32", f"block_norm.weight has {d} entries"])


def test_weights_not_a_dict(weights):
    fails(TypeError, Mamba2Block, list(weights.values()), match=["weights"])
    fails(TypeError, Mamba2Block, None, match=["weights"])


@pytest.mark.parametrize("drop", [["dt_bias"], ["norm.weight", "D"], ["block_norm.weight"]])
def test_missing_weights_listed(weights, drop):
    w = {k: v for k, v in weights.items() if k not in drop}
    msg = fails(ValueError, Mamba2Block, w, match=["missing"])
    # in the reported list, not only in the "(expected [...])" list after it
    assert_names(msg.split("(expected", 1)[0], *drop)


def test_unknown_weights_listed(weights):
    w = dict(weights)
    w["mixer.dt_bias"] = weights["dt_bias"]
    w["x_proj.weight"] = np.zeros((3, 3), np.float32)
    fails(ValueError, Mamba2Block, w, match=["unknown", "mixer.dt_bias", "x_proj.weight"])
    del w["A_log"]
    msg = fails(ValueError, Mamba2Block, w, match=["missing", "unknown"])
    assert_names(msg.split("(expected", 1)[0], "A_log")


@pytest.mark.parametrize("name", WEIGHT_NAMES[1:])
def test_wrong_weight_shape_named(weights, name):
    w = dict(weights)
    shape = weights[name].shape
    bad_shape = shape[:-1] + (shape[-1] + 1,)
    w[name] = np.zeros(bad_shape, np.float32)
    fails(ValueError, Mamba2Block, w, match=[name, str(bad_shape)])


def test_weight_not_a_buffer(weights):
    w = dict(weights)
    w["D"] = [1.0, 1.0]
    fails(TypeError, Mamba2Block, w, match=["D", "list"])


# ------------------------------------------------------------ state buffers
@pytest.mark.parametrize("which", NAMES)
def test_read_only_state(block, x, which):
    good = numpy_state(block)
    arr = np.array(getattr(good, which))
    arr.flags.writeable = False
    st = _with(good, **{which: arr})
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st))):
        fails(ValueError, call, *args, keep=[st, x], match=[f"state.{which}", "read-only"])


@pytest.mark.parametrize("which", NAMES)
def test_non_contiguous_state(block, x, which):
    good = numpy_state(block)
    arr = getattr(good, which)
    wide = np.zeros(arr.shape[:-1] + (2 * arr.shape[-1],), np.float32)
    wide[..., ::2] = arr
    st = _with(good, **{which: wide[..., ::2]})
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st))):
        fails(ValueError, call, *args, keep=[wide, good, x],
              match=[f"state.{which}", "C-contiguous"])


@pytest.mark.parametrize("which,shape", [
    ("conv_window", (B, CD, 3)), ("conv_window", (B, CD - 1, 4)), ("h", (B, H, 64, 127)),
    ("h", (B, H + 1, 64, 128)), ("h", (B, H * 64, 128)), ("buffer_xbc", (B, 255, CD)),
    ("buffer_xbc", (B, 256, CD + 1)), ("buffer_dtraw", (B, 256, H + 1)),
    ("buffer_dtraw", (B, 256 * H))])
def test_wrong_state_shape(block, x, which, shape):
    good = numpy_state(block)
    st = _with(good, **{which: np.zeros(shape, np.float32)})
    fails(ValueError, block.forward, x, st, keep=[st, x], match=[f"state.{which}"])
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=[f"state.{which}"])


def test_state_not_a_buffer_or_wrong_type(block, x):
    good = numpy_state(block)
    st = _with(good, h=[0.0] * 10)
    fails(TypeError, block.forward, x, st, keep=[good, x], match=["state.h"])
    with raises_naming(TypeError, "state", "Mamba2State", "dict"):
        block.forward(x, {"h": None})
    m1 = mojolearn.Mamba1Block  # a Mamba-1 state is not a Mamba-2 state
    w1 = __import__("mojolearn.reference.weights", fromlist=["x"]).mamba1_weights(4, 0)
    with raises_naming(TypeError, "state", "Mamba2State", "Mamba1State"):
        block.step(x[:, 0], m1(w1).allocate_state(B))


@pytest.mark.parametrize("state_batch", [1, 3])
def test_batch_mismatch(block, state_batch):
    for st in (filled_state(block, state_batch), numpy_state(block, state_batch)):
        xx = random_input(B, L, D, seed=2)
        match = ["batch mismatch", "x", f"B={B}", f"conv_window {state_batch}"]
        fails(ValueError, block.forward, xx, st, keep=[st, xx], match=match)
        fails(ValueError, block.step, xx[:, 0], st, keep=[st], match=match)


@pytest.mark.parametrize("which", NAMES)
def test_batch_mismatch_between_state_arrays(block, x, which):
    good = numpy_state(block)
    other = numpy_state(block, B + 1)
    st = _with(good, **{which: getattr(other, which)})
    match = ["batch mismatch", f"{which} {B + 1}"]
    fails(ValueError, block.forward, x, st, keep=[good, other, x], match=match)
    fails(ValueError, block.step, x[:, 0], st, keep=[good, other], match=match)


@pytest.mark.parametrize("bad", [-1, 256, 300, 10**9])
def test_buffered_tokens_out_of_range(block, x, bad):
    with raises_naming(ValueError, f"buffered_tokens = {bad}", "[0, 256)"):
        Mamba2State(*[np.zeros(SHAPES[n], np.float32) for n in NAMES], buffered_tokens=bad)
    st = numpy_state(block)
    good = snapshot(st)
    st.buffered_tokens = bad  # set after construction: checked at the call
    before = [_bytes(getattr(st, n)) for n in NAMES]
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st))):
        with raises_naming(ValueError, f"state.buffered_tokens = {bad}", "[0, 256)"):
            call(*args)
        assert [_bytes(getattr(st, n)) for n in NAMES] == before
        assert st.buffered_tokens == bad
    assert good[0][:4] == tuple(before)


@pytest.mark.parametrize("bad", [2.0, True, "3", None])
def test_buffered_tokens_bad_type(bad):
    with raises_naming(TypeError, "buffered_tokens", type(bad).__name__):
        Mamba2State(*[np.zeros(SHAPES[n], np.float32) for n in NAMES], buffered_tokens=bad)


# -------------------------------------------------------------- non-finite
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [(0, 0, 0), (1, 2, 3), (1, L - 1, D - 1)])
def test_nonfinite_x_named_with_first_index(block, value, pos):
    x = random_input(B, L, D, seed=4)
    idx = int(np.ravel_multi_index(pos, x.shape))
    x.reshape(-1)[idx] = value
    if idx + 7 < x.size:
        x.reshape(-1)[idx + 7] = np.nan
    fails(ValueError, block.forward, x, keep=[x], match=["x", f"index {idx}"])
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["x", f"index {idx}"])
    xt = np.ascontiguousarray(x[:, pos[1]])
    tidx = pos[0] * D + pos[2]
    fails(ValueError, block.step, xt, st, keep=[st, xt], match=["x", f"index {tidx}"])


def test_nonfinite_x_with_lengths_only_real_positions(block):
    x = random_input(B, L, D, seed=4)
    x[1, 3:] = np.nan                        # padding: allowed
    y = np.asarray(block.forward(x, lengths=[L, 3]))
    assert (y[1, 3:].view(np.uint32) == 0).all()
    x[1, 2, 5] = np.inf                      # a real position: refused
    idx = int(np.ravel_multi_index((1, 2, 5), x.shape))
    fails(ValueError, block.forward, x, lengths=[L, 3], keep=[x], match=["x", f"index {idx}"])


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_nonfinite_weight_at_construction(weights, name):
    w = dict(weights)
    w[name] = np.array(weights[name], copy=True)
    idx = w[name].size - 1
    w[name].reshape(-1)[idx] = np.nan
    fails(ValueError, Mamba2Block, w, keep=[w[name]], match=[name, f"index {idx}"])


@pytest.mark.parametrize("which,pos", [("conv_window", (1, 5, 2)), ("h", (0, 1, 3, 100)),
                                       ("buffer_xbc", (1, 2, 7)), ("buffer_dtraw", (0, 1, 1))])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_nonfinite_state(block, x, which, pos, value):
    st = filled_state(block)                 # buffered_tokens == 3: rows 0..2 are read
    arr = np.asarray(getattr(st, which))
    arr[pos] = value
    idx = int(np.ravel_multi_index(pos, arr.shape))
    match = [f"state.{which}", f"index {idx}"]
    fails(ValueError, block.forward, x, st, keep=[st, x], match=match)
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=match)
    arr[pos] = 0.0
    block.forward(x, st)


def test_unread_buffer_rows_are_not_checked(block, x):
    """Rows at and past buffered_tokens are never read, so they may hold anything."""
    st = filled_state(block)
    np.asarray(st.buffer_xbc)[:, 3:] = np.nan
    np.asarray(st.buffer_dtraw)[:, 200] = np.inf
    ref = filled_state(block)
    assert np.asarray(block.forward(x, st)).tobytes() == np.asarray(block.forward(x, ref)).tobytes()


# ------------------------------------------------------- numeric_mode, dt_limit
@pytest.mark.parametrize("mode", ["IDENTICAL", "exact", "", None, 0])
def test_bad_numeric_mode(weights, mode):
    match = ["numeric_mode", repr(mode)]
    fails(ValueError, Mamba2Block, weights, numeric_mode=mode, match=match)
    fails(ValueError, Mamba2BlockInference, weights, numeric_mode=mode, match=match)


def test_fast_mode_without_binary(weights):
    from mojolearn import _loader
    if "fast" in _loader.available_modes():
        pytest.skip("a fast binary is installed")
    fails(ValueError, Mamba2Block, weights, numeric_mode="fast", match=["numeric_mode", "'fast'"])


@pytest.mark.parametrize("bad", [(float("nan"), 1.0), (0.0, float("nan")), (0.2, 0.1),
                                 (1.0,), (0.0, 1.0, 2.0), 0.5, None, "ab", (0.0, "1"),
                                 (True, 1.0), (0.0, 1j)],
                         ids=["nan-lo", "nan-hi", "lo>hi", "one", "three", "scalar", "None",
                              "str", "str-item", "bool", "complex"])
def test_bad_dt_limit(weights, bad):
    fails(ValueError, Mamba2Block, weights, dt_limit=bad, match=["dt_limit"])
    fails(ValueError, Mamba2BlockInference, weights, dt_limit=bad, match=["dt_limit"])


def test_good_dt_limits_accepted(weights):
    for lim in ((0, 1), (0.5, 0.5), [0.0, math.inf], (np.float32(0.01), np.float64(0.2)),
                (-1.0, 1e300)):
        blk = Mamba2Block(weights, dt_limit=lim)
        assert blk.dt_limit == (float(lim[0]), float(lim[1]))


# ------------------------------------------------------------------ step
def test_step_more_than_one_token(block):
    st = filled_state(block)
    for n in (2, L):
        xx = random_input(B, n, D, seed=9)
        # names x, says one token per row and gives the received shape
        fails(ValueError, block.step, xx, st, keep=[st, xx],
              match=["x", "one token", "(B, 1, d_model)", f"got {(B, n, D)}"])


def test_step_without_state(block, x):
    fails(ValueError, block.step, x[:, 0], None, keep=[x], match=["state"])


def test_step_2d_and_3d_same_bytes(block, x):
    s1, s2 = filled_state(block), filled_state(block)
    y1 = block.step(np.ascontiguousarray(x[:, 0]), s1)
    y2 = block.step(x[:, :1], s2)
    assert y1.shape == y2.shape == (B, 1, D)
    assert _bytes(y1) == _bytes(y2)
    assert snapshot(s1) == snapshot(s2)


# ----------------------------------------------------------------- lengths
@pytest.mark.parametrize("lengths", [[True, 3], [2.0, 3], ["2", 3]], ids=["bool", "float", "str"])
def test_lengths_bad_type(block, x, lengths):
    fails(TypeError, block.forward, x, lengths=lengths, keep=[x], match=["lengths[0]", "int"])


@pytest.mark.parametrize("lengths,bad_i", [([0, 3], 0), ([3, L + 1], 1)])
def test_lengths_out_of_range(block, x, lengths, bad_i):
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=[f"lengths[{bad_i}] = {lengths[bad_i]}", f"L={L}"])


def test_lengths_wrong_count_and_with_state(block, x):
    fails(ValueError, block.forward, x, lengths=[3], keep=[x], match=["lengths", f"B={B}", "got 1"])
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, lengths=[L, L], keep=[st, x],
          match=["lengths", "state"])


# ------------------------------------------------- backward, params, attributes
def test_inference_backward_not_implemented(weights, x):
    with raises_naming(NotImplementedError, "forward-only"):
        Mamba2BlockInference(weights).backward(x, x)


def test_attributes(block):
    assert (block.d_model, block.d_inner, block.nheads, block.conv_dim) == (D, DI, H, CD)
    assert block.dt_limit == (0.0, math.inf)
    assert block.weight_format == "float32"
    assert block.numeric_mode == "identical" and block.numeric_mode_used() == "identical"
    assert block.vendor_used() == "cpu"
    with raises_naming(AttributeError, "h_last_"):
        Mamba2Block(mamba2_weights(32, 1)).h_last_


def test_get_and_set_params(weights, x):
    blk = Mamba2Block(weights, dt_limit=(0.0, 0.05))
    p = blk.get_params()
    assert set(p) == {"weights", "numeric_mode", "dt_limit"}
    assert p["dt_limit"] == (0.0, 0.05) and sorted(p["weights"]) == sorted(WEIGHT_NAMES)
    y = _bytes(blk.forward(x))
    assert _bytes(Mamba2Block(**p).forward(x)) == y
    blk.set_params(dt_limit=(0.0, math.inf))
    assert blk.dt_limit == (0.0, math.inf)
    assert _bytes(blk.forward(x)) == _bytes(Mamba2Block(weights).forward(x)) != y
    with raises_naming(ValueError, "dt_limit", "(1.0, 0.0)"):
        blk.set_params(dt_limit=(1.0, 0.0))
    assert blk.dt_limit == (0.0, math.inf)  # a failed set_params changes nothing
    with raises_naming(ValueError, "unknown parameters", "chunk_size"):
        blk.set_params(chunk_size=64)


def test_weights_copied_at_construction(weights, x):
    w = {k: np.array(v, copy=True) for k, v in weights.items()}
    blk = Mamba2Block(w)
    y = _bytes(blk.forward(x))
    for v in w.values():
        v[...] = 0.5
    assert _bytes(blk.forward(x)) == y


def test_h_last_lazy_report_after_state_advanced_elsewhere(weights, x):
    a, b = Mamba2Block(weights), Mamba2Block(weights)
    st = a.allocate_state(B)
    a.forward(x, st)
    b.step(x[:, 0], st)  # another block advances the same state
    with raises_naming(ValueError, "h_last_"):
        a.h_last_
    h = np.asarray(b.h_last_).copy()  # b's own report is still available
    assert h.shape == (B, H, 64, 128)
    assert np.asarray(b.h_last_).tobytes() == h.tobytes()  # cached after first access


def test_buffered_tokens_numpy_int_accepted(block, x):
    st = numpy_state(block)
    ref = numpy_state(block)
    st.buffered_tokens = np.int64(st.buffered_tokens)
    assert _bytes(block.forward(x, st)) == _bytes(block.forward(x, ref))
    assert st.buffered_tokens == ref.buffered_tokens and type(st.buffered_tokens) is int


def test_h_last_uses_the_position_the_call_left(block, x):
    """Editing buffered_tokens after a call does not change the lazy report."""
    st = filled_state(block)
    ref = filled_state(block)
    block.forward(x, ref)
    h_ref = np.asarray(block.h_last_).copy()
    block.forward(x, st)
    st.buffered_tokens = 0
    assert np.asarray(block.h_last_).tobytes() == h_ref.tobytes()


# ------------------------------------------------------------ decode session
def test_session_holds_state(block, x):
    st = filled_state(block)
    with block.decode_session(st) as sess:
        for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                           (block.decode_session, (st,))):
            fails(ValueError, call, *args, keep=[st, x], match=["Mamba2DecodeSession"])
        y = sess.step(x[:, 0])
        assert y.shape == (B, 1, D)
        assert st.buffered_tokens == 3  # stale until sync_state
        sess.sync_state()
        assert st.buffered_tokens == 4
    assert not sess.is_open
    block.step(x[:, 1], st)  # usable again after close
    assert st.buffered_tokens == 5


def test_session_after_close_and_failed_steps(block, x):
    st = filled_state(block)
    sess = block.decode_session(st)
    fails(TypeError, sess.step, x[:, 0].astype(np.float64), match=["x", "float64"])
    bad = np.array(x[:, 0], copy=True)
    bad.reshape(-1)[3] = np.nan
    fails(ValueError, sess.step, bad, keep=[bad], match=["x", "index 3"])
    fails(ValueError, sess.step, x[:1, 0], match=["x", "B=1", f"{B} rows"])
    fails(ValueError, sess.step, x[:, :2], match=["x", "one token", f"got {(B, 2, D)}"])
    before = snapshot(st)
    sess.close()
    assert snapshot(st) == before  # nothing was stepped: close copies the same bytes back
    sess.close()  # idempotent
    for call in (lambda: sess.step(x[:, 0]), sess.sync_state, sess.load_state):
        fails(ValueError, call, keep=[st], match=["closed"])


def test_session_load_state_sees_edits_and_validates(block, x):
    a, b = filled_state(block), filled_state(block)
    with block.decode_session(a) as sa, block.decode_session(b) as sb:
        np.asarray(a.h)[0, 0, 0, 0] += np.float32(0.5)
        ya = np.asarray(sa.step(x[:, 0]))
        yb = np.asarray(sb.step(x[:, 0]))
        assert ya.tobytes() == yb.tobytes()  # the edit is not seen before load_state
        sa.load_state()
        sb.load_state()
        assert np.asarray(sa.step(x[:, 1])).tobytes() != np.asarray(sb.step(x[:, 1])).tobytes()
        np.asarray(a.h)[0, 0, 0, 5] = np.nan
        fails(ValueError, sa.load_state, match=["state.h", "index 5"])
