"""Op dispatch shared by every entry (CPU binary, GPU binaries): plan and
task by op id. The GPU kernel calls `op_task` per thread, so the formula code
a GPU runs is the very code the CPU runs; only the scheduling differs."""
from .abi import (
    F32Ptr, I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32,
    OP_FIRST_NONFINITE, OP_MATH_EVAL, OP_M1_PREPARE, OP_M1_FORWARD,
    OP_M2_PREPARE, OP_M2_FORWARD, OP_M3_PREPARE, OP_M3_FORWARD,
    OP_M1_BACKWARD, OP_M2_BACKWARD, OP_M3_BACKWARD, OP_LOWBIT_PACK, OP_LOWBIT_UNPACK,
    OP_PANELS_EXTRACT, OP_PACK_TRANSPOSED, OP_LM_PREPARE, OP_LM_EMBED, OP_LM_LOGITS, OP_LM_NEXT,
)
from .checks import first_nonfinite_task
from .math_eval import math_eval, ME_FN, ME_SRC, ME_DST, ME_N, ME_WIDTH
from .mamba1.forward import m1_prepare_plan, m1_prepare_task, m1_forward_plan, m1_forward_task
from .mamba2.forward import m2_prepare_plan, m2_prepare_task, m2_forward_plan, m2_forward_task
from .mamba3.forward import m3_prepare_plan, m3_prepare_task, m3_forward_plan, m3_forward_task
from .mamba1.backward import m1_backward_plan, m1_backward_task
from .mamba2.backward import m2_backward_plan, m2_backward_task
from .mamba3.backward import m3_backward_plan, m3_backward_task
from .lowbit import lowbit_pack_plan, lowbit_pack_task, lowbit_unpack_plan, lowbit_unpack_task
from .weight_panels import panels_extract_plan, panels_extract_task
from .linear_grad import pack_transposed_plan, pack_transposed_task
from .lm import (
    lm_prepare_plan, lm_prepare_task, lm_embed_plan, lm_embed_task, lm_logits_plan,
    lm_logits_task, lm_next_plan, lm_next_task,
)


def op_plan(op: Int, args: I64Ptr, p: Int) -> Int:
    """Tasks in phase p of op (PHASE_END past the last; workspace bytes for
    PLAN_WORKSPACE; -2 for an unknown op)."""
    if op == OP_M1_FORWARD:
        return m1_forward_plan(args, p)
    if op == OP_M1_PREPARE:
        return m1_prepare_plan(args, p)
    if op == OP_M2_FORWARD:
        return m2_forward_plan(args, p)
    if op == OP_M2_PREPARE:
        return m2_prepare_plan(args, p)
    if op == OP_M3_FORWARD:
        return m3_forward_plan(args, p)
    if op == OP_M3_PREPARE:
        return m3_prepare_plan(args, p)
    if op == OP_M1_BACKWARD:
        return m1_backward_plan(args, p)
    if op == OP_M2_BACKWARD:
        return m2_backward_plan(args, p)
    if op == OP_M3_BACKWARD:
        return m3_backward_plan(args, p)
    if op == OP_LOWBIT_PACK:
        return lowbit_pack_plan(args, p)
    if op == OP_LOWBIT_UNPACK:
        return lowbit_unpack_plan(args, p)
    if op == OP_PANELS_EXTRACT:
        return panels_extract_plan(args, p)
    if op == OP_PACK_TRANSPOSED:
        return pack_transposed_plan(args, p)
    if op == OP_LM_PREPARE:
        return lm_prepare_plan(args, p)
    if op == OP_LM_EMBED:
        return lm_embed_plan(args, p)
    if op == OP_LM_LOGITS:
        return lm_logits_plan(args, p)
    if op == OP_LM_NEXT:
        return lm_next_plan(args, p)
    if op == OP_FIRST_NONFINITE or op == OP_MATH_EVAL:
        if p == PLAN_WORKSPACE:
            return 0
        return 1 if p == 0 else PHASE_END
    return -2


def is_host_op(op: Int) -> Bool:
    """Ops a GPU binary runs on the host: the weight preparation (one-time
    layout copies: the blobs and backward's transposed panels; the packing
    uses exact float64 steps, which Metal lacks), the lowbit conversions and
    the extraction of packed codes (the same), and the input check (an
    index; staging the array would cost more than the scan). None computes
    a block output."""
    return (op == OP_M1_PREPARE or op == OP_M2_PREPARE or op == OP_M3_PREPARE
            or op == OP_PACK_TRANSPOSED or op == OP_FIRST_NONFINITE
            or op == OP_LOWBIT_PACK or op == OP_LOWBIT_UNPACK or op == OP_PANELS_EXTRACT
            or op == OP_LM_PREPARE)


def op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """Runs task t of phase p of op; 0, or -2 for an unknown op."""
    if is_host_op(op):
        return _host_op_task(op, args, p, t)
    return device_op_task(op, args, p, t)


def _host_op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    if op == OP_M1_PREPARE:
        m1_prepare_task(args, p, t)
    elif op == OP_M2_PREPARE:
        m2_prepare_task(args, p, t)
    elif op == OP_M3_PREPARE:
        m3_prepare_task(args, p, t)
    elif op == OP_LOWBIT_PACK:
        lowbit_pack_task(args, p, t)
    elif op == OP_LOWBIT_UNPACK:
        lowbit_unpack_task(args, p, t)
    elif op == OP_PANELS_EXTRACT:
        panels_extract_task(args, p, t)
    elif op == OP_PACK_TRANSPOSED:
        pack_transposed_task(args, p, t)
    elif op == OP_LM_PREPARE:
        lm_prepare_task(args, p, t)
    else:
        first_nonfinite_task(args)
    return 0


def device_op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """op_task for the ops a GPU runs (every block output); -2 for others."""
    if op == OP_M1_FORWARD:
        m1_forward_task(args, p, t)
    elif op == OP_M2_FORWARD:
        m2_forward_task(args, p, t)
    elif op == OP_M3_FORWARD:
        m3_forward_task(args, p, t)
    elif op == OP_M1_BACKWARD:
        m1_backward_task(args, p, t)
    elif op == OP_M2_BACKWARD:
        m2_backward_task(args, p, t)
    elif op == OP_M3_BACKWARD:
        m3_backward_task(args, p, t)
    elif op == OP_LM_EMBED:
        lm_embed_task(args, p, t)
    elif op == OP_LM_LOGITS:
        lm_logits_task(args, p, t)
    elif op == OP_LM_NEXT:
        lm_next_task(args, p, t)
    elif op == OP_MATH_EVAL:
        math_eval(arg_int(args, ME_FN), arg_f32(args, ME_SRC), arg_f32(args, ME_DST),
                  arg_int(args, ME_N), arg_int(args, ME_WIDTH))
    else:
        return -2
    return 0
