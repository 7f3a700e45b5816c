"""The binaries' slot declarations (ml_op_spec, opspec.mojo) and their use.

Every op's argument slots are declared once, in the binary; the Python layer
packs arguments by name. These tests check that the declaration is whole
(every op id, every slot number once), that each CPU binary declares the
same, that it agrees with the buffer table a device stages, and that no
slot number is written in the Python package.
"""
import re
from pathlib import Path

import pytest

from mojolearn import _abi, _loader

OPS = _abi.op_names()
PACKAGE = Path(_abi.__file__).parent


def _binaries():
    libs = []
    for path in _loader.find_binaries():
        try:
            lib = _loader.native().Library(str(path))
        except RuntimeError:
            continue
        if lib.vendor == 0 and not _loader.missing_cpu_features(lib):
            libs.append(lib)
    assert libs, "no CPU binary this machine can run"
    return libs


def test_every_op_id_has_a_whole_declaration():
    """Each op id of _abi is known to the binary, and its slots are 0..n-1,
    each exactly once, with a known kind and direction."""
    lib = _loader.library()
    for name, op in OPS.items():
        spec = _abi.op_spec(lib, op)
        assert sorted(spec.slots.values()) == list(range(spec.nargs)), name
        assert set(spec.kinds.values()) <= {"int", "f32", "i64", "i32", "codes", "work"}, name
        for n, kind in spec.kinds.items():
            ok = {"-"} if kind == "int" else {"in", "out", "inout", "scratch"}
            assert spec.dirs[n] in ok, (name, n)
    unknown = max(OPS.values()) + 1
    with pytest.raises(ValueError, match=f"op {unknown}"):
        _abi.op_spec(lib, unknown)


def test_op_ids_name_the_ops_they_claim():
    """A wrong op id in _abi (a mirror of abi.mojo) would hand the kernel
    another op's arguments: each id's slots are those of its kind of op."""
    lib = _loader.library()
    for name, op in OPS.items():
        slots = set(_abi.op_spec(lib, op).slots)
        if name.endswith("_FORWARD"):
            assert {"x", "y", "blob", "work", "lengths"} <= slots, name
        elif name.endswith("_BACKWARD"):
            assert {"x", "grad_output", "dx", "blob"} <= slots, name
        elif name.endswith("_PREPARE") and name != "OP_LM_PREPARE":
            assert {"d", "blob", "wfmt", "in_proj.weight"} <= slots, name
    m = {n: set(_abi.op_spec(lib, op).slots) for n, op in OPS.items()}
    assert "flags" in m["OP_M1_FORWARD"] and "cache" in m["OP_M2_FORWARD"]
    assert "report:theta" in m["OP_M3_FORWARD"] and "x_proj.weight" in m["OP_M1_BACKWARD"]
    assert m["OP_MATH_EVAL"] == {"fn", "src", "dst", "n", "width"}
    assert m["OP_LOWBIT_PACK"] == m["OP_LOWBIT_UNPACK"] == {"fmt", "src", "rows", "cols",
                                                            "dst", "aux"}


def test_every_cpu_binary_declares_the_same_slots():
    texts = []
    for lib in _binaries():
        _abi._SPECS.clear()
        specs = {op: _abi.op_spec(lib, op) for op in OPS.values()}
        texts.append({op: (s.slots, s.kinds, s.dirs) for op, s in specs.items()})
    _abi._SPECS.clear()
    assert all(t == texts[0] for t in texts)


def test_pack_places_values_by_name_and_refuses_unknown_names():
    spec = _abi.OpSpec(7, "b=0,int,-;x=2,f32,in;grad:D=1,f32,inout;")
    assert spec.nargs == 3

    class Buf:
        address = 4096

    assert spec.pack({"grad:D": Buf()}, b=5, x=None) == [5, 4096, 0]
    assert spec.pack(x=Buf()) == [0, 0, 4096]
    with pytest.raises(KeyError, match=r"op 7 has no slot 'y'.*'grad:D'"):
        spec.pack(y=1)


def test_staged_buffer_table_matches_the_declaration():
    """The rows a device would stage for a real call are the declared
    buffer slots with their declared directions (buffers.mojo reads them
    off the same declaration; this guards the reading)."""
    import numpy as np
    import mojolearn
    from mojolearn.reference.weights import mamba2_weights
    lib = _loader.library()
    block = mojolearn.Mamba2Block(mamba2_weights(32, seed=3))

    lib.emulate_device = True
    try:
        lib.staged_rows = {}
        st = block.allocate_state(2)
        block.forward(np.ones((2, 5, 32), np.float32), st)
        rows = dict(lib.staged_rows)
    finally:
        lib.emulate_device = False
    spec = _abi.op_spec(lib, _abi.OP_M2_FORWARD)
    buffers = [n for n, k in spec.kinds.items() if k != "int"]
    # x, y, blob, the 4 state arrays, work (no lengths, h_last, cache or row_tokens here)
    assert rows[_abi.OP_M2_FORWARD] == 8 and len(buffers) == 12


SLOT_NUMBER = (r"args\[\d", r"\.run\([^)\n]*,\s*\[", r"_SLOTS?\w* = \d")


def _hits(patterns, text):
    return [m.group(0) for pat in patterns for m in re.finditer(pat, text)]


def _package_hits(patterns):
    return [f"{p.name}: {hit}" for p in PACKAGE.rglob("*.py")
            for hit in _hits(patterns, p.read_text())]


def _slot_numbers(text):
    return _hits(SLOT_NUMBER, text)


def test_no_slot_number_is_written_in_the_package():
    """Argument lists are packed by name (OpSpec.pack): no literal index
    into an op's arguments and no positional argument list in the package."""
    assert _package_hits(SLOT_NUMBER) == []
    # control: the forms this replaced are found
    old = ("args[6], args[7] = cw, h\nlib.run(OP_X, [b, l, d])\n"
           "_FWD_SLOTS = 16\n")
    assert len(_slot_numbers(old)) == 4


# The numbers the binary exports (ml_op_table, ml_constants) written as
# literals: an op id, a call flag bit, a buffer direction or phase code, and
# the buffer table's row width used to index or size rows.
SHARED_NUMBER = (
    r"\bOP_\w+\s*=\s*-?\d",
    r"\w*(?:FLAG|NO_LOAD|NO_SAVE|NO_TOKENS)\w*(?:\s*,\s*\w+)*\s*=\s*-?\d",
    r"\b(?:BUF_\w+|PHASE_END|PLAN_WORKSPACE)\s*=\s*-?\d",
    r"rows\[\s*\d+\s*\*",
    r"\(\s*\d+\s*\*\s*cap\s*\)",
)


def test_no_shared_number_is_copied_into_the_package():
    """Op ids, flag bits, directions and the buffer row width come from the
    binary's own export (_abi.op_ids / _abi.constant), never a literal."""
    assert _package_hits(SHARED_NUMBER) == []
    # control: each form a copied number took before is found
    planted = ("OP_M1_FORWARD = 11\n_NO_LOAD, _NO_SAVE, _NO_TOKENS = 1, 2, 4\n"
               "BUF_INOUT = 3\nrows = (ctypes.c_int64 * (3 * cap))()\nif rows[3 * i] == slot:\n")
    assert len(_hits(SHARED_NUMBER, planted)) == 5


def test_exported_numbers_are_the_ones_the_kernels_use():
    """The exported table says what the binary does: each op id answers a
    plan (an unknown id does not), host ops are those ml_host_op names,
    and the buffer rows have the exported width."""
    lib = _loader.library()
    ops, host, consts = _abi._tables(lib)
    assert len(set(ops.values())) == len(ops) >= 19
    import ctypes
    host_op = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(lib.symbol("ml_host_op"))
    assert host == {n for n, op in ops.items() if host_op(op)} and "m1_forward" not in host
    spec = _abi.op_spec(lib, "m1_forward")
    assert spec.op == ops["m1_forward"] and lib.workspace_bytes(spec.op, spec.pack(b=1, l=1, d=32)) > 0
    assert {"m1_prepare", "first_nonfinite", "lm_prepare"} <= host
    assert consts["BUF_ROW"] == 3 and consts["PHASE_END"] == -1
    assert {consts[k] for k in ("BUF_IN", "BUF_OUT", "BUF_INOUT")} == {1, 2, 3}
    flags = [consts[f"M1_FLAG_{k}"] for k in ("NO_LOAD", "NO_SAVE", "NO_TOKENS")]
    assert sorted(flags) == [1, 2, 4]


def test_workspace_query_tells_a_refusal_from_an_unknown_op():
    """A plan's refusal (-3) and an op the binary lacks (-2) read differently."""
    from mojolearn import _loader
    lib = _loader.library()
    spec = _abi.op_spec(lib, _abi.OP_M1_PREPARE)
    assert lib.workspace_bytes(_abi.OP_M1_PREPARE, spec.pack(d=64, wfmt=0)) > 0
    with pytest.raises(RuntimeError, match="op 10 refused its arguments"):
        lib.workspace_bytes(_abi.OP_M1_PREPARE, spec.pack(d=64, wfmt=99))
    with pytest.raises(RuntimeError, match="unknown op 999"):
        lib.workspace_bytes(999, [0] * 8)
