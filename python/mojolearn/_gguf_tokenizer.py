"""The tokenizer a GGUF file carries (llama.cpp's ``tokenizer.ggml.*``
metadata) as a ``tokenizers.Tokenizer``, for text on a .gguf model that has
no tokenizer.json beside it (docs/checkpoints.md, "GGUF files").

Read: llama.cpp's "gpt2" tokenizer model, a byte-level BPE: the token list
(``tokenizer.ggml.tokens``, id = position), their types
(``tokenizer.ggml.token_type``), the merges in rank order
(``tokenizer.ggml.merges``, "left right"), ``add_bos_token`` /
``add_eos_token`` and the split named by ``tokenizer.ggml.pre``, rebuilt as
the tokenizer.json of the tokenizer that name stands for does it, for the
names Mamba checkpoints carry: "gpt-2" (GPT-2's byte-level regex, no
normalizer), "mpt" and "olmo" (both name GPT-NeoX's tokenizer, the one Mamba
and Mamba-2 are trained with: NFC, then GPT-2's regex; llama.cpp itself does
not normalize, so text that is not in NFC may tokenize differently there),
"falcon" (Falcon-7B's, which Falcon-Mamba is trained with: punctuation runs,
GPT-2's regex, digit runs cut in threes). Any other tokenizer model or split
is refused naming the key and its value.

Token types: normal (and byte) tokens are the BPE's vocabulary; control and
unknown tokens are special added tokens (matched in text, dropped by
``decode``), user-defined ones plain added tokens (matched in text); unused
ones (the converter's "[PAD{i}]" fillers up to the model's vocabulary) are
left out, so their ids decode to nothing, as in the model's tokenizer.json.

The chat template the converter copies from tokenizer_config.json
(``tokenizer.chat_template``) is read too, for the server's chat endpoint.
"""
from __future__ import annotations

MODEL, PRE = "tokenizer.ggml.model", "tokenizer.ggml.pre"
TOKENS, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
CHAT_TEMPLATE = "tokenizer.chat_template"  # tokenizer_config.json's, as the converter copies it
# tokenizer.ggml.pre -> (the normalizer, the split) of the tokenizer it names
SPLITS = {"gpt-2": (None, "byte-level"), "mpt": ("NFC", "byte-level"),
          "olmo": ("NFC", "byte-level"), "falcon": (None, "falcon")}
# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _need_list(meta, key, kind, path, *, required=True):
    """meta[key] as a list whose items are all of type kind (None if absent
    and not required); ValueError naming the key otherwise."""
    value = meta.get(key)
    if value is None and not required:
        return None
    if value is None:
        raise ValueError(f"{path}: metadata key {key} is missing (a 'gpt2' tokenizer needs it)")
    if not isinstance(value, list) or not value or \
            any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
        raise ValueError(f"{path}: metadata key {key} must be a non-empty array of "
                         f"{'strings' if kind is str else 'integers'}")
    return value


def _token_id(meta, key, n, path):
    """meta[key] as a token id in [0, n), None when absent; ValueError
    naming the key otherwise."""
    tid = meta.get(key)
    if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int)
                            or not 0 <= tid < n):
        raise ValueError(f"{path}: metadata key {key} = {tid!r} is not a token id "
                         f"(0 to {n - 1})")
    return tid


def _special_ids(meta, n, path) -> dict:
    """{"bos"/"eos": id} of the tokens the post-processor adds (add_bos_token
    / add_eos_token true); ValueError naming the key for a bad flag or id."""
    out = {}
    for what in ("bos", "eos"):
        flag = meta.get(f"tokenizer.ggml.add_{what}_token", False)
        if not isinstance(flag, bool):
            raise ValueError(f"{path}: metadata key tokenizer.ggml.add_{what}_token = {flag!r} "
                             "must be a bool")
        key = f"tokenizer.ggml.{what}_token_id"
        tid = _token_id(meta, key, n, path)
        if flag:
            if tid is None:
                raise ValueError(f"{path}: metadata key tokenizer.ggml.add_{what}_token is true "
                                 f"but {key} is missing")
            out[what] = tid
    return out


def _checked_types(meta, n, path) -> list:
    """The n token types (all normal when the key is absent); ValueError
    naming the key for another length or a type llama.cpp does not have."""
    types = _need_list(meta, TYPES, int, path, required=False)
    if types is None:  # llama.cpp: every token normal
        return [NORMAL] * n
    if len(types) != n:
        raise ValueError(f"{path}: metadata key {TYPES} has {len(types)} entries, "
                         f"{TOKENS} {n}")
    for i, t in enumerate(types):
        if not NORMAL <= t <= BYTE:
            raise ValueError(f"{path}: metadata key {TYPES}[{i}] = {t} is not a llama.cpp "
                             "token type (1 to 6)")
    return types


def _vocab(tokens, types, path) -> dict:
    """{token: id} of every token but the unused ones; ValueError naming the
    key for a token listed twice (one text, one id, as the BPE needs)."""
    vocab = {}
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ == UNUSED:
            continue
        if tok in vocab:
            raise ValueError(f"{path}: metadata key {TOKENS} lists {tok!r} twice (ids "
                             f"{vocab[tok]} and {i})")
        vocab[tok] = i
    return vocab


def _merge_pairs(merges, vocab, path) -> list:
    """[(left, right)] in rank order. A merge is "left right", split at its
    first space after the first character (as llama.cpp does: a left part
    may itself be a space); both parts and their join must be tokens."""
    pairs = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"{path}: metadata key {MERGES}[{i}] = {m!r} is not "
                             "'left right'")
        left, right = m[:cut], m[cut + 1:]
        for part in (left, right, left + right):
            if part not in vocab:
                raise ValueError(f"{path}: metadata key {MERGES}[{i}] = {m!r}: {part!r} is "
                                 f"not a token of {TOKENS}")
        pairs.append((left, right))
    return pairs


def gguf_tokenizer(meta: dict, path):
    """The ``tokenizers.Tokenizer`` of a GGUF file's metadata (see module).

    Raises ValueError naming the metadata key: no tokenizer in the file, a
    tokenizer model other than "gpt2", a split (``tokenizer.ggml.pre``) not
    read, malformed tokens, types, merges or special-token ids. ImportError
    without the ``tokenizers`` package. Nothing is built before every check
    has passed.
    """
    model = meta.get(MODEL)
    if model is None:
        raise ValueError(f"{path}: metadata key {MODEL} is missing: the file carries no "
                         "tokenizer")
    if model != "gpt2":
        raise ValueError(f"{path}: metadata key {MODEL} = {model!r}: only 'gpt2' "
                         "(byte-level BPE) tokenizers are read")
    pre = meta.get(PRE)
    if pre not in SPLITS:
        shown = "is missing (llama.cpp then splits with its 'default' rules, not read)" \
            if pre is None else f"= {pre!r} is not read"
        raise ValueError(f"{path}: metadata key {PRE} {shown}; read: "
                         f"{', '.join(map(repr, SPLITS))}")
    tokens = _need_list(meta, TOKENS, str, path)
    types = _checked_types(meta, len(tokens), path)
    vocab = _vocab(tokens, types, path)
    pairs = _merge_pairs(_need_list(meta, MERGES, str, path), vocab, path)
    added = _special_ids(meta, len(tokens), path)
    for what, tid in added.items():
        if types[tid] == UNUSED or any(c.isspace() or c == ":" for c in tokens[tid]):
            raise ValueError(f"{path}: metadata key tokenizer.ggml.{what}_token_id = {tid}: "
                             f"token {tokens[tid]!r} cannot be added to every text")
    try:
        from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers,
                                pre_tokenizers, processors)
    except ImportError:
        raise ImportError(f"the tokenizer of {path} needs the `tokenizers` package "
                          "(pip install tokenizers)") from None
    tk = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    normalizer, split = SPLITS[pre]
    if normalizer == "NFC":
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = _pre_tokenizer(split)
    tk.decoder = decoders.ByteLevel()
    # in the vocabulary already: added tokens keep their ids
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    tk.add_tokens([AddedToken(tokens[i], special=False)
                   for i, t in enumerate(types) if t == USER_DEFINED])
    if added:
        def seq(text, type_id):  # [bos] text [eos], as transformers builds it
            parts = [tokens[added[w]] for w in ("bos",) if w in added] + [text] + \
                [tokens[added[w]] for w in ("eos",) if w in added]
            return [f"{p}:{type_id}" for p in parts]
        tk.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0), pair=seq("$A", 0) + seq("$B", 1),
            special_tokens=[(tokens[t], t) for t in set(added.values())])
    return tk


def _pre_tokenizer(split: str):
    """The split before the BPE: GPT-2's byte-level regex; for "falcon",
    Falcon-7B's tokenizer.json sequence (runs of punctuation apart, the
    byte-level regex, digit runs apart, then cut into threes from the left),
    which llama.cpp approximates with regexes."""
    from tokenizers import Regex, pre_tokenizers as pt
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "byte-level":
        return byte_level
    return pt.Sequence([pt.Punctuation(behavior="contiguous"), byte_level,
                        pt.Digits(individual_digits=False),
                        pt.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated", invert=False)])


def gguf_chat_template(meta: dict, path):
    """(template, {"bos_token": text, "eos_token": text}) of the chat template
    a GGUF file carries (``tokenizer.chat_template``, the default one), the
    special tokens' texts from ``tokenizer.ggml.bos_token_id`` /
    ``eos_token_id`` ("" when absent); None when the file has no template.
    ValueError naming the key for a template that is not a non-empty string
    or an id that is not one of the file's tokens."""
    source = meta.get(CHAT_TEMPLATE)
    if source is None:
        return None
    if not isinstance(source, str) or not source:
        raise ValueError(f"{path}: metadata key {CHAT_TEMPLATE} must be a non-empty string, "
                         f"got {source!r:.60}")
    tokens = _need_list(meta, TOKENS, str, path, required=False) or []
    special = {}
    for what in ("bos", "eos"):
        tid = _token_id(meta, f"tokenizer.ggml.{what}_token_id", len(tokens), path)
        special[f"{what}_token"] = "" if tid is None else tokens[tid]
    return source, special
