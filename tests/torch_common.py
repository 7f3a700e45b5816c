"""Shared setup of the mojolearn.torch tests (test_torch_bridge.py,
test_torch_modules.py); import it after pytest.importorskip("torch")."""
import numpy as np
import torch

import mojolearn
import mojolearn.torch as mt
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights

D = 32
KINDS = {
    "mamba1": (mt.Mamba1, mojolearn.Mamba1Block, mamba1_weights),
    "mamba2": (mt.Mamba2, mojolearn.Mamba2Block, mamba2_weights),
    "mamba3": (mt.Mamba3, mojolearn.Mamba3Block, mamba3_weights),
}
ALL = list(KINDS)


def _setup(kind, seed=1, **kw):
    cls, block_cls, wf = KINDS[kind]
    w = wf(D, seed=seed)
    return cls.from_weights(w, **kw), block_cls(w, **kw), w


def _t(a):
    """A float32 tensor over a copy of a."""
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def _param_grads(module):
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
