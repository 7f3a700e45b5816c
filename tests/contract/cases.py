"""The six block classes as data for the contract tests, and the helpers the
tests share (also used by the per-block files).

A Case knows what differs between the blocks: the weight maker and d_model,
the state's arrays (``state._ARRAYS``) and values (``state._VALUES``), the
chunk length the kernels fold at, the reports a call leaves (``h_last_``,
...), and how a message words a batch mismatch. Everything a contract test
does with them is the same for all six classes.
"""
from __future__ import annotations

import array as pyarray
import functools
import re

import ml_dtypes
import numpy as np
import pytest

import mojolearn
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)
from tests.errors import assert_names

B, L = 2, 5  # the batch and length of the error tests' x


class Case:
    """One block class, with what differs between the kinds (_KINDS):

    d: d_model (Mamba-1: 20, every weight of another shape and vector
    tails; Mamba-2/3: 64, two heads); chunk: tokens per chunk of the
    state's buffers (Mamba-1 has none: 32 stands in, so that every length
    is spelled the same way for all); norm: the weight d_model is read
    from; small_d: another valid d_model; attrs: attributes a refused
    set_params must keep; params: get_params' keys; reports: what a call
    leaves on the block; buffers: arrays whose rows (axis 1) at and past
    buffered_tokens are never read; unread: arrays a call on a used state
    never reads (Mamba-3's pending_k/v, read only while pending); inert:
    arrays no later output depends on (Mamba-3's q rows of tokens already
    output: checked and kept, never used again); position: the state value
    that says where the open chunk is (changing it must move the bits);
    ulp_moves: (array, index into read_positions) where one ulp of a
    restored state moves the continuation's bits (elsewhere a small change
    is needed: one ulp of h rounds away);
    batch_words(name, rows): how a batch-mismatch message names state.<name>
    having `rows` rows; options: constructor options every block of the
    case is built with (the Falcon-Mamba variant of Mamba-1: bcdt_rms_eps),
    named in the case's label.
    """

    def __init__(self, name, options=None, **fields):
        self.name = name
        self.options = dict(options or {})
        self.label = name + "".join(f"[{k}={v}]" for k, v in self.options.items())
        self.__dict__.update(fields)
        self.block_kind = f"mamba{self.kind}"
        self.inference = name.endswith("Inference")
        self.state_name = f"Mamba{self.kind}State"
        self.session_name = f"Mamba{self.kind}DecodeSession"

    def __repr__(self):
        return self.label

    def _with_options(self, cls):
        return functools.partial(cls, **self.options) if self.options else cls

    @property
    def cls(self):
        """The block class (with the case's options bound)."""
        return self._with_options(getattr(mojolearn, self.name))

    @property
    def sibling(self):
        """The other class of the pair (Block <-> BlockInference), options bound."""
        other = self.name[:-len("Inference")] if self.inference else self.name + "Inference"
        return self._with_options(getattr(mojolearn, other))

    def weights(self, seed=3, d=None):
        return self.maker(d or self.d, seed=seed)

    @functools.cached_property
    def weight_names(self):
        return list(self.weights())

    def block(self, weights=None, **kwargs):
        """A new block (weights: seed 3 by default)."""
        return self.cls(self.weights() if weights is None else weights, **kwargs)

    @functools.cached_property
    def shared(self):
        """One block per case (seed 21) for the bit tests: built once."""
        return self.block(self.weights(seed=21))

    @functools.cached_property
    def arrays(self):
        return tuple(self.block().allocate_state(1)._ARRAYS)

    @functools.cached_property
    def values(self):
        return tuple(self.block().allocate_state(1)._VALUES)

    @property
    def read_arrays(self):
        """The arrays a call on a used state checks."""
        return tuple(n for n in self.arrays if n not in self.unread)

    @property
    def carried(self):
        """The arrays later outputs depend on: one value moved (at the middle
        read position, a state a few tokens into a chunk) moves their bits."""
        return tuple(n for n in self.read_arrays if n not in self.inert)

    def x(self, b=B, l=L, seed=11):
        return random_input(b, l, self.d, seed=seed)

    def read_positions(self, name, shape, tokens):
        """First, middle and last position of state.<name> that a call on a
        state holding `tokens` buffered tokens reads (buffers: the middle
        of the newest row)."""
        last = [s - 1 for s in shape]
        mid = [s // 2 for s in shape]
        if name in self.buffers:
            last[1] = mid[1] = tokens - 1
        return [tuple([0] * len(shape)), tuple(mid), tuple(last)]

    def reports_of(self, block):
        """Copies of the block's reports (none for Mamba-1)."""
        return [np.array(getattr(block, r), copy=True) for r in self.reports]


_M3_BUFFERS = ("buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt", "buffer_sig", "buffer_adt")

_KINDS = [
    dict(kind=1, maker=mamba1_weights, d=20, chunk=32, norm="norm.weight", small_d=8,
         attrs=("d_model", "d_inner", "dt_rank", "weight_format", "numeric_mode",
                "bcdt_rms_eps"),
         params={"weights", "numeric_mode", "bcdt_rms_eps"}, reports=(), buffers=(), unread=(),
         inert=(),
         position=None, ulp_moves=(),
         batch_words=lambda name, rows: (f"state.conv_window has {rows} rows"
                                         if name == "conv_window" else f"state.h {rows}")),
    dict(kind=2, maker=mamba2_weights, d=64, chunk=256, norm="block_norm.weight", small_d=32,
         attrs=("d_model", "d_inner", "nheads", "n_groups", "conv_dim", "dt_limit",
                "weight_format", "numeric_mode"),
         params={"weights", "numeric_mode", "dt_limit", "n_groups"}, reports=("h_last_",),
         buffers=("buffer_xbc", "buffer_dtraw"), unread=(), inert=(),
         position="buffered_tokens", ulp_moves=(), batch_words=lambda name, rows: f"{name} {rows}"),
    dict(kind=3, maker=mamba3_weights, d=64, chunk=64, norm="block_norm.weight", small_d=32,
         attrs=("d_model", "d_inner", "nheads", "d_in_proj", "weight_format", "numeric_mode"),
         params={"weights", "numeric_mode"},
         reports=("h_last_", "k_last_", "v_last_", "theta_last_"), buffers=_M3_BUFFERS,
         unread=("pending_k", "pending_v"), inert=("buffer_qrot",),
         position="buffered_tokens", ulp_moves=(("theta", 1), ("buffer_krot", 2)),
         batch_words=lambda name, rows: f"state.{name} has shape ({rows}, "),
]

CASES = [Case(f"Mamba{k['kind']}{suffix}", **k) for k in _KINDS
         for suffix in ("Block", "BlockInference")]
# Falcon-Mamba: Mamba-1 with the weightless norms of dt, B and C (its own
# kernel stage and backward stage), through every contract.
CASES[2:2] = [Case(f"Mamba1{suffix}", options={"bcdt_rms_eps": 1e-6}, **_KINDS[0])
              for suffix in ("Block", "BlockInference")]
# Mamba-2 with two groups of B and C (Mamba-Codestral has eight): d 128, so
# heads 0, 1 read group 0 and heads 2, 3 group 1, and the gated norm runs
# per group.
CASES[6:6] = [Case(f"Mamba2{suffix}", options={"n_groups": 2},
                   **dict(_KINDS[1], d=128, small_d=64,
                          maker=functools.partial(mamba2_weights, n_groups=2)))
              for suffix in ("Block", "BlockInference")]


# ------------------------------------------------------------ helpers
def at(spec, c):
    """A length or position spelled in chunks: 7, "c", "c-1", "2c+12"."""
    if isinstance(spec, int):
        return spec
    m = re.fullmatch(r"(\d*)c([+-]\d+)?", spec)
    return int(m[1] or 1) * c + int(m[2] or 0)


def as_bytes(buf) -> bytes:
    try:
        return memoryview(buf).tobytes()
    except (TypeError, ValueError):  # a dtype without a buffer format (ml_dtypes)
        return np.asarray(buf).tobytes()


def is_state(obj) -> bool:
    return hasattr(type(obj), "_ARRAYS") and hasattr(type(obj), "_VALUES")


def snapshot(*objs):
    """Bytes of every buffer; a state contributes each array and each value."""
    out = []
    for o in objs:
        if is_state(o):
            out.append(tuple(as_bytes(getattr(o, n)) for n in o._ARRAYS)
                       + tuple(getattr(o, n) for n in o._VALUES))
        else:
            out.append(as_bytes(o))
    return out


def fails(exc, fn, *args, keep=(), match=(), **kwargs):
    """Call fn expecting exc; the message must name every string in match
    (as a whole token, tests/errors.py); every object in keep must keep its
    bytes ("a failed call changes nothing"). Returns the message."""
    before = snapshot(*keep)
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = assert_names(str(info.value), *match)
    assert snapshot(*keep) == before, "a failed call changed a caller buffer"
    return msg


def family_fixtures(make_weights, block_cls, d, batch, length):
    """The module fixtures of a family's own error tests, to assign as
    ``weights, block, x = family_fixtures(...)``: weights (make_weights(d,
    seed=3)) and block (block_cls of them), module-scoped, and x ((batch,
    length, d), seed 11)."""
    @pytest.fixture(scope="module", name="weights")
    def weights_fixture():
        return make_weights(d, seed=3)

    @pytest.fixture(scope="module", name="block")
    def block_fixture(weights):
        return block_cls(weights)

    @pytest.fixture(name="x")
    def x_fixture():
        return random_input(batch, length, d, seed=11)

    return weights_fixture, block_fixture, x_fixture


def filled_state(block, batch=B, tokens=3, seed=5):
    """A state with non-zero contents: allocate_state after a prefill."""
    st = block.allocate_state(batch)
    block.forward(random_input(batch, tokens, block.d_model, seed=seed), st)
    return st


def numpy_state(state):
    """The same state in caller-owned NumPy buffers."""
    return state_with(state, **{n: np.array(getattr(state, n)) for n in state._ARRAYS})


def state_with(state, **arrays):
    """A state of the same class with some arrays replaced (the others are
    the same objects) and the same values."""
    parts = [arrays.get(n, getattr(state, n)) for n in state._ARRAYS]
    return type(state)(*parts, **{n: getattr(state, n) for n in state._VALUES})


def with_value(a, index, value=np.nan):
    """A copy of a with one flat element set."""
    a = np.array(a, copy=True)
    a.reshape(-1)[index] = value
    return a


def steps(block, x, state, t0, t1):
    """block.step over tokens t0..t1-1 of x, concatenated to (B, t1-t0, d)."""
    return np.concatenate([np.asarray(block.step(np.ascontiguousarray(x[:, t]), state))
                           for t in range(t0, t1)], 1)


def _bf16_bits(shape):
    """A uint16 buffer (bfloat16 bit patterns) that declares no dtype."""
    buf = pyarray.array("H", [0x3F80] * int(np.prod(shape)))
    return memoryview(buf).cast("B").cast("H", shape)


def _f64_pyarray(shape):
    buf = pyarray.array("d", [1.0] * int(np.prod(shape)))
    return memoryview(buf).cast("B").cast("d", shape)


# (id, maker(shape) -> buffer, the dtype words the message must give)
BAD_DTYPES = [pytest.param(make, words, id=name) for name, make, words in [
    ("float64", lambda s: np.ones(s, np.float64), ["float64"]),
    ("float16", lambda s: np.ones(s, np.float16), ["float16"]),
    ("uint16-numpy", lambda s: np.full(s, 0x3F80, np.uint16), ["uint16"]),
    ("bf16-bits-buffer", _bf16_bits, ["uint16", "bfloat16"]),
    ("float64-array.array", _f64_pyarray, ["float64"]),
    ("float64-mojolearn.Array", lambda s: mojolearn.Array(s, "float64"), ["float64"]),
    ("float32-bigendian", lambda s: np.ones(s, ">f4"), [">f4"]),
    ("bfloat16-ml_dtypes", lambda s: np.ones(s, ml_dtypes.bfloat16), ["bfloat16"]),
]]
