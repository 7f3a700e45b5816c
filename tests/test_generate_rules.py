"""Generation's edge rules, each checked where a slip would show:

- a stop token ends a request even when it is the first generated token
  (the prefill step) or the first decoded one, alone or joining a batch;
- tokens are streamed as they come: ``Batcher.run`` yields a token before the
  next step runs, and ``generate``'s stream callback sees each token before
  the step after it;
- lm.mojo's next-token rule on exact ties and exact boundaries, with the
  expected ids written from the rule's text (mojo/mojolearn_kernels/lm.mojo):
  greedy takes the first index of the largest logit; ranked candidates order
  ties by id ascending; top_p keeps the shortest prefix whose sum *reaches*
  top_p * total; the pick is the first kept id whose running sum *exceeds*
  u * mass. Logits 0 and -1000 make every weight exactly 1 or 0, so the sums
  are exact and each boundary is hit exactly.
"""
import numpy as np
import pytest

import mojolearn
from mojolearn import generate as generate_module
from mojolearn.reference.weights import mamba1_weights
from mojolearn.save import save_checkpoint

V = 48
PROMPT = [3, 14, 15, 9]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny Mamba-1 LM whose greedy tokens are not all one token."""
    rng = np.random.default_rng(8)
    d = 32
    layers = [mamba1_weights(d, seed=40 + i, scale=4.0) for i in range(2)]
    emb = rng.standard_normal((V, d)).astype(np.float32)
    norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    folder = save_checkpoint(tmp_path_factory.mktemp("m1"), "mamba", layers, emb, norm)
    model = mojolearn.MambaLM(folder)
    full = model.generate([PROMPT], max_new_tokens=8)[0]
    assert len(set(full[:3])) == 3, full  # the three first tokens differ
    return model


# ----------------------------------------------------------------- stop tokens
def test_a_stop_token_that_is_the_first_token_ends_the_request(lm):
    full = lm.generate([PROMPT], max_new_tokens=8)[0]
    assert len(full) == 8  # control: without a stop token it runs to the end
    assert lm.generate([PROMPT], max_new_tokens=8, stop_tokens=[full[0]])[0] == full[:1]
    assert lm.generate([PROMPT], max_new_tokens=8, stop_tokens=[full[1]])[0] == full[:2]
    # one of several stop tokens; per-prompt stop lists
    assert lm.generate([PROMPT], max_new_tokens=8, stop_tokens=[V - 1, full[0]])[0] == full[:1]
    assert lm.generate([PROMPT, PROMPT], max_new_tokens=8,
                       stop_tokens=[[full[0]], [full[2]]]) == [full[:1], full[:3]]


def test_a_stop_token_first_ends_a_request_that_joins_a_batch(lm):
    b = lm.batcher()
    other = b.submit([1, 2], max_new_tokens=6)
    b.step()
    first = lm.generate([PROMPT], max_new_tokens=1)[0][0]
    joining = b.submit(PROMPT, max_new_tokens=8, stop_tokens=[first])
    got = b.step()
    assert (joining, first) in got
    assert joining.done and joining.finish_reason == "stop" and joining.tokens == [first]
    assert joining not in b.active and other in b.active
    list(b.run())
    assert other.tokens == lm.generate([[1, 2]], max_new_tokens=6)[0]
    assert other.finish_reason == "length" and joining.tokens == [first]


# ----------------------------------------------------------------- streaming
def test_the_batcher_yields_each_token_before_the_next_step(lm):
    b = lm.batcher()
    req = b.submit(PROMPT, max_new_tokens=5)
    seen = []
    for r, tok in b.run():
        assert r is req
        seen.append(tok)
        # the request has exactly the tokens yielded so far: no step ran ahead
        assert req.tokens == seen
        assert req.done == (len(seen) == 5) and b.busy == (len(seen) < 5)
    assert seen == lm.generate([PROMPT], max_new_tokens=5)[0]


def test_the_stream_callback_sees_each_token_before_the_step_after_it(lm, monkeypatch):
    steps = []
    step = generate_module.Batcher.step

    def counted(self):
        out = step(self)
        steps.append(len(out))
        return out
    monkeypatch.setattr(generate_module.Batcher, "step", counted)
    prompts = [PROMPT, [7], [1, 2, 3]]
    calls = []
    toks = lm.generate(prompts, max_new_tokens=4, stream=lambda i, t: calls.append(
        (i, t, len(steps))))
    assert len(steps) == 4
    for i, t in enumerate(toks):
        mine = [(tok, n) for j, tok, n in calls if j == i]
        assert [tok for tok, _ in mine] == t
        # token k of every prompt comes out of step k + 1 (all prompts start
        # together) and is streamed before step k + 2 runs
        assert [n for _, n in mine] == [1, 2, 3, 4], (i, mine)


# ----------------------------------------------------------------- next-token rule
def _next(lm, rows, t=0.0, k=0, p=1.0, u=0.0):
    """next_tokens of float32 logits rows (R, V), one parameter set for all."""
    rows = np.asarray(rows, np.float32)
    logits = mojolearn.Array(rows.shape)
    np.asarray(logits)[:] = rows
    r = len(rows)
    return lm.next_tokens(logits, [t] * r, [k] * r, [p] * r, [u] * r)


def _row(value_at, rest=-1000.0):
    row = np.full(V, rest, np.float32)
    for i, v in value_at.items():
        row[i] = v
    return row


def test_greedy_takes_the_first_index_of_the_largest_logit_on_ties(lm):
    cases = [
        (_row({5: 2.0, 20: 2.0, 30: 1.0}), 5),
        (np.zeros(V, np.float32), 0),
        (_row({0: 1.5, V - 1: 1.5}), 0),
        (_row({V - 2: 3.0, V - 1: 3.0}), V - 2),
        (_row({7: 0.0, 3: -0.0}), 3),          # -0.0 == 0.0: a tie
        (_row({11: 4.0, 12: np.nextafter(np.float32(4), np.float32(5))}), 12),  # control
    ]
    rows = [r for r, _ in cases]
    for r, want in cases:  # the rule, independently: first index of the maximum
        assert list(r).index(max(r)) == want
    assert _next(lm, rows) == [w for _, w in cases]
    # a greedy row ignores u, top_k and top_p
    assert _next(lm, rows, k=2, p=0.5, u=0.99) == [w for _, w in cases]


def test_ranked_ties_go_by_id_ascending(lm):
    """top_k over equal logits keeps the smallest ids, in id order: with
    u = 0.75 over two kept ids of weight 1, target 1.5 is first exceeded by
    the second kept id's running sum (2)."""
    tie = _row({9: 0.0, 3: 0.0, 30: 0.0, 17: 0.0})
    assert _next(lm, [tie], t=1.0, k=2, u=0.75) == [9]     # kept 3, 9
    assert _next(lm, [tie], t=1.0, k=3, u=0.9) == [17]     # kept 3, 9, 17; target 2.7
    assert _next(lm, [np.zeros(V)], t=1.0, k=2, u=0.75) == [1]  # kept 0, 1
    assert _next(lm, [np.zeros(V)], t=1.0, k=2, u=0.25) == [0]  # control: target 0.5


def test_top_p_keeps_the_shortest_prefix_that_reaches_the_goal(lm):
    """Four equal candidates (ids 3, 9, 17, 30 ranked by id), the rest of
    weight 0: total 4. top_p 0.5: goal 2, reached exactly by 2 ids (3, 9);
    u 0.75: target 1.5 -> id 9. A rule that needs the sum to pass the goal
    keeps 3 ids (target 2.25 -> id 17)."""
    tie = _row({9: 0.0, 3: 0.0, 30: 0.0, 17: 0.0})
    assert _next(lm, [tie], t=1.0, p=0.5, u=0.75) == [9]
    assert _next(lm, [tie], t=1.0, p=0.5, u=0.99) == [9]      # never past the 2 kept
    assert _next(lm, [tie], t=1.0, p=0.25, u=0.99) == [3]     # goal 1: one id
    assert _next(lm, [tie], t=1.0, p=0.75, u=0.99) == [17]    # goal 3: three ids
    assert _next(lm, [tie], t=2.0, p=0.5, u=0.75) == [9]      # (l - m) / T = 0 too
    # controls: just above a boundary one more id is kept
    above = float(np.nextafter(np.float32(0.5), np.float32(1)))
    assert _next(lm, [tie], t=1.0, p=above, u=0.99) == [17]
    assert _next(lm, [tie], t=1.0, p=1.0, u=0.99) == [30]     # no cut: all four


def test_the_pick_is_the_first_running_sum_that_exceeds_the_target(lm):
    """Two kept ids of weight 1 (mass 2): u 0.5 gives target 1.0, which the
    first running sum (1.0) only equals: the second id. The cut-free path
    (candidates in index order) and the ranked path agree."""
    two = _row({4: 0.0, 6: 0.0})
    assert _next(lm, [two], t=1.0, u=0.5) == [6]
    assert _next(lm, [two], t=1.0, k=2, u=0.5) == [6]
    assert _next(lm, [two], t=1.0, p=0.9, u=0.5) == [6]
    assert _next(lm, [two], t=1.0, u=0.0) == [4]                       # target 0
    below = float(np.nextafter(np.float32(0.5), np.float32(0)))
    assert _next(lm, [two], t=1.0, u=below) == [4]                     # control
