"""Contract: weights, numeric_mode and params (docs/guide/errors.rst), for
every block class and every weight it takes: missing, unknown, wrong shape,
wrong dtype, not a buffer, not a dict, non-finite; numeric_mode; a refused
set_params leaves the block unchanged; weights are copied in and out and
read in logical order whatever their layout; backward of the inference
classes; the reports (h_last_, ...) before a call and once stale.

A refused construction leaves the caller's weight arrays as they were.
"""
import array as pyarray
import re

import numpy as np
import pytest

from mojolearn import _loader
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
from tests.contract.cases import (B, BAD_DTYPES, as_bytes, fails, filled_state, numpy_state,
                                  snapshot, with_value)
from tests.errors import assert_names, assert_not_names, raises_naming

ALL_NAMES = [n for make in (mamba1_weights, mamba2_weights, mamba3_weights) for n in make(32, 0)]


def _listed(msg, word):
    """The part of msg after `word`, up to the next ';' or '(' (the names the
    message lists for `word`, not the list of expected names after them)."""
    assert word in msg, msg
    return re.split(r"[;(]", msg.split(word, 1)[1], maxsplit=1)[0]


# ------------------------------------------------------------ names
def test_weights_not_a_dict(case):
    w = case.weights()
    for bad in (list(w.values()), None, tuple(w.items())):
        fails(TypeError, case.cls, bad, match=["weights", type(bad).__name__])


def test_missing_weights_listed(case):
    names = case.weight_names
    w0 = case.weights()
    for drop in ([names[-2]], [names[3], names[5]], [case.norm], [case.norm, names[-1]], names):
        w = {k: v for k, v in w0.items() if k not in drop}
        msg = fails(ValueError, case.cls, w, keep=list(w.values()), match=["missing"])
        listed = _listed(msg, "missing")
        assert_names(listed, *drop)
        assert_not_names(listed, *w)  # present names are not reported as missing


def test_unknown_weights_listed(case):
    names = case.weight_names
    foreign = next(n for n in ALL_NAMES if n not in names)  # another block's weight
    for extra in (["foo.weight"], [f"mixer.{names[3]}", "bias"], [foreign]):
        w = case.weights()
        for k in extra:
            w[k] = np.zeros(3, np.float32)
        msg = fails(ValueError, case.cls, w, match=["unknown"] + extra)
        listed = _listed(msg, "unknown")
        assert_names(listed, *extra)
        assert_not_names(listed, *names)


def test_missing_and_unknown_both_listed(case):
    w = case.weights()
    name = case.weight_names[4]
    w[f"mixer.{name}"] = w.pop(name)
    msg = fails(ValueError, case.cls, w, match=["missing", "unknown"])
    assert_names(_listed(msg, "missing"), name)
    assert_names(_listed(msg, "unknown"), f"mixer.{name}")
    assert_not_names(_listed(msg, "unknown"), name)


# ------------------------------------------------------------ shapes
def test_wrong_weight_shape_named(case):
    w0 = case.weights()
    for name in case.weight_names:
        shape = w0[name].shape
        if name == case.norm:  # d_model is read from it: another ndim
            bad_shapes, want = [(case.d, 1)], []
        else:
            swapped = shape[::-1] if len(set(shape)) > 1 else (shape[0] + 1,) + shape[1:]
            bad_shapes, want = [shape[:-1] + (shape[-1] + 1,), swapped], [str(shape)]
        for bad_shape in bad_shapes:
            w = dict(w0, **{name: np.zeros(bad_shape, np.float32)})
            fails(ValueError, case.cls, w, keep=list(w0.values()),
                  match=[name, str(bad_shape)] + want)


def test_weights_of_two_d_models(case):
    """Every weight fits one d_model except the norm (which gives d_model)."""
    w = case.weights()
    w[case.norm] = np.ones(case.small_d, np.float32)
    fails(ValueError, case.cls, w, match=["in_proj.weight", str(w["in_proj.weight"].shape)])


# ------------------------------------------------------------ dtype, buffer
@pytest.mark.parametrize("make,words", BAD_DTYPES)
def test_weight_bad_dtype(case, make, words):
    w0 = case.weights()
    for name in case.weight_names:
        w = dict(w0, **{name: make(w0[name].shape)})
        fails(TypeError, case.cls, w, keep=list(w.values()), match=[name] + words)


@pytest.mark.parametrize("kind", ["list", "None"])
def test_weight_not_a_buffer(case, kind):
    w0 = case.weights()
    for name in case.weight_names:
        bad = w0[name].tolist() if kind == "list" else None
        fails(TypeError, case.cls, dict(w0, **{name: bad}), keep=list(w0.values()),
              match=[name, type(bad).__name__])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_weight_named_with_its_index(case, value):
    w0 = case.weights()
    for name in case.weight_names:
        n = w0[name].size
        for idx in (0, n // 2, n - 1):
            w = dict(w0, **{name: with_value(w0[name], idx, value)})
            fails(ValueError, case.cls, w, keep=list(w.values()),
                  match=[name, f"flat index {idx}"])


# ------------------------------------------------------------ numeric_mode
@pytest.mark.parametrize("mode", ["IDENTICAL", "exact", "", None, 0, "fast "])
def test_bad_numeric_mode(case, mode):
    fails(ValueError, case.cls, case.weights(), numeric_mode=mode,
          match=["numeric_mode", repr(mode)])


def test_fast_mode_without_binary(case):
    if "fast" in _loader.available_modes():
        pytest.skip("a fast binary is installed")
    fails(ValueError, case.cls, case.weights(), numeric_mode="fast",
          match=["numeric_mode", "'fast'", "not available"])


def test_numeric_mode_checked_before_weights(case):
    with raises_naming(ValueError, "numeric_mode", "'turbo'"):
        case.cls({}, numeric_mode="turbo")


# ------------------------------------------------------------ params
def test_weights_copied_at_construction(case, x):
    w = case.weights()
    blk = case.cls(w)
    y0 = as_bytes(blk.forward(x))
    for v in w.values():
        v *= 2.0
        v.reshape(-1)[0] = np.nan
    assert as_bytes(blk.forward(x)) == y0
    # also for array.array / memoryview weights
    bufs = {k: pyarray.array("f", v.reshape(-1).tolist()) for k, v in case.weights().items()}
    blk2 = case.cls({k: memoryview(b).cast("B").cast("f", case.weights()[k].shape)
                     for k, b in bufs.items()})
    assert as_bytes(blk2.forward(x)) == y0
    for b in bufs.values():
        for i in range(len(b)):
            b[i] = 0.5
    assert as_bytes(blk2.forward(x)) == y0
    # control: a block on the changed values gives other bytes
    assert as_bytes(case.cls({k: np.nan_to_num(v) for k, v in w.items()}).forward(x)) != y0


def test_strided_fortran_and_read_only_weights_give_the_bytes_of_a_copy(case, x):
    """Weights are read in logical order, whatever their layout, and never
    written."""
    w = case.weights()
    y0 = as_bytes(case.cls(w).forward(x))
    fortran = {k: np.asfortranarray(v) for k, v in w.items()}
    fortran["in_proj.weight"] = np.ascontiguousarray(w["in_proj.weight"].T).T
    assert not fortran["in_proj.weight"].flags.c_contiguous
    wide = {k: np.zeros(v.shape[:-1] + (2 * v.shape[-1],), np.float32) for k, v in w.items()}
    for k, v in w.items():
        wide[k][..., 1::2] = v
    strided = {k: v[..., 1::2] for k, v in wide.items()}
    read_only = {k: v.copy() for k, v in w.items()}
    for v in read_only.values():
        v.flags.writeable = False
    for name, ws in (("fortran", fortran), ("strided", strided), ("read-only", read_only)):
        before = snapshot(*ws.values())
        assert as_bytes(case.cls(ws).forward(x)) == y0, name
        assert snapshot(*ws.values()) == before, name
    # control: the other half of the wide buffers (zeros but the norms) gives other bytes
    other = {k: v[..., 0::2] for k, v in wide.items()}
    other[case.norm] = w[case.norm]
    assert as_bytes(case.cls(other).forward(x)) != y0


def test_get_params_returns_copies(case, x):
    w = case.weights()
    blk = case.cls(w)
    y0 = as_bytes(blk.forward(x))
    p = blk.get_params()
    assert set(p) == case.params and p["numeric_mode"] == "identical"
    assert list(p["weights"]) == case.weight_names
    for k, v in p["weights"].items():
        assert memoryview(v).shape == w[k].shape and as_bytes(v) == as_bytes(w[k]), k
        np.asarray(v)[...] = 7.0
    assert as_bytes(blk.forward(x)) == y0
    p2 = blk.get_params()
    for k in case.weight_names:
        assert as_bytes(p2["weights"][k]) == as_bytes(w[k]), k
        assert p2["weights"][k] is not p["weights"][k], k
    assert as_bytes(case.cls(**p2).forward(x)) == y0  # round trip
    assert as_bytes(case.cls(**p).forward(x)) != y0  # control: the 7.0s are other weights


def test_set_params_rebuilds(case, x):
    blk = case.block()
    y0 = as_bytes(blk.forward(x))
    w2 = case.weights(seed=99)
    assert blk.set_params(weights=w2) is blk
    y2 = as_bytes(case.cls(case.weights(seed=99)).forward(x))
    assert as_bytes(blk.forward(x)) == y2 != y0
    w2[case.weight_names[-1]][:] = 0  # the weights given to set_params are copied too
    assert as_bytes(blk.forward(x)) == y2
    blk.set_params(numeric_mode="identical")  # numeric_mode alone keeps the weights
    assert as_bytes(blk.forward(x)) == y2
    blk.set_params(weights=case.weights(seed=1, d=case.small_d))  # another d_model
    assert blk.d_model == case.small_d
    assert blk.forward(case.x()[..., :case.small_d].copy()).shape == (B, 5, case.small_d)


def _refused_set_params(case):
    """(exception, set_params kwargs, names the message must give): one of
    each kind of refusal, including valid weights paired with a bad argument
    (nothing may be applied) and a smaller block's weights with one bad."""
    d, names, w = case.d, case.weight_names, case.weights()
    other = case.weights(seed=8)  # valid on their own
    small = case.weights(seed=1, d=case.small_d)
    small["D"] = np.zeros(3, np.float32)
    out = [
        (ValueError, {"weights": dict(w, **{names[-1]: with_value(w[names[-1]], 17)})},
         [names[-1], "flat index 17"]),
        (TypeError, {"weights": dict(w, D=w["D"].astype(np.float64))}, ["D", "float64"]),
        (ValueError, {"weights": dict(w, **{"in_proj.weight": np.zeros((5, d), np.float32)})},
         ["in_proj.weight", f"(5, {d})"]),
        (ValueError, {"weights": {k: v for k, v in w.items() if k != names[4]}},
         [f"missing ['{names[4]}']"]),
        (ValueError, {"weights": dict(w, extra=np.zeros(1, np.float32))}, ["unknown ['extra']"]),
        (ValueError, {"weights": small}, ["D", "(3,)"]),
        (TypeError, {"weights": list(w.values())}, ["weights", "list"]),
        (ValueError, {"numeric_mode": "bogus"}, ["numeric_mode", "'bogus'"]),
        (ValueError, {"weights": other, "numeric_mode": "bogus"}, ["numeric_mode", "'bogus'"]),
        (ValueError, {"weights": other, "chunk_size": 64}, ["unknown parameters", "chunk_size"]),
        (ValueError, {"bogus_param": 1}, ["unknown parameters", "bogus_param"]),
    ]
    if "fast" not in _loader.available_modes():
        out.append((ValueError, {"numeric_mode": "fast"}, ["numeric_mode", "'fast'"]))
    return out


def test_refused_set_params_leaves_the_block_unchanged(case, x):
    """Every parameter byte, the attributes, the outputs (stateless, carried,
    step) and a caller's state stay as they were."""
    blk = case.block()
    st = filled_state(blk)
    y0 = as_bytes(blk.forward(x))
    p0 = {k: as_bytes(v) for k, v in blk.get_params()["weights"].items()}
    attrs0 = tuple(getattr(blk, a) for a in case.attrs)
    s0 = snapshot(st)
    refusals = _refused_set_params(case)
    assert len(refusals) >= 11
    for exc, params, words in refusals:
        fails(exc, blk.set_params, **params, keep=[st], match=words)
        assert as_bytes(blk.forward(x)) == y0, sorted(params)
        p = blk.get_params()
        assert p["numeric_mode"] == "identical", sorted(params)
        assert {k: as_bytes(v) for k, v in p["weights"].items()} == p0, sorted(params)
        assert tuple(getattr(blk, a) for a in case.attrs) == attrs0, sorted(params)
    assert snapshot(st) == s0
    # the old weights still drive a carried forward and a step
    ref = case.block()
    st_ref = numpy_state(st)
    assert as_bytes(blk.forward(x, st)) == as_bytes(ref.forward(x, st_ref))
    assert as_bytes(blk.step(x[:, 0].copy(), st)) == as_bytes(ref.step(x[:, 0].copy(), st_ref))
    assert snapshot(st) == snapshot(st_ref)
    # control: an accepted set_params does change the output and the params
    blk.set_params(weights=case.weights(seed=8))
    assert as_bytes(blk.forward(x)) != y0
    assert {k: as_bytes(v) for k, v in blk.get_params()["weights"].items()} != p0


# ------------------------------------------------------------ attributes
def test_common_attributes(case, block):
    assert block.d_model == case.d and block.weight_format == "float32"
    assert block.numeric_mode == block.numeric_mode_used() == "identical"
    assert block.vendor_used() == "cpu"


def test_backward_or_forward_only(case, block, x):
    if case.inference:
        with raises_naming(NotImplementedError, case.name, "forward-only"):
            block.backward(x, x)
    else:
        g = block.backward(x, x)
        assert set(g) == {"x"} | set(case.weight_names)
        assert g["x"].shape == x.shape


def test_reports_before_and_after_calls(case, x):
    """Reports (h_last_, ...) are AttributeError before any call, and
    ValueError once another call advanced the state they came from; the
    other block's own reports stay readable. Mamba-1 has none."""
    blk = case.block()
    if not case.reports:
        assert not hasattr(blk, "h_last_")
        return
    for r in case.reports:
        with raises_naming(AttributeError, r, "forward"):
            getattr(blk, r)
    other = case.block()
    st = blk.allocate_state(B)
    blk.forward(x, st)
    other.step(x[:, 0].copy(), st)  # another block advances the same state
    for r in case.reports:
        with raises_naming(ValueError, r, "no longer available"):
            getattr(blk, r)
    theirs = case.reports_of(other)
    assert all(a.shape[0] == B for a in theirs)
    assert [a.tobytes() for a in case.reports_of(other)] == [a.tobytes() for a in theirs]
    # control: reports read right after the call stay readable (and the same)
    blk.forward(x, st)
    mine = case.reports_of(blk)
    other.step(x[:, 0].copy(), st)
    assert [a.tobytes() for a in case.reports_of(blk)] == [a.tobytes() for a in mine]
