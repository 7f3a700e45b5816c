"""The language-model cases of the digest matrix (bench/gpu_cases.py):
MambaLM logits and generation (greedy, top-k and top-p sampling, a request
joining mid-stream) for each block kind, float32 and int8 weights (and the
q4_0 / q8_0 ones, which gpu_cases lists last). Every
case's bytes include logits, so the perturbation control (embeddings and the
final norm weight one ulp away) changes all of them."""
from __future__ import annotations

VOCAB = 50  # not a multiple of the head's 16-row panels
KINDS = {1: ("mamba", 32), 2: ("mamba2", 64), 3: ("mamba3", 64)}


def _checkpoint(kind: int, perturb: bool):
    import numpy as np
    from mojolearn.checkpoints import load_checkpoint
    from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
    name, d = KINDS[kind]
    make = {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}[kind]
    norm = "norm.weight" if kind == 1 else "block_norm.weight"
    rng = np.random.default_rng(20 + kind)
    emb = rng.standard_normal((VOCAB, d)).astype(np.float32)
    norm_f = np.ones(d, np.float32)
    if perturb:  # the final norm too: int8 codes can absorb the embeddings' ulp
        emb = np.nextafter(emb, np.float32(np.inf))
        norm_f = np.nextafter(norm_f, np.float32(np.inf))
    sd = {"embeddings.weight": emb, "norm_f.weight": norm_f}
    if kind == 2:  # untied: a head of its own
        sd["lm_head.weight"] = rng.standard_normal((VOCAB, d)).astype(np.float32) * 0.5
    for i in range(2):
        for k, v in make(d, seed=30 + i, scale=4.0).items():
            sd[f"layers.{i}.{'norm.weight' if k == norm else 'mixer.' + k}"] = v
    cfg = {"model_type": name, "hidden_size": d, "num_hidden_layers": 2, "vocab_size": VOCAB,
           "tie_word_embeddings": kind != 2}
    return load_checkpoint(sd, config=cfg)


def _bytes(a) -> bytes:
    import numpy as np
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def lm_cases(mojolearn, perturb: bool = False, formats=("float32", "int8")):
    """(name, bytes) of every LM case, for each weight format in formats."""
    import numpy as np
    for kind in KINDS:
        for fmt in formats:
            lm = mojolearn.MambaLM(_checkpoint(kind, perturb), weight_format=fmt)
            tag = f"lm{kind} {fmt}"
            yield f"{tag} logits", _bytes(lm.logits([[1, 2, 3, 4, 5, 6, 7],
                                                     [49, 0, 8, 8, 30, 2, 11]]))
            b = lm.batcher(keep_logits=True)
            reqs = [b.submit([3, 1, 4], max_new_tokens=5),
                    b.submit([1, 5, 9, 2, 6], max_new_tokens=4, temperature=0.8, top_k=6, seed=7)]
            b.step()
            reqs.append(b.submit([27], max_new_tokens=4, temperature=1.2, top_p=0.7, seed=8))
            list(b.run())
            parts = [np.asarray(r.tokens, np.int64).tobytes()
                     + b"".join(_bytes(x) for x in r.logits) for r in reqs]
            yield f"{tag} generate", b"".join(parts)
            if kind != 1 and fmt == "float32":  # rows folding at different steps
                q = {2: 256, 3: 64}[kind]
                yield f"{tag} chunk ends", _chunk_ends(lm, q, True)
                yield f"{tag} chunk ends no cache", _chunk_ends(lm, q, False)


def _chunk_ends(lm, q: int, cache: bool) -> bytes:
    """Rows whose chunks end at different decode steps, in one batch (with
    or without the decode sessions' speed cache)."""
    import numpy as np
    b = lm.batcher(keep_logits=True, session_cache=cache)
    reqs = [b.submit([(3 * j + i) % VOCAB for j in range(n)], max_new_tokens=6)
            for i, n in enumerate([q - 4, q - 1, 2, 2 * q - 2])]
    list(b.run())
    return b"".join(np.asarray(r.tokens, np.int64).tobytes()
                    + b"".join(_bytes(x) for x in r.logits) for r in reqs)
