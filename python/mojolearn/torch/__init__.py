"""PyTorch modules over the mojolearn kernels: ``Mamba1``, ``Mamba2``, ``Mamba3``.

Importing this package imports PyTorch (``import mojolearn`` does not; PyTorch
stays an optional dependency). Each module is a ``torch.nn.Module`` holding
its weights as ``torch.nn.Parameter`` under the names of the mojolearn block
(the transformers / mamba_ssm names), so a transformers mixer's
``state_dict`` plus the block norm weight loads with ``load_state_dict``.
``forward(x)`` runs one whole block (input RMSNorm, mixer and residual, as
:class:`mojolearn.Mamba1Block` etc.) through the Mojo kernels, and autograd
runs the kernels' backward (``block.backward``, the zero-state prefill VJP).

Both directions are registered as torch custom ops (``torch.library``):
``mojolearn::mamba_forward`` and ``mojolearn::mamba_backward``, with fake
(meta) implementations and ``register_autograd``, so ``torch.compile`` traces
a model through them without graph breaks (``fullgraph=True`` works).

Zero-copy: inputs reach the kernels as buffers over the tensors' own memory,
outputs are tensors over the kernels' memory, and the backward kernel writes
the gradients into tensors torch allocated (``_tensors``). Each module keeps
its kernel block, rebuilt only when a parameter changed (``_kernel``: a few
milliseconds at d_model = 768, once per optimizer step in training).

State: ``forward(x, state)`` with a mojolearn state object updates it in
place and has no gradients (``torch.no_grad()`` or nothing requiring grad,
else NotImplementedError; ``step`` likewise). Every module also takes the
state as a dict of tensors (one per array of the block's state class, plus
its plain values: ``buffered_tokens`` for Mamba2 / Mamba3, ``pending`` for
Mamba3), e.g. ``forward(x, {'conv_window': ..., 'h': ...})``, and then
returns ``(y, new_state)`` (a new dict; the given tensors are not changed),
differentiable with respect to x, the parameters and the given state
tensors (ops ``mojolearn::mamba_forward_state`` / ``mamba_backward_state``,
over ``Block.backward(x, g, state, grad_state=...)``): a long sequence can be
trained in pieces with the state carried between them.

Limitations (see the user guide's PyTorch page): float32 on the CPU only;
no ragged ``lengths``; no double backward.

Modules: ``modules`` (Mamba1, Mamba2, Mamba3), ``_ops`` (the custom ops),
``_kernel`` (the kernel block cache), ``_tensors`` (memory between tensors
and kernels).
"""
from ..families import FAMILIES
from ._kernel import _Kernel
from .modules import Mamba1, Mamba2, Mamba3, _Weights

# every family's module (the registry names it; a family whose module lives
# in a module of its own is imported on first use, by __getattr__)
_BY_NAME = {f.torch_module.rpartition(".")[2]: f for f in FAMILIES}
__all__ = list(_BY_NAME)

# A whole-module pickle (torch.save(m)) names these classes: they keep the
# names they had when this package was one file, mojolearn.torch.<name>, so
# pickles written before the split load and the public names stay the ones
# repr() and the docs show.
for _cls in (Mamba1, Mamba2, Mamba3, _Kernel, _Weights):
    _cls.__module__ = __name__
del _cls


def __getattr__(name):
    fam = _BY_NAME.get(name)
    if fam is None or fam.torch_module == f"{__name__}.{name}":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return fam.torch_class
