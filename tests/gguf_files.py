"""GGUF files written with llama.cpp's own Python writer (the `gguf`
package), the way its converter (convert_hf_to_gguf.py, MambaModel and
Mamba2Model) writes a Mamba / Falcon-Mamba / Mamba-2 model: the same
metadata keys, tensor names and transforms (A_log -> ssm_a = -exp(A_log),
the convolution weight squeezed to (C, 4), Mamba-2's A and D given a
trailing axis and its gated norm reshaped per group, dt_bias named
ssm_dt.bias, a head equal to the embedding left out). Spelled out here from
the converter, not taken from mojolearn."""
from __future__ import annotations

import numpy as np

import mojolearn
from mojolearn import _abi, _loader

D_STATE = {"mamba": 16, "mamba2": 128}


def kernel_neg_exp(a_log) -> np.ndarray:
    """-exp(a_log) as the blocks' prepare op computes it (the kernels' own
    float32 exp, OP_MATH_EVAL fn 0 at width 1, which the prepare op uses)."""
    a = np.ascontiguousarray(a_log, np.float32)
    out = np.empty_like(a)
    lib = _loader.library()
    nat = _loader.native()
    args = _abi.op_spec(lib, _abi.OP_MATH_EVAL).pack(
        fn=0, src=nat.address(a), dst=nat.address(out, True), n=a.size, width=1)
    lib.run(_abi.OP_MATH_EVAL, args)
    return -out


def torch_neg_exp(a_log) -> np.ndarray:
    """-exp(A_log) as the converter computes it (torch, float32)."""
    import torch
    return (-torch.exp(torch.from_numpy(np.ascontiguousarray(a_log, np.float32)))).numpy()


def _as(arr, qtype):
    """(data, raw_dtype) for GGUFWriter.add_tensor in ggml type qtype."""
    import gguf
    T = gguf.GGMLQuantizationType
    if qtype is None or qtype == T.F32:
        return np.ascontiguousarray(arr, np.float32), None
    if qtype == T.F16:
        return np.ascontiguousarray(arr, np.float16), None
    if qtype == T.F64:
        return np.ascontiguousarray(arr, np.float64), None
    return gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype), qtype


def _looks_special(token: str) -> bool:
    """The converter's does_token_look_special, for the token shapes the
    tests use."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def add_tokenizer(w, folder, pre, vocab_size, edit=None):
    """Write the tokenizer of folder (tokenizer.json and tokenizer_config.json)
    into GGUFWriter w as the converter's _set_vocab_gpt2 does: its
    get_vocab_base (every id below vocab_size: the tokenizer's token, typed
    normal / control / user-defined, or an unused "[PAD{i}]"), then the `gguf`
    package's own SpecialVocab (merges, special ids, add_bos/eos, chat
    template). pre: tokenizer.ggml.pre (the converter picks it from a hash of
    known tokenizers' output). edit(tokens, types, special_vocab), if given,
    changes what is written (negative controls)."""
    import gguf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    assert max(vocab.values()) < vocab_size
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            info = tok.added_tokens_decoder[i]
            if not info.normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if info.special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    special = gguf.SpecialVocab(folder, load_merges=True)
    if edit is not None:
        edit(tokens, types, special)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special.add_to_gguf(w)


def write_gguf(path, kind, layers, emb, norm, head=None, *, falcon=False, a_of=torch_neg_exp,
               types=None, eps=1e-5, eos=None, arch=None, extra=None, skip=(), n_groups=1,
               tokenizer=None):
    """Write a model as convert_hf_to_gguf would. layers: the blocks' weight
    dicts (A_log included); head None: tied. types: {gguf tensor name:
    GGMLQuantizationType} (default F32). a_of: A_log -> the stored ssm_a.
    extra: {metadata key: (value, GGUFValueType)} written after the rest;
    skip: tensor names left out; n_groups: Mamba-2's B/C groups (the gated
    norm stored as (groups, d_inner / groups)). tokenizer: (folder, pre, edit)
    for add_tokenizer (default: a placeholder list of tokens, no merges).
    Returns {gguf tensor name: the float32 values written before any type
    conversion}."""
    import gguf
    types = types or {}
    arch = arch or kind
    d = emb.shape[1]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(d)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(len(layers))
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(2 * d)
    w.add_ssm_state_size(D_STATE[kind])
    if kind == "mamba":
        w.add_ssm_time_step_rank(-(d // -16))
    else:
        w.add_ssm_time_step_rank(2 * d // 64)
        w.add_ssm_group_count(n_groups)
    w.add_layer_norm_rms_eps(eps)
    if kind == "mamba":
        w.add_ssm_dt_b_c_rms(falcon)
    w.add_file_type(0)
    if tokenizer is None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(emb.shape[0])])
    else:
        add_tokenizer(w, tokenizer[0], tokenizer[1], emb.shape[0], *tokenizer[2:])
    if eos is not None:
        w.add_eos_token_id(eos)
    for key, (value, vtype) in (extra or {}).items():
        w.add_key_value(key, value, vtype)
    tensors = {"token_embd.weight": emb}
    for i, lw in enumerate(layers):
        p = f"blk.{i}."
        norm_name = "norm.weight" if kind == "mamba" else "block_norm.weight"
        tensors[p + "attn_norm.weight"] = lw[norm_name]
        tensors[p + "ssm_in.weight"] = lw["in_proj.weight"]
        tensors[p + "ssm_conv1d.weight"] = np.asarray(lw["conv1d.weight"]).reshape(-1, 4)
        tensors[p + "ssm_conv1d.bias"] = lw["conv1d.bias"]
        a = a_of(lw["A_log"])
        if kind == "mamba":
            tensors[p + "ssm_x.weight"] = lw["x_proj.weight"]
            tensors[p + "ssm_dt.weight"] = lw["dt_proj.weight"]
            tensors[p + "ssm_dt.bias"] = lw["dt_proj.bias"]
            tensors[p + "ssm_a"] = a
            tensors[p + "ssm_d"] = lw["D"]
        else:
            tensors[p + "ssm_dt.bias"] = lw["dt_bias"]
            tensors[p + "ssm_a"] = np.asarray(a).reshape(-1, 1)
            tensors[p + "ssm_d"] = np.asarray(lw["D"]).reshape(-1, 1)
            tensors[p + "ssm_norm.weight"] = np.asarray(lw["norm.weight"]).reshape(n_groups, -1)
        tensors[p + "ssm_out.weight"] = lw["out_proj.weight"]
    tensors["output_norm.weight"] = norm
    if head is not None:
        tensors["output.weight"] = head
    written = {}
    for name, value in tensors.items():
        if name in skip:
            continue
        data, raw = _as(value, types.get(name))
        w.add_tensor(name, data, raw_dtype=raw)
        written[name] = np.asarray(value, np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def model(kind, d, n_layers=2, vocab=64, seed=0, tied=True):
    """(layers, emb, norm, head) float32 NumPy weights: norms, D and the
    output projections perturbed so that a swapped or ignored weight shows."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        w = {k: np.array(memoryview(v)).astype(np.float32) for k, v in mojolearn.init_weights(
            kind, d, seed=seed + i, n_layers=n_layers).items()}
        for k in w:
            if k.endswith("norm.weight") or k == "D":
                w[k] = (w[k] + 0.1 * rng.standard_normal(w[k].shape)).astype(np.float32)
            if k == "out_proj.weight":
                w[k] *= 8
        layers.append(w)
    emb = rng.standard_normal((vocab, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    head = None if tied else rng.standard_normal((vocab, d)).astype(np.float32)
    return layers, emb, norm, head
