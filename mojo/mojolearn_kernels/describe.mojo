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
