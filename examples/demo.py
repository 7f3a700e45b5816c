"""mojolearn demo: a Mamba-1 block built from weights, prefill vs
token-by-token decode (bit for bit), and the speed of both.

Runs without NumPy: the weights are generated with the standard library.
"""
import array
import random
import time

import mojolearn


def f32(shape, scale, rng):
    n = 1
    for s in shape:
        n *= s
    buf = array.array("f", (rng.uniform(-scale, scale) for _ in range(n)))
    return memoryview(buf).cast("B").cast("f", shape)


def demo_weights(d, seed=0):
    """Random weights with the shapes of Mamba1Block (the embedded default)."""
    rng = random.Random(seed)
    di, r = 2 * d, -(-d // 16)
    import math
    a_log = array.array("f", [math.log(n + 1) for _ in range(di) for n in range(16)])
    dt_bias = array.array("f", [math.log(math.expm1(math.exp(rng.uniform(math.log(1e-3), math.log(1e-1)))))
                                for _ in range(di)])
    return {
        "norm.weight": f32((d,), 1.0, rng),
        "in_proj.weight": f32((2 * di, d), d ** -0.5, rng),
        "conv1d.weight": f32((di, 1, 4), 0.5, rng),
        "conv1d.bias": f32((di,), 0.5, rng),
        "x_proj.weight": f32((r + 32, di), di ** -0.5, rng),
        "dt_proj.weight": f32((di, r), r ** -0.5, rng),
        "dt_proj.bias": memoryview(dt_bias),
        "A_log": memoryview(a_log).cast("B").cast("f", (di, 16)),
        "D": f32((di,), 1.0, rng),
        "out_proj.weight": f32((d, di), di ** -0.5, rng),
    }


def main():
    d, B, L = 256, 1, 256
    block = mojolearn.Mamba1Block(demo_weights(d))
    print(f"mojolearn {mojolearn.__version__}: Mamba1Block d_model={d} on "
          f"{block.vendor_used()} ({block.binary_info().get('arch')}), "
          f"numeric mode {block.numeric_mode_used()}, "
          f"{mojolearn.get_num_threads()} threads")
    x = f32((B, L, d), 1.0, random.Random(1))

    block.forward(x)  # warm-up
    t0 = time.perf_counter()
    y = block.forward(x)
    t_prefill = time.perf_counter() - t0

    state = block.allocate_state(B)
    flat = x.cast("B").cast("f")  # B = 1: token t is a slice of d floats
    xs = [flat[t * d:(t + 1) * d].cast("B").cast("f", (B, d)) for t in range(L)]
    t0 = time.perf_counter()
    with block.decode_session(state) as session:
        steps = [session.step(xt) for xt in xs]
    t_decode = time.perf_counter() - t0

    prefill_bytes = bytes(memoryview(y).cast("B"))
    decode_bytes = b"".join(bytes(memoryview(s).cast("B")) for s in steps)
    same = prefill_bytes == decode_bytes
    print(f"prefill of {L} tokens:  {t_prefill * 1e3:8.2f} ms  "
          f"({B * L / t_prefill:,.0f} tokens/s)")
    print(f"decode, token by token: {t_decode / L * 1e3:8.3f} ms/token")
    print("prefill and token-by-token decode agree bit for bit:", "YES" if same else "NO")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
