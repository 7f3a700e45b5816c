"""The engine interface of MambaLM (embed_ids, head_logits, row_position,
open_rows, restack_states) and generate's arguments: rows decoded through
the public interface have the bits of each request alone; bad arguments
are refused by name before anything runs."""
import numpy as np
import pytest

import mojolearn

from .engine_common import alone, prompt_of, tiny_folder, tiny_lm
from .errors import raises_naming


@pytest.fixture(scope="module", params=["mamba", "mamba2", "mamba3"])
def lm(request, tmp_path_factory):
    return tiny_lm(tiny_folder(tmp_path_factory.mktemp(request.param), request.param))


def _b(a):
    return bytes(memoryview(a).cast("B"))


def test_embed_ids_and_head_logits_are_the_rows_of_embed_and_logits(lm):
    toks = [[1, 5, 9, 3]]
    assert _b(lm.embed_ids(toks[0])) == _b(lm.embed(toks))
    x = lm.forward_tokens(toks, lm.allocate_state(1))
    assert _b(lm.head_logits(x)) == _b(lm.logits(toks))
    assert _b(lm.head_logits(lm.embed_ids([1, 5]))) != _b(lm.head_logits(lm.embed_ids([1, 6])))
    with raises_naming(ValueError, "ids", "48"):
        lm.embed_ids([1, 48])
    with raises_naming(ValueError, "ids", "-1"):
        lm.embed_ids([-1])
    with raises_naming(TypeError, "ids"):
        lm.embed_ids([1.5])
    with raises_naming(ValueError, "hidden", "d_model"):
        lm.head_logits(mojolearn.Array((2, lm.d_model + 1)))


def test_rows_decoded_through_the_interface_have_each_requests_bits(lm):
    """Two requests prefilled alone, restacked into one state, decoded
    together with their own positions: each row's logits are its alone
    run's; one row leaves, the other goes on."""
    prompts = [prompt_of(70, 1), prompt_of(3, 2)]
    ref = [alone(lm, p, 6)[1] for p in prompts]
    own = []
    for p in prompts:
        st = lm.allocate_state(1)
        lm.forward_tokens([p], st)
        own.append(st)
    pos = [lm.row_position(st) for st in own]
    states = lm.restack_states([(own[0], 0), (own[1], 0)], consume=True)
    assert own[0] == [None] * lm.n_layers  # consumed
    toks = []  # the first tokens: from the alone runs' first logits (greedy)
    for p, r in zip(prompts, ref):
        lg = mojolearn.Array((1, lm.vocab_size))
        memoryview(lg).cast("B")[:] = r[0]
        toks.append(lm.next_tokens(lg, [0.0], [0], [1.0], [0.0])[0])
    dec = lm.open_rows(states, pos)
    got = [[], []]
    for _ in range(5):
        y = dec.step(lm.embed_ids(toks).reshape((2, 1, lm.d_model)))
        lg = lm.head_logits(y)
        toks = lm.next_tokens(lg, [0.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2)
        for i in range(2):
            got[i].append(_b(lg)[i * lm.vocab_size * 4:(i + 1) * lm.vocab_size * 4])
    positions = dec.close()
    assert got[0] == ref[0][1:] and got[1] == ref[1][1:]
    assert got[0] != got[1]  # control
    if lm.kind == "mamba":
        assert positions == [0, 0]
    else:
        assert positions != pos  # moved on by 5 tokens each
    one = lm.restack_states([(states, 1)])
    assert _b(one[0].h) == _b(states[0].h)[len(_b(one[0].h)):]  # row 1 of 2
    with raises_naming(ValueError, "parts[0]", "row"):
        lm.restack_states([(states, 2)])
    with raises_naming(ValueError, "parts"):
        lm.restack_states([])


def test_check_state_validates_a_model_state_by_name(lm):
    st = lm.allocate_state(2)
    assert lm.check_state(st) == st and lm.check_state(st, batch=2) == st
    with raises_naming(ValueError, "s[0]"):
        lm.check_state(st, "s", batch=1)
    with raises_naming(ValueError, "s"):
        lm.check_state(st[:1], "s")
    with raises_naming(TypeError, "s"):
        lm.check_state(5, "s")


@pytest.mark.parametrize("kind", ["mamba2", "mamba3"])  # (Mamba-1 rows have no positions)
def test_sessions_take_row_tokens_and_in_place_by_public_names(kind, tmp_path):
    lm = tiny_lm(tiny_folder(tmp_path, kind, n_layers=1))
    blk = lm.blocks[0]
    st = blk.allocate_state(2)
    cls = type(blk.decode_session(blk.allocate_state(1)))
    s = cls(blk, st, row_tokens=[3, 5], in_place=True)
    assert s.in_place and s.row_positions() == [3, 5]
    s.step(np.zeros((2, 1, lm.d_model), np.float32))
    assert s.row_positions() == [4, 6]
    s.close()
    with pytest.raises(TypeError):
        cls(blk, st, _row_tokens=[0, 0])
    plain = blk.decode_session(st)
    with raises_naming(ValueError, "row_positions"):
        plain.row_positions()
    plain.close()


# -- generate's arguments ------------------------------------------------------

@pytest.mark.parametrize("name, hint", [
    ("eos_token_id", "stop_tokens"), ("do_sample", "temperature"),
    ("max_length", "max_new_tokens"), ("dtype", "weight_format"),
    ("torch_dtype", "weight_format"), ("pad_token_id", "eos_token_id")])
def test_transformers_argument_names_point_to_ours(lm, name, hint):
    hint_names = [hint] if hint != "eos_token_id" else []
    with raises_naming(TypeError, name, *hint_names):
        lm.generate([[1, 2]], **{name: 1})
    with raises_naming(TypeError, "bogus"):
        lm.generate([[1, 2]], bogus=1)


def test_mambalm_points_dtype_to_weight_format(tmp_path):
    folder = tiny_folder(tmp_path, "mamba", n_layers=1)
    for name in ("dtype", "torch_dtype"):
        with raises_naming(TypeError, name, "weight_format"):
            mojolearn.MambaLM(folder, **{name: "float32"})
    with raises_naming(TypeError, "bogus"):
        mojolearn.MambaLM(folder, bogus=1)


def test_bad_generate_arguments_are_refused_before_any_prefill(lm, monkeypatch):
    ran = []
    real = type(lm).forward_tokens
    monkeypatch.setattr(type(lm), "forward_tokens",
                        lambda self, *a: ran.append(1) or real(self, *a))
    with raises_naming(TypeError, "stream"):
        lm.generate([[1, 2]], stream=5)
    with raises_naming(TypeError, "temperature"):  # one (bad) value, not 3 per-prompt ones
        lm.generate([[1, 2], [3]], temperature="abc")
    with raises_naming(TypeError, "stop_tokens"):
        lm.generate([[1, 2]], stop_tokens=5)
    with raises_naming(ValueError, "top_k"):
        lm.generate([[1, 2]], top_k=2 ** 63)
    with raises_naming(TypeError, "stop_tokens"):
        lm.generate([[1, 2]], stop_tokens=[1, [2]])
    assert not ran
    lm.generate([[1, 2]], max_new_tokens=1)
    assert ran  # control: the patch sees a real run


def test_generate_takes_per_prompt_stop_sets(lm):
    full = lm.generate([prompt_of(4), prompt_of(5, 1)], max_new_tokens=5, stop_tokens=())
    got = lm.generate([prompt_of(4), prompt_of(5, 1)], max_new_tokens=5,
                      stop_tokens=[[full[0][1]], None])
    assert got[0] == full[0][:full[0].index(full[0][1]) + 1] and got[1] == full[1]
