"""Train a 2-layer model of mojolearn blocks on associative recall.

    python examples/train_recall.py [--kind mamba1|mamba2|mamba3] [--steps 3000]
                                    [--threads 2] [--seed 0] [--target 0.9]

The task (the associative-recall probe of the Mamba papers): a sequence of
key-value pairs ``k1 v1 k2 v2 ... kn vn`` followed by one of the keys; the
model must answer the value that followed it. Keys and values are drawn
fresh for every sequence, so the only way to answer is to recall them from
the sequence. Chance is 1 / number of values.

The model: a PyTorch embedding, two mojolearn.torch blocks (each RMSNorm,
mixer and residual, forward and backward in the Mojo kernels), a final
RMSNorm and a linear head. The blocks start from mojolearn.init_weights
(mamba_ssm's initialisation). Adam, cross-entropy on the answer only.
It prints the loss and the accuracy on a fixed held-out batch as it goes
and stops once that accuracy reaches --target. Needs PyTorch.
"""
import argparse
import sys
import time

import torch

import mojolearn
import mojolearn.torch as mt

N_PAIRS = 8     # key-value pairs per sequence
N_KEYS = 16     # key tokens 0..15
N_VALUES = 16   # value tokens 16..31
VOCAB = N_KEYS + N_VALUES


def batch(n, gen):
    """(tokens (n, 2 N_PAIRS + 1), answers (n,)) of fresh recall problems."""
    keys = torch.stack([torch.randperm(N_KEYS, generator=gen)[:N_PAIRS] for _ in range(n)])
    values = torch.randint(N_VALUES, (n, N_PAIRS), generator=gen) + N_KEYS
    pick = torch.randint(N_PAIRS, (n,), generator=gen)
    seq = torch.stack([keys, values], dim=2).reshape(n, 2 * N_PAIRS)
    query = keys[torch.arange(n), pick]
    return torch.cat([seq, query[:, None]], dim=1), values[torch.arange(n), pick]


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class RecallModel(torch.nn.Module):
    def __init__(self, kind, d, seed):
        super().__init__()
        cls = {"mamba1": mt.Mamba1, "mamba2": mt.Mamba2, "mamba3": mt.Mamba3}[kind]
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.ModuleList(
            cls.from_weights(mojolearn.init_weights(kind, d, seed=seed + i, n_layers=2))
            for i in range(2))
        self.norm = RMSNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, -1]))  # the answer position only


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="mamba1", choices=["mamba1", "mamba2", "mamba3"])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.9)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    mojolearn.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    model = RecallModel(a.kind, a.d_model, a.seed)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    held_x, held_y = batch(512, torch.Generator().manual_seed(10_000 + a.seed))
    print(f"{a.kind}, d_model {a.d_model}, 2 layers, {sum(p.numel() for p in model.parameters())} "
          f"parameters; chance {1 / N_VALUES:.3f}")
    t0, acc, loss_avg = time.perf_counter(), 0.0, None
    for step in range(1, a.steps + 1):
        x, y = batch(a.batch, gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if step % 50 == 0:
            with torch.no_grad():
                acc = (model(held_x).argmax(-1) == held_y).float().mean().item()
            print(f"step {step:5d}  loss {loss_avg:.3f}  held-out accuracy {acc:.3f}  "
                  f"{time.perf_counter() - t0:6.1f} s", flush=True)
            if acc >= a.target:
                break
    ok = acc >= a.target
    print(f"{'reached' if ok else 'did not reach'} {a.target:.0%} held-out accuracy: {acc:.3f} "
          f"after {step} steps, {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
