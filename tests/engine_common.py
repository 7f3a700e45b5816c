"""Tiny language models and an independent one-request reference for the
engine tests (tests/test_engine_*.py)."""
from __future__ import annotations

import random

import numpy as np

import mojolearn
from mojolearn.checkpoints import load_checkpoint
from mojolearn.save import save_checkpoint

BLOCK_KIND = {"mamba": "mamba1", "mamba2": "mamba2", "mamba3": "mamba3"}
VOCAB = 48


def tiny_folder(root, kind, *, d=32, n_layers=2, seed=0):
    """A checkpoint folder of a random d=32 model (out_proj scaled up and an
    untied head, so the greedy tokens are not all one token)."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        w = mojolearn.init_weights(BLOCK_KIND[kind], d, seed=seed + 10 + i)
        w = {k: np.asarray(v).copy() for k, v in w.items()}
        w["out_proj.weight"] *= 8.0
        layers.append(w)
    emb = rng.standard_normal((VOCAB, d)).astype(np.float32)
    norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    head = (0.3 * rng.standard_normal((VOCAB, d))).astype(np.float32)  # untied: the
    return save_checkpoint(root, kind, layers, emb, norm, head)  # last token does not echo


def tiny_lm(folder, *, eos=None):
    """MambaLM of a folder; eos: the checkpoint's eos_token_ids (set on the
    Checkpoint before the model is built)."""
    ck = load_checkpoint(folder)
    if eos is not None:
        ck.eos_token_ids = tuple(eos)
    return mojolearn.MambaLM(ck)


def alone(lm, prompt, n, temperature=0.0, top_k=0, top_p=1.0, seed=0, state=None,
          stop=()):
    """One request by the block API alone, independent of the Batcher: the
    whole prompt in one forward from a zero (or the given, copied) state,
    then block.step per token with the state's own position; the head and
    next-token ops; the request's random stream. Returns (tokens, logits
    bytes)."""
    rng = random.Random(seed)
    states = lm.allocate_state(1) if state is None else [st.copy() for st in state]
    x = lm.forward_tokens([list(prompt)], states)
    row = x.address + (len(prompt) - 1) * lm.d_model * 4
    toks, logits = [], []
    while True:
        lg = lm._head(row, 1)
        logits.append(bytes(memoryview(lg).cast("B")))
        u = rng.getrandbits(24) / float(1 << 24)
        toks.append(lm.next_tokens(lg, [temperature], [top_k], [top_p], [u])[0])
        if len(toks) == n or toks[-1] in stop:
            return toks, logits
        x = lm._embed_ids([toks[-1]]).reshape((1, 1, lm.d_model))
        for blk, st in zip(lm.blocks, states):
            x = blk.step(x, st)
        row = x.address


def logits_bytes(req):
    """A request's kept logits as a list of bytes."""
    return [bytes(memoryview(a).cast("B")) for a in req.logits]


def prompt_of(length, salt=0, vocab=VOCAB):
    return [(7 * j + 3 * salt + 1) % vocab for j in range(length)]
