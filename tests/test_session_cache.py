"""The decode sessions' speed cache is a choice (memory per stream): with it
or without it a Mamba-2/3 session, MambaLM.open_rows and the Batcher give
the same bytes (Mamba-1: its sessions against block.step); without it nothing is allocated; the Batcher's 'auto' rule
follows its budget; bad values are refused by name and change nothing."""
import numpy as np
import pytest

import mojolearn
from mojolearn.mamba.sessions import Mamba2DecodeSession, Mamba3DecodeSession
from tests.bits import assert_bits_differ, assert_same_bits
from tests.engine_common import tiny_folder, tiny_lm

KINDS = ("mamba2", "mamba3")
CHUNK = {"mamba": 16, "mamba2": 256, "mamba3": 64}  # (Mamba-1: no chunks; any length)
SESSION = {"mamba2": Mamba2DecodeSession, "mamba3": Mamba3DecodeSession}


def _block(kind):
    return {"mamba2": mojolearn.Mamba2Block, "mamba3": mojolearn.Mamba3Block}[kind](
        mojolearn.init_weights(kind, 32, seed=4))


def _x(b, l, seed):
    return np.random.default_rng(seed).standard_normal((b, l, 32)).astype(np.float32)


def _session_run(blk, x, n0, n1, **kw):
    """Prefill n0 tokens, then session steps n0..n1: outputs and the state
    arrays after close, as bytes."""
    st = blk.allocate_state(x.shape[0])
    blk.forward(x[:, :n0], st)
    with blk.decode_session(st, **kw) as s:
        ys = [np.asarray(s.step(np.ascontiguousarray(x[:, t]))) for t in range(n0, n1)]
    arrays = b"".join(np.asarray(getattr(st, n)).tobytes() for n in type(st)._ARRAYS)
    return np.concatenate(ys, 1), arrays


@pytest.mark.parametrize("kind", KINDS)
def test_session_without_cache_gives_the_bytes_with_it_across_a_fold(kind):
    blk, q = _block(kind), CHUNK[kind]
    n0, n1 = q - 5, q + 4  # the steps cross a chunk end (a fold)
    x = _x(3, n1, seed=1)
    y_on, st_on = _session_run(blk, x, n0, n1, cache=True)
    y_off, st_off = _session_run(blk, x, n0, n1, cache=False)
    assert_same_bits(y_off, y_on, "cache off vs on")
    assert st_off == st_on
    # control: one input value moved one ulp changes the outputs
    x2 = x.copy()
    x2[1, n0 + 2, 7] = np.nextafter(x2[1, n0 + 2, 7], np.float32(np.inf))
    assert_bits_differ(_session_run(blk, x2, n0, n1, cache=False)[0], y_on, "nudged x")


@pytest.mark.parametrize("kind", KINDS)
def test_rows_at_their_own_positions_without_cache_equal_with_it(kind):
    """row_tokens (the Batcher's path): rows at different chunk positions,
    one folding during the steps; a reload (load_state) in between."""
    blk, q = _block(kind), CHUNK[kind]
    lens = [q - 3, 5, 1]
    x = _x(3, q + 8, seed=2)

    def run(cache):
        st = blk.allocate_state(3)
        pre = [blk.allocate_state(1) for _ in lens]
        for i, (p, n) in enumerate(zip(pre, lens)):
            blk.forward(x[i:i + 1, :n], p)
        for name in type(st)._ARRAYS:  # row i of the batch state: request i's state
            a = np.asarray(getattr(st, name))
            for i, p in enumerate(pre):
                a[i] = np.asarray(getattr(p, name))[0]
        ys = []
        with SESSION[kind](blk, st, row_tokens=list(lens), cache=cache) as s:
            for t in range(6):
                ys.append(np.asarray(s.step(np.ascontiguousarray(x[:, q + t]))))
                if t == 2:
                    s.sync_state()
                    s.load_state()
        return np.concatenate(ys, 1)

    on = run(True)
    assert_same_bits(run(False), on, "row_tokens, cache off vs on")
    x[0, q + 1, 0] += np.float32(0.5)  # control
    assert_bits_differ(run(False), on, "edited x")


def test_without_cache_nothing_is_allocated():
    blk = _block("mamba2")
    st = blk.allocate_state(2)
    with blk.decode_session(st) as s:
        assert s.cache_bytes == blk._session_cache_bytes(2) > 0
    with blk.decode_session(st, cache=False) as s:
        assert s.cache_bytes == 0 and s._cache is None
        assert s._args[s._spec.slot("cache")] == 0  # the kernel's uncached path
    m3 = _block("mamba3")
    with m3.decode_session(m3.allocate_state(2)) as s:
        assert s.cache_bytes == 0  # Mamba-3 keeps none
    m1 = mojolearn.Mamba1Block(mojolearn.init_weights("mamba1", 32, seed=4))
    with m1.decode_session(m1.allocate_state(2)) as s:  # its workspace holds the state
        assert s.cache_bytes == m1._session_cache_bytes(2) == 4 * s._work.size > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_bad_cache_value_is_refused_and_changes_nothing(kind, bad):
    blk = _block(kind)
    st = blk.allocate_state(1)
    with pytest.raises(TypeError, match="cache"):
        blk.decode_session(st, cache=bad)
    blk.step(np.zeros((1, 32), np.float32), st)  # the state was not taken


# -- the model and the engine ----------------------------------------------------

@pytest.fixture(scope="module", params=("mamba",) + KINDS)
def lm(request, tmp_path_factory):
    return tiny_lm(tiny_folder(tmp_path_factory.mktemp(request.param), request.param))


def test_open_rows_without_cache_gives_the_bytes_with_it(lm):
    states = lm.allocate_state(2)
    lm.forward_tokens([[1, 2, 3], [4, 5, 6]], states)
    x = np.random.default_rng(3).standard_normal((4, 2, 1, lm.d_model)).astype(np.float32)

    def run(cache):
        st = [s.copy() for s in states]
        dec = lm.open_rows(st, [3, 3], cache=cache)
        expect = lm.session_cache_bytes(2) if cache else 0
        assert dec.cache_bytes == expect
        ys = [np.asarray(dec.step(x[t])) for t in range(4)]
        dec.close()
        return np.concatenate(ys, 1)

    on = run(True)
    assert_same_bits(run(False), on, "open_rows cache off vs on")
    with pytest.raises(TypeError, match="cache"):
        lm.open_rows(states, [3, 3], cache="off")
    assert_bits_differ(run(False), np.asarray(on) + np.float32(1.0), "control")


def _generate(lm, **kw):
    """Requests joining and leaving, one crossing a chunk end while decoding:
    every token and logit as bytes, and the stats' session_cache_bytes after
    each step with rows decoding (rows opened as 1, 2 and 3)."""
    q = CHUNK[lm.kind]
    b = lm.batcher(keep_logits=True, **kw)
    reqs = [b.submit([(5 * i + 1) % 40 for i in range(q - 2)], max_new_tokens=6),
            b.submit([7, 8], max_new_tokens=4, temperature=0.9, seed=3)]
    b.step()
    reqs.append(b.submit([9, 1, 2], max_new_tokens=5, top_k=5, temperature=1.1, seed=4))
    seen = []
    while b.busy:
        b.step()
        st = b.stats
        if st.active_rows:
            seen.append(st.session_cache_bytes)
    out = b"".join(np.asarray(r.tokens, np.int64).tobytes()
                   + b"".join(np.asarray(lg).tobytes() for lg in r.logits) for r in reqs)
    return out, seen


def test_batcher_gives_the_same_bytes_with_and_without_cache(lm):
    on, seen_on = _generate(lm, session_cache=True)
    off, seen_off = _generate(lm, session_cache=False)
    assert off == on
    assert set(seen_off) == {0}
    sizes = {lm.session_cache_bytes(n) for n in (1, 2, 3)}
    assert lm.session_cache_bytes(3) in seen_on and set(seen_on) <= sizes
    auto, _ = _generate(lm)  # the default: 'auto' with the system's budget
    assert auto == on
    # control: another seed of the sampled requests changes the bytes
    b = lm.batcher(keep_logits=True, session_cache=False)
    r = b.submit([7, 8], max_new_tokens=4, temperature=0.9, seed=5)
    list(b.run())
    assert np.asarray(r.tokens, np.int64).tobytes() + b"".join(
        np.asarray(lg).tobytes() for lg in r.logits) not in on


def test_auto_keeps_the_cache_while_it_fits_the_budget(tmp_path):
    lm = tiny_lm(tiny_folder(tmp_path, "mamba2"))
    need = lm.session_cache_bytes(3)
    assert need == 3 * lm.session_cache_bytes(1) > 0
    two = lm.session_cache_bytes(2)
    for budget, expect in [(need, {need, two}), (need - 1, {0, two}), (0, {0}),
                           (10 * need, {need, two})]:
        _, seen = _generate(lm, session_cache="auto", session_cache_budget=budget)
        assert set(seen) - {lm.session_cache_bytes(1)} == expect, (budget, seen)


@pytest.mark.parametrize("kw, name", [
    ({"session_cache": "yes"}, "session_cache"), ({"session_cache": 1}, "session_cache"),
    ({"session_cache_budget": -1}, "session_cache_budget"),
    ({"session_cache_budget": 1.5}, "session_cache_budget")])
def test_bad_batcher_cache_arguments_are_refused_by_name(lm, kw, name):
    with pytest.raises((TypeError, ValueError), match=name):
        lm.batcher(**kw)


def test_session_cache_bytes_refuses_bad_rows(lm):
    with pytest.raises(ValueError, match="rows"):
        lm.session_cache_bytes(0)
    with pytest.raises(TypeError, match="rows"):
        lm.session_cache_bytes("2")


def test_auto_without_a_budget_takes_half_the_available_memory(tmp_path, monkeypatch):
    from mojolearn import batcher as batcher_module
    lm = tiny_lm(tiny_folder(tmp_path, "mamba2"))
    need, two = lm.session_cache_bytes(3), lm.session_cache_bytes(2)
    for avail, expect in [(2 * need, {need, two}), (2 * need - 2, {0, two}),
                          (None, {need, two})]:  # unreadable: keep it
        monkeypatch.setattr(batcher_module, "_available_memory", lambda: avail)
        _, seen = _generate(lm)
        assert set(seen) - {lm.session_cache_bytes(1)} == expect, (avail, seen)
    monkeypatch.undo()
    assert batcher_module._available_memory() > 0  # this system reports it
