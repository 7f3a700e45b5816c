"""Mamba-1 kernels: backward, backward_layout, forward, stages (each module's docstring says what it holds)."""
