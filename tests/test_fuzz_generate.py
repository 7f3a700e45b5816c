"""Random generate / Batcher.submit arguments (Hypothesis): each call is
either refused by a TypeError or ValueError naming an argument that is
wrong (by an oracle written here) with nothing changed, or gives the bits
of the plain one-request run; a request already running is never
disturbed."""
import math
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .engine_common import VOCAB, alone, logits_bytes, tiny_folder, tiny_lm
from .errors import name_pattern

_LM = {}


def _lm():
    if "lm" not in _LM:
        _LM["lm"] = tiny_lm(tiny_folder(tempfile.mkdtemp(), "mamba3", n_layers=1))
    return _LM["lm"]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _f32(v):
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.inf


def _real_ok(v):
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and \
        math.isfinite(_f32(float(v)))


def _wrong(args) -> list:
    """The names of the arguments the oracle calls wrong."""
    bad = []
    p = args["prompt"]
    if not isinstance(p, list) or not p or not all(_is_int(t) and 0 <= t < VOCAB for t in p):
        bad.append("prompt")
    m = args["max_new_tokens"]
    if not (_is_int(m) and 1 <= m < 2 ** 63):
        bad.append("max_new_tokens")
    t = args["temperature"]
    if not (_real_ok(t) and t >= 0 and (t == 0 or _f32(float(t)) != 0)):
        bad.append("temperature")
    k = args["top_k"]
    if not (_is_int(k) and 0 <= k < 2 ** 63):
        bad.append("top_k")
    q = args["top_p"]
    if not (_real_ok(q) and 0 < q <= 1 and _f32(float(q)) != 0):
        bad.append("top_p")
    if not _is_int(args["seed"]):
        bad.append("seed")
    s = args["stop_tokens"]
    if s is not None and not (isinstance(s, list) and all(_is_int(t) and 0 <= t < VOCAB
                                                          for t in s)):
        bad.append("stop_tokens")
    return bad


ANY = st.one_of(st.text(max_size=3), st.booleans(), st.none(), st.just([1]))
# each argument: a good value, or (for at most two of them) anything
GOOD = {
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5),
    "max_new_tokens": st.integers(1, 4),
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 3), st.integers(0, 2)),
    "top_k": st.one_of(st.integers(0, 8), st.just(2 ** 63 - 1)),
    "top_p": st.floats(0.05, 1.0),
    "seed": st.integers(-(2 ** 70), 2 ** 70),
    "stop_tokens": st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
}
WILD = {
    "prompt": st.one_of(st.lists(st.integers(-1, VOCAB), max_size=5), ANY),
    "max_new_tokens": st.one_of(st.integers(-1, 4), st.just(2 ** 64), st.floats(), ANY),
    "temperature": st.one_of(st.floats(-1, 3), st.floats(), st.just(1e-60), st.just(1e300),
                             st.integers(-1, 2), ANY),
    "top_k": st.one_of(st.integers(-1, 8), st.just(2 ** 63), st.floats(0, 3), ANY),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.just(1e-60), st.floats(), ANY),
    "seed": st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.floats(0, 3), ANY),
    "stop_tokens": st.one_of(st.lists(st.integers(-1, VOCAB), max_size=3),
                             st.integers(0, 5), st.text(max_size=2), ANY),
}


@st.composite
def _arguments(draw):
    wild = draw(st.sets(st.sampled_from(sorted(GOOD)), max_size=2))
    return {k: draw(WILD[k] if k in wild else GOOD[k]) for k in GOOD}


ARGS = _arguments()
WITNESS = dict(prompt=[3, 1, 4, 1, 5], max_new_tokens=6, temperature=0.8, seed=9)


def _plain(lm, a):
    kw = {k: a[k] for k in ("temperature", "top_k", "top_p", "seed")}
    return alone(lm, a["prompt"], a["max_new_tokens"], stop=tuple(a["stop_tokens"] or ()),
                 **kw)


def _refused_by_name(err, bad):
    import re
    assert isinstance(err, (TypeError, ValueError)), repr(err)
    assert any(re.search(name_pattern(n), str(err)) for n in bad), (str(err), bad)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(ARGS)
def test_submit_refuses_by_name_or_gives_the_plain_bits(args):
    lm = _lm()
    b = lm.batcher(keep_logits=True, prefill_chunk=3)
    w = b.submit(**WITNESS)
    b.step()
    bad = _wrong(args)
    try:
        r = b.submit(**args)
    except Exception as e:  # noqa: BLE001 - the class is the point of the check
        assert bad, f"refused good arguments: {e!r}"
        _refused_by_name(e, bad)
        assert b.stats.requests_submitted == 1
        r = None
    else:
        assert not bad, f"accepted {bad}"
    list(b.run())
    wt, wl = alone(lm, WITNESS["prompt"], 6, temperature=0.8, seed=9)
    assert w.tokens == wt and logits_bytes(w) == wl  # never disturbed
    if r is not None:
        toks, lg = _plain(lm, args)
        assert r.error is None and r.tokens == toks and logits_bytes(r) == lg


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ARGS, st.sampled_from([None, 5, "x", print]))
def test_generate_refuses_by_name_or_gives_the_plain_bits(args, stream):
    lm = _lm()
    # generate takes one value for all prompts or a sequence of one per prompt
    one = {k: v[0] if isinstance(v, list) and len(v) == 1 and k not in ("prompt", "stop_tokens")
           else v for k, v in args.items()}
    bad = _wrong(one) + ([] if stream is None or callable(stream) else ["stream"])
    kw = {k: v for k, v in args.items() if k != "prompt"}
    seen = []
    try:
        toks, lg = lm.generate([args["prompt"]], return_logits=True,
                               stream=(lambda i, t: seen.append(t)) if stream is print
                               else stream, **kw)
    except Exception as e:  # noqa: BLE001
        assert bad, f"refused good arguments: {e!r}"
        _refused_by_name(e, bad)
        assert not seen
        return
    assert not bad, f"accepted {bad}"
    want, wl = _plain(lm, one)
    assert toks == [want] and [bytes(memoryview(a).cast("B")) for a in lg[0]] == wl
    assert stream is None or seen == want


def test_the_oracle_can_refuse():
    """Control: the oracle names each wrong argument (a mutation that lets
    one through would otherwise be invisible)."""
    good = dict(prompt=[1], max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                stop_tokens=None)
    assert _wrong(good) == []
    for name, value in [("top_k", 2 ** 63), ("stop_tokens", 5), ("temperature", "abc"),
                        ("prompt", [VOCAB]), ("top_p", 1e-60)]:
        assert _wrong({**good, name: value}) == [name]
    with pytest.raises(AssertionError):
        _refused_by_name(ValueError("something else"), ["top_k"])
