"""Mamba-2 block (not implemented yet: every plan reports an unknown op)."""
from .abi import I64Ptr


def m2_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    return -2


def m2_prepare_task(args: I64Ptr, phase: Int, task: Int):
    pass


def m2_forward_plan(args: I64Ptr, phase: Int) -> Int:
    return -2


def m2_forward_task(args: I64Ptr, phase: Int, task: Int):
    pass
