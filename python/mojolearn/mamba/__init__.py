"""Mamba-1, Mamba-2 and Mamba-3 blocks in float32.

Each block takes caller-supplied weights and provides forward(x, state=None),
step(x, state), allocate_state(...) and backward(x, grad_output). The
recurrent state is explicit and owned by the caller, so prefill,
continuation and token-by-token decode give the same bits.
"""
from .mamba1 import Mamba1Block, Mamba1BlockInference, Mamba1State
from .session import Mamba1DecodeSession

__all__ = ["Mamba1Block", "Mamba1BlockInference", "Mamba1State", "Mamba1DecodeSession"]
