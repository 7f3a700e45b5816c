"""Op ids of the binaries' C ABI, and each op's argument slots by name.

ABI_VERSION mirrors mojo/mojolearn_kernels/abi.mojo (the loader checks
it). Nothing else is copied: the op ids (``OP_M1_FORWARD`` ...) come from
the binary's op table (``ml_op_table``, ops.mojo), the other shared numbers
from ``ml_constants`` (``constant``), and argument slots from ``ml_op_spec``
(OpSpec).
"""
from __future__ import annotations

ABI_VERSION = 9

VENDORS = {0: "cpu", 1: "cuda", 2: "hip", 3: "metal"}
NUMERIC_MODES = {0: "identical", 1: "fast"}



def _text(lib, symbol: str) -> str:
    """The text an ``ml_*(buf, cap)`` export writes (grown once if short)."""
    import ctypes
    fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64)(lib.symbol(symbol))
    buf = ctypes.create_string_buffer(1024)
    n = fn(buf, len(buf))
    if n > len(buf):
        buf = ctypes.create_string_buffer(n)
        n = fn(buf, n)
    return buf.raw[:n].decode("ascii")


_TABLES: dict = {}


def _tables(lib) -> tuple:
    """(op ids by name, host-op names, constants by name) of binary `lib`,
    read once per binary from its ``ml_op_table`` and ``ml_constants``."""
    t = _TABLES.get(lib.path)
    if t is None:
        ops, host, consts = {}, set(), {}
        for part in _text(lib, "ml_op_table").split(";"):
            if part:
                name, rest = part.split("=")
                op, where = rest.split(",")
                ops[name] = int(op)
                if where == "host":
                    host.add(name)
        for part in _text(lib, "ml_constants").split(";"):
            if part:
                name, value = part.split("=")
                consts[name] = int(value)
        t = _TABLES[lib.path] = (ops, frozenset(host), consts)
    return t


def op_ids(lib=None) -> dict:
    """Op ids by name ('m1_forward', ...) as binary `lib` (default: the
    loaded one) declares them (mojo/mojolearn_kernels/ops.mojo)."""
    if lib is None:
        from . import _loader
        lib = _loader.library()
    return _tables(lib)[0]


def op_names(lib=None) -> dict:
    """``{'OP_M1_FORWARD': 11, ...}``: every op of the table under the
    constant name Python code uses for it."""
    return {"OP_" + k.upper(): v for k, v in op_ids(lib).items()}


def constant(name: str, lib=None) -> int:
    """A number shared with the binaries (constants.mojo: 'BUF_ROW',
    'M1_FLAG_NO_LOAD', ...), read from binary `lib` (default: the loaded one)."""
    if lib is None:
        from . import _loader
        lib = _loader.library()
    return _tables(lib)[2][name]


def __getattr__(name: str) -> int:
    """``OP_M1_FORWARD`` and the like: the id of op 'm1_forward' in the
    loaded binary (read on first use, never a copied number)."""
    if name.startswith("OP_"):
        ids = op_ids()
        key = name[3:].lower()
        if key in ids:
            value = ids[key]
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def op_spec(lib, op) -> OpSpec:
    """The OpSpec of op (its id, or its name in the op table such as
    'm1_forward') in the loaded binary `lib` (read once per binary)."""
    key = (lib.path, op)
    spec = _SPECS.get(key)
    if spec is None:
        import ctypes
        if isinstance(op, str):
            op = _tables(lib)[0][op]
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
    spec = op_spec(lib, op)
    op, slot = spec.op, spec.slot(name)
    a = (ctypes.c_int64 * len(args))(*args)
    a[slot] = a[slot] or 1  # the table lists only non-null slots; never dereferenced
    cap, width = 64, _tables(lib)[2]["BUF_ROW"]
    rows = (ctypes.c_int64 * (width * cap))()
    n = fn(op, a, rows, cap)
    if n < 0 or n > cap:
        raise ValueError(f"op {op}: no buffer table for these arguments")
    for i in range(n):
        if rows[width * i] == slot:
            return int(rows[width * i + 1])
    raise ValueError(f"op {op}: slot {name!r} is not one of its buffers here")
