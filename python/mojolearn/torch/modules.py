"""The torch.nn.Modules: Mamba1, Mamba2, Mamba3 over the kernel blocks.

Each holds its weights as ``torch.nn.Parameter`` under the mojolearn block's
weight names, initialises them like mojolearn.reference.weights, and runs
the block through the custom ops (``_ops``) or, with a state object,
directly (no gradients).
"""
import math

import torch

from ..families import family
from ._kernel import _Kernel
from ._ops import _forward_op, _forward_state_op
from ._tensors import _as_float32_tensor, _buffer, _contiguous, _tensor


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
    _FAMILY = None          # the mojolearn.families.Family
    _BLOCK = None           # its block class
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
        names = self._BLOCK._runner.spec.weight_order
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

    def _shapes(self, d: int) -> dict:
        return self._FAMILY.weight_shapes(d)

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
                             f"{sorted(cls._BLOCK._runner.spec.weight_order)}")
        names = set(weights.keys())
        want = set(cls._BLOCK._runner.spec.weight_order)
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
        state_cls = cls._runner.spec.state_class
        names, vnames = state_cls._ARRAYS, state_cls._VALUES
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

    @classmethod
    def _advance(cls, values, tokens) -> dict:
        """The state's plain values after a forward of `tokens` tokens: its
        chunk position, where the block's state has one."""
        after = cls._BLOCK._runner.spec.position_after
        return {} if after is None else {"buffered_tokens": after(values["buffered_tokens"],
                                                                  tokens)}

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
    bcdt_rms_eps : float or None, default None
        None: the Mamba block. A float: the Falcon-Mamba block (weightless
        RMS norms on B, C and dt with this epsilon, transformers'
        ``mixer_rms_eps``; see :class:`mojolearn.Mamba1Block`).
    numeric_mode : {'identical', 'fast'}, default 'identical'
    generator : torch.Generator or None
        For the initialisation (mojolearn.reference.weights' distributions).
    """

    _FAMILY = family("mamba")
    _BLOCK = _FAMILY.block_class
    _NORM = "norm.weight"

    def __init__(self, d_model, *, bcdt_rms_eps=None, numeric_mode="identical",
                 generator=None, _init=True):
        kwargs = {} if bcdt_rms_eps is None else {"bcdt_rms_eps": bcdt_rms_eps}
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init, **kwargs)

    @staticmethod
    def _check_d(d):
        if d < 1:
            raise ValueError(f"d_model must be >= 1, got {d}")

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
    G = n_groups, CD = di + 256 G: ``block_norm.weight`` (d,) (transformers'
    ``Mamba2Block.norm.weight``), then transformers' ``Mamba2Mixer`` names:
    ``in_proj.weight`` (2di + 256 G + H, d), ``conv1d.weight`` (CD, 1, 4),
    ``conv1d.bias`` (CD,), ``dt_bias`` (H,), ``A_log`` (H,), ``D`` (H,),
    ``norm.weight`` (di,) (the mixer's gated norm), ``out_proj.weight``
    (d, di). A ``Mamba2Mixer`` state_dict plus ``block_norm.weight`` loads
    with ``load_state_dict``.

    Parameters
    ----------
    d_model : int
    n_groups : int, default 1
        transformers' ``n_groups`` (see :class:`mojolearn.Mamba2Block`).
    dt_limit : (lo, hi), default (0.0, inf)
        transformers' ``time_step_limit`` (see :class:`mojolearn.Mamba2Block`).
    numeric_mode : {'identical', 'fast'}, default 'identical'
    generator : torch.Generator or None
    """

    _FAMILY = family("mamba2")
    _BLOCK = _FAMILY.block_class

    def __init__(self, d_model, *, n_groups=1, dt_limit=(0.0, math.inf),
                 numeric_mode="identical", generator=None, _init=True):
        object.__setattr__(self, "_n_groups", n_groups)  # read by _shapes (checked by the shapes)
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init, dt_limit=tuple(dt_limit), n_groups=n_groups)

    def _shapes(self, d: int) -> dict:
        return self._FAMILY.weight_shapes(d, self._n_groups)

    @staticmethod
    def _check_d(d):
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-2 needs d_model a positive multiple of 32, got {d}")

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

    _FAMILY = family("mamba3")
    _BLOCK = _FAMILY.block_class

    def __init__(self, d_model, *, numeric_mode="identical", generator=None, _init=True):
        super().__init__(d_model, numeric_mode=numeric_mode, generator=generator,
                         _init=_init)

    @staticmethod
    def _check_d(d):
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-3 needs d_model a positive multiple of 32, got {d}")

    @classmethod
    def _advance(cls, values, tokens):
        # the input states (pending) are consumed by the first token
        return dict(super()._advance(values, tokens), pending=False)

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
