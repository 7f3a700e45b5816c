"""Mamba-3 kernels: backward, backward_layout, backward_scan, forward, layout, scan, stages (each module's docstring says what it holds)."""
