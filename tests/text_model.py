"""A tiny Mamba language model folder with a real byte-level BPE tokenizer
(tokenizer.json trained on a few lines mixing ASCII, accents, CJK and emoji)
and a chat template, for the CLI and server tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mojolearn

TEXT = [
    "The café serves crème brûlée and naïve piñatas. ",
    "日本語のテキストと中文的文字。 ",
    "Emoji: 🙂🚀🎉 and 👩‍💻 in a line. ",
    "Ünïcödé mïxed wïth ASCII, 한국어 and Ελληνικά. ",
]
VOCAB = 320
EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer():
    """A byte-level BPE trained on TEXT, at most VOCAB ids (EOS is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TEXT * 4, trainer)
    assert tk.get_vocab_size() <= VOCAB
    return tk


def write_model(folder, *, chat: bool = True, d_model: int = 32) -> Path:
    """A 2-layer Mamba-1 model (vocab VOCAB) with tokenizer.json, and with
    ``chat`` a tokenizer_config.json holding a chat template."""
    from mojolearn.reference.weights import mamba1_weights
    from mojolearn.save import save_checkpoint
    folder = Path(folder)
    rng = np.random.default_rng(0)
    save_checkpoint(folder, "mamba",
                    [mamba1_weights(d_model, seed=1, scale=4.0),
                     mamba1_weights(d_model, seed=2, scale=4.0)],
                    rng.standard_normal((VOCAB, d_model)).astype(np.float32),
                    np.ones(d_model, np.float32), config={"eos_token_id": 0})
    tokenizer().save(str(folder / "tokenizer.json"))
    if chat:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": CHAT_TEMPLATE, "eos_token": EOS}))
    return folder


@pytest.fixture(scope="session")
def text_folder(tmp_path_factory):
    """The model folder of write_model (with a chat template), made once."""
    return write_model(tmp_path_factory.mktemp("text_lm"))


@pytest.fixture(scope="session")
def text_lm(text_folder):
    """MambaLM of text_folder."""
    return mojolearn.MambaLM(text_folder)


def child_env() -> dict:
    """The environment for a child `python -m mojolearn` that imports this
    checkout's mojolearn."""
    here = str(Path(mojolearn.__file__).parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def run_cli(*args, timeout=300):
    """`python -m mojolearn ARGS` in a child process: the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "mojolearn", *map(str, args)],
                          capture_output=True, text=True, env=child_env(), timeout=timeout)
