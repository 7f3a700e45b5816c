"""The residual add that ends every block's forward: y = x + out_proj(...).

The out_proj matmul of a chunk of rows (B rows x nc tokens, token t0 first)
leaves its result tile by tile; each tile's rows and columns are added to x
here, as soon as the tile is done. Padding tokens of ragged rows (t at or
past the row's length) get +0.0, whatever x and the projection hold there.
"""
from .abi import F32Ptr, I64Ptr


def add_residual_tile(x: F32Ptr, y: F32Ptr, proj: F32Ptr, l: Int, d: Int,
                      lens: I64Ptr, ragged: Bool, t0: Int, nc: Int,
                      r0: Int, r1: Int, c0: Int, c1: Int):
    """y[b, t, c] = x[b, t, c] + proj[r, c] for rows r in [r0, r1) (r = b nc
    + t - t0) and columns c in [c0, c1). x and y are (B, L, d); proj is
    (B nc, d); lens (B,) holds the row lengths when ragged."""
    comptime W = 16
    for r in range(r0, r1):
        var bb = r // nc
        var t = t0 + r % nc
        var off = (bb * l + t) * d
        if ragged and t >= Int(lens[unsafe_offset=bb]):
            for col in range(c0, c1):
                y[unsafe_offset=off + col] = 0.0
        else:
            var col = c0
            while col + W <= c1:
                y.unsafe_store(off + col, x.unsafe_load[width=W](off + col)
                               + proj.unsafe_load[width=W](r * d + col))
                col += W
            while col < c1:
                y[unsafe_offset=off + col] = x[unsafe_offset=off + col] + proj[unsafe_offset=r * d + col]
                col += 1
