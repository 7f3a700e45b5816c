"""Serving a lone llama.cpp .gguf file: the server's chat endpoint renders the
chat template the converter copied into the file (``tokenizer.chat_template``,
its bos/eos texts from the file's ids) and tokenizes with the file's own
tokenizer; a chat template beside the file wins over it; a file with neither
is refused saying what is missing, and a malformed template key is an error
naming it. The GGUF files are written as tests/test_gguf_tokenizer.py writes
them (llama.cpp's writer, the converter's steps); the chat test drives a
server child process with the official openai client over 127.0.0.1."""
from __future__ import annotations

import json

import pytest

import mojolearn
from mojolearn.gguf import read_tokenizer

from .test_gguf_tokenizer import _tokenizer_json, _write
from .text_model import CHAT_TEMPLATE, EOS, run_cli

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

from mojolearn.serve.chat import load_chat_template  # noqa: E402

from .test_serve import NAME, ServerProcess, _free_port  # noqa: E402
from .test_serve_app import _call  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Café? 日本 🙂"}]
PROMPT = "<|system|>Be brief.\n<|user|>Café? 日本 🙂\n<|assistant|>"  # CHAT_TEMPLATE's text
BESIDE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"


def _tokenizer_folder(folder, chat_template=None):
    """A tokenizer.json folder (test_gguf_tokenizer's tokenizer) whose
    tokenizer_config.json holds chat_template, for the converter to copy."""
    folder.mkdir(parents=True)
    _tokenizer_json().save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path}: .gguf files, each alone in its folder."""
    tmp = tmp_path_factory.mktemp("ggchat")
    chat = _tokenizer_folder(tmp / "tok-chat", CHAT_TEMPLATE)
    plain = _tokenizer_folder(tmp / "tok-plain")
    out = {}
    for name, tok in (("chat", chat), ("plain", plain)):
        (tmp / name).mkdir()
        out[name] = _write(tmp / name / "m.gguf", tok, "gpt-2")
    return out


@pytest.fixture(scope="module")
def server(files):
    srv = ServerProcess(files["chat"], "--max-tokens", 64)
    try:
        yield srv
    finally:
        srv.kill()


def test_a_lone_gguf_serves_chat_with_the_template_it_carries(files, server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    path = files["chat"]
    tok, lm = read_tokenizer(path), mojolearn.MambaLM(path)
    want = lm.generate([tok.encode(PROMPT).ids], max_new_tokens=10, temperature=0.0)[0]
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10,
                                       temperature=0)
    eos = want and want[-1] in lm.eos_token_ids
    assert r.choices[0].message.content == tok.decode(want[:-1] if eos else want)
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT).ids)
    assert r.usage.completion_tokens == len(want)
    # text completions and stop strings use the file's tokenizer too
    text = "The café serves"
    want = lm.generate([tok.encode(text).ids], max_new_tokens=6, temperature=0.0)[0]
    r = client.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                  stop=["@@never@@"], extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want


def test_a_template_beside_the_file_wins_over_the_files_own(files, tmp_path):
    own = load_chat_template(files["chat"])
    assert own.render(MESSAGES) == PROMPT
    path = tmp_path / "m.gguf"
    path.write_bytes(files["chat"].read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": BESIDE}))
    beside = load_chat_template(path).render(MESSAGES)
    assert beside == "[system] Be brief. [user] Café? 日本 🙂 "
    assert beside != PROMPT  # control: the two templates differ
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text(BESIDE)
    assert load_chat_template(path).render(MESSAGES) == beside


def test_the_files_bos_and_eos_ids_give_the_templates_token_texts(tmp_path):
    def template(tokens, types, special):
        special.chat_template = "{{ bos_token }}|{% for m in messages %}{{ m['content'] }}" \
            "{% endfor %}|{{ eos_token }}"
        special.special_token_ids["eos"] = tokens.index("<|pad|>")
    tok = _tokenizer_folder(tmp_path / "tok")
    path = _write(tmp_path / "m.gguf", tok, "gpt-2", template)
    assert load_chat_template(path).render(MESSAGES) == f"{EOS}|Be brief.Café? 日本 🙂|<|pad|>"


def test_a_lone_gguf_without_a_template_refuses_chat_saying_what_is_missing(files):
    from mojolearn.serve.app import Server
    path = files["plain"]
    assert load_chat_template(path) is None
    server = Server(mojolearn.MambaLM(path), tokenizer=read_tokenizer(path),
                    chat_template=None)
    try:
        status, _, body = _call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES})
        err = json.loads(body)["error"]
        assert status == 400 and err["code"] == "no_chat_template"
        assert "tokenizer.chat_template" in err["message"]
    finally:
        server.close()
    # a template but no tokenizer: the message names the tokenizer, not the template
    server = Server(mojolearn.MambaLM(path), tokenizer=None,
                    chat_template=load_chat_template(files["chat"]))
    try:
        for path_, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                            ("/v1/completions", {"prompt": "hi"}),
                            ("/v1/completions", {"prompt": [1], "stop": ["x"]})):
            status, _, text = _call(server, "POST", path_, body)
            err = json.loads(text)["error"]
            assert status == 400 and err["code"] is None, err
            assert "tokenizer" in err["message"] and ".gguf" in err["message"], err
            assert "chat template" not in err["message"], err
    finally:
        server.close()


def test_a_malformed_template_key_is_an_error_naming_it(tmp_path):
    import gguf
    from .gguf_files import model, write_gguf
    from .test_gguf_tokenizer import VOCAB
    tok = _tokenizer_folder(tmp_path / "tok")
    path = tmp_path / "bad" / "m.gguf"
    path.parent.mkdir()
    layers, emb, norm, head = model("mamba", 32, vocab=VOCAB)
    # the key as a number (the writer's own add_chat_template writes text only)
    write_gguf(path, "mamba", layers, emb, norm, head, tokenizer=(tok, "gpt-2"),
               extra={"tokenizer.chat_template": (7, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template must be a non-empty "
                                         r"string, got 7"):
        load_chat_template(path)
    r = run_cli("serve", path, "--port", _free_port())
    assert r.returncode == 2 and "tokenizer.chat_template" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
