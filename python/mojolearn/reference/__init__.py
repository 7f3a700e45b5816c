"""Float64 NumPy references of the Mamba blocks, and deterministic weights.

Use these to check your own results (or a build of mojolearn on a new
machine) against an independent float64 computation of what the kernels
compute. They are small per-token loops written from the block definitions
in the docs (numerics.md, mamba2.md, mamba3.md), sharing no code with the
kernels: fine for hundreds of tokens, not for benchmarks. Everything is
float64: inputs and weights are widened exactly.

How the test suite uses them: for Mamba-1 and Mamba-2 it compares the
kernel against transformers' block (``MambaBlock``, ``Mamba2Block``) run in
verified float64 (``tests/reference/hf_mamba.py``), which is itself checked
equal to the NumPy reference to 1e-10 relative
(``tests/reference/test_references.py``); each backward
(``mamba1/backward.mojo``, ``mamba2/backward.mojo``) is checked against
torch autograd of that float64 block. Mamba-3 has no transformers block:
see :mod:`mojolearn.reference.mamba3`.

Modules (each needs NumPy; importing :mod:`mojolearn.reference` itself does
not, NumPy is imported when a function is first used):

- :mod:`mojolearn.reference.mamba1`: :func:`~mojolearn.reference.mamba1.mamba1_numpy`,
  the reference of :class:`mojolearn.Mamba1Block`
  (``mojo/mojolearn_kernels/mamba1/forward.mojo``);
- :mod:`mojolearn.reference.mamba2`: :func:`~mojolearn.reference.mamba2.mamba2_numpy`,
  the reference of :class:`mojolearn.Mamba2Block`
  (``mojo/mojolearn_kernels/mamba2/forward.mojo``);
- :mod:`mojolearn.reference.mamba3`: :func:`~mojolearn.reference.mamba3.mamba3_numpy`,
  the reference of :class:`mojolearn.Mamba3Block`
  (``mojo/mojolearn_kernels/mamba3/forward.mojo``);
- :mod:`mojolearn.reference.ops`: the shared float64 pieces (``rmsnorm``,
  ``silu``, ``softplus``);
- :mod:`mojolearn.reference.weights`: deterministic float32 weight dicts
  and inputs (``mamba1_weights``, ``mamba2_weights``, ``mamba3_weights``,
  ``random_input``) under the constructors' names and shapes.

The functions are also reachable from this package, e.g.
``mojolearn.reference.mamba1_numpy``.
"""
from .._lazy import lazy_getattr

_LAZY = {
    "mamba1_numpy": ".mamba1",
    "mamba2_numpy": ".mamba2",
    "mamba3_numpy": ".mamba3",
    "rmsnorm": ".ops",
    "silu": ".ops",
    "softplus": ".ops",
    "mamba1_weights": ".weights",
    "mamba2_weights": ".weights",
    "mamba3_weights": ".weights",
    "random_input": ".weights",
    "mamba1_dims": ".weights",
    "mamba2_dims": ".weights",
    "mamba3_dims": ".weights",
    "mamba1": None,
    "mamba2": None,
    "mamba3": None,
    "ops": None,
    "weights": None,
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__():
    return __all__
