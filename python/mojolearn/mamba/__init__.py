"""Mamba-1, Mamba-2 and Mamba-3 blocks in float32.

Each block takes caller-supplied weights and provides forward(x, state=None),
step(x, state), allocate_state(...) and backward(x, grad_output). The
recurrent state is explicit and owned by the caller, so prefill,
continuation and token-by-token decode give the same bits.
"""
from importlib import import_module

_LAZY = {
    "Mamba1Block": ".mamba1", "Mamba1BlockInference": ".mamba1", "Mamba1State": ".mamba1",
    "Mamba1DecodeSession": ".session",
    "Mamba2Block": ".mamba2", "Mamba2BlockInference": ".mamba2", "Mamba2State": ".mamba2",
    "Mamba2DecodeSession": ".mamba2",
    "Mamba3Block": ".mamba3", "Mamba3BlockInference": ".mamba3", "Mamba3State": ".mamba3",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'mojolearn.mamba' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
