"""Memory between torch tensors and the kernels, copied only where it must be.

In: a contiguous float32 CPU tensor is handed to the kernels as a buffer over
its own memory (``tensor.numpy()``; a non-contiguous tensor is copied to a
contiguous one first). Out: a forward output is a tensor over the memory of
the kernel's :class:`mojolearn.Array` (``torch.from_numpy(numpy.asarray(y))``,
which keeps the Array alive), and the backward kernel writes the gradients
straight into tensors torch allocated (``_TorchOut``).
"""
import ctypes
import threading

import torch

try:  # the zero-copy view of an input tensor: tensor.numpy() when NumPy is there
    import numpy as _np  # noqa: F401
except ImportError:  # pragma: no cover - exercised by monkeypatching _np
    _np = None


def _buffer(t):
    """A buffer over the memory of t (a contiguous float32 CPU tensor, no
    autograd history): ``t.numpy()`` (shares memory), or without NumPy a
    ctypes array at ``t.data_ptr()`` seen as a (shape) float32 memoryview.
    The caller keeps t alive while the buffer is used."""
    if t.is_neg():
        t = t.resolve_neg()
    if _np is not None:
        return t.numpy()
    n = t.numel()
    raw = (ctypes.c_float * n).from_address(t.data_ptr())
    mv = memoryview(raw).cast("B")
    return mv.cast("f", list(t.shape)) if t.dim() else mv.cast("f")


def _contiguous(t):
    """t detached and C-contiguous (a copy only if it was not)."""
    return t.detach().contiguous()


def _tensor(arr):
    """A tensor over the memory of mojolearn.Array arr (no copy; the tensor
    keeps arr alive): ``torch.from_numpy(numpy.asarray(arr))``, or without
    NumPy ``torch.frombuffer(arr).view(shape)``. (torch.from_dlpack(arr)
    shares memory too, but a DLPack or view tensor still alive when the
    interpreter exits is not freed then, and nanobind reports the Array as
    leaked; a from_numpy tensor is.)"""
    if _np is not None:
        return torch.from_numpy(_np.asarray(arr))
    return torch.frombuffer(arr, dtype=torch.float32).view(arr.shape)


def _as_float32_tensor(value, name):
    """A weight given as a tensor or any float32 buffer, as a float32 tensor
    (may share memory with value: it is only copied from)."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise TypeError(f"weight {name} must be float32, got {value.dtype}; convert "
                            f"it explicitly (mojolearn never converts dtypes)")
        return value.detach().to("cpu")
    mv = memoryview(value)
    if mv.format.lstrip("@=<") != "f" or mv.itemsize != 4:
        raise TypeError(f"weight {name} must be float32, got buffer format {mv.format!r}")
    data = bytearray(mv.tobytes())  # a private copy, writable (torch.frombuffer)
    t = torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)
    return t.view(tuple(mv.shape))


# Gradients land in torch-allocated memory, not in mojolearn.Arrays: torch
# never frees the gradients of a graph still alive at interpreter exit (a
# training script's last loss), and nanobind reports every Array still alive
# then as leaked. Each block the module builds gets an instance-level
# _grad_arrays (the hook Runner.run_backward allocates its outputs with) that,
# while a backward op runs on the calling thread (_TLS.torch_outputs), hands
# out torch tensors' memory; any other call (block.backward by the user) gets
# its Arrays as usual.
_TLS = threading.local()


class _TorchOut:
    """A backward output in a torch tensor's memory (what the kernel reads:
    address, shape, nbytes)."""

    __slots__ = ("tensor", "address", "shape", "nbytes")

    def __init__(self, shape, zero):
        t = torch.empty(tuple(shape), dtype=torch.float32)
        self.tensor, self.address, self.shape = t, t.data_ptr(), tuple(shape)
        self.nbytes = 4 * t.numel()
        if zero and self.nbytes:
            # a plain memset, as the Arrays get: torch.zeros would fill large
            # tensors on torch's OpenMP threads, whose spinning afterwards
            # slows the kernel that runs next on the same cores
            ctypes.memset(self.address, 0, self.nbytes)


def _grad_arrays_hook(original):
    def grad_arrays(x_shape, w, names, written=()):
        if not getattr(_TLS, "torch_outputs", False):
            return original(x_shape, w, names, written=written)
        grads = {"x": _TorchOut(x_shape, zero=False)}
        for name in names:
            grads[name] = _TorchOut(w[name].shape, zero=name not in written)
        return grads
    return grad_arrays


def _grad_tensor(g):
    """The tensor of a backward output: a _TorchOut's own tensor, or (should
    the block allocate its outputs some other way) a torch-owned copy."""
    if isinstance(g, _TorchOut):
        return g.tensor
    return _tensor(g).clone()
