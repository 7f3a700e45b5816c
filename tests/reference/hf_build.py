"""The one way the tests make transformers modules: seeded, fully initialised, checked.

transformers creates some parameters with ``torch.empty`` and leaves them to an
initialisation that only a whole ``PreTrainedModel`` runs (its ``post_init``): a bare
``MambaBlock`` never initialises its mixer's ``A_log`` and ``D``. A test that reads them
reads whatever the allocator left there, a failure on some runs and machines only.

``build`` makes a module

1. after ``torch.manual_seed(seed)`` (the module's own random draws are reproducible),
2. with every floating ``torch.empty`` / ``empty_like`` / ``new_empty`` /
   ``empty_strided`` result of its construction filled with NaN (``_poisoned_empty``), so
   a tensor no initialisation writes is NaN on every run, not by chance,
3. running the module's own initialisation of its Mamba mixers where transformers'
   whole-model initialisation would (``init_mamba_weights`` / ``init_mamba2_weights``, for
   a module that is not a ``PreTrainedModel``: a ``PreTrainedModel`` initialised itself),

then checks every parameter and buffer (``check_finite``): a non-finite value raises
``NonFiniteTensorError`` naming the tensor. ``load`` is ``from_pretrained`` (with hub kernels off) with the
same check. tests/test_hf_build.py holds the guards: no test file builds a transformers module
another way, and an uninitialised block is refused.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["build", "load", "check_finite", "NonFiniteTensorError", "OWN_INIT"]

#: Methods that initialise a mixer's S4D parameters (transformers' ``_init_weights``
#: calls them for every mixer of a whole model).
OWN_INIT = ("init_mamba_weights", "init_mamba2_weights", "init_falcon_mamba_weights")

_EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class NonFiniteTensorError(AssertionError):
    """A tensor of a transformers module built for the tests holds NaN or inf."""


class _poisoned_empty(TorchFunctionMode):
    """Fills the floating results of the torch.empty family with NaN."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                out.fill_(float("nan"))
        return out


def check_finite(module, label: str = "module"):
    """module, after checking that every parameter and buffer is finite.

    Raises
    ------
    NonFiniteTensorError
        Naming the first non-finite tensor, its count and first flat index.
    """
    named = list(module.named_parameters()) + list(module.named_buffers())
    if not named:
        raise NonFiniteTensorError(f"{label}: no tensor to check")
    for name, t in named:
        if t.is_floating_point() or t.is_complex():
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                first = int(torch.nonzero(bad.reshape(-1))[0])
                raise NonFiniteTensorError(
                    f"{label}: {name} holds {int(bad.sum())} non-finite values of "
                    f"{t.numel()} (first at flat index {first}): uninitialised?")
    return module


def build(cls, *args, seed: int, _own_init: bool = True, **kwargs):
    """cls(*args, **kwargs), a transformers module, made deterministic and checked.

    Parameters
    ----------
    cls : type
        A transformers ``nn.Module`` class (a block, a mixer or a whole model).
    seed : int
        ``torch.manual_seed`` before construction (the global generator is left where
        the construction leaves it, so later draws of the test are reproducible too).
    _own_init : bool
        False only for the guard's negative control: skip the mixers' initialisation.
    """
    from transformers import PreTrainedModel
    torch.manual_seed(seed)
    with _poisoned_empty():
        module = cls(*args, **kwargs)
        if _own_init and not isinstance(module, PreTrainedModel):
            with torch.no_grad():
                for sub in module.modules():
                    for name in OWN_INIT:
                        if callable(getattr(sub, name, None)):
                            getattr(sub, name)()
    return check_finite(module, f"{cls.__name__} (seed {seed})")


def load(cls, folder, **kwargs):
    """cls.from_pretrained(folder, use_kernels=False, **kwargs), checked like ``build``
    (from 5.25 on, transformers kernelizes a loaded model unless told not to)."""
    return check_finite(cls.from_pretrained(folder, use_kernels=False, **kwargs),
                        f"{cls.__name__}.from_pretrained")
