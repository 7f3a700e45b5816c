"""Mamba-3 bad input (docs/guide/errors.rst), weights/params and the
state rules of docs/mamba3.md, "State" (set_input_states, buffered_tokens,
pending).

Every error test checks the exception class and that the message names the
thing at fault; a failing call given a state also checks that the state and
the caller's x kept their bytes ("a failed call changes nothing").
"""
from __future__ import annotations

import array as pyarray

import ml_dtypes
import numpy as np
import pytest

import mojolearn
from mojolearn.mamba import Mamba3Block, Mamba3BlockInference, Mamba3State
from tests.errors import assert_names, raises_naming
from mojolearn.reference.weights import mamba3_weights, random_input

D = 64            # H = 2 heads
H = 2
B, L = 2, 5
WEIGHT_NAMES = ["block_norm.weight", "in_proj.weight", "dt_bias", "B_norm.weight",
                "C_norm.weight", "B_bias", "C_bias", "D", "out_proj.weight"]
STATE_NAMES = ["theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
               "buffer_sig", "buffer_adt", "pending_k", "pending_v"]


@pytest.fixture(scope="module")
def weights():
    return mamba3_weights(D, seed=3)


@pytest.fixture(scope="module")
def block(weights):
    return Mamba3Block(weights)


@pytest.fixture
def x():
    return random_input(B, L, D, seed=11)


def _bytes(buf) -> bytes:
    return memoryview(buf).tobytes()


def filled_state(block, batch=B, n=3):
    st = block.allocate_state(batch)
    block.forward(random_input(batch, n, D, seed=5), st)
    return st


def numpy_parts(st):
    return {n: np.array(getattr(st, n)) for n in STATE_NAMES}


def snapshot(*objs):
    out = []
    for o in objs:
        if isinstance(o, Mamba3State):
            out.append(tuple(_bytes(getattr(o, n)) for n in STATE_NAMES)
                       + (o.buffered_tokens, o.pending))
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


def _bf16_bits(shape):
    n = int(np.prod(shape))
    return memoryview(pyarray.array("H", [0x3F80] * n)).cast("B").cast("H", shape)


BAD_DTYPES = [
    pytest.param(lambda s: np.ones(s, np.float64), ["float64"], id="float64"),
    pytest.param(lambda s: np.ones(s, np.float16), ["float16"], id="float16"),
    pytest.param(_bf16_bits, ["uint16", "bfloat16"], id="bf16-bits"),
    pytest.param(lambda s: mojolearn.Array(s, "float64"), ["float64"], id="Array-float64"),
    pytest.param(lambda s: np.ones(s, ml_dtypes.bfloat16), ["bfloat16"], id="bfloat16"),
]


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("make,words", BAD_DTYPES)
def test_x_bad_dtype(block, make, words):
    fails(TypeError, block.forward, make((B, L, D)), match=["x"] + words)
    st = filled_state(block)
    fails(TypeError, block.forward, make((B, L, D)), st, keep=[st], match=["x"] + words)
    fails(TypeError, block.step, make((B, D)), st, keep=[st], match=["x"] + words)


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_weight_bad_dtype(weights, name):
    for make, words in ((lambda s: np.ones(s, np.float64), ["float64"]),
                        (lambda s: np.ones(s, np.float16), ["float16"])):
        w = dict(weights)
        w[name] = make(weights[name].shape)
        fails(TypeError, Mamba3Block, w, match=[name] + words)


@pytest.mark.parametrize("which", STATE_NAMES)
def test_state_bad_dtype(block, x, which):
    good = filled_state(block)
    parts = numpy_parts(good)
    parts[which] = parts[which].astype(np.float64)
    st = Mamba3State(**parts, buffered_tokens=good.buffered_tokens)
    keep = [good, x]
    fails(TypeError, block.forward, x, st, keep=keep, match=[f"state.{which}", "float64"])
    fails(TypeError, block.step, x[:, 0], st, keep=keep, match=[f"state.{which}", "float64"])


# ------------------------------------------------------- buffers, shapes
@pytest.mark.parametrize("bad", [None, "text", 3.0, [[[0.0] * D] * L] * B],
                         ids=["None", "str", "float", "list"])
def test_x_not_a_buffer(block, bad):
    fails(TypeError, block.forward, bad, match=["x", type(bad).__name__])
    st = filled_state(block)
    fails(TypeError, block.step, bad, st, keep=[st], match=["x", type(bad).__name__])


@pytest.mark.parametrize("shape", [(L, D), (1, B, L, D), (0, L, D), (B, 0, D), (B, L, D - 32),
                                   (B, L, D + 1)])
def test_x_bad_shape(block, shape):
    st = filled_state(block)
    bad = np.zeros(shape, np.float32)
    # a wrong d_model is reported as "d_model N", any other bad shape in full
    match = ["x", f"d_model {shape[-1]}" if len(shape) == 3 and shape[0] and shape[1]
             else str(shape)]
    fails(ValueError, block.forward, bad, match=match)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=match)


def test_step_shapes(block, x):
    st = filled_state(block)
    fails(ValueError, block.step, x, st, keep=[st],
          match=["x", "one token", "(B, 1, d_model)", f"got {x.shape}"])
    fails(ValueError, block.step, np.zeros((0, D), np.float32), st, keep=[st],
          match=["x", "B >= 1", str((0, D))])
    fails(ValueError, block.step, x[:, 0], None, match=["state"])
    fails(ValueError, block.step, x[:, 0, :D - 1].copy(), st, keep=[st],
          match=["x", f"d_model {D - 1}", f"block has {D}"])
    fails(ValueError, block.step, x[:1, 0], st, keep=[st],
          match=["batch mismatch", "x", "B=1", f"({B}, "])   # the state's shape (B, ...)


@pytest.mark.parametrize("d", [16, 48, 33, 0])
def test_d_model_not_multiple_of_32(d):
    w = mamba3_weights(32, seed=1)
    w["block_norm.weight"] = np.ones(d, np.float32)
    fails(ValueError, Mamba3Block, w, match=["multiple of 32", f"block_norm.weight has {d} entries"])


def test_missing_and_unknown_weights(weights):
    w = {k: v for k, v in weights.items() if k not in ("D", "B_bias")}
    msg = fails(ValueError, Mamba3Block, w, match=["missing"])
    # in the reported list, not only in the "(expected [...])" list after it
    assert_names(msg.split("(expected", 1)[0], "'D'", "'B_bias'")
    w = dict(weights)
    w["A_log"] = np.zeros(2, np.float32)
    fails(ValueError, Mamba3Block, w, match=["unknown", "A_log"])
    msg = fails(ValueError, Mamba3Block, {k: v for k, v in weights.items()
                                          if k != "block_norm.weight"}, match=["missing"])
    assert_names(msg.split("(expected", 1)[0], "block_norm.weight")
    fails(TypeError, Mamba3Block, list(weights.values()), match=["weights"])


@pytest.mark.parametrize("name", WEIGHT_NAMES[1:])
def test_weight_wrong_shape(weights, name):
    w = dict(weights)
    w[name] = np.zeros(weights[name].shape[:-1] + (weights[name].shape[-1] + 1,), np.float32)
    fails(ValueError, Mamba3Block, w, match=[name, str(weights[name].shape),
                                             str(np.shape(w[name]))])
    w[name] = weights[name].tolist()
    fails(TypeError, Mamba3Block, w, match=[name, "list"])


@pytest.mark.parametrize("which", STATE_NAMES)
def test_state_wrong_shape_readonly_noncontiguous(block, x, which):
    good = filled_state(block)
    # wrong shape
    parts = numpy_parts(good)
    parts[which] = np.zeros(parts[which].shape[:-1] + (parts[which].shape[-1] + 1,), np.float32)
    st = Mamba3State(**parts, buffered_tokens=good.buffered_tokens)
    fails(ValueError, block.forward, x, st, keep=[good, x], match=[f"state.{which}"])
    # read-only
    parts = numpy_parts(good)
    parts[which].setflags(write=False)
    st = Mamba3State(**parts, buffered_tokens=good.buffered_tokens)
    fails(ValueError, block.forward, x, st, keep=[x], match=[f"state.{which}", "read-only"])
    # non-contiguous
    parts = numpy_parts(good)
    big = np.zeros(parts[which].shape + (2,), np.float32)
    parts[which] = big[..., 0]
    st = Mamba3State(**parts, buffered_tokens=good.buffered_tokens)
    fails(ValueError, block.step, x[:, 0], st, keep=[x, big], match=[f"state.{which}",
                                                                     "C-contiguous"])


def test_state_batch_mismatch_and_type(block, x):
    st = filled_state(block, batch=3)
    match = ["batch mismatch", "x", f"B={B}", "(3, "]   # the state's shape (3, ...)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=match)
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=match)
    fails(TypeError, block.forward, x, object(), match=["state", "Mamba3State", "object"])


@pytest.mark.parametrize("n", [-1, 65, 1000])
def test_buffered_tokens_out_of_range(block, x, n):
    st = filled_state(block)
    st.buffered_tokens = n
    fails(ValueError, block.forward, x, st, keep=[st],
          match=[f"state.buffered_tokens = {n}", "[0, 64]"])


def test_buffered_tokens_type():
    with raises_naming(TypeError, "buffered_tokens", "int", "float"):
        Mamba3State(*[None] * 10, buffered_tokens=1.5)
    with raises_naming(TypeError, "pending", "bool", "int"):
        Mamba3State(*[None] * 10, pending=1)


# ------------------------------------------------------------ non-finite
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_x(block, x, value):
    bad = x.copy()
    bad.reshape(-1)[D + 37] = value          # row 0, token 1, element 37
    fails(ValueError, block.forward, bad, match=["x", f"index {D + 37}"])
    st = filled_state(block)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=["x", f"index {D + 37}"])
    fails(ValueError, block.step, bad[:, 1], st, keep=[st], match=["x", "index 37"])


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_nonfinite_weight(weights, name):
    w = dict(weights)
    w[name] = weights[name].copy()
    w[name].reshape(-1)[1 % w[name].size] = np.nan
    fails(ValueError, Mamba3Block, w, match=[name, f"index {1 % w[name].size}"])


@pytest.mark.parametrize("which", ["theta", "h", "buffer_qrot", "buffer_v", "buffer_dt",
                                   "buffer_adt"])
def test_nonfinite_state(block, x, which):
    good = filled_state(block, n=3)
    parts = numpy_parts(good)
    a = parts[which]
    a.reshape(-1)[1] = np.inf
    st = Mamba3State(**parts, buffered_tokens=good.buffered_tokens)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=[f"state.{which}", "index 1"])
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=[f"state.{which}"])


def test_nonfinite_in_unused_buffer_rows_is_ignored(block, x):
    """Rows at or past buffered_tokens are never read (documented)."""
    good = filled_state(block, n=3)
    parts = numpy_parts(good)
    parts["buffer_krot"][:, 10] = np.nan
    st = Mamba3State(**parts, buffered_tokens=3)
    y = np.asarray(block.forward(x, st))
    ref = np.asarray(block.forward(x, good))
    assert y.tobytes() == ref.tobytes()


# ------------------------------------------------------------ lengths
def test_lengths_errors(block, x):
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, lengths=[L, L], keep=[st], match=["lengths", "state"])
    fails(ValueError, block.forward, x, lengths=[L], match=["lengths", f"B={B}", "got 1"])
    fails(ValueError, block.forward, x, lengths=[0, L], match=["lengths[0] = 0", f"L={L}"])
    fails(ValueError, block.forward, x, lengths=[L, L + 1],
          match=[f"lengths[1] = {L + 1}", f"L={L}"])
    fails(TypeError, block.forward, x, lengths=[True, L], match=["lengths[0]", "int", "bool"])
    fails(TypeError, block.forward, x, lengths=[2.0, L], match=["lengths[0]", "int", "float"])
    fails(TypeError, block.forward, x, lengths=5, match=["lengths", "sequence"])


# ------------------------------------------------------- input states
def test_set_input_states_on_used_state_fails_at_next_call(block, x):
    st = filled_state(block)
    ins = [np.zeros((B, H, 32), np.float32), np.zeros((B, H, 64, 128), np.float32),
           np.zeros((B, H, 128), np.float32), np.zeros((B, H, 64), np.float32)]
    st.set_input_states(*ins)
    assert st.pending
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["state.pending", "fresh"])
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=["state.pending", "fresh"])


def test_set_input_states_bad_arguments(block):
    st = block.allocate_state(B)
    good = [np.zeros((B, H, 32), np.float32), np.zeros((B, H, 64, 128), np.float32),
            np.zeros((B, H, 128), np.float32), np.zeros((B, H, 64), np.float32)]
    names = ["theta", "h", "k", "v"]
    for i, n in enumerate(names):
        bad = list(good)
        bad[i] = good[i].astype(np.float64)
        fails(TypeError, st.set_input_states, *bad, keep=[st], match=[n, "float64"])
        bad[i] = np.zeros(good[i].shape[:-1] + (3,), np.float32)
        fails(ValueError, st.set_input_states, *bad, keep=[st],
              match=[n, f"got {bad[i].shape}"])
    assert not st.pending


def test_pending_consumed_and_nonfinite_pending(block, x):
    st = block.allocate_state(B)
    ins = [np.zeros((B, H, 32), np.float32), np.zeros((B, H, 64, 128), np.float32),
           np.ones((B, H, 128), np.float32), np.ones((B, H, 64), np.float32)]
    ins[2][1, 1, 5] = np.nan
    st.set_input_states(*ins)
    fails(ValueError, block.forward, x, st, keep=[st], match=["state.pending_k"])
    ins[2][1, 1, 5] = 0.0
    st.set_input_states(*ins)
    block.forward(x, st)
    assert not st.pending and st.buffered_tokens == L


# --------------------------------------------------- construction, params
@pytest.mark.parametrize("mode", ["fast", "exact", None, 0])
def test_bad_numeric_mode(weights, mode):
    fails(ValueError, Mamba3Block, weights, numeric_mode=mode, match=["numeric_mode", repr(mode)])


def test_inference_backward_not_implemented(weights, x):
    with pytest.raises(NotImplementedError):
        Mamba3BlockInference(weights).backward(x, x)


def test_attributes_params_session_info(weights, x):
    blk = Mamba3Block(weights)
    assert (blk.d_model, blk.d_inner, blk.nheads) == (D, 2 * D, H)
    assert blk.d_in_proj == 2 * 2 * D + 256 + 3 * H + 32
    assert blk.weight_format == "float32"
    assert blk.session_info() is None and not hasattr(blk, "h_last_")
    y = np.asarray(blk.forward(x))
    info = blk.session_info()
    assert isinstance(info, dict) and info["forward_calls"] == 1
    # weights are copied at construction
    w = {k: v.copy() for k, v in weights.items()}
    b2 = Mamba3Block(w)
    w["out_proj.weight"][:] = 0
    assert np.asarray(b2.forward(x)).tobytes() == y.tobytes()
    p = blk.get_params()
    assert set(p) == {"weights", "numeric_mode"} and set(p["weights"]) == set(WEIGHT_NAMES)
    assert np.asarray(Mamba3Block(**p).forward(x)).tobytes() == y.tobytes()
    w2 = dict(weights)
    w2["D"] = weights["D"] * np.float32(2)
    blk.set_params(weights=w2)
    assert np.asarray(blk.forward(x)).tobytes() != y.tobytes()
    with raises_naming(ValueError, "unknown parameters", "dt_limit"):
        blk.set_params(dt_limit=(0, 1))
    with raises_naming(ValueError, "missing ['D']"):
        blk.set_params(weights={k: v for k, v in w2.items() if k != "D"})


def _bad_set_params(weights):
    """(exception, set_params kwargs, names the message must give): one of
    each kind of refusal, including good weights paired with a bad argument
    (nothing may be applied) and a smaller block's weights with one bad."""
    nan = dict(weights)
    nan["C_bias"] = weights["C_bias"].copy()
    nan["C_bias"].reshape(-1)[17] = np.nan
    other = mamba3_weights(D, seed=8)          # valid on their own
    small = mamba3_weights(32, seed=1)
    small["D"] = np.zeros(3, np.float32)
    return [
        (ValueError, {"weights": nan}, ["C_bias", "index 17"]),
        (TypeError, {"weights": dict(weights, D=weights["D"].astype(np.float64))},
         ["D", "float64"]),
        (ValueError, {"weights": dict(weights, **{"in_proj.weight": np.zeros((5, D), np.float32)})},
         ["in_proj.weight", "(5, 64)"]),
        (ValueError, {"weights": {k: v for k, v in weights.items() if k != "dt_bias"}},
         ["missing ['dt_bias']"]),
        (ValueError, {"weights": dict(weights, extra=np.zeros(1, np.float32))},
         ["unknown ['extra']"]),
        (ValueError, {"weights": small}, ["D", "(3,)"]),
        (TypeError, {"weights": list(weights.values())}, ["weights", "list"]),
        (ValueError, {"numeric_mode": "fast"}, ["numeric_mode", "'fast'"]),
        (ValueError, {"numeric_mode": "bogus"}, ["numeric_mode", "'bogus'"]),
        (ValueError, {"weights": other, "numeric_mode": "bogus"}, ["numeric_mode", "'bogus'"]),
        (ValueError, {"weights": other, "dt_limit": (0, 1)}, ["unknown parameters", "dt_limit"]),
        (ValueError, {"bogus_param": 1}, ["unknown parameters", "bogus_param"]),
    ]


def test_failed_set_params_keeps_old_block(weights, x):
    """A refused set_params changes nothing: every parameter byte, the
    attributes, the outputs (stateless, stateful, step) and a caller's state."""
    blk = Mamba3Block(weights)
    st = filled_state(blk)
    y0 = _bytes(blk.forward(x))
    p0 = {k: _bytes(v) for k, v in blk.get_params()["weights"].items()}
    attrs0 = (blk.d_model, blk.d_inner, blk.nheads, blk.d_in_proj, blk.weight_format,
              blk.numeric_mode)
    s0 = snapshot(st)
    for exc, params, words in _bad_set_params(weights):
        fails(exc, blk.set_params, **params, keep=[st], match=words)
        assert _bytes(blk.forward(x)) == y0, sorted(params)
        p = blk.get_params()
        assert p["numeric_mode"] == "identical", sorted(params)
        assert {k: _bytes(v) for k, v in p["weights"].items()} == p0, sorted(params)
        assert (blk.d_model, blk.d_inner, blk.nheads, blk.d_in_proj, blk.weight_format,
                blk.numeric_mode) == attrs0, sorted(params)
    assert snapshot(st) == s0
    # the old weights still drive a carried forward and step
    ref = Mamba3Block(weights)
    st_ref = Mamba3State(**numpy_parts(st), buffered_tokens=st.buffered_tokens)
    assert _bytes(blk.forward(x, st)) == _bytes(ref.forward(x, st_ref))
    assert _bytes(blk.step(x[:, 0], st)) == _bytes(ref.step(x[:, 0], st_ref))
    assert snapshot(st) == snapshot(st_ref)
    # negative control: an accepted set_params does change the output and params
    blk.set_params(weights=mamba3_weights(D, seed=8))
    assert _bytes(blk.forward(x)) != y0
    assert {k: _bytes(v) for k, v in blk.get_params()["weights"].items()} != p0


def test_reports_unavailable_after_state_advanced(block, x):
    st = block.allocate_state(B)
    block.forward(x, st)
    other = Mamba3Block(block.get_params()["weights"])
    other.forward(x[:, :1].copy(), st)      # another block advances the state
    with raises_naming(ValueError, "h_last_", "no longer available"):
        block.h_last_
