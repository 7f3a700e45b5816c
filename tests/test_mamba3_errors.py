"""Mamba-3 bad input (SPEC section 6), weights/params (section 7) and the
state rules of section 4 (set_input_states, buffered_tokens, pending).

Every error test checks the exception class and that the message names the
thing at fault; a failing call given a state also checks that the state and
the caller's x kept their bytes ("a failed call changes nothing").
"""
from __future__ import annotations

import array as pyarray
import re

import numpy as np
import pytest

import mojolearn
from mojolearn.mamba import Mamba3Block, Mamba3BlockInference, Mamba3State
from tests.reference.mamba3_weights import mamba3_weights, random_input

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
    msg = str(info.value)
    for part in match:
        assert part in msg, f"message {msg!r} does not name {part!r}"
    assert snapshot(*keep) == before, "a failed call changed a caller buffer"
    return msg


def names_x(msg):
    assert re.search(r"(?<![\w.])x(?![\w])", msg), f"message {msg!r} does not name x"


def _bf16_bits(shape):
    n = int(np.prod(shape))
    return memoryview(pyarray.array("H", [0x3F80] * n)).cast("B").cast("H", shape)


BAD_DTYPES = [
    pytest.param(lambda s: np.ones(s, np.float64), ["float64"], id="float64"),
    pytest.param(lambda s: np.ones(s, np.float16), ["float16"], id="float16"),
    pytest.param(_bf16_bits, ["uint16", "bfloat16"], id="bf16-bits"),
    pytest.param(lambda s: mojolearn.Array(s, "float64"), ["float64"], id="Array-float64"),
]
try:
    import ml_dtypes
    BAD_DTYPES.append(pytest.param(lambda s: np.ones(s, ml_dtypes.bfloat16), ["bfloat16"],
                                   id="bfloat16"))
except ImportError:
    pass


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("make,words", BAD_DTYPES)
def test_x_bad_dtype(block, make, words):
    names_x(fails(TypeError, block.forward, make((B, L, D)), match=words))
    st = filled_state(block)
    names_x(fails(TypeError, block.forward, make((B, L, D)), st, keep=[st], match=words))
    names_x(fails(TypeError, block.step, make((B, D)), st, keep=[st], match=words))


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
    names_x(fails(ValueError, block.forward, bad))
    st = filled_state(block)
    fails(ValueError, block.step, bad, st, keep=[st])


@pytest.mark.parametrize("shape", [(L, D), (1, B, L, D), (0, L, D), (B, 0, D), (B, L, D - 32),
                                   (B, L, D + 1)])
def test_x_bad_shape(block, shape):
    st = filled_state(block)
    bad = np.zeros(shape, np.float32)
    names_x(fails(ValueError, block.forward, bad, match=[str(shape[-1]) if len(shape) == 3
                                                         and shape[0] and shape[1]
                                                         else str(shape)]))
    fails(ValueError, block.forward, bad, st, keep=[st, bad])


def test_step_shapes(block, x):
    st = filled_state(block)
    fails(ValueError, block.step, x, st, keep=[st], match=["one token", str(x.shape)])
    fails(ValueError, block.step, np.zeros((0, D), np.float32), st, keep=[st])
    fails(ValueError, block.step, x[:, 0], None, match=["state"])
    fails(ValueError, block.step, x[:, 0, :D - 1].copy(), st, keep=[st], match=[str(D - 1)])
    fails(ValueError, block.step, x[:1, 0], st, keep=[st], match=["batch"])


@pytest.mark.parametrize("d", [16, 48, 33, 0])
def test_d_model_not_multiple_of_32(d):
    w = mamba3_weights(32, seed=1)
    w["block_norm.weight"] = np.ones(d, np.float32)
    fails(ValueError, Mamba3Block, w, match=["32"])


def test_missing_and_unknown_weights(weights):
    w = {k: v for k, v in weights.items() if k not in ("D", "B_bias")}
    msg = fails(ValueError, Mamba3Block, w, match=["missing", "'D'", "'B_bias'"])
    w = dict(weights)
    w["A_log"] = np.zeros(2, np.float32)
    fails(ValueError, Mamba3Block, w, match=["unknown", "A_log"])
    fails(ValueError, Mamba3Block, {k: v for k, v in weights.items()
                                    if k != "block_norm.weight"},
          match=["block_norm.weight"])
    fails(ValueError, Mamba3Block, list(weights.values()), match=["weights"])


@pytest.mark.parametrize("name", WEIGHT_NAMES[1:])
def test_weight_wrong_shape(weights, name):
    w = dict(weights)
    w[name] = np.zeros(weights[name].shape[:-1] + (weights[name].shape[-1] + 1,), np.float32)
    fails(ValueError, Mamba3Block, w, match=[name, str(weights[name].shape)])
    w[name] = weights[name].tolist()
    fails(ValueError, Mamba3Block, w, match=[name])


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
                                                                     "contiguous"])


def test_state_batch_mismatch_and_type(block, x):
    st = filled_state(block, batch=3)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["batch"])
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=["batch"])
    fails(TypeError, block.forward, x, object(), match=["Mamba3State"])


@pytest.mark.parametrize("n", [-1, 65, 1000])
def test_buffered_tokens_out_of_range(block, x, n):
    st = filled_state(block)
    st.buffered_tokens = n
    fails(ValueError, block.forward, x, st, keep=[st], match=["buffered_tokens", str(n)])


def test_buffered_tokens_type():
    with pytest.raises(TypeError, match="buffered_tokens"):
        Mamba3State(*[None] * 10, buffered_tokens=1.5)
    with pytest.raises(TypeError, match="pending"):
        Mamba3State(*[None] * 10, pending=1)


# ------------------------------------------------------------ non-finite
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_x(block, x, value):
    bad = x.copy()
    bad.reshape(-1)[D + 37] = value          # row 0, token 1, element 37
    names_x(fails(ValueError, block.forward, bad, match=[f"index {D + 37}"]))
    st = filled_state(block)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=[f"index {D + 37}"])
    fails(ValueError, block.step, bad[:, 1], st, keep=[st], match=["index 37"])


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
    fails(ValueError, block.forward, x, st, lengths=[L, L], keep=[st], match=["lengths"])
    fails(ValueError, block.forward, x, lengths=[L], match=["lengths"])
    fails(ValueError, block.forward, x, lengths=[0, L], match=["lengths[0]"])
    fails(ValueError, block.forward, x, lengths=[L, L + 1], match=["lengths[1]"])
    fails(TypeError, block.forward, x, lengths=[True, L], match=["lengths[0]"])
    fails(TypeError, block.forward, x, lengths=[2.0, L], match=["lengths[0]"])
    fails(TypeError, block.forward, x, lengths=5, match=["lengths"])


# ------------------------------------------------------- input states
def test_set_input_states_on_used_state_fails_at_next_call(block, x):
    st = filled_state(block)
    ins = [np.zeros((B, H, 32), np.float32), np.zeros((B, H, 64, 128), np.float32),
           np.zeros((B, H, 128), np.float32), np.zeros((B, H, 64), np.float32)]
    st.set_input_states(*ins)
    assert st.pending
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["pending", "fresh"])
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=["pending"])


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
        fails(ValueError, st.set_input_states, *bad, keep=[st], match=[n])
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
    fails(ValueError, Mamba3Block, weights, numeric_mode=mode, match=["numeric_mode"])


def test_inference_backward_not_implemented(weights, x):
    with pytest.raises(NotImplementedError):
        Mamba3BlockInference(weights).backward(x, x)


def test_attributes_params_session_info(weights, x):
    blk = Mamba3Block(weights)
    assert (blk.d_model, blk.d_inner, blk.nheads) == (D, 2 * D, H)
    assert blk.d_in_proj == 2 * 2 * D + 256 + 3 * H + 32
    assert blk.weight_format == "float32"
    assert blk.session_info() is None and blk.h_last_ is None
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
    with pytest.raises(ValueError):
        blk.set_params(dt_limit=(0, 1))
    with pytest.raises(ValueError):
        blk.set_params(weights={k: v for k, v in w2.items() if k != "D"})


def test_reports_unavailable_after_state_advanced(block, x):
    st = block.allocate_state(B)
    block.forward(x, st)
    other = Mamba3Block(block.get_params()["weights"])
    other.forward(x[:, :1].copy(), st)      # another block advances the state
    with pytest.raises(ValueError, match="no longer available"):
        block.h_last_
