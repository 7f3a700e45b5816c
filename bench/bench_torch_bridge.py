"""Overhead of mojolearn.torch: forward + backward through the torch module
(custom ops, autograd, gradients into the Parameters) against calling the
mojolearn block's forward and backward directly, on the same weights and
inputs, with the same thread count for the kernels and for PyTorch.

    PYTHONPATH=python python bench/bench_torch_bridge.py [--d 768 --B 8 --L 1024
        --threads 2 --reps 3 --kinds mamba1,mamba2,mamba3]

Per block it prints the best-of-reps seconds of

- direct:  block.forward(x); block.backward(x, g)       (NumPy in and out)
- module:  y = m(x); y.backward(g)                         (torch in and out;
           parameters' grads set to None before each rep, as zero_grad does)
- rebuild: the module's block rebuilt after an in-place parameter change
           (once per optimizer step in training), alone
- no-grad: m(x) under torch.no_grad() vs block.forward(x)

(direct and module alternate rep by rep, as do the two forwards), and the
ratios module / direct and no-grad / forward; and for Mamba-1 and Mamba-2
the transformers block (MambaBlock / Mamba2Block, float32, its PyTorch path)
on the same weights and inputs, forward + backward under torch autograd
(transformers: y = blk(x); y.backward(g)), and module / transformers.
"""
import argparse
import math
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--L", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default="mamba1,mamba2,mamba3")
    a = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    import torch
    import mojolearn
    import mojolearn.torch as mt
    from mojolearn.reference import weights as W
    from _harness import SETTLE_S, busy_warm

    torch.set_num_threads(a.threads)
    mojolearn.set_num_threads(a.threads)
    kinds = {"mamba1": (mt.Mamba1, mojolearn.Mamba1Block, W.mamba1_weights),
             "mamba2": (mt.Mamba2, mojolearn.Mamba2Block, W.mamba2_weights),
             "mamba3": (mt.Mamba3, mojolearn.Mamba3Block, W.mamba3_weights)}

    def hf_block(kind, w):
        """The transformers block on the same weights (float32), or None."""
        if kind == "mamba3":
            return None
        import transformers
        from transformers.models.mamba import modeling_mamba as m1
        from transformers.models.mamba2 import modeling_mamba2 as m2
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in w.items()}
        d = a.d
        if kind == "mamba1":
            cfg = transformers.MambaConfig(hidden_size=d, state_size=16, expand=2, conv_kernel=4,
                                           time_step_rank=math.ceil(d / 16), use_bias=False,
                                           use_conv_bias=True, layer_norm_epsilon=1e-5,
                                           use_mambapy=False, num_hidden_layers=1)
            blk = m1.MambaBlock(cfg, layer_idx=0)
            sd = {("norm.weight" if k == "norm.weight" else f"mixer.{k}"): v for k, v in t.items()}
        else:
            cfg = transformers.Mamba2Config(hidden_size=d, num_heads=2 * d // 64, head_dim=64,
                                            state_size=128, n_groups=1, expand=2, conv_kernel=4,
                                            chunk_size=256, use_bias=False, use_conv_bias=True,
                                            layer_norm_epsilon=1e-5, num_hidden_layers=1)
            blk = m2.Mamba2Block(cfg, layer_idx=0)
            sd = {f"mixer.{k}": v for k, v in t.items() if k != "block_norm.weight"}
            sd["norm.weight"] = t["block_norm.weight"]
        sd["mixer.conv1d.weight"] = sd["mixer.conv1d.weight"].reshape(-1, 1, 4)
        blk.load_state_dict(sd, strict=True)
        return blk.train()

    def best(fn, reps):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"d={a.d} B={a.B} L={a.L} threads={a.threads} (kernels and torch) "
          f"reps={a.reps} (best of), torch {torch.__version__}")
    for kind in a.kinds.split(","):
        cls, block_cls, wf = kinds[kind]
        w = wf(a.d, seed=0)
        block = block_cls(w)
        m = cls.from_weights(w)
        x = W.random_input(a.B, a.L, a.d, seed=1)
        g = W.random_input(a.B, a.L, a.d, seed=2)
        xt, gt = torch.from_numpy(x), torch.from_numpy(g)

        def direct():
            block.forward(x)
            block.backward(x, g)

        def module():
            for p in m.parameters():
                p.grad = None
            m(xt).backward(gt)

        def rebuild():
            with torch.no_grad():
                m.D.add_(0.0)  # an in-place change: the key's _version moves
            m.kernel_block()

        def fwd_direct():
            block.forward(x)

        def fwd_module():
            with torch.no_grad():
                m(xt)

        # the two sides of each pair alternate rep by rep, so that a change of
        # the machine's load during the run hits both alike
        res = {}
        for pair in ((("direct", direct), ("module", module)),
                     (("fwd_direct", fwd_direct), ("fwd_module", fwd_module))):
            for _, fn in pair:
                fn()  # warm-up
            times = {name: [] for name, _ in pair}
            for _ in range(a.reps):
                for name, fn in pair:
                    time.sleep(SETTLE_S)
                    busy_warm(fwd_direct, 0.25)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            res.update({name: min(t) for name, t in times.items()})
        res["rebuild"] = best(rebuild, a.reps)
        hf = hf_block(kind, w)
        if hf is not None:
            xh = xt.clone().requires_grad_(True)

            def theirs():
                for p in hf.parameters():
                    p.grad = None
                hf(xh).backward(gt)
            time.sleep(SETTLE_S)
            res["transformers"] = best(theirs, a.reps)
        # the module's gradients are the block's (a sanity check of the run)
        for p in m.parameters():
            p.grad = None
        m(xt).backward(gt)
        want = block.backward(x, g)
        assert np.asarray(want["D"]).tobytes() == m.D.grad.numpy().tobytes()
        print(f"{kind}: fwd+bwd direct {res['direct']:.3f} s, module {res['module']:.3f} s, "
              f"ratio {res['module'] / res['direct']:.3f}; rebuild {res['rebuild'] * 1e3:.1f} ms "
              f"({100 * res['rebuild'] / res['direct']:.1f}% of a fwd+bwd); no-grad forward "
              f"direct {res['fwd_direct']:.3f} s, module {res['fwd_module']:.3f} s, ratio "
              f"{res['fwd_module'] / res['fwd_direct']:.3f}"
              + (f"; transformers fwd+bwd {res['transformers']:.3f} s, module is "
                 f"{res['transformers'] / res['module']:.1f}x faster" if "transformers" in res
                 else ""), flush=True)


if __name__ == "__main__":
    main()
