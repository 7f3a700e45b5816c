"""Mamba-2 kernels: backward, backward_layout, backward_recompute, forward, layout, ssd (each module's docstring says what it holds)."""
