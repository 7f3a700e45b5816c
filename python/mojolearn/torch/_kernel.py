"""The kernel block cache: one mojolearn block per module, by handle.

Each module keeps one mojolearn block, built from its parameters on first
use and rebuilt only when a parameter changed since: the key is every
parameter's ``data_ptr()``, ``_version`` (bumped by every in-place change:
optimizer steps, ``load_state_dict``, ``copy_``), shape and strides. A
rebuild costs one block construction: a finiteness scan and a copy of every
weight into the kernels' packed panels, O(number of weights), about a few
milliseconds at d_model = 768 (``bench/bench_torch_bridge.py``); in training
that is once per optimizer step.
"""
import atexit
import itertools
import threading
import weakref

from ..mamba.mamba1 import Mamba1Block
from ._tensors import _buffer, _contiguous, _grad_arrays_hook

_HANDLES = itertools.count(1)
_KERNELS = weakref.WeakValueDictionary()  # handle -> _Kernel (alive with its module)


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor tracks no version: always rebuild
        return object()


class _Kernel:
    """The mojolearn block of one module, rebuilt when its weights change.

    The custom ops name it by an integer handle (a graph constant under
    torch.compile). A deep copy or an unpickled copy is a fresh _Kernel with
    its own handle (a copied module has its own parameters)."""

    def __init__(self, block_cls, names, kwargs):
        self.block_cls, self.names, self.kwargs = block_cls, tuple(names), dict(kwargs)
        self.handle = next(_HANDLES)
        self.builds = 0  # blocks built so far (tests, diagnostics)
        self._key = None
        self._block = None
        self._lock = threading.Lock()
        _KERNELS[self.handle] = self

    def __deepcopy__(self, memo):
        return _Kernel(self.block_cls, self.names, self.kwargs)

    def __reduce__(self):
        return _Kernel, (self.block_cls, self.names, self.kwargs)

    def block(self, weights):
        """The block for these weights (tensors in `names` order): the kept
        one if no weight changed since it was built, else a new one."""
        key = tuple((w.data_ptr(), _version(w), tuple(w.shape), w.stride()) for w in weights)
        with self._lock:
            if self._block is None or key != self._key:
                held = [_contiguous(w) for w in weights]  # alive until the copy is made
                bufs = {n: _buffer(w) for n, w in zip(self.names, held)}
                block = self.block_cls(bufs, **self.kwargs)  # copies the weights
                block._grad_arrays = _grad_arrays_hook(block._grad_arrays)
                self._block = block
                self._key = key
                self.builds += 1
            return self._block


@atexit.register
def _drop_blocks():
    """At exit, drop every module's kernel block (rebuilt if used again): a
    module that outlives the interpreter (torch.compile's caches keep
    compiled modules) would otherwise keep its block's Arrays alive, which
    nanobind reports as leaked."""
    for k in list(_KERNELS.values()):
        with k._lock:
            k._block = k._key = None
    Mamba1Block._forget_workspace()  # this thread's kernel workspace (made again on use)


def _kernel(handle):
    k = _KERNELS.get(handle)
    if k is None:
        raise RuntimeError(f"mojolearn.torch: no module with kernel handle {handle} is alive")
    return k
