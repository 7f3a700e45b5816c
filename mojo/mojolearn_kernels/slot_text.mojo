"""An op's slot declaration (opspec.mojo) as text, for `ml_op_spec`.

The text is `name=slot,kind,direction;` per slot, in declaration order, for
example `x=3,f32,in;work=9,work,inout;flags=10,int,-;`. Written without heap
use, so the CPU binary needs no Mojo runtime.
"""
from std.collections import Array
from std.memory import stack_allocation
from .abi import I64Ptr
from .describe import U8Ptr, TextBuf
from .dispatch import op_spec
from .opspec import (
    SlotSink, K_INT, K_F32, K_I64, K_I32, K_CODES, K_WORK,
    BUF_IN, BUF_OUT, BUF_INOUT,
)

# More than any op's slot count: the zeroed args the declaration reads.
comptime MAX_SLOTS = 64


struct SlotText(SlotSink):
    var t: TextBuf

    def __init__(out self, buf: U8Ptr, cap: Int):
        self.t = TextBuf(buf, cap)

    def slot(mut self, name: StaticString, slot: Int, kind: Int, dir: Int, bytes: Int):
        self.t.entry(name, slot, ",")
        self.t.put(_kind_name(kind))
        self.t.put(",")
        self.t.put(_dir_name(kind, dir))
        self.t.put(";")


def _kind_name(kind: Int) -> StaticString:
    comptime assert K_INT == 0 and K_F32 == 1 and K_I64 == 2 and K_I32 == 3 and K_CODES == 4
    var names: Array[StaticString, K_WORK + 1] = ["int", "f32", "i64", "i32", "codes", "work"]
    return names[kind] if 0 <= kind <= K_WORK else "work"


def _dir_name(kind: Int, dir: Int) -> StaticString:
    comptime assert BUF_IN == 1 and BUF_OUT == 2 and BUF_INOUT == 3
    if kind == K_INT:
        return "-"
    var names: Array[StaticString, 4] = ["scratch", "in", "out", "inout"]
    return names[dir] if 0 <= dir <= BUF_INOUT else "scratch"


def op_spec_text(op: Int, buf: U8Ptr, cap: Int) -> Int:
    """Writes op's declaration into buf (as far as cap allows); returns its
    full length, or -2 for an unknown op."""
    var zeros = stack_allocation[MAX_SLOTS, Int64]()
    for i in range(MAX_SLOTS):
        zeros[unsafe_offset=i] = 0
    var t = SlotText(buf, cap)
    if not op_spec(op, I64Ptr(unsafe_from_address=Int(zeros)), t):
        return -2
    return t.t.n
