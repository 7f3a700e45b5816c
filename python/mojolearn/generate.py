"""Generation from a MambaLM: ``generate`` for a batch of prompts, and
``Batcher`` for continuous batching (requests join and leave between steps).

Every request runs on its own rows: its prompt is prefilled on its own
state (in chunks of a bounded size, between the decode steps of the others,
or from a cached prefix state), then each step decodes one token for all
active requests at once (one batched pass over each layer's weights and one
over the LM head), and its next token is chosen from its own logits,
parameters and random stream (seeded per request). Identical mode makes a
row's bits independent of the batch and of how its prompt was split, so
each request's tokens and logits are bit-identical to generating its prompt
alone, whatever else is in the batch and whenever it joined.

The engine (mojolearn.batcher, whose Batcher is exported here) uses only
the model's engine interface (MambaLM.embed_ids, forward_tokens, open_rows,
restack_states, row_position, head_logits, next_tokens).
"""
from __future__ import annotations

from .batcher import Batcher
from .request import BatcherStats, Request

__all__ = ["Batcher", "BatcherStats", "Request", "generate"]


# transformers' names for generate's arguments, and what to give instead
_HF_NAMES = {
    "eos_token_id": "stop_tokens= (a collection of ids; default: the model's eos_token_ids)",
    "do_sample": "temperature= (0 is greedy; > 0 samples)",
    "max_length": "max_new_tokens= (generated tokens, the prompt not counted)",
    "dtype": "MambaLM(..., weight_format=) ('float32', 'bfloat16', 'int8', 'q4_0' or 'q8_0')",
    "torch_dtype": "MambaLM(..., weight_format=) ('float32', 'bfloat16', 'int8', 'q4_0' or 'q8_0')",
    "pad_token_id": "nothing: prompts of any lengths need no padding",
    "attention_mask": "nothing: prompts of any lengths need no padding",
    "input_ids": "prompts (a sequence of token-id sequences)",
    "num_return_sequences": "one prompt per sequence (repeat it with other seeds)",
}


def _one(v) -> bool:
    """A single value (not one per prompt): strings count as one value."""
    return isinstance(v, (str, bytes)) or not hasattr(v, "__len__")


def _per_prompt(value, n, name, is_one=_one):
    """value for each of n prompts: one value for all, or a sequence of n."""
    if is_one(value):
        return [value] * n
    vals = list(value)
    if len(vals) != n:
        raise ValueError(f"{name} must be one value or one per prompt ({n}), got {len(vals)}")
    return vals


def _one_stop_set(v) -> bool:
    """stop_tokens is one collection for every prompt (None, or ids)."""
    if v is None:
        return True
    if _one(v) or not hasattr(v, "__iter__"):
        raise TypeError(f"stop_tokens must be None, a collection of token ids or one such "
                        f"collection per prompt, got {type(v).__name__}")
    items = list(v)
    if all(_one(t) and not isinstance(t, (str, bytes)) for t in items):
        return True
    if all(t is None or not _one(t) for t in items):
        return False
    raise TypeError("stop_tokens mixes ids and collections: give a collection of ids, or one "
                    "collection per prompt")


def generate(model, prompts, *, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
             seed=0, stop_tokens=None, stream=None, return_logits: bool = False,
             prefill_chunk=None, **unknown):
    """Generate from a batch of prompts of any lengths.

    Parameters
    ----------
    model : MambaLM
    prompts : sequence of sequences of int
    max_new_tokens, temperature, top_k, top_p, seed
        One value for every prompt, or a sequence with one per prompt
        (Batcher.submit describes each). Sampling with a seed is
        reproducible: a request's random stream depends only on its seed.
    stop_tokens : None, a collection of int, or one of those per prompt
        None: the model's ``eos_token_ids``; (): no stop token.
    stream : callable(index, token) or None
        Called with the prompt's index and each token as it comes.
    return_logits : bool
        Also return, per prompt, the logits of each generated token.
    prefill_chunk : int >= 1 or None, default None
        As for Batcher (None: each prompt whole; the tokens do not depend
        on it).

    Returns
    -------
    list of list of int (and the list of lists of logits with return_logits)
        Each prompt's tokens are bit-identical to generating it alone.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it, before anything runs. transformers'
        names (``eos_token_id``, ``do_sample``, ``max_length``, ``dtype``,
        ...) are refused with the name to use instead.
    """
    for name in unknown:
        if name in _HF_NAMES:
            raise TypeError(f"generate() takes no {name!r} (a transformers argument): "
                            f"use {_HF_NAMES[name]}")
        raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a callable(index, token) or None, got "
                        f"{type(stream).__name__}")
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
        raise ValueError("prompts must be a non-empty sequence of token-id sequences")
    n = len(prompts)
    per = {
        "max_new_tokens": _per_prompt(max_new_tokens, n, "max_new_tokens"),
        "temperature": _per_prompt(temperature, n, "temperature"),
        "top_k": _per_prompt(top_k, n, "top_k"),
        "top_p": _per_prompt(top_p, n, "top_p"),
        "seed": _per_prompt(seed, n, "seed"),
        "stop_tokens": _per_prompt(stop_tokens, n, "stop_tokens", _one_stop_set),
    }
    batcher = model.batcher(keep_logits=return_logits, prefill_chunk=prefill_chunk)
    reqs = []
    for i, p in enumerate(prompts):
        try:
            reqs.append(batcher.submit(p, **{k: v[i] for k, v in per.items()}))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    index = {r.id: i for i, r in enumerate(reqs)}
    for req, tok in batcher.run():
        if stream is not None:
            stream(index[req.id], tok)
    for r in reqs:
        if r.error is not None:
            raise r.error
    tokens = [r.tokens for r in reqs]
    return (tokens, [r.logits for r in reqs]) if return_logits else tokens
