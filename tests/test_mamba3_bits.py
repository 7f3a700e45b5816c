"""Mamba-3 only bit properties (docs/numerics.md, "The contract of identical
mode"): long passes (64+ tokens per row) against short ones, and input
states (set_input_states). What every block promises (decode == prefill,
any split, ragged rows, thread counts, batch composition, sessions, state
bytes, ...): the block contract, tests/contract/.

Each property is checked with exact byte equality and has a negative control
showing that the same check fails on a one-ulp (or otherwise small) change.
"""
import numpy as np

import mojolearn
from tests.bits import assert_bits_differ, assert_same_bits, nudge
from mojolearn.reference.weights import mamba3_weights, random_input

D = 32
W = mamba3_weights(D, seed=21)
_BLOCK = []


def block():
    if not _BLOCK:
        _BLOCK.append(mojolearn.Mamba3Block(W))
    return _BLOCK[0]


STATE_NAMES = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
               "buffer_sig", "buffer_adt", "pending_k", "pending_v")


def reports(b):
    return [np.asarray(a).copy() for a in (b.h_last_, b.k_last_, b.v_last_, b.theta_last_)]


def steps(b, x, state, t0, t1):
    return [np.asarray(b.step(x[:, t], state)) for t in range(t0, t1)]


def test_long_pass_leaves_every_state_byte_of_short_passes():
    """A pass of 64+ tokens per row (B <= 16 at 1024 rows) scans on a
    contiguous copy of each head's chunk rows; shorter passes work in the
    state itself. The outputs and every byte of the state, invalid buffer
    rows included, are the same either way: rows alone (B = 1, one pass of
    up to 300 tokens) vs in a batch of 17 (passes of 60 tokens); and a
    ragged row of 10 tokens (no fold) in a 300-token pass vs alone."""
    x = random_input(17, 300, D, seed=13)
    s_all = block().allocate_state(17)
    y = np.asarray(block().forward(x, s_all))
    for i in range(5):
        s = block().allocate_state(1)
        if i == 4:  # a second call: 40 tokens, then a long pass from there
            block().forward(x[i:i + 1, :40], s)
            yi = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, 40:]), s))
            assert_same_bits(yi[0], y[i, 40:], f"row {i} continued alone")
        else:
            yi = np.asarray(block().forward(x[i:i + 1], s))
            assert_same_bits(yi[0], y[i], f"row {i} alone")
        for name in STATE_NAMES:
            assert_same_bits(np.asarray(getattr(s, name))[0],
                             np.asarray(getattr(s_all, name))[i], f"row {i} state.{name}")
    y2 = np.asarray(block().forward(x[:2], lengths=[300, 10]))
    rep = reports(block())
    alone = np.asarray(block().forward(x[1:2, :10]))
    assert_same_bits(y2[1, :10], alone[0], "ragged row of 10 in a long pass")
    for a, b_, name in zip(reports(block()), rep, ("h", "k", "v", "theta")):
        assert_same_bits(a[0], b_[1], f"ragged row report {name}")
    # negative controls: the invalid rows (44..63 of a 300-token row) hold
    # the last folded chunk's rows, so a scan that left them as they were
    # (zeros) would fail the state check above; a nudged input is seen
    assert s_all.buffered_tokens == 44
    assert np.asarray(s_all.buffer_krot)[0, 44:].any()
    assert_bits_differ(np.asarray(block().forward(nudge(x[:1], index=299 * D)))[0], y[0],
                       "nudged last token")


def test_scan_tasks_of_several_heads_equal_rows_alone():
    """In a long pass one scan task runs several heads of its row in turn on
    one scratch (at most about 48 tasks: B = 8 with 8 heads gives 2 heads a
    task); outputs and state bytes equal each row alone (one head a task)
    and the same rows in a batch of 17 (passes of 60 tokens, in place)."""
    w = mamba3_weights(256, seed=22)
    blk = mojolearn.Mamba3Block(w)
    assert blk.nheads == 8
    x = random_input(17, 150, 256, seed=14)
    s8 = blk.allocate_state(8)
    y8 = np.asarray(blk.forward(np.ascontiguousarray(x[:8]), s8))
    s17 = blk.allocate_state(17)
    y17 = np.asarray(blk.forward(x, s17))
    assert_same_bits(y8, y17[:8], "rows 0..7 of 8 vs of 17")
    for i in (0, 5, 7):
        s = blk.allocate_state(1)
        assert_same_bits(np.asarray(blk.forward(x[i:i + 1], s))[0], y8[i], f"row {i} alone")
        for name in STATE_NAMES:
            assert_same_bits(np.asarray(getattr(s, name))[0], np.asarray(getattr(s8, name))[i],
                             f"row {i} state.{name}")
            assert_same_bits(np.asarray(getattr(s17, name))[i], np.asarray(getattr(s8, name))[i],
                             f"row {i} state.{name} in 17")
    assert_bits_differ(np.asarray(blk.forward(nudge(x[:8], index=149 * 256)))[0], y8[0],
                       "nudged last token")


def _input_states(seed, B=2):
    rng = np.random.default_rng(seed)
    H = block().nheads
    return (rng.uniform(0, 6.28, (B, H, 32)).astype(np.float32),
            (0.1 * rng.standard_normal((B, H, 64, 128))).astype(np.float32),
            rng.standard_normal((B, H, 128)).astype(np.float32),
            rng.standard_normal((B, H, 64)).astype(np.float32))


def test_steps_after_set_input_states_equal_forward():
    x = random_input(2, 70, D, seed=9)
    ins = _input_states(1)
    y = np.asarray(block().forward(x, block().allocate_state(2).set_input_states(*ins)))
    s = block().allocate_state(2).set_input_states(*ins)
    ys = steps(block(), x, s, 0, 70)
    assert not s.pending
    assert_same_bits(np.concatenate(ys, 1), y, "steps vs forward after set_input_states")
    ins2 = list(ins)
    ins2[2] = nudge(ins[2])
    y2 = np.asarray(block().forward(x, block().allocate_state(2).set_input_states(*ins2)))
    assert_bits_differ(y2, y, "nudged input-state k")


def test_input_states_continuation_close_to_unbroken_run():
    """Continuing from the reports (h_last_, k_last_, v_last_, theta_last_) of a
    prefix equals the unbroken run up to rounding (a different formula: the
    prefix's chunk is folded with gamma only)."""
    x = random_input(2, 150, D, seed=10)
    y = np.asarray(block().forward(x), np.float64)
    for cut in (30, 64, 100):
        block().forward(x[:, :cut])
        ins = [np.asarray(a).copy() for a in (block().theta_last_, block().h_last_,
                                              block().k_last_, block().v_last_)]
        s = block().allocate_state(2).set_input_states(*ins)
        y2 = np.asarray(block().forward(x[:, cut:], s), np.float64)
        ref = y[:, cut:]
        np.testing.assert_allclose(y2, ref, rtol=1e-5, atol=2e-5)
        # negative control: dropping the pending k v term is visible
        s0 = block().allocate_state(2).set_input_states(ins[0], ins[1], ins[2] * 0, ins[3])
        y0 = np.asarray(block().forward(x[:, cut:], s0), np.float64)
        assert np.abs(y0 - ref).max() > 1e-3
