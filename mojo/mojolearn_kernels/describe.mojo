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
