"""Float64 reference implementations and deterministic test weights for the Mamba blocks.

- ``weights``: deterministic float32 weight dicts and inputs (``mamba1_weights``,
  ``mamba2_weights``, ``random_input``).
- ``hf_mamba``: transformers' ``MambaBlock`` / ``Mamba2Block`` run in verified float64
  (``mamba1_reference``, ``mamba2_reference``).
- ``numpy_mamba``: small independent float64 NumPy recurrences written from SPEC.md
  (``mamba1_numpy``, ``mamba2_numpy``).
"""
