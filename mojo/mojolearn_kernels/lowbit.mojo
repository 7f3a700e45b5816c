"""Packed projection weights (not implemented yet)."""
from .abi import I64Ptr


def lowbit_pack_plan(args: I64Ptr, phase: Int) -> Int:
    return -2


def lowbit_pack_task(args: I64Ptr, phase: Int, task: Int):
    pass


def lowbit_unpack_plan(args: I64Ptr, phase: Int) -> Int:
    return -2


def lowbit_unpack_task(args: I64Ptr, phase: Int, task: Int):
    pass
