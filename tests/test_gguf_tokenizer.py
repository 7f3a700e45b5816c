"""The tokenizer a GGUF file carries (mojolearn.gguf.read_tokenizer and the
CLI's text prompts on a .gguf file), written by llama.cpp's own writer the
way its converter writes it (tests/gguf_files.py add_tokenizer) from a real
byte-level BPE tokenizer.json (tests/text_model.py's, plus a user-defined
whitespace token, a user-defined "\\n\\n" and a second control token; an
NFC variant for "mpt" / "olmo"; one with Falcon-7B's split for "falcon").

What is compared: the ids `encode` gives (and the text `decode` gives) with
the tokenizer rebuilt from the file against the tokenizer.json it was
written from, on ASCII, accents (composed and not), CJK, emoji, whitespace
runs and special tokens; the CLI's output on the .gguf against the
safetensors folder with that tokenizer.json. Negative controls: a file whose
merges are reordered or cut, a control token written as normal, the wrong
split name (GPT-2's) for the NFC and the Falcon tokenizers, a different
tokenizer.json beside the file.
"""
from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

import mojolearn
from mojolearn._cli_common import load_tokenizer
from mojolearn.gguf import read_tokenizer
from mojolearn.save import save_checkpoint

from .errors import raises_naming
from .gguf_files import kernel_neg_exp, model, write_gguf
from .text_model import EOS, run_cli, tokenizer

gguf = pytest.importorskip("gguf")  # in the test extra
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")  # the converter reads the tokenizer with it

VOCAB = 368  # the tokenizers' ids (323; Falcon's 363) padded to a multiple of 8 as the
#              converter pads
TRAIN_NUMBERS = ("Call 555-1234 or 1,000,000 now!!! (yes) x+y=z; $5.00... 12345678 a1b22c333 "
                 "don't (no) 1 2 3 'tis")
NUMBERS = TRAIN_NUMBERS + " 0000"  # Falcon: "000" "0"; GPT-2: "00" "00"
DECOMPOSED = "cafe\u0301 cre\u0300me nai\u0308ve"  # accents as combining marks (not NFC)
TEXTS = [
    "The café serves crème brûlée and naïve piñatas.",
    "Math at the bathhouse, another summer.",  # merges that compete: 'a t' / 't h', 'm e' / 'e r'
    DECOMPOSED,
    "日本語のテキストと中文的文字。한국어",
    "Emoji: 🙂🚀🎉 and 👩‍💻 in a line.",
    "a  b    c\n\n\t  x   \n\n\n  ",
    f"{EOS}Ünïcödé<|pad|> mïxed{EOS}",
    "Привет, мир! 12345 don't",  # characters and digits the merges never saw
    NUMBERS,  # digits and punctuation: where Falcon's split differs
    "",
]


# Falcon-7B's split, as its tokenizer.json writes it (Falcon-Mamba's tokenizer)
FALCON_SPLIT = {"type": "Sequence", "pretokenizers": [
    {"type": "Punctuation", "behavior": "Contiguous"},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    {"type": "Digits", "individual_digits": False},
    {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated",
     "invert": False}]}


def _falcon_tokenizer():
    """A BPE trained with GPT-2's split (merges that cross Falcon's
    boundaries: the split decides) that then splits as Falcon-7B does (set
    from the JSON form above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from .text_model import TEXT
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[EOS],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator((TEXT + [TRAIN_NUMBERS]) * 4, trainer)
    spec = json.loads(tk.to_str())
    spec["pre_tokenizer"] = FALCON_SPLIT
    tk = Tokenizer.from_str(json.dumps(spec))
    tk.decoder = decoders.ByteLevel()
    return tk


def _tokenizer_json(nfc=False, bos=False, falcon=False):
    """text_model's tokenizer (with falcon: one trained with Falcon's split)
    with added tokens: user-defined "    " and "\\n\\n" (GPT-NeoX has
    whitespace runs as added tokens), control <|pad|>; with nfc an NFC
    normalizer (GPT-NeoX's), with bos EOS put first (a TemplateProcessing,
    which the converter reads as add_bos_token)."""
    from tokenizers import AddedToken, normalizers, processors
    tk = _falcon_tokenizer() if falcon else tokenizer()
    tk.add_tokens([AddedToken("    ", special=False), AddedToken("\n\n", special=False)])
    tk.add_special_tokens([AddedToken("<|pad|>", special=True, normalized=False)])
    if nfc:
        tk.normalizer = normalizers.NFC()
    if bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{EOS} $A", pair=f"{EOS} $A {EOS}:1 $B:1", special_tokens=[(EOS, 0)])
    return tk


def _tokenizer_folder(folder, tk):
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    return folder


def _write(path, tok_folder, pre, edit=None, weights=None, a_of=None):
    layers, emb, norm, head = weights or model("mamba", 32, vocab=VOCAB)
    write_gguf(path, "mamba", layers, emb, norm, head, tokenizer=(tok_folder, pre, edit),
               **({"a_of": a_of} if a_of else {}))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path}: the tokenizer.json folders and GGUF files of the tests."""
    tmp = tmp_path_factory.mktemp("ggtok")
    out = {"plain": _tokenizer_folder(tmp / "plain", _tokenizer_json()),
           "nfc": _tokenizer_folder(tmp / "nfc", _tokenizer_json(nfc=True)),
           "bos": _tokenizer_folder(tmp / "bos", _tokenizer_json(bos=True)),
           "falcon-json": _tokenizer_folder(tmp / "falcon", _tokenizer_json(falcon=True))}
    out["falcon"] = _write(tmp / "falcon.gguf", out["falcon-json"], "falcon")
    out["gpt-2"] = _write(tmp / "gpt2.gguf", out["plain"], "gpt-2")
    out["mpt"] = _write(tmp / "mpt.gguf", out["nfc"], "mpt")
    out["olmo"] = _write(tmp / "olmo.gguf", out["nfc"], "olmo")
    out["bos.gguf"] = _write(tmp / "bos.gguf", out["bos"], "gpt-2")
    return out


def _json(folder):
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def _all_ids(tk):
    return [tk.encode(t).ids for t in TEXTS]


@pytest.mark.parametrize("gguf_name, folder", [("gpt-2", "plain"), ("mpt", "nfc"),
                                               ("olmo", "nfc"), ("bos.gguf", "bos"),
                                               ("falcon", "falcon-json")])
def test_encode_and_decode_equal_the_tokenizer_json(files, gguf_name, folder):
    want, got = _json(files[folder]), read_tokenizer(files[gguf_name])
    ids = _all_ids(want)
    assert _all_ids(got) == ids
    # merges are used (ids past the 257 single bytes and EOS), and the added tokens matched
    flat = [i for row in ids for i in row]
    assert max(flat) > 300 and {320, 321, 322} <= set(flat)
    assert (ids[0][0] == 0) is (folder == "bos")
    for row in ids + [list(range(VOCAB))]:  # every id, the unused fillers included
        for skip in (True, False):
            assert got.decode(row, skip_special_tokens=skip) == \
                want.decode(row, skip_special_tokens=skip)
    assert [got.decode([i]) for i in range(VOCAB)] == [want.decode([i]) for i in range(VOCAB)]


def test_the_file_records_what_the_converter_wrote(files):
    meta = mojolearn.gguf.read_gguf(files["gpt-2"]).metadata
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"]) == VOCAB
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{VOCAB - 1}]"
    assert meta["tokenizer.ggml.token_type"][0] == 3 and meta["tokenizer.ggml.token_type"][-1] == 5
    assert meta["tokenizer.ggml.token_type"][320] == 4  # "    ": user-defined
    assert meta["tokenizer.ggml.eos_token_id"] == 0
    assert meta.get("tokenizer.ggml.add_bos_token") is None
    assert mojolearn.gguf.read_gguf(files["bos.gguf"]).metadata["tokenizer.ggml.add_bos_token"]


def _reverse_merges(tokens, types, special):
    special.merges.reverse()


def _swap_two_merges(tokens, types, special):
    m = special.merges
    i, j = m.index("a t"), m.index("t h")
    m[i], m[j] = m[j], m[i]


def _drop_last_merges(tokens, types, special):
    del special.merges[-8:]


def _pad_as_normal(tokens, types, special):
    types[322] = gguf.TokenType.NORMAL  # <|pad|>, no longer matched in text


def _space_run_unused(tokens, types, special):
    types[320] = gguf.TokenType.UNUSED  # "    "


@pytest.mark.parametrize("edit", [_reverse_merges, _swap_two_merges, _drop_last_merges,
                                  _pad_as_normal, _space_run_unused])
def test_negative_controls_a_changed_tokenizer_gives_other_ids(files, tmp_path, edit):
    bad = read_tokenizer(_write(tmp_path / "bad.gguf", files["plain"], "gpt-2", edit))
    assert _all_ids(bad) != _all_ids(_json(files["plain"]))


def test_negative_control_the_split_name_decides_the_normalizer(files, tmp_path):
    # the NFC tokenizer written under GPT-2's name: decomposed accents differ
    wrong = read_tokenizer(_write(tmp_path / "wrong.gguf", files["nfc"], "gpt-2"))
    want = _json(files["nfc"])
    assert wrong.encode(TEXTS[0]).ids == want.encode(TEXTS[0]).ids  # composed
    assert wrong.encode(DECOMPOSED).ids != want.encode(DECOMPOSED).ids


def test_negative_control_falcons_split_differs_from_gpt2s(files, tmp_path):
    # the Falcon-split tokenizer written under GPT-2's name
    wrong = read_tokenizer(_write(tmp_path / "wrong.gguf", files["falcon-json"], "gpt-2"))
    want = _json(files["falcon-json"])
    assert wrong.encode(TEXTS[0]).ids == want.encode(TEXTS[0]).ids  # words alike
    assert wrong.encode(NUMBERS).ids != want.encode(NUMBERS).ids


def test_a_tokenizer_json_beside_the_file_wins(files, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(files["gpt-2"], path)
    assert _all_ids(load_tokenizer(path, required=True)) == _all_ids(_json(files["plain"]))
    shutil.copy(files["nfc"] / "tokenizer.json", tmp_path / "tokenizer.json")
    beside = load_tokenizer(path, required=True)
    assert _all_ids(beside) == _all_ids(_json(files["nfc"])) != _all_ids(_json(files["plain"]))


def _cli_lines(r):
    """The CLI's stdout with the timings taken out."""
    assert r.returncode == 0, r.stderr
    return re.sub(r"\d+\.\d+", "T", r.stdout).splitlines()


def test_the_cli_with_a_text_prompt_on_the_gguf_gives_the_folders_tokens(files, tmp_path):
    weights = model("mamba", 32, vocab=VOCAB, seed=3)
    folder = save_checkpoint(tmp_path / "st", "mamba", *weights, config={"eos_token_id": 0})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files["plain"] / name, folder / name)
    path = _write(tmp_path / "m.gguf", files["plain"], "gpt-2", weights=weights,
                  a_of=kernel_neg_exp)  # the kernels' A: the folder's bits
    prompt = TEXTS[0] + " " + TEXTS[4]
    ids = load_tokenizer(path, required=True).encode(prompt).ids
    assert ids == _json(files["plain"]).encode(prompt).ids
    gen = dict(max_new_tokens=8, stop_tokens=())
    assert mojolearn.MambaLM(path).generate([ids], **gen) == \
        mojolearn.MambaLM(folder).generate([ids], **gen)
    args = ("--prompt", prompt, "--max-new-tokens", 8, "--stop-ids", "")
    out = _cli_lines(run_cli("generate", path, *args))
    assert out == _cli_lines(run_cli("generate", folder, *args))
    assert f"prefill {len(ids)} tokens" in out[-1] and "decode 7 tokens" in out[-1]
    # negative control: the same weights, a file whose merges are cut
    cut = _write(tmp_path / "cut.gguf", files["plain"], "gpt-2", _drop_last_merges,
                 weights=weights, a_of=kernel_neg_exp)
    assert _cli_lines(run_cli("generate", cut, *args)) != out


def test_the_files_eos_stops_generation(files, tmp_path):
    weights = model("mamba", 32, vocab=VOCAB, seed=4)
    path = _write(tmp_path / "m.gguf", files["plain"], "gpt-2", weights=weights)
    lm = mojolearn.MambaLM(path)
    assert lm.eos_token_ids == (0,)
    ids = read_tokenizer(path).encode(TEXTS[0]).ids
    first = lm.generate([ids], max_new_tokens=1, stop_tokens=())[0][0]
    assert first != 0

    def eos_first(tokens, types, special):
        special.special_token_ids["eos"] = first
    stop = _write(tmp_path / "stop.gguf", files["plain"], "gpt-2", eos_first, weights=weights)
    r = run_cli("generate", stop, "--prompt", TEXTS[0], "--max-new-tokens", 5)
    assert _cli_lines(r)[-1].endswith("stopped: stop")
    r = run_cli("generate", path, "--prompt", TEXTS[0], "--max-new-tokens", 5)
    assert _cli_lines(r)[-1].endswith("stopped: length")  # negative control


def _set(key, value, vtype=None):
    def edit(meta):
        meta[key] = (value, vtype)
    return edit


def _raw_file(path, meta):
    """A GGUF file holding only metadata: {key: (value, GGUFValueType or None)}."""
    w = gguf.GGUFWriter(str(path), "mamba")
    for key, (value, vtype) in meta.items():
        if value is not None:
            w.add_key_value(key, value, vtype or _vtype(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vtype(value):
    V = gguf.GGUFValueType
    if isinstance(value, list):
        return V.ARRAY
    return V.BOOL if isinstance(value, bool) else V.UINT32 if isinstance(value, int) \
        else V.STRING


def _good_meta():
    """The tokenizer keys of a well-formed small file."""
    tokens = ["a", "b", "ab", "<s>", "[PAD4]"]
    return {"tokenizer.ggml.model": ("gpt2", None), "tokenizer.ggml.pre": ("gpt-2", None),
            "tokenizer.ggml.tokens": (tokens, None),
            "tokenizer.ggml.token_type": ([1, 1, 1, 3, 5], None),
            "tokenizer.ggml.merges": (["a b"], None)}


BAD = [
    ({"tokenizer.ggml.model": ("llama", None)}, ["tokenizer.ggml.model", "'llama'"]),
    ({"tokenizer.ggml.model": (None, None)}, ["tokenizer.ggml.model", "missing"]),
    ({"tokenizer.ggml.pre": ("falcon3", None)}, ["tokenizer.ggml.pre", "'falcon3'"]),
    ({"tokenizer.ggml.pre": ("default", None)}, ["tokenizer.ggml.pre", "'default'"]),
    ({"tokenizer.ggml.pre": (None, None)}, ["tokenizer.ggml.pre", "missing"]),
    ({"tokenizer.ggml.merges": (None, None)}, ["tokenizer.ggml.merges", "missing"]),
    ({"tokenizer.ggml.merges": (["ab"], None)}, ["tokenizer.ggml.merges[0]", "'ab'"]),
    ({"tokenizer.ggml.merges": (["a c"], None)}, ["tokenizer.ggml.merges[0]", "'c'"]),
    ({"tokenizer.ggml.merges": (["b a"], None)}, ["tokenizer.ggml.merges[0]", "'ba'"]),
    ({"tokenizer.ggml.tokens": (["a", "b", "ab", "a", "x"], None)},
     ["tokenizer.ggml.tokens", "'a' twice"]),
    ({"tokenizer.ggml.tokens": ([1, 2], None)},
     ["tokenizer.ggml.tokens", "strings"]),
    ({"tokenizer.ggml.token_type": ([1, 1, 1], None)},
     ["tokenizer.ggml.token_type", "3 entries"]),
    ({"tokenizer.ggml.token_type": ([1, 1, 1, 9, 1], None)},
     ["tokenizer.ggml.token_type[3] = 9"]),
    ({"tokenizer.ggml.add_bos_token": (True, None)},
     ["tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"]),
    ({"tokenizer.ggml.add_eos_token": (True, None), "tokenizer.ggml.eos_token_id": (4, None)},
     ["tokenizer.ggml.eos_token_id = 4"]),
    ({"tokenizer.ggml.bos_token_id": (7, None)}, ["tokenizer.ggml.bos_token_id = 7"]),
    ({"tokenizer.ggml.tokens": (["a", "b", "ab", "<s>:0", "[PAD4]"], None),
      "tokenizer.ggml.add_bos_token": (True, None), "tokenizer.ggml.bos_token_id": (3, None)},
     ["tokenizer.ggml.bos_token_id = 3", "'<s>:0'"]),
]


@pytest.mark.parametrize("change, names", BAD)
def test_unsupported_or_malformed_tokenizers_are_refused_naming_the_key(tmp_path, change,
                                                                         names):
    meta = _good_meta()
    tk = read_tokenizer(_raw_file(tmp_path / "good.gguf", meta))  # the control: it reads
    assert tk.encode("abab<s>ba").ids == [2, 2, 3, 1, 0]
    meta.update(change)
    path = _raw_file(tmp_path / "bad.gguf", meta)
    with raises_naming(ValueError, str(path), *names):
        read_tokenizer(path)
    # the CLI: one line naming the key for a text prompt
    assert load_tokenizer(path) is None  # token ids need no tokenizer
    with raises_naming(ValueError, *names, "tokenizer.json"):
        load_tokenizer(path, required=True)


def test_the_cli_names_the_key_of_an_unsupported_tokenizer(tmp_path):
    layers, emb, norm, head = model("mamba", 32, vocab=8)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba", layers, emb, norm, head)  # tokens only: no split, no merges
    r = run_cli("generate", path, "--prompt", "hi")
    assert r.returncode == 2 and "tokenizer.ggml.pre" in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1
    r = run_cli("generate", path, "--prompt-ids", "1,2", "--max-new-tokens", 2)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2  # the ids, then the summary


def test_the_server_takes_the_files_tokenizer(files):
    pytest.importorskip("starlette")
    from mojolearn.serve.ray_deployment import build_server
    server = build_server(str(files["gpt-2"]))
    try:
        assert _all_ids(server.tokenizer) == _all_ids(_json(files["plain"]))
    finally:
        server.close()


def test_a_merge_is_split_at_the_first_space_after_its_first_character(tmp_path):
    # as llama.cpp splits: "  a" is " " + "a" (a left part may be a space)
    meta = _good_meta()
    meta["tokenizer.ggml.tokens"] = (["a", "b", "ab", "<s>", "[PAD4]", " ", " a"], None)
    meta["tokenizer.ggml.token_type"] = ([1, 1, 1, 3, 5, 1, 1], None)
    meta["tokenizer.ggml.merges"] = (["a b", "  a"], None)
    tk = read_tokenizer(_raw_file(tmp_path / "m.gguf", meta))
    assert json.loads(tk.to_str())["model"]["merges"] == [["a", "b"], [" ", "a"]]


def test_an_unknown_type_token_is_special_like_a_control_token(tmp_path):
    meta = _good_meta()
    meta["tokenizer.ggml.token_type"] = ([1, 1, 1, 2, 5], None)  # <s>: llama.cpp's "unknown"
    tk = read_tokenizer(_raw_file(tmp_path / "m.gguf", meta))
    assert tk.encode("ab<s>").ids == [2, 3]
    assert tk.decode([2, 3]) == "ab" and tk.decode([2, 3], skip_special_tokens=False) == "ab<s>"


def test_without_the_tokenizers_package(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with raises_naming(ImportError, "tokenizers", "pip install tokenizers"):
        read_tokenizer(files["gpt-2"])
    assert load_tokenizer(files["gpt-2"]) is None  # token ids still work
    with raises_naming(ImportError, "tokenizers"):
        load_tokenizer(files["gpt-2"], required=True)
