"""python -m mojolearn generate: one-line errors with status 2, text streamed
whole characters at a time (mojolearn.textstream), the stop reason, Hub ids
passed through."""
from __future__ import annotations

import sys

import pytest

import mojolearn
from mojolearn.textstream import IncrementalDecoder, StopText

from .text_model import TEXT, run_cli, text_folder, text_lm, tokenizer  # noqa: F401 (fixtures)

pytest.importorskip("tokenizers")


def _error_lines(stderr):
    return [ln for ln in stderr.splitlines() if not ln.startswith("loaded MambaLM(")]


@pytest.mark.parametrize("args, names", [
    (["{missing}", "--prompt-ids", "1"], "missing_model"),
    (["{bad_config}", "--prompt-ids", "1"], "hidden_size"),
    (["{folder}", "--prompt-ids", "-1"], "prompt[0] = -1"),
    (["{folder}", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["{folder}", "--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens"),
    (["{folder}", "--prompt-ids", "1", "--threads", "0"], "threads"),
    (["{folder}", "--prompt-ids", "1", "--top-p", "0"], "top_p"),
    (["{folder}", "--prompt-ids", "1", "--top-k", "-3"], "top_k"),
    (["{folder}", "--prompt-ids", "1", "--temperature", "nan"], "temperature"),
    (["{folder}", "--prompt-ids", "1", "--stop-ids", "999"], "stop_tokens[0] = 999"),
    (["{no_tokenizer}", "--prompt", "hello"], "tokenizer.json"),
])
def test_every_library_error_is_one_line_naming_it_with_status_2(text_folder, tmp_path, args,
                                                                 names):
    import shutil
    bad = tmp_path / "bad_config"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "mamba", "hidden_size": "x"}')
    plain = tmp_path / "no_tokenizer"
    shutil.copytree(text_folder, plain)
    (plain / "tokenizer.json").unlink()
    paths = dict(folder=text_folder, missing=tmp_path / "missing_model", bad_config=bad,
                 no_tokenizer=plain)
    r = run_cli("generate", *[a.format(**paths) for a in args])
    assert r.returncode == 2, r.stderr
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -m mojolearn generate: error: ") and names in lines[0]
    assert r.stdout == ""


def test_debug_shows_the_traceback(tmp_path):
    r = run_cli("generate", tmp_path / "missing_model", "--prompt-ids", "1", "--debug")
    assert r.returncode != 0 and "Traceback (most recent call last)" in r.stderr


def _naive_pieces(tok, ids):
    """What the CLI printed before: decode(all)[len(shown):] after each token."""
    shown, out = "", []
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i])
        out.append(text[len(shown):])
        shown = text
    return out


def test_streamed_text_is_whole_characters_and_joins_to_the_text():
    tok = tokenizer()
    for text in TEXT + ["".join(TEXT)]:
        ids = tok.encode(text).ids
        dec = IncrementalDecoder(tok)
        pieces = [dec.add(t) for t in ids] + [dec.finish()]
        assert "".join(pieces) == text == tok.decode(ids) == dec.text
        assert not any("\ufffd" in p for p in pieces), pieces
    # negative control: the text really splits characters over tokens
    assert any("\ufffd" in p for p in _naive_pieces(tok, tok.encode("".join(TEXT)).ids))


def test_an_unfinished_sequence_is_flushed_at_the_end():
    tok = tokenizer()
    ids = tok.encode("🙂").ids
    assert len(ids) > 1  # the emoji is split over byte tokens
    dec = IncrementalDecoder(tok)
    assert [dec.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.finish() == tok.decode(ids[:-1])  # shown as it decodes, U+FFFD and all


def test_stop_strings_are_cut_and_a_partial_match_is_held_back():
    s = StopText(["</s>", "STOP"])
    got = [s.feed(p) for p in ["ab", "c<", "/", "s", ">tail"]]
    assert got == ["ab", "c", "", "", ""] and s.stopped and s.finish() == ""
    t = StopText(["STOP"])
    assert [t.feed(p) for p in ["xST", "Ox"]] == ["x", "STOx"] and not t.stopped
    assert t.feed("yS") == "y" and t.finish() == "S"
    assert StopText([]).feed("any") == "any"


def test_the_command_streams_the_generated_text_and_the_stop_reason(text_folder, text_lm):
    tok = tokenizer()
    prompt = "café 日本 🙂"
    ids = tok.encode(prompt).ids
    longer = text_lm.generate([ids], max_new_tokens=40, stop_tokens=())[0]
    # a length whose text ends in an unfinished sequence: the held tail must be flushed
    n = next(n for n in range(2, 41) if tok.decode(longer[:n]).endswith("\ufffd"))
    r = run_cli("generate", text_folder, "--prompt", prompt, "--max-new-tokens", n,
                "--stop-ids", "")
    assert r.returncode == 0, r.stderr
    text, stats = r.stdout.rsplit("\n", 2)[:2]
    assert text == tok.decode(longer[:n])
    assert stats.endswith("stopped: length")
    first = text_lm.generate([[1, 2, 3]], max_new_tokens=1, stop_tokens=())[0][0]
    r = run_cli("generate", text_folder, "--prompt-ids", "1,2,3", "--max-new-tokens", 12,
                "--stop-ids", first)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].endswith("stopped: stop")


def test_a_hub_id_is_resolved_and_download_passed_through(text_folder, monkeypatch, capsys):
    import types
    from mojolearn import _generate_cli
    calls = []
    fake = types.ModuleType("mojolearn.hub")
    fake.is_hub_id = lambda s: s.count("/") == 1 and not s.startswith("/")
    fake.resolve = lambda s, download=False, _allow=None: calls.append((s, download, _allow)) \
        or text_folder
    monkeypatch.setitem(sys.modules, "mojolearn.hub", fake)
    monkeypatch.setattr(mojolearn, "hub", fake, raising=False)
    for flag in ([], ["--download"]):
        rc = _generate_cli.main(["org/tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2",
                                 *flag])
        assert rc == 0
    assert calls == [("org/tiny", False, "--download"), ("org/tiny", True, "--download")]
    assert "stopped: length" in capsys.readouterr().out


def test_serve_errors_before_serving_are_one_line_with_status_2(text_folder, tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, names in [([tmp_path / "missing_model"], "missing_model"),
                            ([text_folder, "--max-rows", "0"], "--max-rows"),
                            ([text_folder, "--prefill-chunk", "-1"], "--prefill-chunk"),
                            ([text_folder, "--port", port], f"127.0.0.1:{port}")]:
            r = run_cli("serve", *args, *([] if "--port" in args else ["--port", 0]))
            assert r.returncode == 2, r.stderr
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("python -m mojolearn serve: error: ")
            assert names in lines[0], lines
