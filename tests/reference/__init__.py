"""Torch- and transformers-based float64 references for the tests.

- ``hf_mamba``: transformers' ``MambaBlock`` / ``Mamba2Block`` run in verified float64
  (``mamba1_reference``, ``mamba2_reference``); the forward and gradient references of
  Mamba1Block and Mamba2Block.
- ``torch_mamba3``: the Mamba-3 recurrence in float64 PyTorch, for autograd (the gradient
  reference of Mamba3Block).

The float64 NumPy references and the deterministic weights and inputs are public, in
``mojolearn.reference`` (``mamba1``, ``mamba2``, ``mamba3``, ``ops``, ``weights``);
``test_references.py`` checks ``hf_mamba`` against them.
"""
