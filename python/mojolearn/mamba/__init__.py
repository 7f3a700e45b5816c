"""Mamba-1, Mamba-2 and Mamba-3 blocks in float32.

Each block takes caller-supplied weights and provides forward(x, state=None),
step(x, state), allocate_state(...) and backward(x, grad_output). The
recurrent state is explicit and owned by the caller, so prefill,
continuation and token-by-token decode give the same bits.

The block and state classes are also exported from mojolearn (and
documented under those names). Inputs are read through the buffer protocol,
so PyTorch and NumPy are not required.

Examples
--------
>>> import numpy as np, mojolearn
>>> from mojolearn.mamba import Mamba2Block
>>> weights = mojolearn.init_weights("mamba2", 32, seed=0)
>>> x = np.ones((2, 16, 32), np.float32)            # any float32 (B, L, d_model) buffer
>>> block = Mamba2Block(weights, numeric_mode="identical")
>>> y = block.forward(x)
>>> state = block.allocate_state(batch_size=x.shape[0])
>>> y0 = block.step(x[:, :1], state)
"""
from .._lazy import lazy_getattr

from ..families import exported_classes

# every family's block, forward-only block, state and decode session, by
# the module that defines it (the family registry names them)
_LAZY = exported_classes()

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__():
    return __all__
