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
from .describe import U8Ptr, put_str, put_int
from .ops import Op, OpVisitor, visit_ops
from .opspec import BUF_IN, BUF_OUT, BUF_INOUT
from .mamba1.forward import FLAG_NO_LOAD, FLAG_NO_SAVE, FLAG_NO_TOKENS


struct _TableText(OpVisitor):
    var buf: U8Ptr
    var cap: Int
    var n: Int

    def __init__(out self, buf: U8Ptr, cap: Int):
        self.buf = buf
        self.cap = cap
        self.n = 0

    def visit[O: Op](mut self) -> Bool:
        self.n = put_str(self.buf, self.cap, self.n, O.NAME)
        self.n = put_str(self.buf, self.cap, self.n, "=")
        self.n = put_int(self.buf, self.cap, self.n, O.ID)
        self.n = put_str(self.buf, self.cap, self.n, ",host;" if O.HOST else ",device;")
        return False  # on to the next op


def op_table_text(buf: U8Ptr, cap: Int) -> Int:
    """Writes the op table into buf (as far as cap allows); returns its full
    length."""
    var t = _TableText(buf, cap)
    _ = visit_ops(t)
    return t.n


def _put(buf: U8Ptr, cap: Int, n: Int, name: StaticString, v: Int) -> Int:
    var m = put_str(buf, cap, n, name)
    m = put_str(buf, cap, m, "=")
    m = put_int(buf, cap, m, v)
    return put_str(buf, cap, m, ";")


def constants_text(buf: U8Ptr, cap: Int) -> Int:
    """Writes every shared constant into buf; returns the full length."""
    var n = _put(buf, cap, 0, "PLAN_WORKSPACE", PLAN_WORKSPACE)
    n = _put(buf, cap, n, "PHASE_END", PHASE_END)
    n = _put(buf, cap, n, "BUF_ROW", BUF_ROW)
    n = _put(buf, cap, n, "BUF_IN", BUF_IN)
    n = _put(buf, cap, n, "BUF_OUT", BUF_OUT)
    n = _put(buf, cap, n, "BUF_INOUT", BUF_INOUT)
    n = _put(buf, cap, n, "M1_FLAG_NO_LOAD", FLAG_NO_LOAD)
    n = _put(buf, cap, n, "M1_FLAG_NO_SAVE", FLAG_NO_SAVE)
    return _put(buf, cap, n, "M1_FLAG_NO_TOKENS", FLAG_NO_TOKENS)
