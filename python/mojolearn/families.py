"""The model-family registry: one entry per family (Mamba-1, Mamba-2, Mamba-3).

Everything that differs between the families outside the kernels is read
from here: the kind name and its aliases, the block, state and decode
session classes, the weight shapes, the checkpoint name maps of each file
format, the fixed configuration values, the initializer, the config a
saved folder gets, the torch module and the float64 reference.
``checkpoints``, ``init``, ``save``, ``mojolearn.torch`` and
``mojolearn.reference`` take them from here.

Adding a family here (its block, state, session, init function, torch
module and reference exist): one ``Family`` in ``FAMILIES`` (``_numbered``
fills the Mamba-<n> paths), its transformers fixed values in ``_FIXED``,
the config ``save_checkpoint`` writes in ``_SAVED``, mamba_ssm's options in
``_SSM_OPTIONS``, and ``file_shapes`` where a format stores a weight in
another layout. A family that reuses a block with an option (say a
Mamba-1 variant) points at that block and names the option in
``block_options`` (configs.check_config must then put its value in the
summary, as it does for Mamba-2's ``dt_limit``).

Importing this module imports no block module, no binary and no PyTorch:
classes and functions are named by dotted path and imported when asked.

Kind names: the canonical names are the ones the library reports
(``Checkpoint.kind``, ``MambaLM.kind``): 'mamba' (transformers'
``model_type`` for Mamba-1), 'mamba2' and 'mamba3'. 'mamba1' is accepted
everywhere as an alias of 'mamba' (it is ``init_weights``' spelling and
the block's name).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module

__all__ = ["Family", "FAMILIES", "family", "kinds"]

# checkpoint file formats a family's weights are named in (docs/checkpoints.md)
FORMATS = ("transformers", "mamba_ssm")


def _resolve(path: str):
    """The object at 'package.module.Name' (imported now)."""
    module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)


class _Resolved:
    """A read-only attribute: the object a dotted-path field names, imported
    when read."""

    def __init__(self, field_name: str, doc: str):
        self.field_name, self.__doc__ = field_name, doc

    def __get__(self, obj, owner=None):
        return self if obj is None else _resolve(getattr(obj, self.field_name))


@dataclass(frozen=True)
class Family:
    """One model family. Its fields:

    - ``kind``: the canonical kind name (``Checkpoint.kind``); ``aliases``:
      other accepted spellings; ``title``: the name used in messages
      ('Mamba-2').
    - ``block``, ``state``, ``session``: dotted paths of the block, state
      and decode session classes (``block_class``, ``state_class``,
      ``session_class`` import them).
    - ``shapes``: dotted path of ``weight_shapes(d_model) -> {name: shape}``.
    - ``input_norm``: the block weight name of the layer's input RMSNorm
      (checkpoints call it ``layers.{i}.norm.weight``).
    - ``row_positions``: whether the decode session keeps per-row chunk
      positions (Mamba-2/3); Mamba-1 rows need none (an engine steps them
      with ``block.step``).
    - ``block_options``: checkpoint summary entries passed to the block
      constructor (Mamba-2: ``dt_limit``).
    - ``model_type``: transformers' ``config.model_type`` (mojolearn's for
      Mamba-3); ``ssm_layer``: mamba_ssm's ``ssm_cfg['layer']``;
      ``variant_model_types``: other model types read as this family with
      a block option (Mamba-1: 'falcon_mamba', whose blocks take
      ``bcdt_rms_eps``; configs.check_config reads the option's value).
    - ``min_multiple``: d_model must be a positive multiple of it.
    - ``initializer``, ``torch_module``, ``reference``,
      ``reference_weights``: dotted paths of mojolearn.init's drawing
      function, the torch.nn.Module class, the float64 reference forward
      and its weight maker.
    - ``dt_rank``: the block projects dt through a low rank (Mamba-1's
      ``dt_proj``; its config's ``time_step_rank`` is checked).
    - ``tied_by_default``: a transformers config without
      ``tie_word_embeddings`` ties the head (False for Mamba-2, as
      transformers' Mamba2Config).
    - ``file_shapes``: {format: {block weight name: layout rule}} for
      weights a file format stores in another layout (the same values in C
      order, so a reshape): mamba_ssm's Mamba-3 ``B_bias`` is (H, 1, N).
    """

    kind: str
    aliases: tuple
    title: str
    block: str
    state: str
    session: str
    shapes: str
    input_norm: str
    row_positions: bool
    block_options: tuple
    model_type: str
    ssm_layer: str
    min_multiple: int
    initializer: str
    torch_module: str
    reference: str
    reference_weights: str
    dt_rank: bool = False
    tied_by_default: bool = True
    variant_model_types: tuple = ()
    file_shapes: dict = field(default_factory=dict)

    # -- classes and functions (imported when asked) ------------------------
    block_class = _Resolved("block", "The block class (imports the block module, not a "
                                     "binary).")
    state_class = _Resolved("state", "The state class.")
    session_class = _Resolved("session", "The decode session class (``Mamba2DecodeSession``"
                                         " ...).")
    torch_class = _Resolved("torch_module", "The torch.nn.Module class (imports PyTorch).")
    reference_forward = _Resolved("reference", "The float64 NumPy reference forward "
                                               "(imports NumPy).")
    reference_weight_maker = _Resolved("reference_weights", "mojolearn.reference.weights' "
                                       "maker of this family's weights (imports NumPy).")

    def weight_shapes(self, d_model: int, n_groups: int = 1) -> dict:
        """{block weight name: shape} for d_model (conv1d: two accepted
        shapes); n_groups: Mamba-2's groups of B and C (other families have
        one)."""
        if "n_groups" in self.block_options:
            return _resolve(self.shapes)(d_model, n_groups)
        return _resolve(self.shapes)(d_model)

    def initial_weights(self, d_model: int, draw, out_scale: float, dt_min: float,
                        dt_max: float) -> dict:
        """{name: (shape, values)} drawn by mojolearn.init's function."""
        return _resolve(self.initializer)(d_model, draw, out_scale, dt_min, dt_max)

    def check_d_model(self, d: int, field_name: str = "d_model") -> None:
        """ValueError naming field_name unless d fits the block."""
        if d < 1 or d % self.min_multiple:
            want = ">= 1" if self.min_multiple == 1 else \
                f"a positive multiple of {self.min_multiple}"
            raise ValueError(f"{field_name} must be {want} for {self.title}, got {d}")

    # -- checkpoint names -------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The layer-relative checkpoint key of a block weight (both formats
        name them alike): the input norm is ``norm.weight``, every other
        weight ``mixer.<name>``."""
        return "norm.weight" if name == self.input_norm else f"mixer.{name}"

    def block_name(self, key: str):
        """The block weight name of a layer-relative checkpoint key, or None."""
        if key == "norm.weight":
            return self.input_norm
        if key.startswith("mixer."):
            return key[len("mixer."):]
        return None

    def stored_shape(self, fmt: str, name: str, shape: tuple) -> tuple:
        """The shape a weight of block shape ``shape`` has in format fmt."""
        rule = self.file_shapes.get(fmt, {}).get(name)
        return _LAYOUTS[rule](shape) if rule else shape

    # -- configs ----------------------------------------------------------
    def fixed_config(self, d: int) -> dict:
        """The transformers config values the block fixes (refused when a
        config says otherwise)."""
        common = {"conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
                  "layer_norm_epsilon": 1e-5}
        return dict(common, **_FIXED[self.kind](d))

    def ssm_options(self) -> tuple:
        """(fixed {option: value}, ignored option names) of mamba_ssm's
        ``ssm_cfg`` for this family's mixer module."""
        fixed, ignored = _SSM_OPTIONS[self.kind]
        return dict(fixed), tuple(ignored)

    def saved_config(self, d: int, n_groups: int = 1) -> dict:
        """The config.json fields save_checkpoint writes for d_model d (and
        Mamba-2's n_groups)."""
        out = dict(_SAVED[self.kind](d))
        if "n_groups" in self.block_options:
            out["n_groups"] = n_groups
        return out


def _insert_axis1(shape):
    return (shape[0], 1) + tuple(shape[1:])


_LAYOUTS = {"insert_axis1": _insert_axis1}

_FIXED = {
    "mamba": lambda d: {"state_size": 16},
    "mamba2": lambda d: {"state_size": 128, "head_dim": 64, "chunk_size": 256,
                         "num_heads": 2 * d // 64},
    "mamba3": lambda d: {"state_size": 128, "head_dim": 64, "num_heads": 2 * d // 64,
                         "chunk_size": 64},
}

_SAVED = {
    "mamba": lambda d: {},
    "mamba2": lambda d: {"state_size": 128, "head_dim": 64, "num_heads": d * 2 // 64,
                         "expand": 2, "chunk_size": 256},
    "mamba3": lambda d: {"state_size": 128, "head_dim": 64, "num_heads": d * 2 // 64,
                         "expand": 2, "chunk_size": 64},
}

# mamba_ssm's ssm_cfg options per family: (the block's fixed values, options
# that only choose an initialisation or a kernel and are ignored); any other
# option is refused by name (mojolearn._mamba_ssm_config)
_SSM_INIT = ("dt_min", "dt_max", "dt_init_floor", "layer_idx", "device", "dtype")
_SSM_OPTIONS = {
    "mamba": ({"d_state": 16, "d_conv": 4, "expand": 2, "conv_bias": True, "bias": False},
              _SSM_INIT + ("dt_init", "dt_scale", "use_fast_path")),
    "mamba2": ({"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64,
                "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False,
                "bias": False, "conv_bias": True, "chunk_size": 256, "process_group": None},
               _SSM_INIT + ("conv_init", "A_init_range", "use_mem_eff_path",
                            "sequence_parallel")),
    "mamba3": ({"d_state": 128, "expand": 2, "headdim": 64, "ngroups": 1, "rope_fraction": 0.5,
                "A_floor": 1e-4, "is_outproj_norm": False, "is_mimo": False, "chunk_size": 64},
               # mimo_rank and the fused pre-gate norm only act with is_mimo
               _SSM_INIT + ("mimo_rank", "fuse_pregate_headwise_norm", "dropout", "n_layer")),
}


def _numbered(n: int, **fields) -> Family:
    """A family whose modules follow the Mamba-<n> naming (mamba<n>.py,
    Mamba<n>Block, Mamba<n>State, Mamba<n>DecodeSession, mamba<n>_*)."""
    m = f"mojolearn.mamba.mamba{n}."
    names = dict(title=f"Mamba-{n}", block=f"{m}Mamba{n}Block", state=f"{m}Mamba{n}State",
                 session=f"mojolearn.mamba.sessions.Mamba{n}DecodeSession",
                 shapes=f"{m}mamba{n}_weight_shapes", ssm_layer=f"Mamba{n}",
                 initializer=f"mojolearn.init._mamba{n}", torch_module=f"mojolearn.torch.Mamba{n}",
                 reference=f"mojolearn.reference.mamba{n}.mamba{n}_numpy",
                 reference_weights=f"mojolearn.reference.weights.mamba{n}_weights")
    return Family(**dict(names, **fields))


FAMILIES = (
    _numbered(1, kind="mamba", aliases=("mamba1",), model_type="mamba",
              input_norm="norm.weight", row_positions=False, block_options=("bcdt_rms_eps",),
              min_multiple=1, dt_rank=True, variant_model_types=("falcon_mamba",)),
    _numbered(2, kind="mamba2", aliases=(), model_type="mamba2",
              input_norm="block_norm.weight", row_positions=True,
              block_options=("dt_limit", "n_groups"), min_multiple=32, tied_by_default=False),
    _numbered(3, kind="mamba3", aliases=(), model_type="mamba3",
              input_norm="block_norm.weight", row_positions=True, block_options=(),
              min_multiple=32,
              # mamba_ssm keeps a MIMO rank axis (1 for SISO) in the q/k biases
              file_shapes={"mamba_ssm": {"B_bias": "insert_axis1",
                                         "C_bias": "insert_axis1"}}),
)

_BY_NAME = {name: f for f in FAMILIES for name in (f.kind,) + f.aliases}


def kinds() -> list:
    """Every accepted kind spelling, canonical names first."""
    return [f.kind for f in FAMILIES] + [a for f in FAMILIES for a in f.aliases]


def family(kind, argument: str = "kind") -> Family:
    """The Family of a kind name or alias; ValueError naming ``argument``
    and the accepted spellings otherwise.

    Examples
    --------
    >>> from mojolearn.families import family
    >>> family("mamba1").kind, family("mamba2").title
    ('mamba', 'Mamba-2')
    """
    f = _BY_NAME.get(kind) if isinstance(kind, str) else None
    if f is None:
        raise ValueError(f"{argument} must be one of {kinds()}, got {kind!r}")
    return f


def exported_classes() -> dict:
    """{public class name: dotted module} of every family's block, its
    forward-only ``<Block>Inference``, state and decode session: the names
    ``mojolearn`` and ``mojolearn.mamba`` export (imported when first used)."""
    out = {}
    for f in FAMILIES:
        for path, extra in ((f.block, ("Inference",)), (f.state, ()), (f.session, ())):
            module, _, name = path.rpartition(".")
            for n in (name,) + tuple(name + e for e in extra):
                out[n] = module
    return out


def by_model_type(model_type):
    """The Family whose transformers model_type this is, or None."""
    return next((f for f in FAMILIES
                 if model_type == f.model_type or model_type in f.variant_model_types), None)


def by_ssm_layer(layer):
    """The Family of a mamba_ssm ``ssm_cfg['layer']`` value, or None."""
    return next((f for f in FAMILIES if f.ssm_layer == layer), None)
