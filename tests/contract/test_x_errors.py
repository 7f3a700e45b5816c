"""Contract: the intake of x (forward, forward with a state, step) and of
lengths, for every block class (docs/guide/errors.rst).

Every refusal checks the exception class and that the message names the
argument at fault as a whole token (tests/errors.py), with the dtype, shape
or flat index; every refused call given a state checks that the state and
x kept their bytes.
"""
import re

import numpy as np
import pytest

from mojolearn.reference.weights import random_input
from tests.contract.cases import (B, BAD_DTYPES, L, as_bytes, fails, filled_state, numpy_state,
                                  snapshot)
from tests.errors import assert_names, assert_not_names, name_pattern, raises_naming


def test_name_checks_want_whole_tokens():
    """The message check itself can fail: "x" is not found in "explicitly"
    or "index", "h" not in "state.h", "3" not in "37"."""
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


# ------------------------------------------------------------------ dtype
@pytest.mark.parametrize("make,words", BAD_DTYPES)
def test_x_bad_dtype(case, block, make, words):
    d = case.d
    st = filled_state(block)
    for shape, call, args in (((B, L, d), block.forward, ()), ((B, L, d), block.forward, (st,)),
                              ((B, 1, d), block.step, (st,)), ((B, d), block.step, (st,))):
        bad = make(shape)
        fails(TypeError, call, bad, *args, keep=[st, bad], match=["x"] + words)


# ----------------------------------------------------------- not a buffer
@pytest.mark.parametrize("bad", [None, [[[0.0] * 4] * L] * B, "text", 3.0, {"a": 1}],
                         ids=["None", "list", "str", "float", "dict"])
def test_x_not_a_buffer(block, bad):
    match = ["x", type(bad).__name__]
    fails(TypeError, block.forward, bad, match=match)
    st = filled_state(block)
    fails(TypeError, block.forward, bad, st, keep=[st], match=match)
    fails(TypeError, block.step, bad, st, keep=[st], match=match)


# ----------------------------------------------------------------- shapes
def test_x_wrong_ndim(case, block):
    d = case.d
    st = filled_state(block)
    for shape in [(L, d), (B * L * d,), (1, B, L, d), (B, L, d, 1)]:
        bad = np.zeros(shape, np.float32)
        fails(ValueError, block.forward, bad, match=["x", str(shape)])
        fails(ValueError, block.forward, bad, st, keep=[st, bad], match=["x", str(shape)])
    for shape in [(d,), (B * d,), (1, B, 1, d), (B, 1, d, 1)]:
        bad = np.zeros(shape, np.float32)
        fails(ValueError, block.step, bad, st, keep=[st, bad], match=["x", str(shape)])


def test_x_zero_batch_or_length(case, block):
    d = case.d
    st = filled_state(block)
    for shape in [(0, L, d), (B, 0, d), (0, 0, d)]:
        bad = np.zeros(shape, np.float32)
        fails(ValueError, block.forward, bad, match=["x", "B >= 1", "L >= 1", str(shape)])
        fails(ValueError, block.forward, bad, st, keep=[st], match=["x", str(shape)])
    for shape in [(0, d), (0, 1, d)]:
        fails(ValueError, block.step, np.zeros(shape, np.float32), st, keep=[st],
              match=["x", "B >= 1", str(shape)])


@pytest.mark.parametrize("which", ["minus1", "plus1", "one", "double"])
def test_x_wrong_d_model(case, block, which):
    d = case.d
    d_bad = {"minus1": d - 1, "plus1": d + 1, "one": 1, "double": 2 * d}[which]
    st = filled_state(block)
    bad = random_input(B, L, d_bad, seed=1)
    match = ["x", f"d_model {d_bad}", f"block has {d}"]
    fails(ValueError, block.forward, bad, match=match)
    fails(ValueError, block.forward, bad, st, keep=[st, bad], match=match)
    fails(ValueError, block.step, bad[:, :1], st, keep=[st, bad], match=match)
    fails(ValueError, block.step, np.ascontiguousarray(bad[:, 0]), st, keep=[st], match=match)


# ------------------------------------------------------------- non-finite
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [(0, 0, 0), (1, 2, 3), (1, L - 1, -1), (0, 4, 7)],
                         ids=["first", "1-2-3", "last", "0-4-7"])
def test_nonfinite_x_named_with_first_index(case, block, value, pos):
    d = case.d
    pos = (pos[0], pos[1], pos[2] % d)
    x = case.x(seed=4)
    idx = int(np.ravel_multi_index(pos, x.shape))
    x.reshape(-1)[idx] = value
    if idx + 7 < x.size:  # a later non-finite value: the first index is reported
        x.reshape(-1)[idx + 7] = np.nan
    msg = fails(ValueError, block.forward, x, keep=[x], match=["x", f"flat index {idx}"])
    assert_not_names(msg, f"index {idx + 7}")
    st = filled_state(block)
    fails(ValueError, block.forward, x, st, keep=[st, x], match=["x", f"flat index {idx}"])
    st_np = numpy_state(filled_state(block))
    fails(ValueError, block.forward, x, st_np, keep=[st_np, x], match=["x", f"flat index {idx}"])
    # step: x (B, d) and (B, 1, d); the index within that token's array
    xt = np.ascontiguousarray(x[:, pos[1]])
    tidx = pos[0] * d + pos[2]
    fails(ValueError, block.step, xt, st, keep=[st, xt], match=["x", f"flat index {tidx}"])
    fails(ValueError, block.step, xt[:, None], st, keep=[st], match=["x", f"flat index {tidx}"])


def test_nonfinite_x_strided_is_named_by_its_logical_index(case, block):
    """A non-contiguous x is read in logical (C) order: the index is the flat
    index of the logical (B, L, d) array."""
    base = case.x(l=2 * L, seed=4)
    x = base[:, ::2]
    assert not x.flags.c_contiguous
    x[1, 3, 5] = np.nan
    idx = int(np.ravel_multi_index((1, 3, 5), x.shape))
    fails(ValueError, block.forward, x, keep=[base], match=["x", f"flat index {idx}"])


def test_nonfinite_x_with_lengths_only_real_positions(case, block):
    """Real positions are checked (index of the full x); padding may hold
    anything (docs/numerics.md, "Ragged batches")."""
    x = case.x(seed=4)
    lengths = [3, L]
    x[0, 3:] = np.nan                         # padding of row 0: ignored
    x[0, 4, 0] = np.inf
    y = np.asarray(block.forward(x, lengths=lengths))
    assert (y[0, 3:].view(np.uint32) == 0).all(), "padding is not exactly +0.0"
    assert np.isfinite(y).all()
    x[1, 4, 2] = np.inf                       # real (row 1 is full length)
    idx = int(np.ravel_multi_index((1, 4, 2), x.shape))
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=["x", f"flat index {idx}"])


# -------------------------------------------- layouts that are accepted
def test_strided_fortran_and_read_only_x_give_the_bytes_of_a_copy(case, block, x):
    """Non-contiguous and read-only x are read in logical order (copied, never
    written): forward, forward with a state and step give the bytes of the
    contiguous copy."""
    y0 = as_bytes(block.forward(x))
    wide = np.zeros(x.shape[:-1] + (2 * case.d,), np.float32)
    wide[..., 1::2] = x
    ro = x.copy()
    ro.flags.writeable = False
    views = {"strided": wide[..., 1::2], "fortran": np.asfortranarray(x), "read-only": ro}
    assert not views["fortran"].flags.c_contiguous
    for name, v in views.items():
        before = snapshot(v)
        assert as_bytes(block.forward(v)) == y0, name
        s1, s2 = block.allocate_state(B), block.allocate_state(B)
        assert as_bytes(block.forward(v, s1)) == as_bytes(block.forward(x, s2)), name
        assert as_bytes(block.step(v[:, 2], s1)) == as_bytes(block.step(x[:, 2].copy(), s2)), name
        assert snapshot(s1) == snapshot(s2), name
        assert snapshot(v) == before, name
    # control: the other half of the wide buffer (zeros) gives other bytes
    assert as_bytes(block.forward(wide[..., 0::2])) != y0


# ------------------------------------------------------------------- step
def test_step_takes_one_token(case, block):
    st = filled_state(block)
    for n in (0, 2, L):
        xx = case.x(l=n, seed=9) if n else np.zeros((B, 0, case.d), np.float32)
        fails(ValueError, block.step, xx, st, keep=[st, xx],
              match=["x", "one token", "(B, 1, d_model)", f"got {(B, n, case.d)}"])


def test_step_needs_a_state(block, x):
    fails(ValueError, block.step, np.ascontiguousarray(x[:, 0]), None, keep=[x],
          match=["state", "allocate_state"])
    fails(ValueError, block.step, x[:, :1], None, keep=[x], match=["state", "allocate_state"])


def test_step_2d_and_3d_same_bytes(block, x):
    s1, s2 = filled_state(block), filled_state(block)
    y1 = block.step(np.ascontiguousarray(x[:, 0]), s1)
    y2 = block.step(x[:, :1], s2)
    assert y1.shape == y2.shape == (B, 1, x.shape[2])
    assert as_bytes(y1) == as_bytes(y2)
    assert snapshot(s1) == snapshot(s2)
    # control: another token gives other bytes
    assert as_bytes(block.step(x[:, 1:2], s2)) != as_bytes(y1)


# ---------------------------------------------------------------- lengths
@pytest.mark.parametrize("lengths", [[True, 3], [2, False], [True, True], [2.0, 3], [2, 3.5],
                                     [np.float32(2), 3], np.array([True, True]), ["2", 3]],
                         ids=["bool0", "bool1", "bools", "float", "float2", "npfloat",
                              "npbool", "str"])
def test_lengths_bad_type(block, x, lengths):
    i, v = next((i, v) for i, v in enumerate(lengths)
                if isinstance(v, (bool, np.bool_, float, np.floating, str)))
    fails(TypeError, block.forward, x, lengths=lengths, keep=[x],
          match=[f"lengths[{i}]", "int", type(v).__name__])


def test_lengths_not_a_sequence(block, x):
    fails(TypeError, block.forward, x, lengths=3, keep=[x], match=["lengths", "sequence", "int"])


@pytest.mark.parametrize("lengths,bad_i", [([0, 3], 0), ([3, L + 1], 1), ([-1, 2], 0),
                                           ([L, 0], 1), ([10**9, 1], 0)])
def test_lengths_out_of_range(block, x, lengths, bad_i):
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=[f"lengths[{bad_i}] = {lengths[bad_i]}", f"L={L}"])


@pytest.mark.parametrize("lengths", [[3], [1, 2, 3], []])
def test_lengths_wrong_count(block, x, lengths):
    fails(ValueError, block.forward, x, lengths=lengths, keep=[x],
          match=["lengths", f"B={B}", f"got {len(lengths)}"])


def test_lengths_with_a_state(case, block, x):
    if case.kind == 1:  # its forward ends each row's state at its length
        pytest.skip("Mamba-1 takes lengths with a state (tests/test_mamba1_state_grad.py)")
    for st in (filled_state(block), numpy_state(filled_state(block))):
        fails(ValueError, block.forward, x, st, lengths=[L, L], keep=[st, x],
              match=["lengths", "state"])


def test_lengths_numpy_ints_accepted(block, x):
    a = block.forward(x, lengths=[3, L])
    b = block.forward(x, lengths=np.array([3, L], np.int64))
    c = block.forward(x, lengths=(np.int32(3), np.int16(L)))
    assert as_bytes(a) == as_bytes(b) == as_bytes(c)
    assert as_bytes(block.forward(x, lengths=[4, L])) != as_bytes(a)  # control
