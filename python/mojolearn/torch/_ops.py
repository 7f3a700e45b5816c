"""The torch custom ops over the kernel blocks, and their registration.

Both directions are torch custom ops (``torch.library``), with fake (meta)
implementations and ``register_autograd``, so ``torch.compile`` traces a
model through them without graph breaks (``fullgraph=True`` works):
``mojolearn::mamba_forward`` / ``mamba_backward`` (zero-state prefill and its
VJP, ``block.backward``) and ``mojolearn::mamba_forward_state`` /
``mamba_backward_state`` (from given state arrays, and the VJP through them,
``block.backward(x, g, state, grad_state=...)``). The ops name a module's
kernel block by its handle (``_kernel``); none changes its inputs.
"""
import sys
import types
from typing import List

import torch

from ._kernel import _kernel
from ._tensors import _TLS, _buffer, _contiguous, _grad_tensor, _tensor


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
    st = _state_object(block._runner.spec.state_class, [_buffer(a) for a in arrays], values)
    y = block.forward(_buffer(xc), st)
    return [_tensor(y)] + arrays


def _backward_state_impl(x, grad_y, weights, state, values, grad_state, handle):
    """[dx, d(weight) for each weight, d(state array) for each array]:
    block.backward(x, grad_y, state, grad_state=...) (see _backward_impl)."""
    kernel = _kernel(handle)
    block = kernel.block(weights)
    cls = block._runner.spec.state_class
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
    return sys.modules["mojolearn.torch._ops"]._forward_impl(x, weights, handle)


def _mamba_forward_fake(x, weights, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _mamba_backward(x: torch.Tensor, grad_output: torch.Tensor, weights: List[torch.Tensor],
                    handle: int) -> List[torch.Tensor]:
    """[dx, one gradient per weight] = block.backward(x, grad_output)."""
    return sys.modules["mojolearn.torch._ops"]._backward_impl(x, grad_output, weights, handle)


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
    return sys.modules["mojolearn.torch._ops"]._autograd_backward(ctx, grad_output)


def _mamba_forward_state(x: torch.Tensor, weights: List[torch.Tensor], state: List[torch.Tensor],
                         values: List[int], handle: int) -> List[torch.Tensor]:
    """[y, final state arrays] = block(x) from the given state arrays and
    the state's plain values (buffered_tokens, ...; the new ones are
    computed by the module, _MambaModule._advance)."""
    return sys.modules["mojolearn.torch._ops"]._forward_state_impl(x, weights, state, values,
                                                                   handle)


def _mamba_forward_state_fake(x, weights, state, values, handle):
    return ([torch.empty_like(x, memory_format=torch.contiguous_format)]
            + [torch.empty_like(s, memory_format=torch.contiguous_format) for s in state])


def _mamba_backward_state(x: torch.Tensor, grad_y: torch.Tensor, weights: List[torch.Tensor],
                          state: List[torch.Tensor], values: List[int],
                          grad_state: List[torch.Tensor], handle: int) -> List[torch.Tensor]:
    """[dx, one gradient per weight, one per state array]."""
    return sys.modules["mojolearn.torch._ops"]._backward_state_impl(x, grad_y, weights, state,
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
    return sys.modules["mojolearn.torch._ops"]._autograd_backward_state(ctx, grads)


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
