"""The binaries' self-description string, written without heap use."""
from std.memory import Pointer

comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]


def put_str(buf: U8Ptr, cap: Int, pos: Int, s: StringSlice) -> Int:
    """Copies s into buf at pos (as far as cap allows); returns the new pos."""
    var bytes = s.as_bytes()
    for i in range(len(bytes)):
        if pos + i < cap:
            buf[unsafe_offset=pos + i] = bytes[i]
    return pos + len(bytes)


def put_int(buf: U8Ptr, cap: Int, pos: Int, v: Int) -> Int:
    """Writes v in decimal (a '-' first if negative); returns the new pos."""
    var n = pos
    if v < 0:
        n = put_str(buf, cap, n, "-")
    var a = -v if v < 0 else v
    var p = 1
    while p * 10 <= a:
        p *= 10
    while p > 0:
        if n < cap:
            buf[unsafe_offset=n] = UInt8(48 + (a // p) % 10)
        n += 1
        p //= 10
    return n


def describe_text(
    buf: U8Ptr, cap: Int, vendor: StringSlice, arch: StringSlice, features: StringSlice
) -> Int:
    """A binary's `ml_describe` text, `vendor=..;arch=..;features=..;mode=identical`,
    into buf (as far as cap allows); returns its full length."""
    var n = put_str(buf, cap, 0, "vendor=")
    n = put_str(buf, cap, n, vendor)
    n = put_str(buf, cap, n, ";arch=")
    n = put_str(buf, cap, n, arch)
    n = put_str(buf, cap, n, ";features=")
    n = put_str(buf, cap, n, features)
    return put_str(buf, cap, n, ";mode=identical")


struct TextBuf:
    """Text written into a caller's buffer as far as cap allows; n counts
    the full length, so a caller can ask again with a larger buffer."""

    var buf: U8Ptr
    var cap: Int
    var n: Int

    def __init__(out self, buf: U8Ptr, cap: Int):
        self.buf = buf
        self.cap = cap
        self.n = 0

    def put(mut self, s: StringSlice):
        self.n = put_str(self.buf, self.cap, self.n, s)

    def put_int(mut self, v: Int):
        self.n = put_int(self.buf, self.cap, self.n, v)

    def entry(mut self, name: StringSlice, v: Int, tail: StringSlice):
        """`name=v` then tail (';' or ',...')."""
        self.put(name)
        self.put("=")
        self.put_int(v)
        self.put(tail)
