"""Run a transformers Mamba / Mamba-2 checkpoint with mojolearn blocks.

    python examples/load_checkpoint.py [FOLDER] [--tokens N] [--prompt 1,2,3]
                                       [--weight-format float32|bfloat16|int8]

FOLDER holds config.json and model.safetensors (what save_pretrained writes,
or a Hub download such as state-spaces/mamba-130m-hf). Without FOLDER a tiny
random MambaForCausalLM is built with transformers and saved to a temporary
folder first. Loading needs neither PyTorch nor transformers; the final norm
and LM head are applied with NumPy. When transformers is installed, its own
greedy tokens are printed next to ours.
"""
import argparse
import sys
import tempfile
import time

import numpy as np

import mojolearn


def tiny_random_model(folder):
    import torch
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(3)
    cfg = MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3)
    model = MambaForCausalLM(cfg)
    with torch.no_grad():  # a larger out_proj, so the greedy tokens are not all one token
        for name, p in model.named_parameters():
            if name.endswith("out_proj.weight"):
                p.mul_(16.0)
    model.save_pretrained(folder)
    print(f"built a tiny random MambaForCausalLM in {folder}")


def logits(ck, h):
    """Final RMSNorm (eps 1e-5) and LM head, float64, for rows h (B, d)."""
    h = np.asarray(h, np.float64).reshape(h.shape[0], -1)
    r = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    return (np.asarray(ck.final_norm, np.float64) * (h * r)) @ np.asarray(ck.lm_head, np.float64).T


def generate(ck, blocks, prompt, n):
    states = [b.allocate_state(1) for b in blocks]
    x = ck.embed([prompt])
    for b, s in zip(blocks, states):  # prefill, carrying each layer's state
        x = b.forward(x, s)
    out = [int(logits(ck, np.asarray(x)[:, -1]).argmax())]
    while len(out) < n:  # decode: one step() per layer per token
        x = ck.embed([[out[-1]]])
        for b, s in zip(blocks, states):
            x = b.step(x, s)
        out.append(int(logits(ck, np.asarray(x)[:, 0]).argmax()))
    return out


def transformers_greedy(folder, prompt, n):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=None, eos_token_id=None)
    return seq[0, len(prompt):].tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="3,17,42,8,21,5")
    ap.add_argument("--weight-format", default="float32", choices=["float32", "bfloat16", "int8"])
    args = ap.parse_args(argv)
    folder = args.folder
    if folder is None:
        folder = tempfile.mkdtemp(prefix="mojolearn_ckpt_")
        tiny_random_model(folder)
    t0 = time.perf_counter()
    ck = mojolearn.load_checkpoint(folder)
    blocks = ck.blocks(weight_format=args.weight_format)
    print(f"loaded {ck} in {time.perf_counter() - t0:.2f}s; blocks: "
          f"{type(blocks[0]).__name__} x {len(blocks)}, weight_format {blocks[0].weight_format}")
    prompt = [int(t) for t in args.prompt.split(",")]
    t0 = time.perf_counter()
    ours = generate(ck, blocks, prompt, args.tokens)
    print(f"mojolearn greedy ({time.perf_counter() - t0:.2f}s): {ours}")
    theirs = transformers_greedy(folder, prompt, args.tokens)
    if theirs is not None:
        print(f"transformers greedy:        {theirs}")
        print("same tokens" if theirs == ours else "tokens differ (float32 near-ties, or a "
              "packed weight_format)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
