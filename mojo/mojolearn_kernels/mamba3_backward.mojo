"""Mamba-3 backward (not implemented yet: every plan reports an unknown op)."""
from .abi import I64Ptr


def m3_backward_plan(args: I64Ptr, phase: Int) -> Int:
    return -2


def m3_backward_task(args: I64Ptr, phase: Int, task: Int):
    pass
