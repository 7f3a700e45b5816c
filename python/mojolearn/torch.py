"""PyTorch modules over the mojolearn kernels: ``Mamba1``, ``Mamba2``, ``Mamba3``.

Importing this module imports PyTorch (``import mojolearn`` does not; PyTorch
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

Zero-copy: a contiguous float32 CPU tensor is handed to the kernels as a
buffer over its own memory (``tensor.numpy()``; a non-contiguous tensor is
copied to a contiguous one first). The output is a tensor over the memory of
the kernel's :class:`mojolearn.Array` (``torch.from_numpy(numpy.asarray(y))``,
which keeps the Array alive), and the backward kernel writes the gradients
straight into tensors torch allocated.

Kernel block cache: each module keeps one mojolearn block, built from its
parameters on first use and rebuilt only when a parameter changed since: the
key is every parameter's ``data_ptr()``, ``_version`` (bumped by every
in-place change: optimizer steps, ``load_state_dict``, ``copy_``), shape and
strides. A rebuild costs one block construction: a finiteness scan and a copy
of every weight into the kernels' packed panels, O(number of weights), about
a few milliseconds at d_model = 768 (``bench/bench_torch_bridge.py``); in
training that is once per optimizer step.

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
"""
import atexit
import ctypes
import itertools
import math
import sys
import threading
import types
import weakref
from typing import List

import torch

from .mamba.mamba1 import Mamba1Block, mamba1_weight_shapes
from .mamba.mamba2 import Mamba2Block, mamba2_weight_shapes
from .mamba.mamba3 import Mamba3Block, mamba3_weight_shapes

try:  # the zero-copy view of an input tensor: tensor.numpy() when NumPy is there
    import numpy as _np  # noqa: F401
except ImportError:  # pragma: no cover - exercised by monkeypatching _np
    _np = None

__all__ = ["Mamba1", "Mamba2", "Mamba3"]


# --------------------------------------------------------------------------- buffers
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


# --------------------------------------------------------------------------- kernel blocks
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


# --------------------------------------------------------------------------- custom ops
def _forward_impl(x, weights, handle):
    """y = block(x): a zero-state prefill of the module's block."""
    block = _kernel(handle).block(weights)
    xc = _contiguous(x)
    return _tensor(block.forward(_buffer(xc)))


def _backward_impl(x, grad_output, weights, handle):
    """[dx, d(weight) for each weight]: block.backward(x, grad_output), the
    kernel writing straight into tensors that torch allocated (_TorchOut)."""
    kernel = _kernel(handle)
    block = kernel.block(weights)
    xc, gc = _contiguous(x), _contiguous(grad_output)
    _TLS.torch_outputs = True
    try:
        grads = block.backward(_buffer(xc), _buffer(gc))
    finally:
        _TLS.torch_outputs = False
    return [_grad_tensor(grads["x"])] + [_grad_tensor(grads[n]) for n in kernel.names]


# Gradients land in torch-allocated memory, not in mojolearn.Arrays: torch
# never frees the gradients of a graph still alive at interpreter exit (a
# training script's last loss), and nanobind reports every Array still alive
# then as leaked. Each block the module builds gets an instance-level
# _grad_arrays (the hook _MambaBase._backward allocates its outputs with) that,
# while _backward_impl runs on the calling thread, hands out torch tensors'
# memory; any other call (block.backward by the user) gets its Arrays as usual.
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


def _state_object(cls, arrays, values):
    """A state of class cls over the buffers `arrays` (cls._ARRAYS order)
    with its plain values (cls._VALUES order, as ints: the op schema's
    List[int]; Mamba-3's pending is a bool)."""
    kw = {n: bool(v) if n == "pending" else int(v) for n, v in zip(cls._VALUES, values)}
    return cls(*arrays, **kw)


def _forward_state_impl(x, weights, state, values, handle):
    """[y, the final state's arrays] = block.forward(x, state) from the
    state arrays given (in the state class's order) and its plain values,
    run on copies: the op changes no input."""
    block = _kernel(handle).block(weights)
    xc = _contiguous(x)
    arrays = [s.detach().clone(memory_format=torch.contiguous_format) for s in state]
    st = _state_object(block._STATE_CLASS, [_buffer(a) for a in arrays], values)
    y = block.forward(_buffer(xc), st)
    return [_tensor(y)] + arrays


def _backward_state_impl(x, grad_y, weights, state, values, grad_state, handle):
    """[dx, d(weight) for each weight, d(state array) for each array]:
    block.backward(x, grad_y, state, grad_state=...) (see _backward_impl)."""
    kernel = _kernel(handle)
    block = kernel.block(weights)
    cls = block._STATE_CLASS
    held = [_contiguous(t) for t in [x, grad_y, *state, *grad_state]]
    bufs = [_buffer(t) for t in held]
    st = _state_object(cls, bufs[2:2 + len(state)], values)
    gs = dict(zip(cls._ARRAYS, bufs[2 + len(state):]))
    _TLS.torch_outputs = True
    try:
        grads = block.backward(bufs[0], bufs[1], st, grad_state=gs)
    finally:
        _TLS.torch_outputs = False
    return ([_grad_tensor(grads["x"])] + [_grad_tensor(grads[n]) for n in kernel.names]
            + [_grad_tensor(grads[f"state.{n}"]) for n in cls._ARRAYS])


def _autograd_backward_state(ctx, grads):
    """The forward_state op's VJP: unused outputs' gradients (None) are zeros."""
    x, *rest = ctx.saved_tensors
    weights, state = rest[:ctx.nweights], rest[ctx.nweights:]
    outs = [x] + list(state)
    g = [torch.zeros_like(o) if gi is None else gi for gi, o in zip(grads, outs)]
    r = torch.ops.mojolearn.mamba_backward_state(x, g[0], list(weights), list(state),
                                                 ctx.values, g[1:], ctx.handle)
    need_x, need_w, need_s, _, _ = ctx.needs_input_grad
    nw = len(weights)
    return (r[0] if need_x else None, [a if n else None for a, n in zip(r[1:1 + nw], need_w)],
            [a if n else None for a, n in zip(r[1 + nw:], need_s)], None, None)


def _autograd_backward(ctx, grad_output):
    x, *weights = ctx.saved_tensors
    grads = torch.ops.mojolearn.mamba_backward(x, grad_output, list(weights), ctx.handle)
    need_x, need_w, _ = ctx.needs_input_grad
    return (grads[0] if need_x else None,
            [g if n else None for g, n in zip(grads[1:], need_w)], None)


# The functions registered with torch.library live as long as the process (the
# op registry keeps them). They are made with globals that hold only sys and
# torch, and find this module through sys.modules when called: with this
# module's globals they would keep every mojolearn object reachable at exit,
# which nanobind then reports as leaked.
_OPS_GLOBALS = {"__builtins__": __builtins__, "sys": sys, "torch": torch, "List": List}


def _thin(fn):
    g = types.FunctionType(fn.__code__, _OPS_GLOBALS, fn.__name__, fn.__defaults__,
                           fn.__closure__)
    g.__annotations__ = dict(fn.__annotations__)
    g.__doc__, g.__qualname__, g.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    return g


def _mamba_forward(x: torch.Tensor, weights: List[torch.Tensor], handle: int) -> torch.Tensor:
    """y = block(x), zero state (the block of the module whose kernel handle is given)."""
    return sys.modules["mojolearn.torch"]._forward_impl(x, weights, handle)


def _mamba_forward_fake(x, weights, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _mamba_backward(x: torch.Tensor, grad_output: torch.Tensor, weights: List[torch.Tensor],
                    handle: int) -> List[torch.Tensor]:
    """[dx, one gradient per weight] = block.backward(x, grad_output)."""
    return sys.modules["mojolearn.torch"]._backward_impl(x, grad_output, weights, handle)


def _mamba_backward_fake(x, grad_output, weights, handle):
    return ([torch.empty_like(x, memory_format=torch.contiguous_format)]
            + [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weights])


def _setup_context(ctx, inputs, output):
    # called only when grad mode is on and an input requires grad: under
    # torch.no_grad() the forward keeps nothing
    x, weights, handle = inputs
    ctx.save_for_backward(x, *weights)
    ctx.handle = handle


def _backward_formula(ctx, grad_output):
    return sys.modules["mojolearn.torch"]._autograd_backward(ctx, grad_output)


def _mamba_forward_state(x: torch.Tensor, weights: List[torch.Tensor], state: List[torch.Tensor],
                         values: List[int], handle: int) -> List[torch.Tensor]:
    """[y, final state arrays] = block(x) from the given state arrays and
    the state's plain values (buffered_tokens, ...; the new ones are
    computed by the module, _MambaModule._advance)."""
    return sys.modules["mojolearn.torch"]._forward_state_impl(x, weights, state, values, handle)


def _mamba_forward_state_fake(x, weights, state, values, handle):
    return ([torch.empty_like(x, memory_format=torch.contiguous_format)]
            + [torch.empty_like(s, memory_format=torch.contiguous_format) for s in state])


def _mamba_backward_state(x: torch.Tensor, grad_y: torch.Tensor, weights: List[torch.Tensor],
                          state: List[torch.Tensor], values: List[int],
                          grad_state: List[torch.Tensor], handle: int) -> List[torch.Tensor]:
    """[dx, one gradient per weight, one per state array]."""
    return sys.modules["mojolearn.torch"]._backward_state_impl(x, grad_y, weights, state,
                                                               values, grad_state, handle)


def _mamba_backward_state_fake(x, grad_y, weights, state, values, grad_state, handle):
    return ([torch.empty_like(x, memory_format=torch.contiguous_format)]
            + [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weights]
            + [torch.empty_like(s, memory_format=torch.contiguous_format) for s in state])


def _setup_context_state(ctx, inputs, output):
    x, weights, state, values, handle = inputs
    ctx.save_for_backward(x, *weights, *state)
    ctx.nweights = len(weights)
    ctx.values = list(values)
    ctx.handle = handle


def _backward_formula_state(ctx, grads):
    return sys.modules["mojolearn.torch"]._autograd_backward_state(ctx, grads)


_forward_state_op = torch.library.custom_op(
    "mojolearn::mamba_forward_state", _thin(_mamba_forward_state), mutates_args=())
_forward_state_op.register_fake(_thin(_mamba_forward_state_fake))
_backward_state_op = torch.library.custom_op(
    "mojolearn::mamba_backward_state", _thin(_mamba_backward_state), mutates_args=())
_backward_state_op.register_fake(_thin(_mamba_backward_state_fake))
_forward_state_op.register_autograd(_thin(_backward_formula_state),
                                    setup_context=_thin(_setup_context_state))
del _mamba_forward_state, _mamba_forward_state_fake, _mamba_backward_state
del _mamba_backward_state_fake, _setup_context_state, _backward_formula_state

_forward_op = torch.library.custom_op("mojolearn::mamba_forward", _thin(_mamba_forward),
                                      mutates_args=())
_forward_op.register_fake(_thin(_mamba_forward_fake))
_backward_op = torch.library.custom_op("mojolearn::mamba_backward", _thin(_mamba_backward),
                                       mutates_args=())
_backward_op.register_fake(_thin(_mamba_backward_fake))
_forward_op.register_autograd(_thin(_backward_formula), setup_context=_thin(_setup_context))
del _mamba_forward, _mamba_forward_fake, _mamba_backward, _mamba_backward_fake
del _setup_context, _backward_formula


# --------------------------------------------------------------------------- modules
def _state_value(state, name):
    """A plain value of a state dict (a missing one is the fresh state's):
    buffered_tokens an int, pending (Mamba-3) a bool; TypeError otherwise
    (the block checks the range)."""
    if name == "pending":
        v = state.get(name, False)
        if not isinstance(v, bool):
            raise TypeError(f"state['pending'] must be a bool, got {type(v).__name__}")
        return v
    v = state.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"state[{name!r}] must be an int, got {type(v).__name__}")
    return v


class _Weights(torch.nn.Module):
    """Holds the parameters of one dotted name prefix (e.g. ``in_proj``), so
    that state_dict keys are the block's weight names."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a mojolearn.torch parameter holder has no forward")


def _uniform(shape, bound, g):
    return (torch.rand(shape, dtype=torch.float64, generator=g) * 2.0 - 1.0) * bound


def _normal(shape, g):
    return torch.randn(shape, dtype=torch.float64, generator=g)


def _dt_bias(n, g, dt_min=0.001, dt_max=0.1):
    """Inverse softplus of dt, dt log-uniform in [dt_min, dt_max] floored at 1e-4."""
    u = torch.rand(n, dtype=torch.float64, generator=g)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = torch.clamp(dt, min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class _MambaModule(torch.nn.Module):
    _BLOCK = None           # the mojolearn block class
    _NORM = "block_norm.weight"  # the weight d_model is read from

    def __init__(self, d_model, *, numeric_mode="identical", generator=None, _init=True,
                 **block_kwargs):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int):
            raise TypeError(f"d_model must be an int, got {type(d_model).__name__}")
        self._check_d(d_model)
        self.d_model = d_model
        self.numeric_mode = numeric_mode
        shapes = self._param_shapes()
        names = self._BLOCK._WEIGHT_ORDER
        self._paths = []
        for name in names:
            p = torch.nn.Parameter(torch.zeros(shapes[name], dtype=torch.float32))
            if "." in name:
                owner, leaf = name.split(".")
                if not hasattr(self, owner):
                    self.add_module(owner, _Weights())
                getattr(self, owner).register_parameter(leaf, p)
                self._paths.append((owner, leaf))
            else:
                self.register_parameter(name, p)
                self._paths.append((None, name))
        if _init:
            self.reset_parameters(generator)
        # the kernel block (built on first use; checks numeric_mode and kwargs now)
        self._block_kwargs = dict(block_kwargs, numeric_mode=numeric_mode)
        self._kernel = _Kernel(self._BLOCK, names, self._block_kwargs)
        if _init:
            self.kernel_block()

    def _param_shapes(self) -> dict:
        """{name: shape} of the parameters: the block's weight shapes, the
        first where it accepts two (conv1d: (C, 1, 4), not (C, 4))."""
        return {name: shape[0] if isinstance(shape[0], tuple) else shape
                for name, shape in self._shapes(self.d_model).items()}

    # -- construction ------------------------------------------------------
    @classmethod
    def from_weights(cls, weights, **kwargs):
        """A module with these weights: a dict of name -> float32 tensor or
        buffer (NumPy array, mojolearn.Array, ...) under the block's weight
        names, e.g. ``mojolearn.reference.weights.mamba1_weights(32, 0)`` or
        ``block.get_params()['weights']``. The values are copied into the
        parameters (a conv1d.weight of shape (C, 4) becomes (C, 1, 4)).
        kwargs: the constructor's keywords."""
        if not hasattr(weights, "keys") or cls._NORM not in weights:
            raise ValueError(f"weights must be a dict with {cls._NORM!r} and the other "
                             f"{cls.__name__} weight names "
                             f"{sorted(cls._BLOCK._WEIGHT_ORDER)}")
        names = set(weights.keys())
        want = set(cls._BLOCK._WEIGHT_ORDER)
        if names != want:
            raise ValueError(f"weights: missing {sorted(want - names)}; unknown "
                             f"{sorted(str(n) for n in names - want)} (expected {sorted(want)})")
        tensors = {n: _as_float32_tensor(weights[n], n) for n in weights.keys()}
        d = tensors[cls._NORM].shape[0] if tensors[cls._NORM].dim() == 1 else -1
        m = cls(int(d), _init=False, **kwargs)
        if "conv1d.weight" in tensors and tensors["conv1d.weight"].dim() == 2:
            tensors["conv1d.weight"] = tensors["conv1d.weight"].unsqueeze(1)
        m.load_state_dict(tensors, strict=True)
        m.kernel_block()  # the block's checks (finite values) now
        return m

    def reset_parameters(self, generator=None):
        """Initialise like mojolearn.reference.weights (mamba_ssm /
        transformers): the same distributions, drawn from torch's generator
        (``generator`` or the default one, i.e. ``torch.manual_seed``)."""
        with torch.no_grad():
            for name, value in self._init_values(generator).items():
                self.get_parameter(name).copy_(value.to(torch.float32))

    # -- the kernels -------------------------------------------------------
    def _weights(self):
        return [getattr(self, leaf) if owner is None else getattr(getattr(self, owner), leaf)
                for owner, leaf in self._paths]

    def kernel_block(self):
        """The mojolearn block the module runs (rebuilt if a parameter changed
        since the last call; otherwise the same object)."""
        return self._kernel.block(self._weights())

    def _check_x(self, x, what="x"):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"{what} must be float32, got {x.dtype}; convert it explicitly "
                            f"(mojolearn never converts dtypes)")
        if x.device.type != "cpu":
            raise TypeError(f"{what} must be on the CPU, got device {x.device}")

    def forward(self, x, state=None):
        """Run the block (RMSNorm, mixer, residual) over x.

        Parameters
        ----------
        x : float32 CPU tensor, shape (B, L, d_model)
        state : the block's state (from ``allocate_state``), a dict of
            tensors or None
            None: a zero-state prefill, differentiable w.r.t. x and every
            parameter. A state object is read and updated in place, like
            the mojolearn block's; allowed only under ``torch.no_grad()`` or
            when neither x nor any parameter requires grad
            (NotImplementedError otherwise). A dict of float32 CPU tensors,
            one per array of the block's state class in its shape (Mamba1:
            ``{'conv_window': (B, 2d, 4), 'h': (B, 2d, 16)}``; Mamba2 /
            Mamba3: every ``Mamba2State`` / ``Mamba3State`` array), plus the
            state's plain values as Python values (``buffered_tokens``, an
            int, default 0; Mamba3's ``pending``, a bool, default False):
            the state the forward starts from, not changed; the call
            returns ``(y, new_state)`` (new tensors and the advanced
            values) and is differentiable w.r.t. x, the parameters and
            those tensors.

        Returns
        -------
        y : float32 tensor, shape (B, L, d_model), residual included
            (with a dict state: ``(y, new_state)``, new_state a new dict)
        """
        self._check_x(x)
        weights = self._weights()
        if isinstance(state, dict):
            return self._functional(x, state, weights)
        if state is not None:
            return self._stateful(x, state, "forward", weights)
        return _forward_op(x, weights, self._kernel.handle)

    def _functional(self, x, state, weights):
        """forward from a dict of state tensors (and the state's plain
        values): (y, new state dict)."""
        cls = self._kernel.block_cls
        if not cls._BWD_STATE:
            raise NotImplementedError(
                f"{type(self).__name__}.forward does not take a dict of state tensors "
                f"(gradients through a {cls._STATE_CLASS.__name__} are not available); "
                f"pass its state object under torch.no_grad()")
        names, vnames = cls._STATE_CLASS._ARRAYS, cls._STATE_CLASS._VALUES
        missing = [n for n in names if n not in state]
        unknown = sorted(str(k) for k in state if k not in names and k not in vnames)
        if missing or unknown:
            raise ValueError(f"state must have the tensors {list(names)}"
                             + (f" (and may have {list(vnames)})" if vnames else "")
                             + f"; missing {missing}, unknown {unknown}")
        for n in names:
            self._check_x(state[n], f"state[{n!r}]")
        values = {n: _state_value(state, n) for n in vnames}
        outs = _forward_state_op(x, weights, [state[n] for n in names],
                                 [int(v) for v in values.values()], self._kernel.handle)
        new = dict(zip(names, outs[1:]))
        new.update(self._advance(values, x.shape[1]))
        return outs[0], new

    @staticmethod
    def _advance(values, tokens) -> dict:
        """The state's plain values after a forward of `tokens` tokens."""
        return {}

    def step(self, x, state):
        """One decode token: forward at L = 1 with the state carried (x of
        shape (B, 1, d_model) or (B, d_model)); same rule as a forward with a
        state (no gradients)."""
        self._check_x(x)
        return self._stateful(x, state, "step", self._weights())

    def _stateful(self, x, state, kind, weights):
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad
                                                                for w in weights)):
            raise NotImplementedError(
                f"{type(self).__name__}.{kind} with a state object is not differentiable (it "
                f"updates the state in place). Call it under torch.no_grad(), or with neither "
                f"x nor any parameter requiring grad; for gradients through the state pass it "
                f"as a dict of tensors: y, new_state = forward(x, state_dict)")
        block = self._kernel.block(weights)
        xc = _contiguous(x)
        y = getattr(block, kind)(_buffer(xc), state)
        return _tensor(y)

    def allocate_state(self, batch_size):
        """A zero state of the mojolearn block for batch_size sequences (its
        arrays are mojolearn.Array: ``torch.from_dlpack`` views them)."""
        return self.kernel_block().allocate_state(batch_size)

    def extra_repr(self):
        """d_model, numeric_mode (and Mamba-2's dt_limit), shown by repr()."""
        extra = "".join(f", {k}={v!r}" for k, v in self._block_kwargs.items()
                        if k != "numeric_mode")
        return f"d_model={self.d_model}, numeric_mode={self.numeric_mode!r}{extra}"


class Mamba1(_MambaModule):
    """A Mamba-1 block (:class:`mojolearn.Mamba1Block`: RMSNorm, selective-scan
    mixer and residual) as a torch.nn.Module.

    Parameters (state_dict keys), d = d_model, R = ceil(d / 16): ``norm.weight``
    (d,) (transformers' ``MambaBlock.norm.weight``), then transformers'
    ``MambaMixer`` names: ``in_proj.weight`` (4d, d), ``conv1d.weight``
    (2d, 1, 4), ``conv1d.bias`` (2d,), ``x_proj.weight`` (R + 32, 2d),
    ``dt_proj.weight`` (2d, R), ``dt_proj.bias`` (2d,), ``A_log`` (2d, 16),
    ``D`` (2d,), ``out_proj.weight`` (d, 2d). A ``MambaMixer`` state_dict plus
    ``norm.weight`` loads with ``load_state_dict``.

    Parameters
    ----------
    d_model : int
    numeric_mode : {'identical', 'fast'}, default 'identical'
    generator : torch.Generator or None
        For the initialisation (mojolearn.reference.weights' distributions).
    """

    _BLOCK = Mamba1Block
    _NORM = "norm.weight"

    def __init__(self, d_model, *, numeric_mode="identical", generator=None, _init=True):
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init)

    @staticmethod
    def _check_d(d):
        if d < 1:
            raise ValueError(f"d_model must be >= 1, got {d}")

    _shapes = staticmethod(mamba1_weight_shapes)

    def _init_values(self, g):
        s = self._param_shapes()  # the sizes come from the block's shapes
        d, (di, r), n = self.d_model, s["dt_proj.weight"], s["A_log"][1]
        return {
            "norm.weight": 1.0 + 0.05 * _normal(d, g),
            "in_proj.weight": _uniform(s["in_proj.weight"], d ** -0.5, g),
            "conv1d.weight": _uniform(s["conv1d.weight"], 0.5, g),
            "conv1d.bias": _uniform(di, 0.5, g),
            "x_proj.weight": _uniform(s["x_proj.weight"], di ** -0.5, g),
            "dt_proj.weight": _uniform((di, r), r ** -0.5, g),
            "dt_proj.bias": _dt_bias(di, g),
            "A_log": torch.log(torch.arange(1, n + 1, dtype=torch.float64)).expand(di, n),
            "D": 1.0 + 0.1 * _uniform(di, 1.0, g),
            "out_proj.weight": _uniform((d, di), di ** -0.5, g),
        }

    @staticmethod
    def state_dict_from_transformers(block_state_dict):
        """Our state_dict from a transformers ``MambaBlock`` state_dict
        (``norm.weight`` and ``mixer.<name>``)."""
        return {k[len("mixer."):] if k.startswith("mixer.") else k: v
                for k, v in block_state_dict.items()}


class Mamba2(_MambaModule):
    """A Mamba-2 (SSD) block (:class:`mojolearn.Mamba2Block`: RMSNorm, mixer
    and residual) as a torch.nn.Module; d_model a multiple of 32.

    Parameters (state_dict keys), d = d_model, di = 2d, H = di / 64,
    CD = di + 256: ``block_norm.weight`` (d,) (transformers'
    ``Mamba2Block.norm.weight``), then transformers' ``Mamba2Mixer`` names:
    ``in_proj.weight`` (2di + 256 + H, d), ``conv1d.weight`` (CD, 1, 4),
    ``conv1d.bias`` (CD,), ``dt_bias`` (H,), ``A_log`` (H,), ``D`` (H,),
    ``norm.weight`` (di,) (the mixer's gated norm), ``out_proj.weight``
    (d, di). A ``Mamba2Mixer`` state_dict plus ``block_norm.weight`` loads
    with ``load_state_dict``.

    Parameters
    ----------
    d_model : int
    dt_limit : (lo, hi), default (0.0, inf)
        transformers' ``time_step_limit`` (see :class:`mojolearn.Mamba2Block`).
    numeric_mode : {'identical', 'fast'}, default 'identical'
    generator : torch.Generator or None
    """

    _BLOCK = Mamba2Block

    def __init__(self, d_model, *, dt_limit=(0.0, math.inf), numeric_mode="identical",
                 generator=None, _init=True):
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init, dt_limit=tuple(dt_limit))

    @staticmethod
    def _check_d(d):
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-2 needs d_model a positive multiple of 32, got {d}")

    _shapes = staticmethod(mamba2_weight_shapes)

    @staticmethod
    def _advance(values, tokens):
        return {"buffered_tokens": (values["buffered_tokens"] + tokens) % Mamba2Block._CHUNK}

    def _init_values(self, g):
        s = self._param_shapes()  # the sizes come from the block's shapes
        d, di, h, cd = self.d_model, s["norm.weight"][0], s["D"][0], s["conv1d.bias"][0]
        return {
            "block_norm.weight": 1.0 + 0.05 * _normal(d, g),
            "in_proj.weight": _uniform(s["in_proj.weight"], d ** -0.5, g),
            "conv1d.weight": _uniform((cd, 1, 4), 0.5, g),
            "conv1d.bias": _uniform(cd, 0.5, g),
            "dt_bias": _dt_bias(h, g),
            "A_log": torch.log(1.0 + 15.0 * torch.rand(h, dtype=torch.float64, generator=g)),
            "D": 1.0 + 0.1 * _uniform(h, 1.0, g),
            "norm.weight": 1.0 + 0.05 * _normal(di, g),
            "out_proj.weight": _uniform((d, di), di ** -0.5, g),
        }

    @staticmethod
    def state_dict_from_transformers(block_state_dict):
        """Our state_dict from a transformers ``Mamba2Block`` state_dict: its
        ``norm.weight`` becomes ``block_norm.weight``, ``mixer.<name>`` becomes
        ``<name>`` (so ``mixer.norm.weight`` becomes ``norm.weight``)."""
        out = {}
        for k, v in block_state_dict.items():
            if k.startswith("mixer."):
                out[k[len("mixer."):]] = v
            elif k == "norm.weight":
                out["block_norm.weight"] = v
            else:
                out[k] = v
        return out


class Mamba3(_MambaModule):
    """A Mamba-3 (SISO) block (:class:`mojolearn.Mamba3Block`: RMSNorm, mixer
    and residual) as a torch.nn.Module; d_model a multiple of 32.

    Parameters (state_dict keys; mamba_ssm's ``Mamba3`` names), d = d_model,
    H = 2d / 64, d_in_proj = 4d + 256 + 3H + 32: ``block_norm.weight`` (d,),
    ``in_proj.weight`` (d_in_proj, d), ``dt_bias`` (H,), ``B_norm.weight``
    (128,), ``C_norm.weight`` (128,), ``B_bias`` (H, 128), ``C_bias``
    (H, 128), ``D`` (H,), ``out_proj.weight`` (d, 2d).

    Parameters
    ----------
    d_model : int
    numeric_mode : {'identical', 'fast'}, default 'identical'
    generator : torch.Generator or None
    """

    _BLOCK = Mamba3Block

    def __init__(self, d_model, *, numeric_mode="identical", generator=None, _init=True):
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init)

    @staticmethod
    def _check_d(d):
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-3 needs d_model a positive multiple of 32, got {d}")

    _shapes = staticmethod(mamba3_weight_shapes)

    @staticmethod
    def _advance(values, tokens):
        # the input states (pending) are consumed by the first token
        return {"buffered_tokens": Mamba3Block._count_after(values["buffered_tokens"], tokens),
                "pending": False}

    def _init_values(self, g):
        s = self._param_shapes()  # the sizes come from the block's shapes
        d, di, h = self.d_model, s["out_proj.weight"][1], s["D"][0]
        return {
            "block_norm.weight": 1.0 + 0.05 * _normal(d, g),
            "in_proj.weight": _uniform(s["in_proj.weight"], d ** -0.5, g),
            "dt_bias": _dt_bias(h, g),
            "B_norm.weight": 1.0 + 0.05 * _normal(128, g),
            "C_norm.weight": 1.0 + 0.05 * _normal(128, g),
            "B_bias": 1.0 + 0.1 * _normal((h, 128), g),
            "C_bias": 1.0 + 0.1 * _normal((h, 128), g),
            "D": 1.0 + 0.1 * _uniform(h, 1.0, g),
            "out_proj.weight": _uniform((d, di), di ** -0.5, g),
        }
