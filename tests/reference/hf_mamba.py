"""transformers' MambaBlock and Mamba2Block run in verified float64 on the CPU.

These are the references the float32 blocks of ``mojolearn.mamba`` are checked against
(docs/numerics.md, "Mamba-1"; docs/mamba2.md). The block code that runs is transformers' own torch
("slow") path; we only change precision and never re-implement the math, except where
stated below. They are checked against the independent float64 NumPy recurrences of
``mojolearn.reference.mamba1`` / ``mamba2`` (tests/reference/test_references.py).

Making transformers truly float64
---------------------------------
``block.to(torch.float64)`` is not enough: the blocks still compute parts in float32. Read from
transformers 5.x ``models/mamba/modeling_mamba.py``, ``models/mamba2/modeling_mamba2.py``
and ``models/falcon_mamba/modeling_falcon_mamba.py``, the float32 sources are:

1. ``Tensor.float()`` calls: Mamba-1 mixer (since 5.25 its scan step
   ``mamba_scan_forward``: ``A_log.float()``, ``D.float()``, ``dt_proj.bias.float()``),
   ``mamba_selective_scan`` (``B.float()``, ``hidden_states.float()``),
   ``mamba_selective_state_update`` (``dt``, ``A``, ``B``, ``hidden_states``, ``state``); Mamba-2 mixer (``A_log.float()``),
   ``mamba2_chunk_scan`` (``hidden_states``, ``B``, ``C``, ``dt``),
   ``mamba2_selective_state_update`` (``dt``, ``A``); Falcon-Mamba has Mamba-1's and its
   weightless B/C/dt norm computes in ``x.float()`` (cast back with ``type_as``).
2. ``Tensor.to(torch.float32)``: ``MambaRMSNorm``, ``Mamba2RMSNorm`` and
   ``MambaRMSNormGated`` (input and gate) compute in float32.
3. ``residual_in_fp32``: ``MambaBlock``/``Mamba2Block.forward`` cast the residual with
   ``residual.to(torch.float32)``.

Neutralisation: (3) by building the config with ``residual_in_fp32=False``; (1) and (2)
by ``_CastNeutraliser``, a ``torch.overrides.TorchFunctionMode`` active only during the
reference run, which rewrites ``Tensor.float()`` to ``Tensor.double()`` and any
``torch.float32`` dtype argument of ``Tensor.to`` / ``Tensor.type`` to ``torch.float64``
(so transformers' code runs unchanged, just with float64 casts). It counts what it
rewrote (``LAST_RUN["neutralised"]``); it would also cover the residual cast.

Verification: ``_Float64Guard``, a ``torch.utils._python_dispatch.TorchDispatchMode``,
sees every aten op of the run and records any floating-point input or output tensor
whose dtype is not float64. After the run, a non-empty record raises
``Float32LeakError`` listing the ops; a run in which the guard saw no op also raises.
``_neutralise=False`` (private, for the negative-control test) runs transformers as is
(after ``.to(float64)``, with ``residual_in_fp32=True``, no cast rewriting) and must
raise.

Torch path: during the run every kernel entry point of the block's modeling module is
replaced by transformers' own torch function behind it (``_torch_function``: with the
kernels package installed, which transformers 5.25 requires, an entry point is that
package's ``nn.Module`` made from the function; then ``inspect.unwrap`` through the
fallback wrappers), so hub kernels / mamba_ssm / causal_conv1d are never used even if
installed. The entry points
are the module-level functions that transformers routes to those packages
(``kernel_names`` lists them per module and release, ``_KERNEL_NAMES``):

* before 5.25, in all three modules: ``causal_conv1d_fn``, ``causal_conv1d_update``;
  Mamba-1 and Falcon-Mamba also ``mamba_selective_scan``,
  ``mamba_selective_state_update``, ``mamba_inner_fn``; Mamba-2 also
  ``mamba2_chunk_scan``, ``mamba2_selective_state_update``,
  ``mamba2_split_conv1d_scan_combined``;
* since 5.25 the mixers reach the kernels through two replaceable steps, the cached
  convolution ``causal_conv1d_forward`` and the cached scan ``mamba_scan_forward``
  (Mamba-2: ``mamba2_scan_forward``), which join the list; Falcon-Mamba's mixer lost its
  fused ``mamba_inner_fn`` (its dt norm comes before ``dt_proj``, which that kernel cannot
  do), so its list has no such name.

A listed name the module lacks, or a function of the module that transformers routes to
kernels (a module-level ``def`` under a ``use_kernel_...`` decorator in the module's
source, or one wrapping another at run time) and is not listed, raises ``RuntimeError``
naming the transformers version and the function: the reference never silently runs with
a kernel left in place. (Hub kernels for whole layers, such as Falcon-Mamba's
``RMSNorm`` class, apply only to a model passed through ``kernelize``, which the
references never do.) Blocks are in ``eval()`` mode (Mamba-1's and Mamba-2's fused
training-only branch is skipped) and Mamba-1 and Falcon-Mamba use the sequential scan
(``use_mambapy=False``, ``use_associative_scan=False``); 5.25 moved code between
functions but added no float32 cast beyond those of (1)-(3).

Everything runs under ``torch.no_grad()`` on the CPU with the inherited thread count and
is deterministic. Module patching is serialised by a lock.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import re
import threading

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (imported up front: the cache calls mark_static_address)
import transformers
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from transformers import DynamicCache, FalconMambaConfig, Mamba2Config, MambaConfig
from transformers.models.falcon_mamba import modeling_falcon_mamba as _hf_fm
from transformers.models.mamba import modeling_mamba as _hf_m1
from transformers.models.mamba2 import modeling_mamba2 as _hf_m2

from .hf_build import build

__all__ = ["mamba1_reference", "mamba2_reference", "Float32LeakError", "LAST_RUN", "kernel_names",
           "torch_path"]

#: Diagnostics of the most recent reference run: ``{"block", "path", "neutralised"
#: (Counter of rewritten casts), "ops_checked"}``.
LAST_RUN: dict = {}

_LOCK = threading.RLock()

#: The kernel entry points of each modeling module (module-level functions that hub
#: kernels, mamba_ssm or causal_conv1d replace when installed), per module by the first
#: transformers release (major, minor) with that set. See the module docstring.
_CONV = ("causal_conv1d_fn", "causal_conv1d_update")
_M1_SCAN = ("mamba_selective_scan", "mamba_selective_state_update")
_M2_SCAN = ("mamba2_chunk_scan", "mamba2_selective_state_update",
            "mamba2_split_conv1d_scan_combined")
_STEPS_5_25 = ("causal_conv1d_forward",)  # and the module's scan step
_KERNEL_NAMES = {
    _hf_m1.__name__: {(5, 0): _CONV + _M1_SCAN + ("mamba_inner_fn",),
                      (5, 25): _CONV + _M1_SCAN + ("mamba_inner_fn",)
                      + _STEPS_5_25 + ("mamba_scan_forward",)},
    _hf_fm.__name__: {(5, 0): _CONV + _M1_SCAN + ("mamba_inner_fn",),
                      (5, 25): _CONV + _M1_SCAN + _STEPS_5_25 + ("mamba_scan_forward",)},
    _hf_m2.__name__: {(5, 0): _CONV + _M2_SCAN,
                      (5, 25): _CONV + _M2_SCAN + _STEPS_5_25 + ("mamba2_scan_forward",)},
}

_M1_MIXER_NAMES = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
                   "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight")
_M2_MIXER_NAMES = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                   "out_proj.weight")


class Float32LeakError(AssertionError):
    """A tensor op of a float64 reference run had a non-float64 floating-point operand."""


# --------------------------------------------------------------------------- modes
class _CastNeutraliser(TorchFunctionMode):
    """Rewrites float32 casts to float64 casts (Tensor.float, Tensor.to, Tensor.type)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            self.counts["Tensor.float()"] += 1
            return torch.Tensor.double(*args, **kwargs)
        if func is torch.Tensor.to or func is torch.Tensor.type:
            name = "Tensor.to" if func is torch.Tensor.to else "Tensor.type"
            changed = False
            new_args = list(args)
            for i in range(1, len(new_args)):
                if new_args[i] is torch.float32 or (func is torch.Tensor.type and new_args[i] in (
                        "torch.FloatTensor", "torch.float32")):
                    new_args[i] = torch.float64
                    changed = True
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
                changed = True
            if changed:
                self.counts[f"{name}(float32)"] += 1
            return func(*new_args, **kwargs)
        return func(*args, **kwargs)


class _Float64Guard(TorchDispatchMode):
    """Records every aten op whose floating-point inputs or outputs are not float64."""

    def __init__(self):
        super().__init__()
        self.leaks = collections.Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        for where, tree in (("input", (args, kwargs)), ("output", out)):
            for t in tree_leaves(tree):
                if (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                        and t.dtype != torch.float64):
                    self.leaks[f"{func} {where} {t.dtype}"] += 1
        return out


@contextlib.contextmanager
def _patched(module, replacements: dict):
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def kernel_names(module) -> tuple:
    """The kernel entry points of transformers' modeling ``module`` at the installed release.

    Raises ``RuntimeError`` naming the transformers version and the function when a listed
    entry point is missing, or when a function the module routes to kernels (decorated with
    a ``use_kernel_...`` decorator, or wrapping another at run time) is not listed.
    """
    version = transformers.__version__
    table = _KERNEL_NAMES[module.__name__]
    release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    since = max(v for v in table if release >= v)
    names = table[since]
    missing = [n for n in names if not callable(getattr(module, n, None))]
    if missing:
        raise RuntimeError(
            f"transformers {version}: {module.__name__} has no {', '.join(missing)}; the float64 "
            f"reference expects the kernel entry points of transformers >= "
            f"{since[0]}.{since[1]} there (tests/reference/hf_mamba.py, _KERNEL_NAMES)")
    # the functions transformers routes to kernels: decorated for it in the source, or
    # wrapping another at run time (a fallback wrapper, or a kernel package's)
    routed = set(re.findall(r"^@use_kernel_\w+\(.*\)\n(?:@.*\n)*def (\w+)",
                            inspect.getsource(module), re.MULTILINE))
    routed |= {n for n, f in vars(module).items() if inspect.isfunction(f)
               and f.__module__ == module.__name__ and hasattr(f, "__wrapped__")}
    unlisted = sorted(routed - set(names))
    if unlisted:
        raise RuntimeError(
            f"transformers {version}: {module.__name__} has kernel entry points the float64 "
            f"reference does not replace: {', '.join(unlisted)} (tests/reference/hf_mamba.py, "
            f"_KERNEL_NAMES)")
    return names


def _torch_function(entry_point):
    """transformers' own function behind a kernel entry point: through the kernels package's
    function module (an ``nn.Module`` whose forward calls the function it was made from,
    unless ``kernelize`` routed it) and the ``functools.wraps`` wrappers around either."""
    fn = inspect.unwrap(entry_point)
    if isinstance(fn, torch.nn.Module):
        made_from = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if not inspect.isfunction(made_from):
            raise RuntimeError(f"transformers {transformers.__version__}: no function found "
                               f"behind the kernel module {fn!r}")
        fn = inspect.unwrap(made_from)
    return fn


@contextlib.contextmanager
def torch_path(module):
    """Context in which ``module``'s kernel entry points are transformers' own torch functions
    (holds the patching lock)."""
    with _LOCK, _patched(module, {n: _torch_function(getattr(module, n))
                                  for n in kernel_names(module)}):
        yield


@contextlib.contextmanager
def _float64_run(block_name: str, module, neutralise: bool, extra=None):
    """Context of one reference run: torch path forced, casts neutralised, float64 verified."""
    neutraliser = _CastNeutraliser() if neutralise else None
    guard = _Float64Guard()
    report = {"block": block_name, "path": None, "neutralised": collections.Counter(),
              "ops_checked": 0}
    with torch_path(module), _patched(module, extra or {}), torch.no_grad():
        with (neutraliser if neutraliser is not None else contextlib.nullcontext()):
            with guard:
                yield report
    report["ops_checked"] = guard.ops
    if neutraliser is not None:
        report["neutralised"] = neutraliser.counts
    LAST_RUN.clear()
    LAST_RUN.update(report)
    if guard.ops == 0:
        raise Float32LeakError(f"{block_name}: the float64 guard saw no tensor op")
    if guard.leaks:
        listing = "; ".join(f"{k} (x{n})" for k, n in guard.leaks.most_common(20))
        raise Float32LeakError(
            f"{block_name}: {sum(guard.leaks.values())} non-float64 operands in the float64 "
            f"reference run: {listing}")


# --------------------------------------------------------------------------- helpers
def _as64(a, name: str, shape=None) -> torch.Tensor:
    arr = np.asarray(a)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating-point array, got {arr.dtype}")
    arr = np.array(arr, dtype=np.float64, copy=True)  # exact widening of float32
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: non-finite values")
    return torch.from_numpy(arr)


def _conv_weight(w, channels: int) -> torch.Tensor:
    arr = np.asarray(w)
    if arr.shape == (channels, 4):
        arr = arr.reshape(channels, 1, 4)
    return _as64(arr, "conv1d.weight", (channels, 1, 4))


def _check_names(weights: dict, expected) -> None:
    got, want = set(weights), set(expected)
    if got != want:
        raise ValueError(f"weights: missing {sorted(want - got)}, unknown {sorted(got - want)}")


def _x64(x, d: int) -> torch.Tensor:
    t = _as64(x, "x")
    if t.ndim != 3 or t.shape[2] != d or t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"x: expected (B, L, {d}) with B, L >= 1, got {tuple(t.shape)}")
    return t


def _np(t: torch.Tensor) -> np.ndarray:
    assert t.dtype == torch.float64, t.dtype
    return t.detach().cpu().numpy().copy()


# --------------------------------------------------------------------------- Mamba-1
def _mamba1_config(d: int, residual_in_fp32: bool, bcdt_eps=None):
    # bcdt_eps: Falcon-Mamba (FalconMambaConfig: the mixer's weightless RMS
    # norms of B, C and dt, with eps mixer_rms_eps)
    common = dict(
        hidden_size=d, state_size=16, expand=2, conv_kernel=4, time_step_rank=math.ceil(d / 16),
        use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, hidden_act="silu",
        use_mambapy=False, use_associative_scan=False, residual_in_fp32=residual_in_fp32,
        num_hidden_layers=1)
    if bcdt_eps is None:
        return MambaConfig(**common)
    return FalconMambaConfig(mixer_rms_eps=float(bcdt_eps), **common)


def _mamba1_block(weights: dict, residual_in_fp32: bool, bcdt_eps=None):
    names = ("norm.weight",) + _M1_MIXER_NAMES
    _check_names(weights, names)
    d = int(np.asarray(weights["norm.weight"]).shape[0])
    di, R = 2 * d, math.ceil(d / 16)
    shapes = {"norm.weight": (d,), "in_proj.weight": (2 * di, d), "conv1d.bias": (di,),
              "x_proj.weight": (R + 32, di), "dt_proj.weight": (di, R), "dt_proj.bias": (di,),
              "A_log": (di, 16), "D": (di,), "out_proj.weight": (d, di)}
    state = {("norm.weight" if k == "norm.weight" else f"mixer.{k}"): _as64(weights[k], k, s)
             for k, s in shapes.items()}
    state["mixer.conv1d.weight"] = _conv_weight(weights["conv1d.weight"], di)
    cfg = _mamba1_config(d, residual_in_fp32, bcdt_eps)
    cls = _hf_m1.MambaBlock if bcdt_eps is None else _hf_fm.FalconMambaBlock
    block = build(cls, cfg, layer_idx=0, seed=0).to(torch.float64).eval()
    block.load_state_dict(state, strict=True)
    if bcdt_eps is not None:
        mixer = block.mixer
        # the norm module's eps attribute: variance_epsilon since transformers
        # 5.25, eps before
        norm = mixer.b_layernorm
        norm_eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
        assert mixer.rms_eps == bcdt_eps and norm_eps == bcdt_eps
    for p in block.parameters():
        assert p.dtype == torch.float64
    return block, cfg, d, di


def mamba1_reference(weights: dict, x, conv_state=None, ssm_state=None, *, bcdt_rms_eps=None,
                     _neutralise: bool = True):
    """transformers' ``MambaBlock.forward`` in verified float64 (with
    ``bcdt_rms_eps``: ``FalconMambaBlock.forward``, whose mixer applies
    weightless RMS norms with that eps to dt, B and C after x_proj).

    Parameters
    ----------
    weights : dict of str to array
        Mamba1Block weights (names of ``mojolearn.reference.weights.mamba1_weights``);
        loaded as ``norm.weight`` and ``mixer.<name>``, widened exactly to float64.
    x : array (B, L, d)
        float32 input, converted exactly to float64.
    conv_state : array (B, 2d, 4) or None
        Last four pre-convolution ``hid`` rows, oldest first (transformers' conv-state
        layout, and ``Mamba1State.conv_window``).
    ssm_state : array (B, 2d, 16) or None
        SSM state ``h``.

    Returns
    -------
    y : float64 ndarray (B, L, d), residual included
    conv_state : float64 ndarray (B, 2d, 4), after the last token
    ssm_state : float64 ndarray (B, 2d, 16), after the last token

    How the state is carried
    ------------------------
    * No state given (both None): one multi-token prefill ``block(x, cache=cache)`` with a
      fresh ``DynamicCache(config=cfg)``; transformers' full-sequence path (causal conv,
      sequential selective scan from zero) writes the final conv window and SSM state into
      the cache, which we return.
    * A state given (a missing one is zeros): transformers' cache cannot continue a
      *multi-token* call from a carried SSM state: with ``seq_len > 1`` the mixer runs
      ``mamba_selective_scan``, which always starts from a zero SSM state (only the conv
      window is continued). So we load the states into a fresh ``DynamicCache``
      (``update_conv_state`` / ``update_recurrent_state``) and step token by token
      (``block(x[:, t:t+1], cache=cache)``), i.e. transformers' cached decode path
      (``causal_conv1d_update`` + ``mamba_selective_state_update``).
    """
    neutral = bool(_neutralise)
    block, cfg, d, di = _mamba1_block(weights, residual_in_fp32=not neutral,
                                      bcdt_eps=bcdt_rms_eps)
    module, name = (_hf_m1, "MambaBlock") if bcdt_rms_eps is None else (_hf_fm, "FalconMambaBlock")
    x64 = _x64(x, d)
    B, L, _ = x64.shape
    carried = conv_state is not None or ssm_state is not None
    if carried:
        cs = _as64(conv_state, "conv_state", (B, di, 4)) if conv_state is not None \
            else torch.zeros(B, di, 4, dtype=torch.float64)
        ss = _as64(ssm_state, "ssm_state", (B, di, 16)) if ssm_state is not None \
            else torch.zeros(B, di, 16, dtype=torch.float64)
    with _float64_run(name, module, neutral) as report:
        cache = DynamicCache(config=cfg)
        if not carried:
            report["path"] = "prefill"
            y = block(x64, cache=cache)
        else:
            report["path"] = "stepped"
            cache.update_conv_state(cs, 0, conv_kernel_size=4)
            cache.update_recurrent_state(ss, 0)
            y = torch.cat([block(x64[:, t:t + 1], cache=cache) for t in range(L)], dim=1)
        conv_out = cache.get_conv_state(0).clone()
        ssm_out = cache.get_recurrent_state(0).clone()
    assert y.shape == (B, L, d) and conv_out.shape == (B, di, 4) and ssm_out.shape == (B, di, 16)
    return _np(y), _np(conv_out), _np(ssm_out)


# --------------------------------------------------------------------------- Mamba-2
def _check_dt_limit(dt_limit):
    try:
        lo, hi = dt_limit
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be two numbers, got {dt_limit!r}") from None
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise ValueError(f"dt_limit must be two numbers, got {dt_limit!r}")
    lo, hi = float(lo), float(hi)
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy lo <= hi without NaN, got {dt_limit!r}")
    return lo, hi


def _mamba2_config(d: int, dt_limit, residual_in_fp32: bool, n_groups: int = 1) -> Mamba2Config:
    return Mamba2Config(
        hidden_size=d, num_heads=(2 * d) // 64, head_dim=64, state_size=128, n_groups=n_groups,
        expand=2,
        conv_kernel=4, chunk_size=256, use_bias=False, use_conv_bias=True, hidden_act="silu",
        layer_norm_epsilon=1e-5, norm_before_gate=False, rms_norm=True,
        time_step_limit=tuple(dt_limit), residual_in_fp32=residual_in_fp32, num_hidden_layers=1)


def _mamba2_block(weights: dict, dt_limit, residual_in_fp32: bool, n_groups: int = 1):
    names = ("block_norm.weight", "norm.weight") + _M2_MIXER_NAMES
    _check_names(weights, names)
    d = int(np.asarray(weights["block_norm.weight"]).shape[0])
    if d < 32 or d % 32:
        raise ValueError(f"Mamba-2 needs d_model a multiple of 32, got {d}")
    di = 2 * d
    H, CD = di // 64, di + 256 * n_groups
    shapes = {"in_proj.weight": (di + CD + H, d), "conv1d.bias": (CD,), "dt_bias": (H,),
              "A_log": (H,), "D": (H,), "out_proj.weight": (d, di)}
    state = {f"mixer.{k}": _as64(weights[k], k, s) for k, s in shapes.items()}
    state["mixer.conv1d.weight"] = _conv_weight(weights["conv1d.weight"], CD)
    state["norm.weight"] = _as64(weights["block_norm.weight"], "block_norm.weight", (d,))
    state["mixer.norm.weight"] = _as64(weights["norm.weight"], "norm.weight", (di,))
    cfg = _mamba2_config(d, dt_limit, residual_in_fp32, n_groups)
    block = build(_hf_m2.Mamba2Block, cfg, layer_idx=0, seed=0).to(torch.float64).eval()
    block.load_state_dict(state, strict=True)
    for p in block.parameters():
        assert p.dtype == torch.float64
    assert block.mixer.chunk_size == 256 and block.mixer.n_groups == n_groups
    assert block.mixer.norm.group_size == di // n_groups
    return block, cfg, d, di, H


def mamba2_reference(weights: dict, x, initial_h=None, dt_limit=(0.0, math.inf), *,
                     n_groups: int = 1, _neutralise: bool = True):
    """transformers' ``Mamba2Block.forward`` (torch_forward path) in verified float64.

    Parameters
    ----------
    weights : dict of str to array
        Mamba2Block weights (names of ``mojolearn.reference.weights.mamba2_weights``).
        ``block_norm.weight`` is loaded as the block's ``norm.weight``, our ``norm.weight``
        (the gated norm) as ``mixer.norm.weight``, the rest as ``mixer.<name>``; widened
        exactly to float64.
    x : array (B, L, d), d a multiple of 32
    initial_h : array (B, H, 64, 128) or None
        Initial SSM states (zeros if None). The conv window always starts at zeros.
    dt_limit : (lo, hi)
        transformers' ``time_step_limit``: dt = clamp(softplus(dtraw + dt_bias), lo, hi).
    n_groups : int
        transformers' ``n_groups`` (groups of B and C; the gated norm's group size is
        d_inner / n_groups).

    Returns
    -------
    y : float64 ndarray (B, L, d), residual included
    h_last : float64 ndarray (B, H, 64, 128), the SSM state after the last token (the
        ``final_state`` of the chunk scan; the zero-padded tail rows have dt = 0 and leave
        it unchanged).

    How initial states enter
    ------------------------
    The block is called without a cache, so the mixer always takes the chunked SSD path
    (``mamba2_chunk_scan``, chunk 256), for every L including 1. ``initial_h`` is passed
    as that torch function's own ``initial_states`` argument and ``h_last`` is its
    ``final_state`` (``return_final_states=True``); we do this with a thin wrapper around
    transformers' unmodified ``mamba2_chunk_scan`` that only sets these two arguments.
    We do not load ``initial_h`` through ``DynamicCache``: with a cached state and
    ``seq_len == 1`` transformers switches to ``mamba2_selective_state_update``, which
    ignores ``time_step_limit`` (no clamp), unlike the chunk path and our Mamba-2 (docs/mamba2.md).
    """
    lo, hi = _check_dt_limit(dt_limit)
    neutral = bool(_neutralise)
    block, cfg, d, di, H = _mamba2_block(weights, (lo, hi), residual_in_fp32=not neutral,
                                         n_groups=n_groups)
    x64 = _x64(x, d)
    B, L, _ = x64.shape
    h0 = _as64(initial_h, "initial_h", (B, H, 64, 128)) if initial_h is not None else None

    kernel_names(_hf_m2)  # the module's entry points checked before one is used here
    chunk_scan = _torch_function(_hf_m2.mamba2_chunk_scan)
    finals = []

    def chunk_scan_with_states(*args, initial_states=None, return_final_states=False, **kwargs):
        if initial_states is not None:
            raise AssertionError("unexpected cache-provided initial_states")
        out, final = chunk_scan(*args, initial_states=h0, return_final_states=True, **kwargs)
        finals.append(final)
        return (out, final) if return_final_states else out

    def no_recurrent_step(*args, **kwargs):
        raise AssertionError("mamba2_selective_state_update must not run in the reference")

    extra = {"mamba2_chunk_scan": chunk_scan_with_states,
             "mamba2_selective_state_update": no_recurrent_step}
    with _float64_run("Mamba2Block", _hf_m2, neutral, extra) as report:
        report["path"] = "chunk_scan"
        y = block(x64)
    assert len(finals) == 1, len(finals)
    h_last = finals[0]
    assert y.shape == (B, L, d) and h_last.shape == (B, H, 64, 128)
    return _np(y), _np(h_last)
