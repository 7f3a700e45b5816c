"""The numbers the Python layer shares with the binaries, exported as text.

`ml_op_table` lists the op table (ops.mojo) as `name=id,where;` with where
`host` or `device` (Op.HOST); `ml_constants` lists `NAME=value;` for every
other number Python passes or reads: phase-plan codes, the buffer table's
row width and direction bits, and call flags. Python reads both once per
binary (python/mojolearn/_abi.py) instead of copying a literal. Written
without heap use, so the CPU binary needs no Mojo runtime.
"""
from .abi import PHASE_END, PLAN_WORKSPACE
from .buffers import BUF_ROW
from .describe import U8Ptr, TextBuf
from .ops import Op, OpVisitor, visit_ops
from .opspec import BUF_IN, BUF_OUT, BUF_INOUT
from .mamba1.forward import FLAG_NO_LOAD, FLAG_NO_SAVE, FLAG_NO_TOKENS


struct _TableText(OpVisitor):
    var t: TextBuf

    def __init__(out self, buf: U8Ptr, cap: Int):
        self.t = TextBuf(buf, cap)

    def visit[O: Op](mut self) -> Bool:
        self.t.entry(O.NAME, O.ID, ",host;" if O.HOST else ",device;")
        return False  # on to the next op


def op_table_text(buf: U8Ptr, cap: Int) -> Int:
    """Writes the op table into buf (as far as cap allows); returns its full
    length."""
    var v = _TableText(buf, cap)
    _ = visit_ops(v)
    return v.t.n


def constants_text(buf: U8Ptr, cap: Int) -> Int:
    """Writes every shared constant into buf; returns the full length."""
    var t = TextBuf(buf, cap)
    t.entry("PLAN_WORKSPACE", PLAN_WORKSPACE, ";")
    t.entry("PHASE_END", PHASE_END, ";")
    t.entry("BUF_ROW", BUF_ROW, ";")
    t.entry("BUF_IN", BUF_IN, ";")
    t.entry("BUF_OUT", BUF_OUT, ";")
    t.entry("BUF_INOUT", BUF_INOUT, ";")
    t.entry("M1_FLAG_NO_LOAD", FLAG_NO_LOAD, ";")
    t.entry("M1_FLAG_NO_SAVE", FLAG_NO_SAVE, ";")
    t.entry("M1_FLAG_NO_TOKENS", FLAG_NO_TOKENS, ";")
    return t.n
