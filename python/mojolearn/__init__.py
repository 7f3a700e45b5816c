"""mojolearn: bit-reproducible Mamba blocks in float32, Mojo kernels.

Importing this package loads no binary: the host layer and a kernel binary
are loaded on first use (constructing a block, or touching mojolearn.Array).
mojolearn.reference holds float64 NumPy references of the blocks, to check
results against (it needs NumPy, imported only when a reference is used).
"""
from ._lazy import lazy_getattr

from .families import exported_classes as _exported_classes

__version__ = "0.1.0"

_LAZY = {
    "Array": "._array",
    "mamba": None,
    "set_num_threads": "._loader",
    "get_num_threads": "._loader",
    "BinaryNotFoundError": "._loader",
    "vendor_used": "._loader",
    "numeric_mode_used": "._loader",
    "lowbit": None,
    "checkpoints": None,
    "reference": None,        # float64 NumPy references (NumPy imported on first use)
    "torch": None,            # torch.nn.Modules over the kernels (imports PyTorch; optional)
    "load_checkpoint": ".checkpoints",
    "MambaLM": ".lm",
    "init_weights": ".init",
    "save": None,              # save_checkpoint: folders that load_checkpoint reads
    "lm": None,
    "generate": None,          # generation and continuous batching over a MambaLM
    "read_safetensors": ".checkpoints",
}
# every family's block, forward-only block, state and decode session (from
# the family registry, which imports nothing), through mojolearn.mamba
_LAZY.update(dict.fromkeys(_exported_classes(), ".mamba"))

# mojolearn.torch stays out of __all__: `from mojolearn import *` must not import PyTorch.
__all__ = sorted(n for n in _LAZY if n != "torch") + ["__version__"]

__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__():
    return __all__
