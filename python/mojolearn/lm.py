"""mojolearn.MambaLM: a whole Mamba language model on the kernels.

The embedding lookup, the blocks, the final RMSNorm, the LM head and the
choice of the next token all run in the binary (the vocabulary ends:
mojo/mojolearn_kernels/lm.mojo), so a row's logits and tokens are a pure
function of its own tokens: the same bits alone or in any batch, prefill or
token by token. Generation and continuous batching: mojolearn.generate.
"""
from __future__ import annotations

from array import array as _pyarray

from . import _abi, _intake

from .lowbit import FORMATS as WEIGHT_FORMATS, FORMAT_IDS, _common_format

PREPARE_ROWS = 4096  # vocabulary rows packed per call when read from a file (a multiple of 16)


class MambaLM:
    """A Mamba, Mamba-2 or Mamba-3 language model.

    Parameters
    ----------
    source : str, os.PathLike or mojolearn.checkpoints.Checkpoint
        A checkpoint folder (transformers' or mamba_ssm's layout, see
        docs/checkpoints.md), a llama.cpp GGUF file (a path ending in
        .gguf), a Hub id "org/name", or a ``load_checkpoint`` result.
    weight_format : {None, 'float32', 'bfloat16', 'int8', 'q4_0', 'q8_0'}, default None
        Format of every projection, the embedding and the LM head
        (mojolearn.lowbit: the kernels widen packed weights exactly, so the
        model computes on the rounded values). None keeps each weight as the
        checkpoint stores it: float32, except a GGUF file's q4_0 / q8_0
        matrices, which stay packed; 'float32' expands those exactly.
    numeric_mode : {'identical', 'fast'}, default 'identical'
    download : bool, default False
        For a Hub id "org/name" not in huggingface_hub's cache: download it
        (see ``load_checkpoint``).

    Attributes
    ----------
    kind : {'mamba', 'mamba2', 'mamba3'}
    d_model, n_layers, vocab_size : int
    tied : bool
        Whether the LM head is the embedding (one copy is kept).
    eos_token_ids : tuple of int
        The checkpoint's end-of-sequence ids (empty if it names none):
        generation stops at them unless given other ``stop_tokens``.
    blocks : list of Mamba1Block, Mamba2Block or Mamba3Block
    weight_format : str
        The format the weights are kept in: one of mojolearn.lowbit's
        formats, or 'mixed' (a GGUF file whose x_proj and dt_proj are
        float32 beside q4_0 matrices, for one).

    Notes
    -----
    Thread safety: ``logits`` may be called from several threads at once;
    a Batcher (``batcher()``) must be driven by one thread.

    Examples
    --------
    >>> lm = mojolearn.MambaLM(lm_folder)           # a checkpoint folder
    >>> tokens = lm.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
    >>> [len(t) for t in tokens]
    [4, 4]
    >>> lm.logits([[1, 2, 3]]).shape
    (1, 3, 64)
    """

    def __init__(self, source, *, weight_format=None,
                 numeric_mode: str = "identical", download: bool = False, **unknown):
        from .checkpoints import Checkpoint, load_checkpoint
        from .mamba._base import check_numeric_mode
        from ._loader import library
        for name in unknown:
            if name in ("dtype", "torch_dtype"):
                raise TypeError(f"MambaLM() takes no {name!r} (a transformers argument): use "
                                f"weight_format= ({', '.join(map(repr, WEIGHT_FORMATS))})")
            raise TypeError(f"MambaLM() got an unexpected keyword argument {name!r}")
        if weight_format is not None and weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {list(WEIGHT_FORMATS)}, "
                             f"got {weight_format!r}")
        self.numeric_mode = check_numeric_mode(numeric_mode)
        owned = not isinstance(source, Checkpoint)
        # A folder is read lazily: layer by layer and the vocabulary in row
        # ranges, each dropped once packed, so the model is not held twice.
        ck = source if not owned else load_checkpoint(source, lazy=True, download=download)
        self.kind = ck.kind
        self.d_model = ck.d_model
        self.n_layers = ck.n_layers
        self.vocab_size = ck.vocab_size
        self.tied = bool(ck.tie_word_embeddings)
        self.eos_token_ids = _eos_ids(getattr(ck, "eos_token_ids", ()))
        self._lib = library(self.numeric_mode)
        self.blocks = []
        for i in range(ck.n_layers):
            self.blocks.append(ck.block(i, weight_format=weight_format, numeric_mode=numeric_mode))
            if owned:
                ck.layers[i] = None
        self._blob, formats = self._prepare(ck, weight_format)
        for i, block in enumerate(self.blocks):
            formats.update({f"layers.{i}.{n}": f for n, f in block.weight_formats.items()})
        self.weight_format = _common_format(formats)  # one format, or 'mixed'
        if owned:
            from ._loader import native
            del ck
            native().release_free_memory()  # the pieces read from the file

    def __repr__(self):
        return (f"MambaLM(kind={self.kind!r}, d_model={self.d_model}, "
                f"n_layers={self.n_layers}, vocab_size={self.vocab_size}, "
                f"weight_format={self.weight_format!r})")

    # -- the vocabulary ends ----------------------------------------------
    def _prepare(self, ck, weight_format):
        """(blob, {matrix name: format}): the blob of the final norm weight
        and the vocabulary panels, packed in row ranges of PREPARE_ROWS (read
        from the file range by range when the checkpoint is lazy)."""
        from ._array import Array
        from .checkpoints import LazyTensor, _loaded
        from .lowbit import is_packed
        d, v = self.d_model, self.vocab_size
        norm = _intake.float32_view(_loaded(ck.final_norm), "norm_f.weight", ndim=(1,))
        _intake.check_finite(self._lib, norm)
        mats = {"lm_head.weight": ck.lm_head}
        if not self.tied:
            mats["embeddings.weight"] = ck.embeddings
        for name, value in mats.items():
            shape = tuple(value.shape) if isinstance(value, LazyTensor) or is_packed(value) else \
                _intake.float32_view(value, name, ndim=(2,)).shape
            if shape != (v, d):
                raise ValueError(f"{name} must have shape ({v}, {d}), got {shape}")
        op = _abi.OP_LM_PREPARE
        spec = _abi.op_spec(self._lib, op)
        blob = None
        # row ranges when read from the file (an in-memory packed matrix is
        # handed over whole)
        step = PREPARE_ROWS if any(isinstance(m, LazyTensor) for m in mats.values()) \
            and not any(is_packed(m) for m in mats.values()) else v
        for r0 in range(0, v, step):
            r1 = min(v, r0 + step)
            named, keep = {"norm_f.weight": norm.address}, []
            for name, value in mats.items():
                w = self._rows(value, name, r0, r1, weight_format)
                keep.append(w)
                named[name], named[f"exp:{name}"] = _addresses(w)
            formats = {n: w.format if is_packed(w) else "float32" for n, w in zip(mats, keep)}
            # the formats word (lm.mojo): the head's format, then the embedding's
            ids = [FORMAT_IDS[f] for f in formats.values()]
            wfmt = ids[0] | ids[-1] << 4  # tied: the head's twice
            args = spec.pack(named, d=d, vocab=v, wfmt=wfmt, row0=r0, nrows=r1 - r0)
            if blob is None:
                blob = Array((self._lib.workspace_bytes(op, args) // 4,), zero=True)
            args[spec.slot("blob")] = blob.address
            self._lib.run(op, args)
        return blob, formats

    def _rows(self, value, name, r0, r1, weight_format):
        """Rows [r0, r1) of a vocabulary matrix, checked, in weight_format
        (None: as stored; a float32 view or a PackedWeight)."""
        from .checkpoints import LazyTensor
        from .lowbit import is_packed, pack_one
        if isinstance(value, LazyTensor):
            value = value.rows(r0, r1)
        if is_packed(value):
            if weight_format is None:
                return value  # as the file stores it (its scales checked when made)
            value = value.to_float32()
        w = _intake.float32_view(value, name, ndim=(2,))  # (in memory: all rows at once)
        if weight_format not in (None, "float32"):
            return pack_one(w.mv, weight_format, name)  # checks finiteness
        _intake.check_finite(self._lib, w)
        return w

    def check_tokens(self, tokens, name: str = "tokens") -> list:
        """tokens as a list of ints, each in [0, vocab_size); ValueError
        naming `name`, the position and the id otherwise (TypeError for a
        non-integer)."""
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise TypeError(f"{name} must be a sequence of token ids, got "
                            f"{type(tokens).__name__}")
        out = []
        v = self.vocab_size
        for i, t in enumerate(tokens):
            t = _intake.as_int(t, f"{name}[{i}]")
            if not 0 <= t < v:
                raise ValueError(f"{name}[{i}] = {t} is not a token id of this model "
                                 f"(vocab_size {v})")
            out.append(t)
        if not out:
            raise ValueError(f"{name} is empty: give at least one token id")
        return out

    def embed(self, tokens):
        """Embedding rows of a (B, L) grid of token ids (equal-length rows):
        a float32 mojolearn.Array (B, L, d_model)."""
        rows = self._grid(tokens)
        ids = [t for r in rows for t in r]
        x = self._embed_ids(ids)
        return x.reshape((len(rows), len(rows[0]), self.d_model))

    def _grid(self, tokens) -> list:
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or not len(tokens):
            raise ValueError("tokens must be a non-empty (B, L) grid of token ids")
        rows = [self.check_tokens(r, f"tokens[{i}]") for i, r in enumerate(tokens)]
        if any(len(r) != len(rows[0]) for r in rows):
            raise ValueError("tokens must have rows of one length (pad them and pass "
                             "lengths= for rows of different lengths)")
        return rows

    def embed_ids(self, ids):
        """Embedding rows of a flat sequence of token ids.

        Parameters
        ----------
        ids : sequence of int
            Each in [0, vocab_size) (checked; IndexError-free: a bad id is a
            ValueError naming ``ids``).

        Returns
        -------
        mojolearn.Array, float32 (len(ids), d_model)
        """
        try:
            arr = _pyarray("q", ids)
        except (TypeError, OverflowError) as e:
            raise TypeError(f"ids must be a sequence of int token ids ({e})") from None
        if not len(arr):
            raise ValueError("ids is empty: give at least one token id")
        lo, hi = min(arr), max(arr)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"ids holds {bad}, not a token id of this model "
                             f"(vocab_size {self.vocab_size})")
        return self._embed_ids(arr)

    def _embed_ids(self, ids):
        """(n, d) float32 rows for checked token ids."""
        from ._array import Array
        from ._loader import native
        toks = ids if isinstance(ids, _pyarray) else _pyarray("q", ids)
        x = Array((len(ids), self.d_model), zero=False)
        op = _abi.OP_LM_EMBED
        self._lib.run(op, _abi.op_spec(self._lib, op).pack(
            n=len(ids), d=self.d_model, vocab=self.vocab_size,
            tokens=native().address(memoryview(toks)), blob=self._blob, x=x))
        return x

    def head_logits(self, hidden):
        """The logits of hidden rows: final RMSNorm and the LM head, row by
        row (a row's logits do not depend on the other rows).

        Parameters
        ----------
        hidden : float32 buffer, C-contiguous, last dimension d_model
            Last-layer outputs (as ``forward_tokens`` or a ``RowDecoder``
            step gives them); every leading dimension counts as rows.

        Returns
        -------
        mojolearn.Array, float32 (rows, vocab_size)
        """
        v = _intake.float32_view(hidden, "hidden", contiguous_only=True)
        if not v.shape or v.shape[-1] != self.d_model:
            raise ValueError(f"hidden must have last dimension d_model = {self.d_model}, "
                             f"got shape {v.shape}")
        rows = v.mv.nbytes // (4 * self.d_model)
        if not rows:
            raise ValueError("hidden has no rows")
        out = self._head(v.address, rows)
        del v  # (the buffer stayed alive through the call)
        return out

    def _head(self, x_address: int, rows: int):
        """Logits (rows, V) of `rows` consecutive (d,) rows at x_address."""
        from ._array import Array
        from .mamba._base import workspace_floats
        out = Array((rows, self.vocab_size), zero=False)
        op = _abi.OP_LM_LOGITS
        spec = _abi.op_spec(self._lib, op)
        args = spec.pack(rows=rows, d=self.d_model, vocab=self.vocab_size, x=x_address,
                         blob=self._blob, logits=out)
        work = Array((workspace_floats(self._lib, op, args),), zero=False)
        args[spec.slot("work")] = work.address
        self._lib.run(op, args)
        return out

    def next_tokens(self, logits, temperature, top_k, top_p, u) -> list:
        """The next token of each row of logits (R, V) (lm.mojo's rule): per
        row a temperature (0: greedy), top_k (0: no cut), top_p (1: no cut)
        and a uniform number u in [0, 1)."""
        from ._array import Array
        from ._loader import native
        r = len(u)
        nat = native()
        temps = _pyarray("f", temperature)
        ks = _pyarray("q", top_k)
        ps = _pyarray("f", top_p)
        us = _pyarray("f", u)
        out = _pyarray("q", [0] * r)
        op = _abi.OP_LM_NEXT
        spec = _abi.op_spec(self._lib, op)
        args = spec.pack(rows=r, vocab=self.vocab_size, logits=logits,
                         temperature=nat.address(memoryview(temps)),
                         top_k=nat.address(memoryview(ks)), top_p=nat.address(memoryview(ps)),
                         u=nat.address(memoryview(us)),
                         tokens=nat.address(memoryview(out), True))
        # only sampled rows use the workspace (their candidate ids): a
        # greedy step allocates nothing
        work = None
        if any(t > 0 for t in temperature):
            work = Array((max(1, self._lib.workspace_bytes(op, args) // 4),), zero=False)
        args[spec.slot("work")] = work.address if work is not None else 0
        self._lib.run(op, args)
        return list(out)

    # -- scoring ----------------------------------------------------------
    def logits(self, tokens, *, lengths=None):
        """Logits of every position of a (B, L) grid of token ids.

        Parameters
        ----------
        tokens : (B, L) nested sequence or 2-D integer array
        lengths : sequence of int or None
            Ragged rows: B ints in [1, L]; positions past a row's length are
            padding (their tokens must still be valid ids; their logits are
            those of an all-zero hidden row and mean nothing).

        Returns
        -------
        mojolearn.Array, float32 (B, L, vocab_size)
            Row b, position t: the logits of the token after tokens[b][:t+1].
        """
        x = self.embed(tokens)
        b, l, _ = x.shape
        for block in self.blocks:
            x = block.forward(x, lengths=lengths)
        return self._head(x.address, b * l).reshape((b, l, self.vocab_size))

    # -- state ------------------------------------------------------------
    def allocate_state(self, batch_size: int = 1) -> list:
        """A zero state of every layer (a list of block states)."""
        return [blk.allocate_state(batch_size) for blk in self.blocks]

    def forward_tokens(self, tokens, state) -> "object":
        """Run a (B, L) grid of token ids through the blocks with the state
        carried (updated in place); returns the last layer's outputs (B, L, d)."""
        if len(state) != self.n_layers:
            raise ValueError(f"state must hold {self.n_layers} layer states, got {len(state)}")
        x = self.embed(tokens)
        for block, st in zip(self.blocks, state):
            x = block.forward(x, st)
        return x

    # -- the engine interface: rows decoded together ----------------------
    def row_position(self, states) -> int:
        """The chunk position (buffered tokens) of a batch-1 model state: the
        value a row of it takes in ``open_rows`` (0 for Mamba-1). ValueError
        if its Mamba-3 input states are pending."""
        from .row_decode import row_position
        return row_position(self._check_states(states, "states"))

    def open_rows(self, states, positions, *, cache: bool = True):
        """Start decoding rows together: a mojolearn.row_decode.RowDecoder
        over `states` (one per layer, B rows each) with each row at its own
        chunk position (``positions``, B ints). Close it before the states
        are used otherwise. cache: whether its decode sessions keep their
        speed cache (``session_cache_bytes(B)`` bytes; the same bits
        either way)."""
        from .mamba.sessions import DecodeSessionBase
        from .row_decode import RowDecoder
        cache = DecodeSessionBase._check_cache(cache)
        states = self._check_states(states, "states")
        positions = [_intake.as_int(p, f"positions[{i}]") for i, p in enumerate(positions)]
        return RowDecoder(self, states, positions, cache=cache)

    def session_cache_bytes(self, rows: int = 1) -> int:
        """Bytes of the decode sessions' speed caches of ``rows`` rows
        decoded together, all layers (what ``open_rows(..., cache=True)``
        allocates on top of the states; 0 for Mamba-3, whose sessions keep
        none). Mamba-1: each session's workspace, which holds its rows'
        state in the kernel's layout between steps; Mamba-2: copies of
        state values laid out for the one-token step.

        Examples
        --------
        >>> lm = mojolearn.MambaLM(lm_folder)  # a Mamba-1 model
        >>> lm.session_cache_bytes(8) > lm.session_cache_bytes(1) > 0
        True
        """
        rows = _intake.as_int(rows, "rows")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        return sum(blk._session_cache_bytes(rows) for blk in self.blocks)

    def restack_states(self, parts, *, consume: bool = False) -> list:
        """A new model state of len(parts) rows: row i is row r of the model
        state s for the i-th pair (s, r) of parts (a state may appear in
        several pairs). The plain values (positions) are the first state's:
        rows at their own positions keep them outside the state
        (``open_rows``). consume=True drops each source layer state (sets it
        to None in its list) once copied, so at most one layer is held twice."""
        from .mamba._state import check_not_held
        from .row_decode import restack_rows
        if not parts:
            raise ValueError("parts is empty: give at least one (state, row) pair")
        for i, (states, r) in enumerate(parts):
            self._check_states(states, f"parts[{i}]")
            rows = memoryview(getattr(states[0], type(states[0])._ARRAYS[0])).shape[0]
            if not 0 <= _intake.as_int(r, f"parts[{i}] row") < rows:
                raise ValueError(f"parts[{i}]: row {r} is outside the state's {rows} rows")
            for st in states:
                check_not_held(st)
        return restack_rows(self.blocks, parts, consume)

    def check_state(self, state, name: str = "state", *, batch=None) -> list:
        """Validate a model state (a list of n_layers block states) as the
        blocks do before a call: each layer's class, array shapes, rows
        (``batch`` of them, if given), positions and finite values, and not
        held by an open decode session. Returns it as a list; TypeError or
        ValueError naming ``name[i]`` otherwise."""
        self._check_states(state, name)
        for i, (blk, st) in enumerate(zip(self.blocks, state)):
            try:
                rows = batch if batch is not None else \
                    memoryview(getattr(st, type(st)._ARRAYS[0])).shape[0]
                blk._state_views(st, rows)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}[{i}]: {e}") from None
        return list(state)

    def _check_states(self, states, name):
        """states as a list of n_layers states of the layers' classes (the
        cheap part of check_state: what the engine calls check at each
        regroup)."""
        if not isinstance(states, (list, tuple)):
            raise TypeError(f"{name} must be a list of {self.n_layers} layer states "
                            f"(as allocate_state gives), got {type(states).__name__}")
        if len(states) != self.n_layers:
            raise ValueError(f"{name} must hold {self.n_layers} layer states, got {len(states)}")
        for i, (blk, st) in enumerate(zip(self.blocks, states)):
            try:
                blk._check_state_type(st)
            except TypeError as e:
                raise TypeError(f"{name}[{i}]: {e}") from None
        return states

    # -- generation -------------------------------------------------------
    def batcher(self, *, keep_logits: bool = False, prefill_chunk=256, prefix_cache_bytes=0,
                max_rows=None, session_cache="auto", session_cache_budget=None):
        """A continuous-batching engine over this model
        (mojolearn.generate.Batcher, which describes the arguments)."""
        from .generate import Batcher
        return Batcher(self, keep_logits=keep_logits, prefill_chunk=prefill_chunk,
                       prefix_cache_bytes=prefix_cache_bytes, max_rows=max_rows,
                       session_cache=session_cache,
                       session_cache_budget=session_cache_budget)

    def generate(self, prompts, *, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, stop_tokens=None, stream=None, return_logits: bool = False,
                 prefill_chunk=None, **unknown):
        """Generate from a batch of prompts (mojolearn.generate.generate
        describes the arguments)."""
        from .generate import generate
        return generate(self, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens,
                        stream=stream, return_logits=return_logits,
                        prefill_chunk=prefill_chunk, **unknown)


def _addresses(w) -> tuple:
    """(values or codes, int8 exponents or 0) of a float32 view or PackedWeight."""
    from .lowbit import is_packed
    if is_packed(w):
        return w.data.address, (w.exponents.address if w.exponents is not None else 0)
    return w.address, 0


def _eos_ids(value) -> tuple:
    """The checkpoint's end-of-sequence ids as a tuple of ints (one id or
    a list of them; None or nothing: ())."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return tuple(_intake.as_int(t, f"eos_token_ids[{i}]") for i, t in enumerate(value))
