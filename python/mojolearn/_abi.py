"""Op ids of the binaries' C ABI, and each op's argument slots by name.

The op ids and ABI_VERSION mirror mojo/mojolearn_kernels/abi.mojo (the
loader checks the version; tests/test_op_spec.py the ids). Argument slots
are not mirrored: OpSpec reads them from the binary.
"""
from __future__ import annotations

ABI_VERSION = 8

VENDORS = {0: "cpu", 1: "cuda", 2: "hip", 3: "metal"}
NUMERIC_MODES = {0: "identical", 1: "fast"}

OP_FIRST_NONFINITE = 1
OP_MATH_EVAL = 2
OP_M1_PREPARE = 10
OP_M1_FORWARD = 11
OP_M1_BACKWARD = 12
OP_M2_PREPARE = 20
OP_M2_FORWARD = 21
OP_M2_BACKWARD = 22
OP_M3_PREPARE = 30
OP_M3_FORWARD = 31
OP_M3_BACKWARD = 32
OP_PACK_TRANSPOSED = 33
OP_LOWBIT_PACK = 40
OP_LOWBIT_UNPACK = 41
OP_PANELS_EXTRACT = 42
OP_LM_PREPARE = 50
OP_LM_EMBED = 51
OP_LM_LOGITS = 52
OP_LM_NEXT = 53


class OpSpec:
    """One op's argument slots as the binary declares them.

    The binary is the one place an op's slots are written down
    (mojo/mojolearn_kernels/opspec.mojo, exported as ``ml_op_spec``); the
    Python layer packs arguments by those names and never by number.
    ``kinds[name]`` is 'int', 'f32', 'i64', 'i32', 'codes' or 'work';
    ``dirs[name]`` 'in', 'out', 'inout', 'scratch' or '-' (a scalar).
    """

    __slots__ = ("op", "slots", "kinds", "dirs", "nargs")

    def __init__(self, op: int, text: str):
        self.op = op
        self.slots, self.kinds, self.dirs = {}, {}, {}
        for part in text.split(";"):
            if not part:
                continue
            name, rest = part.split("=", 1)
            slot, kind, direction = rest.split(",")
            self.slots[name] = int(slot)
            self.kinds[name] = kind
            self.dirs[name] = direction
        self.nargs = max(self.slots.values()) + 1

    def slot(self, name: str) -> int:
        """The slot number of `name` (KeyError naming the op's slots if unknown)."""
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"op {self.op} has no slot {name!r}; its slots: "
                           f"{sorted(self.slots)}") from None

    def pack(self, named: dict | None = None, /, **values) -> list:
        """The op's argument list: each named value in its slot, 0 elsewhere.
        A value is an int, None (0) or an object with an ``address``."""
        if named:
            values.update(named)
        args = [0] * self.nargs
        slots = self.slots
        try:
            for name, v in values.items():
                args[slots[name]] = v if type(v) is int else (0 if v is None else v.address)
        except KeyError:
            for name in values:
                self.slot(name)  # raises, naming the slots
        return args


_SPECS: dict = {}


def op_spec(lib, op: int) -> OpSpec:
    """The OpSpec of op in the loaded binary `lib` (read once per binary)."""
    key = (lib.path, op)
    spec = _SPECS.get(key)
    if spec is None:
        import ctypes
        fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p,
                              ctypes.c_int64)(lib.symbol("ml_op_spec"))
        buf = ctypes.create_string_buffer(1024)
        n = fn(op, buf, len(buf))
        if n > len(buf):
            buf = ctypes.create_string_buffer(n)
            n = fn(op, buf, n)
        if n < 0:
            raise ValueError(f"{lib.path} does not know op {op}")
        spec = _SPECS[key] = OpSpec(op, buf.raw[:n].decode("ascii"))
    return spec


def slot_bytes(lib, op: int, args: list, name: str) -> int:
    """Bytes the binary's buffer table (``ml_buffers``) gives slot `name` of
    op for these arguments: sizes are computed where they are declared
    (opspec.mojo), never again in Python."""
    import ctypes
    fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64)(lib.symbol("ml_buffers"))
    slot = op_spec(lib, op).slot(name)
    a = (ctypes.c_int64 * len(args))(*args)
    a[slot] = a[slot] or 1  # the table lists only non-null slots; never dereferenced
    cap = 64
    rows = (ctypes.c_int64 * (3 * cap))()
    n = fn(op, a, rows, cap)
    if n < 0 or n > cap:
        raise ValueError(f"op {op}: no buffer table for these arguments")
    for i in range(n):
        if rows[3 * i] == slot:
            return int(rows[3 * i + 1])
    raise ValueError(f"op {op}: slot {name!r} is not one of its buffers here")
