"""The op table: every op of the C ABI declared once.

An op is a `TableOp`: its id (the number Python passes to `ml_plan` and
`ml_task`), its name (what `ml_op_table` exports, so Python never copies the
id), whether a GPU binary runs it on the host, its plan and task functions
and its slot declaration (an OpSpec of opspec.mojo), all compile-time
parameters. `visit_ops` lists the ops; dispatch.mojo walks that list with a
visitor, so after inlining each entry point is the if-chain over op ids it
was written as before, and no second list of ops exists. How to add an op:
docs/guide/extending.rst.
"""
from .abi import I64Ptr, arg_int, arg_f32, one_phase_plan
from .opspec import SlotSink, OpSpec
from . import opspec as sp
from .checks import first_nonfinite_task
from .math_eval import math_eval, ME_FN, ME_SRC, ME_DST, ME_N, ME_WIDTH
from .mamba1 import forward as m1f
from .mamba1 import backward as m1b
from .mamba2 import forward as m2f
from .mamba2 import backward as m2b
from .mamba3 import forward as m3f
from .mamba3 import backward as m3b
from . import lowbit as lb
from . import weight_panels as wp
from . import linear_grad as lg
from . import lm


trait Op:
    """One op of the C ABI (see the module docstring)."""

    comptime ID: Int
    comptime NAME: StaticString
    # A GPU binary runs it on the host: a one-time layout copy or conversion
    # (some use exact float64 steps, which Metal lacks) or an input check; no
    # host op computes a block output. Its task is never compiled for a GPU.
    comptime HOST: Bool

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int:
        """Tasks in phase p (PHASE_END past the last; workspace bytes for
        PLAN_WORKSPACE; negative for arguments it refuses)."""
        ...

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int):
        """Runs task t of phase p."""
        ...

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        """Every argument slot into s (opspec.mojo)."""
        ...


comptime PlanFn = def(I64Ptr, Int) thin -> Int
comptime TaskFn = def(I64Ptr, Int, Int) thin -> None


struct TableOp[
    id: Int, name: StaticString, host: Bool, plan_fn: PlanFn, task_fn: TaskFn, Spec: OpSpec
](Op):
    """The op `name` with id `id` (unused by any other op, never reused):
    plan_fn and task_fn run it, Spec declares its slots."""

    comptime ID = Self.id
    comptime NAME = Self.name
    comptime HOST = Self.host

    @staticmethod
    @always_inline
    def plan(args: I64Ptr, p: Int) -> Int:
        return Self.plan_fn(args, p)

    @staticmethod
    @always_inline
    def task(args: I64Ptr, p: Int, t: Int):
        Self.task_fn(args, p, t)

    @staticmethod
    @always_inline
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        Self.Spec.spec(args, s)


trait OpVisitor:
    def visit[O: Op](mut self) -> Bool:
        """Called for each op in table order until one returns True."""
        ...


@always_inline
def visit_ops[V: OpVisitor](mut v: V) -> Bool:
    """The table: every op once. True if a visit returned True."""
    return (v.visit[M1Forward]() or v.visit[M1Prepare]() or v.visit[M2Forward]()
            or v.visit[M2Prepare]() or v.visit[M3Forward]() or v.visit[M3Prepare]()
            or v.visit[M1Backward]() or v.visit[M2Backward]() or v.visit[M3Backward]()
            or v.visit[LowbitPack]() or v.visit[LowbitUnpack]() or v.visit[PanelsExtract]()
            or v.visit[PackTransposed]() or v.visit[LmPrepare]() or v.visit[LmEmbed]()
            or v.visit[LmLogits]() or v.visit[LmNext]() or v.visit[FirstNonfinite]()
            or v.visit[MathEval]())


# ---- the ops -----------------------------------------------------------------
def _one_task_plan(args: I64Ptr, p: Int) -> Int:
    """The plan of a one-task op without a workspace."""
    return one_phase_plan(p, 1)


def _first_nonfinite_task(args: I64Ptr, p: Int, t: Int):
    first_nonfinite_task(args)


def _math_eval_task(args: I64Ptr, p: Int, t: Int):
    math_eval(arg_int(args, ME_FN), arg_f32(args, ME_SRC), arg_f32(args, ME_DST),
              arg_int(args, ME_N), arg_int(args, ME_WIDTH))


# HOST True for first_nonfinite: an index; staging the array would cost more than the scan.
comptime FirstNonfinite = TableOp[
    1, "first_nonfinite", True, _one_task_plan, _first_nonfinite_task, sp.FirstNonfiniteSpec]
comptime MathEval = TableOp[2, "math_eval", False, _one_task_plan, _math_eval_task, sp.MathEvalSpec]
comptime M1Prepare = TableOp[
    10, "m1_prepare", True, m1f.m1_prepare_plan, m1f.m1_prepare_task, sp.M1PrepareSpec]
comptime M1Forward = TableOp[
    11, "m1_forward", False, m1f.m1_forward_plan, m1f.m1_forward_task, sp.M1ForwardSpec]
comptime M1Backward = TableOp[
    12, "m1_backward", False, m1b.m1_backward_plan, m1b.m1_backward_task, sp.M1BackwardSpec]
comptime M2Prepare = TableOp[
    20, "m2_prepare", True, m2f.m2_prepare_plan, m2f.m2_prepare_task, sp.M2PrepareSpec]
comptime M2Forward = TableOp[
    21, "m2_forward", False, m2f.m2_forward_plan, m2f.m2_forward_task, sp.M2ForwardSpec]
comptime M2Backward = TableOp[
    22, "m2_backward", False, m2b.m2_backward_plan, m2b.m2_backward_task, sp.M2BackwardSpec]
comptime M3Prepare = TableOp[
    30, "m3_prepare", True, m3f.m3_prepare_plan, m3f.m3_prepare_task, sp.M3PrepareSpec]
comptime M3Forward = TableOp[
    31, "m3_forward", False, m3f.m3_forward_plan, m3f.m3_forward_task, sp.M3ForwardSpec]
comptime M3Backward = TableOp[
    32, "m3_backward", False, m3b.m3_backward_plan, m3b.m3_backward_task, sp.M3BackwardSpec]
# Weight transposes for backward (linear_grad).
comptime PackTransposed = TableOp[
    33, "pack_transposed", True, lg.pack_transposed_plan, lg.pack_transposed_task,
    sp.PackTransposedSpec]
comptime LowbitPack = TableOp[
    40, "lowbit_pack", True, lb.lowbit_pack_plan, lb.lowbit_pack_task, sp.LowbitPackSpec]
comptime LowbitUnpack = TableOp[
    41, "lowbit_unpack", True, lb.lowbit_unpack_plan, lb.lowbit_unpack_task, sp.LowbitUnpackSpec]
# Packed codes back out of a prepared blob.
comptime PanelsExtract = TableOp[
    42, "panels_extract", True, wp.panels_extract_plan, wp.panels_extract_task,
    sp.PanelsExtractSpec]
# A language model's vocabulary ends (lm.mojo).
comptime LmPrepare = TableOp[
    50, "lm_prepare", True, lm.lm_prepare_plan, lm.lm_prepare_task, sp.LmPrepareSpec]
comptime LmEmbed = TableOp[
    51, "lm_embed", False, lm.lm_embed_plan, lm.lm_embed_task, sp.LmEmbedSpec]
comptime LmLogits = TableOp[
    52, "lm_logits", False, lm.lm_logits_plan, lm.lm_logits_task, sp.LmLogitsSpec]
comptime LmNext = TableOp[53, "lm_next", False, lm.lm_next_plan, lm.lm_next_task, sp.LmNextSpec]
