"""Mamba-1 bad input (docs/guide/errors.rst) and weights/params/sessions.

Every error test checks the exception class and that the message names the
thing at fault (array or weight name, dtype name, flat index). Every failing
call that was given a state also checks that the state (and the caller's x)
kept its bytes exactly: "a failed call changes nothing".
"""
from __future__ import annotations

import array as pyarray
import re

import ml_dtypes
import numpy as np
import pytest

import mojolearn
from mojolearn.mamba import Mamba1Block, Mamba1BlockInference, Mamba1State
from tests.errors import assert_names, assert_not_names, name_pattern, raises_naming
from mojolearn.reference.weights import mamba1_weights, random_input

D = 20            # dt_rank 2, d_inner 40: every weight has a distinct shape
DI = 2 * D
R = 2
B, L = 2, 5

WEIGHT_NAMES = ["norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                "out_proj.weight"]


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def weights():
    return mamba1_weights(D, seed=3)


@pytest.fixture(scope="module")
def block(weights):
    return Mamba1Block(weights)


@pytest.fixture
def x():
    return random_input(B, L, D, seed=11)


def _bytes(buf) -> bytes:
    return memoryview(buf).tobytes()


def filled_state(block, batch=B, seed=5):
    """A state with non-zero contents (an allocate_state state after a prefill)."""
    st = block.allocate_state(batch)
    block.forward(random_input(batch, 3, D, seed=seed), st)
    return st


def numpy_state(block, batch=B, seed=5):
    """The same contents in caller-owned NumPy buffers."""
    st = filled_state(block, batch, seed)
    return Mamba1State(np.array(st.conv_window), np.array(st.h),
                       absolute_position=st.absolute_position)


def snapshot(*objs):
    """Bytes of every buffer (a Mamba1State contributes its two arrays and its
    position counter)."""
    out = []
    for o in objs:
        if isinstance(o, Mamba1State):
            out.append((_bytes(o.conv_window), _bytes(o.h), o.absolute_position))
        else:
            out.append(_bytes(o))
    return out


def fails(exc, fn, *args, keep=(), match=(), **kwargs):
    """Call fn expecting exc; the message must name every string in match
    (as a whole token, tests/errors.py); every object in keep must keep its
    bytes."""
    before = snapshot(*keep)
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = assert_names(str(info.value), *match)
    assert snapshot(*keep) == before, "a failed call changed a caller buffer"
    return msg


def test_name_checks_want_whole_tokens():
    """The check itself can fail: "x" is not found in "explicitly" or
    "index", "h" not in "state.h", "3" not in "37"."""
    msg = "y must be float32; convert it explicitly (index 37 of state.h)"
    for name in ("x", "h", "3", "index 3", "state"):
        with pytest.raises(AssertionError):
            assert_names(msg, name)
    assert_names(msg, "y", "float32", "index 37", "state.h")
    assert_not_names(msg, "x", "h")
    assert re.search(name_pattern("x"), "got x.") and not re.search(name_pattern("x"), "x.y")
    with pytest.raises(AssertionError):
        with raises_naming(ValueError, "x"):
            raise ValueError(msg)


def with_nan(a, index, value=np.nan):
    a = np.array(a, copy=True)
    a.reshape(-1)[index] = value
    return a


# ---------------------------------------------------------- bad dtypes
def _bf16_bits(shape):
    """A uint16 buffer (bfloat16 bit patterns) without a dtype attribute."""
    n = int(np.prod(shape))
    buf = pyarray.array("H", [0x3F80] * n)
    return memoryview(buf).cast("B").cast("H", shape)


def _bad_dtype_arrays():
    """(id, maker(shape) -> buffer, dtype words the message must contain)."""
    cases = [
        ("float64", lambda s: np.ones(s, np.float64), ["float64"]),
        ("float16", lambda s: np.ones(s, np.float16), ["float16"]),
        ("uint16-numpy", lambda s: np.full(s, 0x3F80, np.uint16), ["uint16"]),
        ("bf16-bits-buffer", _bf16_bits, ["uint16", "bfloat16"]),
        ("float64-array.array",
         lambda s: memoryview(pyarray.array("d", [1.0] * int(np.prod(s)))).cast("B").cast("d", s),
         ["float64"]),
        ("float64-mojolearn.Array", lambda s: mojolearn.Array(s, "float64"), ["float64"]),
        ("float32-bigendian", lambda s: np.ones(s, ">f4"), [">f4"]),
        ("bfloat16-ml_dtypes", lambda s: np.ones(s, ml_dtypes.bfloat16), ["bfloat16"]),
    ]
    return [pytest.param(*c, id=c[0]) for c in cases]


BAD_DTYPES = _bad_dtype_arrays()


@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_forward_x_bad_dtype(block, case, make, words):
    fails(TypeError, block.forward, make((B, L, D)), match=["x"] + words)


@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_forward_x_bad_dtype_with_state(block, case, make, words):
    st = filled_state(block)
    fails(TypeError, block.forward, make((B, L, D)), st, keep=[st], match=["x"] + words)


@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_step_x_bad_dtype(block, case, make, words):
    st = filled_state(block)
    fails(TypeError, block.step, make((B, 1, D)), st, keep=[st], match=["x"] + words)
    fails(TypeError, block.step, make((B, D)), st, keep=[st], match=["x"] + words)


@pytest.mark.parametrize("name", WEIGHT_NAMES)
@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_weight_bad_dtype(weights, name, case, make, words):
    w = dict(weights)
    w[name] = make(weights[name].shape)
    fails(TypeError, Mamba1Block, w, match=[name] + words)


@pytest.mark.parametrize("which", ["conv_window", "h"])
@pytest.mark.parametrize("case,make,words", BAD_DTYPES)
def test_state_bad_dtype(block, x, which, case, make, words):
    good = filled_state(block)
    parts = {"conv_window": good.conv_window, "h": good.h}
    parts[which] = make(memoryview(parts[which]).shape)
    st = Mamba1State(parts["conv_window"], parts["h"])
    keep = [good.conv_window, good.h, x]  # the other, still float32, array too
    fails(TypeError, block.forward, x, st, keep=keep, match=[f"state.{which}"] + words)
    fails(TypeError, block.step, x[:, :1], st, keep=keep, match=[f"state.{which}"] + words)
    fails(TypeError, block.decode_session, st, keep=keep, match=[f"state.{which}"] + words)


# ------------------------------------------------- not a buffer, shapes
@pytest.mark.parametrize("bad", [None, [[[0.0] * D] * L] * B, "text", 3.0, {"a": 1}],
                         ids=["None", "list", "str", "float", "dict"])
def test_x_not_a_buffer(block, bad):
    fails(TypeError, block.forward, bad, match=["x", type(bad).__name__])
    st = filled_state(block)
    fails(TypeError, block.forward, bad, st, keep=[st], match=["x", type(bad).__name__])
    fails(TypeError, block.step, bad, st, keep=[st], match=["x", type(bad).__name__])


@pytest.mark.parametrize("shape", [(L, D), (B * L * D,), (1, B, L, D), (B, L, D, 1)])
def test_x_wrong_ndim(block, shape):
    st = filled_state(block)
    bad = np.zeros(shape, np.float32)
    fails(ValueError, block.forward, bad, match=["x", str(tuple(shape))])
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=["x", str(tuple(shape))])


@pytest.mark.parametrize("shape", [(0, L, D), (B, 0, D), (0, 0, D)])
def test_x_zero_batch_or_length(block, shape):
    bad = np.zeros(shape, np.float32)
    fails(ValueError, block.forward, bad, match=["x", str(shape)])
    if shape[0] == B:
        st = filled_state(block)
        fails(ValueError, block.forward, bad, st, keep=[st], match=["x", str(shape)])


def test_step_zero_batch(block):
    st = filled_state(block)
    fails(ValueError, block.step, np.zeros((0, D), np.float32), st, keep=[st],
          match=["x", "B >= 1", str((0, D))])
    fails(ValueError, block.step, np.zeros((0, 1, D), np.float32), st, keep=[st],
          match=["x", "B >= 1", str((0, 1, D))])


@pytest.mark.parametrize("d_bad", [D - 1, D + 1, 1, 2 * D])
def test_x_wrong_d_model(block, d_bad):
    st = filled_state(block)
    bad = random_input(B, L, d_bad, seed=1)
    match = ["x", f"d_model {d_bad}", f"block has {D}"]
    fails(ValueError, block.forward, bad, match=match)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=match)
    fails(ValueError, block.step, bad[:, :1], st, keep=[st], match=match)
    fails(ValueError, block.step, bad[:, 0], st, keep=[st], match=match)


def test_weights_not_a_dict(weights):
    fails(TypeError, Mamba1Block, list(weights.values()), match=["weights"])
    fails(TypeError, Mamba1Block, None, match=["weights"])


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_weight_not_a_buffer(weights, name):
    w = dict(weights)
    w[name] = weights[name].tolist()
    fails(TypeError, Mamba1Block, w, match=[name, "list"])


def _listed(msg, word):
    """The part of msg after `word`, up to the next ';' or '(' (the list of
    names the message gives for `word`, not the list of expected names)."""
    assert word in msg, msg
    return re.split(r"[;(]", msg.split(word, 1)[1], maxsplit=1)[0]


@pytest.mark.parametrize("drop", [["D"], ["A_log", "conv1d.bias"], ["norm.weight"],
                                  ["norm.weight", "out_proj.weight"], WEIGHT_NAMES])
def test_missing_weights_listed(weights, drop):
    w = {k: v for k, v in weights.items() if k not in drop}
    msg = fails(ValueError, Mamba1Block, w, match=["missing"])
    listed = _listed(msg, "missing")
    assert_names(listed, *drop)
    assert_not_names(listed, *w)   # names that are present are not reported as missing


@pytest.mark.parametrize("extra", [["foo.weight"], ["mixer.D", "bias"]])
def test_unknown_weights_listed(weights, extra):
    w = dict(weights)
    for k in extra:
        w[k] = np.zeros(3, np.float32)
    msg = fails(ValueError, Mamba1Block, w, match=["unknown"] + extra)
    listed = _listed(msg, "unknown")
    assert_names(listed, *extra)
    assert_not_names(listed, *WEIGHT_NAMES)


def test_missing_and_unknown_both_listed(weights):
    w = dict(weights)
    w["mixer.A_log"] = w.pop("A_log")
    msg = fails(ValueError, Mamba1Block, w, match=["missing", "unknown"])
    assert_names(_listed(msg, "missing"), "A_log")
    assert_names(_listed(msg, "unknown"), "mixer.A_log")
    assert_not_names(_listed(msg, "unknown"), "A_log")


def _wrong_shape(name, shape):
    if name == "norm.weight":
        return (D, 1)          # d_model is read from it: change the ndim
    if len(shape) == 1:
        return (shape[0] + 1,)
    return (shape[1], shape[0]) if shape[0] != shape[1] else (shape[0] + 1, shape[1])


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_wrong_weight_shape_named(weights, name):
    w = dict(weights)
    bad_shape = _wrong_shape(name, weights[name].shape)
    w[name] = np.zeros(bad_shape, np.float32)
    fails(ValueError, Mamba1Block, w, match=[name, str(bad_shape)])


@pytest.mark.parametrize("bad_shape", [(DI, 4, 1), (DI, 1, 3), (DI, 2, 4), (DI, 3), (DI * 4,),
                                       (1, DI, 4)])
def test_wrong_conv_weight_shape(weights, bad_shape):
    w = dict(weights)
    w["conv1d.weight"] = np.zeros(bad_shape, np.float32)
    fails(ValueError, Mamba1Block, w, match=["conv1d.weight", str(bad_shape)])


def test_wrong_d_between_weights(weights):
    """All weights consistent with d=20 except norm.weight of d=16."""
    w = dict(weights)
    w["norm.weight"] = np.ones(16, np.float32)
    fails(ValueError, Mamba1Block, w, match=["in_proj.weight"])


def test_zero_d_model(weights):
    w = {k: np.zeros((0,) * v.ndim, np.float32) for k, v in weights.items()}
    fails(ValueError, Mamba1Block, w, match=["norm.weight"])


# ------------------------------------------------------------ state buffers
def _make_state(block, batch=B, **override):
    good = numpy_state(block, batch)
    parts = {"conv_window": good.conv_window, "h": good.h}
    parts.update(override)
    return Mamba1State(parts["conv_window"], parts["h"]), good


@pytest.mark.parametrize("which", ["conv_window", "h"])
@pytest.mark.parametrize("kind", ["numpy-readonly", "bytes-memoryview"])
def test_read_only_state(block, x, which, kind):
    ref = numpy_state(block)
    arr = np.array(getattr(ref, which))
    if kind == "numpy-readonly":
        arr.flags.writeable = False
        bad = arr
    else:
        bad = memoryview(arr.tobytes()).cast("f", arr.shape)
    st, good = _make_state(block, **{which: bad})
    keep = [st.conv_window, st.h, x]
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=keep, match=[f"state.{which}", "read-only"])


@pytest.mark.parametrize("which", ["conv_window", "h"])
def test_non_contiguous_state(block, x, which):
    ref = numpy_state(block)
    arr = getattr(ref, which)
    wide = np.zeros(arr.shape[:-1] + (2 * arr.shape[-1],), np.float32)
    wide[..., ::2] = arr
    bad = wide[..., ::2]                 # right shape and values, strided
    assert not bad.flags.c_contiguous
    st, _ = _make_state(block, **{which: bad})
    keep = [wide, st.conv_window if which == "h" else st.h, x]
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=keep, match=[f"state.{which}", "C-contiguous"])
    # Fortran-order arrays are not C-contiguous either
    st2, _ = _make_state(block, **{which: np.asfortranarray(arr)})
    fails(ValueError, block.forward, x, st2, keep=[st2], match=[f"state.{which}"])


@pytest.mark.parametrize("which,shape", [("conv_window", (B, DI, 3)), ("conv_window", (B, DI + 1, 4)),
                                         ("h", (B, DI, 15)), ("h", (B, DI, 4)),
                                         ("conv_window", (B, DI * 4)), ("h", (B * DI * 16,))])
def test_wrong_state_shape(block, x, which, shape):
    bad = np.zeros(shape, np.float32)
    st, _ = _make_state(block, **{which: bad})
    keep = [st.conv_window, st.h, x]
    fails(ValueError, block.forward, x, st, keep=keep, match=[f"state.{which}"])
    fails(ValueError, block.step, x[:, 0], st, keep=keep, match=[f"state.{which}"])


def test_state_not_a_buffer(block, x):
    st, _ = _make_state(block, h=[0.0] * 10)
    fails(TypeError, block.forward, x, st, keep=[st.conv_window, x], match=["state.h"])


def test_state_wrong_type(block, x):
    with raises_naming(TypeError, "state", "Mamba1State", "dict"):
        block.forward(x, {"conv_window": None, "h": None})
    with raises_naming(TypeError, "state", "Mamba1State", "tuple"):
        block.step(x[:, 0], (np.zeros((B, DI, 4), np.float32),))


def test_state_reserved_arguments():
    cw, h = np.zeros((1, DI, 4), np.float32), np.zeros((1, DI, 16), np.float32)
    for name in ("affine_boundary", "affine_a", "affine_b"):
        with raises_naming(ValueError, name):
            Mamba1State(cw, h, **{name: 1})


@pytest.mark.parametrize("state_batch", [1, 3])
def test_batch_mismatch(block, state_batch):
    for st in (filled_state(block, state_batch), numpy_state(block, state_batch)):
        xx = random_input(B, L, D, seed=2)
        match = ["batch mismatch", "x", f"B={B}", f"state.conv_window has {state_batch} rows"]
        fails(ValueError, block.forward, xx, st, keep=[st, xx], match=match)
        fails(ValueError, block.step, xx[:, 0], st, keep=[st], match=match)
        fails(ValueError, block.step, xx[:, :1], st, keep=[st], match=match)


def test_batch_mismatch_between_state_arrays(block, x):
    a = numpy_state(block, B)
    b3 = numpy_state(block, B + 1)
    st = Mamba1State(a.conv_window, b3.h)
    fails(ValueError, block.forward, x, st, keep=[st, x])
    fails(ValueError, block.step, x[:, 0], st, keep=[st])


# -------------------------------------------------------------- non-finite
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [(0, 0, 0), (1, 2, 3), (1, L - 1, D - 1), (0, 4, 7)])
def test_nonfinite_x_named_with_first_index(block, value, pos):
    x = random_input(B, L, D, seed=4)
    idx = int(np.ravel_multi_index(pos, x.shape))
    x.reshape(-1)[idx] = value
    # later non-finite values do not change the reported (first) index
    if idx + 7 < x.size:
        x.reshape(-1)[idx + 7] = np.nan
    msg = fails(ValueError, block.forward, x, keep=[x], match=["x", f"index {idx}"])
    assert_not_names(msg, f"index {idx + 7}")   # the first index only
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["x", f"index {idx}"])
    st_np = numpy_state(block)
    fails(ValueError, block.forward, x, st_np, keep=[st_np, x], match=["x", f"index {idx}"])
    # step: x (B, 1, d) and (B, d); index within that token's array
    xt = np.ascontiguousarray(x[:, pos[1]])
    tidx = pos[0] * D + pos[2]
    fails(ValueError, block.step, xt, st, keep=[st, xt], match=["x", f"index {tidx}"])
    fails(ValueError, block.step, xt[:, None], st, keep=[st], match=["x", f"index {tidx}"])


def test_nonfinite_x_strided_input_index(block):
    """A non-contiguous x is read in logical (C) order: the index is the flat
    index of the logical (B, L, d) array."""
    base = random_input(B, 2 * L, D, seed=4)
    x = base[:, ::2]
    assert not x.flags.c_contiguous
    x[1, 3, 5] = np.nan
    idx = int(np.ravel_multi_index((1, 3, 5), x.shape))
    fails(ValueError, block.forward, x, keep=[base], match=["x", f"index {idx}"])


def test_nonfinite_x_with_lengths(block):
    """Real positions are checked (index of the full x); padding may hold
    anything (docs/numerics.md, "Ragged batches")."""
    x = random_input(B, L, D, seed=4)
    lengths = [3, L]
    x[1, 4, 2] = np.inf                       # real (row 1 is full length)
    x[0, 4, 0] = np.nan                       # padding of row 0: ignored
    idx = int(np.ravel_multi_index((1, 4, 2), x.shape))
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x], match=["x", f"index {idx}"])
    x[1, 4, 2] = 0.0
    y = np.asarray(block.forward(x, lengths=lengths))
    assert np.all(y[0, 3:] == 0) and not np.signbit(y[0, 3:]).any()
    assert np.isfinite(y).all()


@pytest.mark.parametrize("name", WEIGHT_NAMES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_nonfinite_weight_at_construction(weights, name, where):
    n = weights[name].size
    idx = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    w = dict(weights)
    w[name] = with_nan(weights[name], idx, np.inf if where == "middle" else np.nan)
    fails(ValueError, Mamba1Block, w, keep=[w[name]], match=[name, f"index {idx}"])


def test_nonfinite_conv_weight_2d(weights):
    w = dict(weights)
    c = weights["conv1d.weight"].reshape(DI, 4)
    w["conv1d.weight"] = with_nan(c, 37)
    fails(ValueError, Mamba1Block, w, match=["conv1d.weight", "index 37"])


@pytest.mark.parametrize("which,pos", [("conv_window", (0, 0, 0)), ("conv_window", (1, 7, 3)),
                                       ("h", (0, 0, 0)), ("h", (1, 3, 5)), ("h", (1, DI - 1, 15))])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
@pytest.mark.parametrize("kind", ["Array", "numpy"])
def test_nonfinite_state(block, x, which, pos, value, kind):
    st = filled_state(block) if kind == "Array" else numpy_state(block)
    arr = np.asarray(getattr(st, which))   # zero-copy for mojolearn.Array
    arr[pos] = value
    idx = int(np.ravel_multi_index(pos, arr.shape))
    match = [f"state.{which}", f"index {idx}"]
    fails(ValueError, block.forward, x, st, keep=[st, x], match=match)
    fails(ValueError, block.step, x[:, 0], st, keep=[st], match=match)
    fails(ValueError, block.decode_session, st, keep=[st], match=match)
    # the failed decode_session did not leave the state held: fix it and use it
    arr[pos] = 0.0
    block.forward(x, st)


# ------------------------------------------------------------ numeric_mode
@pytest.mark.parametrize("mode", ["IDENTICAL", "exact", "", None, 0, "fast "])
def test_bad_numeric_mode(weights, mode):
    fails(ValueError, Mamba1Block, weights, numeric_mode=mode, match=["numeric_mode", repr(mode)])
    fails(ValueError, Mamba1BlockInference, weights, numeric_mode=mode,
          match=["numeric_mode", repr(mode)])


def test_fast_mode_without_binary(weights):
    from mojolearn import _loader
    if any(p.name.startswith("libmojolearn_") and "fast" in p.name
           for p in _loader.find_binaries()):
        pytest.skip("a fast binary is installed")
    fails(ValueError, Mamba1Block, weights, numeric_mode="fast", match=["numeric_mode", "'fast'"])


def test_numeric_mode_checked_before_weights():
    """numeric_mode is a constructor-level check: bad mode with good-enough
    weights still gives ValueError naming numeric_mode."""
    with raises_naming(ValueError, "numeric_mode", "'turbo'"):
        Mamba1Block(mamba1_weights(4, 0), numeric_mode="turbo")


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
    fails(ValueError, block.step, x[:, :1], None, match=["state"])


def test_step_2d_and_3d_same_bytes(block, x):
    s1, s2 = filled_state(block), filled_state(block)
    y1 = block.step(np.ascontiguousarray(x[:, 0]), s1)
    y2 = block.step(x[:, :1], s2)
    assert y1.shape == y2.shape == (B, 1, D)
    assert _bytes(y1) == _bytes(y2)
    assert snapshot(s1) == snapshot(s2)


# ----------------------------------------------------------------- lengths
@pytest.mark.parametrize("lengths", [[True, 3], [2, False], [True, True], [2.0, 3],
                                     [2, 3.5], [np.float32(2), 3], np.array([True, True]),
                                     ["2", 3]],
                         ids=["bool0", "bool1", "bools", "float", "float2", "npfloat",
                              "npbool", "str"])
def test_lengths_bad_type(block, x, lengths):
    bad_i = next(i for i, v in enumerate(lengths)
                 if isinstance(v, (bool, np.bool_, float, np.floating, str)))
    fails(TypeError, block.forward, x, lengths=lengths, keep=[x],
          match=[f"lengths[{bad_i}]", "int"])


def test_lengths_not_a_sequence(block, x):
    fails(TypeError, block.forward, x, lengths=3, match=["lengths", "sequence", "int"])


@pytest.mark.parametrize("lengths,bad_i", [([0, 3], 0), ([3, L + 1], 1), ([-1, 2], 0),
                                           ([L, 0], 1), ([10**9, 1], 0)])
def test_lengths_out_of_range(block, x, lengths, bad_i):
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=[f"lengths[{bad_i}] = {lengths[bad_i]}", f"L={L}"])


@pytest.mark.parametrize("lengths", [[3], [1, 2, 3], []])
def test_lengths_wrong_count(block, x, lengths):
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=["lengths", f"B={B}", f"got {len(lengths)}"])


def test_lengths_with_state(block, x):
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, lengths=[L, L], keep=[st, x], match=["lengths", "state"])
    st_np = numpy_state(block)
    fails(ValueError, block.forward, x, st_np, lengths=[1, 2], keep=[st_np])


def test_lengths_numpy_ints_accepted(block, x):
    a = block.forward(x, lengths=[3, L])
    b = block.forward(x, lengths=np.array([3, L], np.int64))
    c = block.forward(x, lengths=(np.int32(3), np.int16(L)))
    assert _bytes(a) == _bytes(b) == _bytes(c)


# -------------------------------------------------------- decode sessions
def test_session_holds_state(block, x):
    st = filled_state(block)
    session = block.decode_session(st)
    before = snapshot(st)
    try:
        fails(ValueError, block.forward, x, st, keep=[st, x], match=["Mamba1DecodeSession"])
        fails(ValueError, block.step, x[:, 0], st, keep=[st], match=["Mamba1DecodeSession"])
        fails(ValueError, block.step, x[:, :1], st, keep=[st], match=["Mamba1DecodeSession"])
        # a second session on the same state is refused too
        fails(ValueError, block.decode_session, st, keep=[st])
        # another block refuses it as well
        other = Mamba1Block(mamba1_weights(D, seed=4))
        fails(ValueError, other.forward, x, st, keep=[st])
        assert session.is_open
    finally:
        session.close()
    assert snapshot(st) == before  # nothing stepped: closing copies back the same bytes
    assert not session.is_open
    block.forward(x, st)  # usable again after close


def test_session_step_after_close(block, x):
    st = filled_state(block)
    with block.decode_session(st) as session:
        session.step(x[:, 0])
    assert not session.is_open
    after = snapshot(st)
    fails(ValueError, session.step, x[:, 0], keep=[st], match=["closed"])
    fails(ValueError, session.sync_state, keep=[st], match=["closed"])
    fails(ValueError, session.load_state, keep=[st], match=["closed"])
    session.close()           # closing twice is a no-op
    session.close()
    assert snapshot(st) == after
    assert not session.is_open
    block.step(x[:, 0], st)   # the state is free


def test_session_close_twice_after_block_use(block, x):
    """A second close() must not copy stale session bytes over a state that
    the block has used since the first close."""
    st = filled_state(block)
    session = block.decode_session(st)
    session.step(x[:, 0])
    session.close()
    block.step(x[:, 1], st)
    after = snapshot(st)
    session.close()
    assert snapshot(st) == after


def _session_ref(block, state, tokens):
    """Outputs and final state of block.step on a copy of state."""
    ref = Mamba1State(np.array(state.conv_window), np.array(state.h),
                      absolute_position=state.absolute_position)
    ys = [_bytes(block.step(t, ref)) for t in tokens]
    return ys, ref


def test_session_failed_step_changes_nothing(block, x):
    st = filled_state(block)
    tokens = [np.ascontiguousarray(x[:, i]) for i in range(3)]
    ys_ref, ref = _session_ref(block, st, tokens)
    with block.decode_session(st) as session:
        got = [_bytes(session.step(tokens[0]))]
        # failing steps: bad dtype, NaN, wrong batch, two tokens, wrong d
        fails(TypeError, session.step, tokens[1].astype(np.float64), match=["x", "float64"])
        bad = with_nan(tokens[1], 3)
        fails(ValueError, session.step, bad, keep=[bad], match=["x", "index 3"])
        fails(ValueError, session.step, tokens[1][:1], match=["x", "B=1", f"{B} rows"])
        fails(ValueError, session.step, x[:, :2], match=["x", "one token", f"got {(B, 2, D)}"])
        fails(ValueError, session.step, np.zeros((B, D + 1), np.float32),
              match=["x", f"d_model {D + 1}"])
        got += [_bytes(session.step(t)) for t in tokens[1:]]
    assert got == ys_ref
    assert snapshot(st) == snapshot(ref)


def test_session_failed_load_state_changes_nothing(block, x):
    st = numpy_state(block)
    tokens = [np.ascontiguousarray(x[:, i]) for i in range(2)]
    ys_ref, ref = _session_ref(block, st, tokens)
    with block.decode_session(st) as session:
        y0 = _bytes(session.step(tokens[0]))
        st.h[1, 2, 3] = np.nan             # edit the (stale) state arrays badly
        idx = int(np.ravel_multi_index((1, 2, 3), st.h.shape))
        fails(ValueError, session.load_state, match=["state.h", f"index {idx}"])
        assert session.is_open
        y1 = _bytes(session.step(tokens[1]))   # the session's own state was kept
    assert [y0, y1] == ys_ref
    assert snapshot(st) == snapshot(ref)


def test_session_batch_mismatch_open(block):
    st = filled_state(block, 3)
    s = block.decode_session(st)
    try:
        fails(ValueError, s.step, random_input(B, 1, D, seed=1),
              match=["x", f"B={B}", "session decodes 3 rows"])
    finally:
        s.close()


# ---------------------------------------------------------------- backward
def test_inference_backward_not_implemented(weights, x):
    blk = Mamba1BlockInference(weights)
    with pytest.raises(NotImplementedError):
        blk.backward(x, np.ones_like(x))


# -------------------------------------------------- weights and params
def test_conv_weight_2d_and_3d_identical(weights, x):
    w2 = dict(weights)
    w2["conv1d.weight"] = np.ascontiguousarray(weights["conv1d.weight"].reshape(DI, 4))
    b3, b2 = Mamba1Block(weights), Mamba1Block(w2)
    assert _bytes(b3.forward(x)) == _bytes(b2.forward(x))
    s3, s2 = b3.allocate_state(B), b2.allocate_state(B)
    assert _bytes(b3.forward(x, s3)) == _bytes(b2.forward(x, s2))
    assert _bytes(b3.step(x[:, 0], s3)) == _bytes(b2.step(x[:, 0], s2))
    assert snapshot(s3) == snapshot(s2)
    assert _bytes(b3.forward(x, lengths=[2, 5])) == _bytes(b2.forward(x, lengths=[2, 5]))


def test_weights_copied_at_construction(weights, x):
    w = {k: v.copy() for k, v in weights.items()}
    blk = Mamba1Block(w)
    y0 = _bytes(blk.forward(x))
    for v in w.values():
        v *= 2.0
        v.reshape(-1)[0] = np.nan
    assert _bytes(blk.forward(x)) == y0
    # also for array.array / memoryview inputs
    wa = {}
    for k, v in weights.items():
        buf = pyarray.array("f", v.reshape(-1).tolist())
        wa[k] = (buf, memoryview(buf).cast("B").cast("f", v.shape))
    blk2 = Mamba1Block({k: mv for k, (buf, mv) in wa.items()})
    assert _bytes(blk2.forward(x)) == y0
    for buf, _ in wa.values():
        for i in range(len(buf)):
            buf[i] = 0.5
    assert _bytes(blk2.forward(x)) == y0


def test_attributes(block):
    assert block.d_model == D and block.d_inner == DI and block.dt_rank == R
    assert block.weight_format == "float32"
    assert block.numeric_mode == "identical"


def test_get_params_returns_copies(weights, x):
    blk = Mamba1Block(weights)
    y0 = _bytes(blk.forward(x))
    p = blk.get_params()
    assert set(p) == {"weights", "numeric_mode"}
    assert p["numeric_mode"] == "identical"
    assert set(p["weights"]) == set(WEIGHT_NAMES)
    for k, v in p["weights"].items():
        assert memoryview(v).shape == weights[k].shape, k
        assert _bytes(v) == _bytes(weights[k]), k
    for v in p["weights"].values():
        np.asarray(v)[...] = 7.0
    assert _bytes(blk.forward(x)) == y0
    p2 = blk.get_params()
    for k in WEIGHT_NAMES:
        assert _bytes(p2["weights"][k]) == _bytes(weights[k])
        assert p2["weights"][k] is not p["weights"][k]
    # round trip
    assert _bytes(Mamba1Block(**blk.get_params()).forward(x)) == y0


def test_set_params_rebuilds(weights, x):
    blk = Mamba1Block(weights)
    w2 = mamba1_weights(D, seed=99)
    assert blk.set_params(weights=w2) is blk
    assert _bytes(blk.forward(x)) == _bytes(Mamba1Block(w2).forward(x))
    # weights passed to set_params are copied too
    w2["D"][:] = 0
    assert _bytes(blk.forward(x)) == _bytes(Mamba1Block(mamba1_weights(D, seed=99)).forward(x))
    # numeric_mode alone keeps the weights
    blk.set_params(numeric_mode="identical")
    assert _bytes(blk.forward(x)) == _bytes(Mamba1Block(mamba1_weights(D, seed=99)).forward(x))
    # another d_model through set_params
    blk.set_params(weights=mamba1_weights(8, seed=1))
    assert (blk.d_model, blk.d_inner, blk.dt_rank) == (8, 16, 1)


def _bad_weight_sets(weights):
    nan = dict(weights)
    nan["A_log"] = with_nan(weights["A_log"], 17)
    f64 = dict(weights)
    f64["D"] = weights["D"].astype(np.float64)
    shape = dict(weights)
    shape["x_proj.weight"] = np.zeros((5, DI), np.float32)
    missing = {k: v for k, v in weights.items() if k != "dt_proj.bias"}
    unknown = dict(weights, extra=np.zeros(1, np.float32))
    return [
        (ValueError, {"weights": nan}, ["A_log", "index 17"]),
        (TypeError, {"weights": f64}, ["D", "float64"]),
        (ValueError, {"weights": shape}, ["x_proj.weight"]),
        (ValueError, {"weights": missing}, ["missing ['dt_proj.bias']"]),
        (ValueError, {"weights": unknown}, ["unknown ['extra']"]),
        (ValueError, {"numeric_mode": "fast"}, ["numeric_mode", "'fast'"]),
        (ValueError, {"numeric_mode": "bogus"}, ["numeric_mode", "'bogus'"]),
        (ValueError, {"bogus_param": 1}, ["unknown parameters", "bogus_param"]),
    ]


def test_failed_set_params_keeps_old_block(weights, x):
    blk = Mamba1Block(weights)
    st = blk.allocate_state(B)
    y0 = _bytes(blk.forward(x))
    ys0 = _bytes(blk.forward(x, st))
    s0 = snapshot(st)
    p0 = {k: _bytes(v) for k, v in blk.get_params()["weights"].items()}
    for exc, params, words in _bad_weight_sets(weights):
        fails(exc, blk.set_params, **params, keep=[st], match=words)
        assert _bytes(blk.forward(x)) == y0, params.keys()
        assert (blk.d_model, blk.d_inner, blk.dt_rank, blk.numeric_mode,
                blk.weight_format) == (D, DI, R, "identical", "float32")
        assert {k: _bytes(v) for k, v in blk.get_params()["weights"].items()} == p0
    assert snapshot(st) == s0
    # the old weights still drive step and a carried forward
    ref = Mamba1Block(weights)
    st_ref = Mamba1State(np.array(st.conv_window), np.array(st.h))
    assert _bytes(blk.step(x[:, 0], st)) == _bytes(ref.step(x[:, 0], st_ref))
    assert _bytes(blk.forward(x, st)) == _bytes(ref.forward(x, st_ref))
    assert snapshot(st.conv_window, st.h) == snapshot(st_ref.conv_window, st_ref.h)
    assert ys0 == _bytes(ref.forward(x, ref.allocate_state(B)))


def test_bad_weights_dict_unchanged(weights):
    """A failed construction leaves the caller's weight arrays as they were."""
    w = {k: v.copy() for k, v in weights.items()}
    w["out_proj.weight"] = with_nan(w["out_proj.weight"], 5)
    before = {k: _bytes(v) for k, v in w.items()}
    with pytest.raises(ValueError):
        Mamba1Block(w)
    assert {k: _bytes(v) for k, v in w.items()} == before


def test_strided_inputs_read_in_logical_order(weights, x):
    """Non-contiguous x and weights (read-only inputs) are accepted and give
    the bytes of their contiguous copies."""
    blk = Mamba1Block(weights)
    y0 = _bytes(blk.forward(x))
    wide = np.zeros((B, L, 2 * D), np.float32)
    wide[..., 1::2] = x
    assert _bytes(blk.forward(wide[..., 1::2])) == y0
    wf = {k: np.asfortranarray(v) for k, v in weights.items()}
    wf["in_proj.weight"] = np.ascontiguousarray(weights["in_proj.weight"].T).T
    assert not wf["in_proj.weight"].flags.c_contiguous
    assert _bytes(Mamba1Block(wf).forward(x)) == y0
    ro = {k: v.copy() for k, v in weights.items()}
    for v in ro.values():
        v.flags.writeable = False
    xr = x.copy()
    xr.flags.writeable = False
    assert _bytes(Mamba1Block(ro).forward(xr)) == y0
