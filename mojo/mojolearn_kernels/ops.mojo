"""The op table: every op of the C ABI declared once.

An op is a struct with its id (the number Python passes to `ml_plan` and
`ml_task`), its name (what `ml_op_table` exports, so Python never copies the
id), whether a GPU binary runs it on the host, and its plan, task and slot
declaration (opspec.mojo). `visit_ops` lists the structs; dispatch.mojo and
opspec.mojo walk that list with a visitor, so after inlining each entry
point is the if-chain over op ids it was written as before, and no second
list of ops exists. How to add an op: docs/guide/extending.rst.
"""
from .abi import I64Ptr, arg_int, arg_f32, one_phase_plan
from .opspec import SlotSink
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
struct FirstNonfinite(Op):
    comptime ID = 1
    comptime NAME = "first_nonfinite"
    comptime HOST = True  # an index: staging the array would cost more than the scan

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return one_phase_plan(p, 1)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): first_nonfinite_task(args)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.first_nonfinite_spec(args, s)


struct MathEval(Op):
    comptime ID = 2
    comptime NAME = "math_eval"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return one_phase_plan(p, 1)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int):
        math_eval(arg_int(args, ME_FN), arg_f32(args, ME_SRC), arg_f32(args, ME_DST),
                  arg_int(args, ME_N), arg_int(args, ME_WIDTH))

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.math_eval_spec(args, s)


struct M1Prepare(Op):
    comptime ID = 10
    comptime NAME = "m1_prepare"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m1f.m1_prepare_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m1f.m1_prepare_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m1_prepare_spec(s)


struct M1Forward(Op):
    comptime ID = 11
    comptime NAME = "m1_forward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m1f.m1_forward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m1f.m1_forward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m1_forward_spec(args, s)


struct M1Backward(Op):
    comptime ID = 12
    comptime NAME = "m1_backward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m1b.m1_backward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m1b.m1_backward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m1_backward_spec(args, s)


struct M2Prepare(Op):
    comptime ID = 20
    comptime NAME = "m2_prepare"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m2f.m2_prepare_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m2f.m2_prepare_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m2_prepare_spec(s)


struct M2Forward(Op):
    comptime ID = 21
    comptime NAME = "m2_forward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m2f.m2_forward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m2f.m2_forward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m2_forward_spec(args, s)


struct M2Backward(Op):
    comptime ID = 22
    comptime NAME = "m2_backward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m2b.m2_backward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m2b.m2_backward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m2_backward_spec(args, s)


struct M3Prepare(Op):
    comptime ID = 30
    comptime NAME = "m3_prepare"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m3f.m3_prepare_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m3f.m3_prepare_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m3_prepare_spec(s)


struct M3Forward(Op):
    comptime ID = 31
    comptime NAME = "m3_forward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m3f.m3_forward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m3f.m3_forward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m3_forward_spec(args, s)


struct M3Backward(Op):
    comptime ID = 32
    comptime NAME = "m3_backward"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return m3b.m3_backward_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): m3b.m3_backward_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.m3_backward_spec(args, s)


struct PackTransposed(Op):
    """Weight transposes for backward (linear_grad)."""
    comptime ID = 33
    comptime NAME = "pack_transposed"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lg.pack_transposed_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lg.pack_transposed_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.pack_transposed_spec(args, s)


struct LowbitPack(Op):
    comptime ID = 40
    comptime NAME = "lowbit_pack"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lb.lowbit_pack_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lb.lowbit_pack_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lowbit_pack_spec(args, s)


struct LowbitUnpack(Op):
    comptime ID = 41
    comptime NAME = "lowbit_unpack"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lb.lowbit_unpack_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lb.lowbit_unpack_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lowbit_unpack_spec(args, s)


struct PanelsExtract(Op):
    """Packed codes back out of a prepared blob."""
    comptime ID = 42
    comptime NAME = "panels_extract"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return wp.panels_extract_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): wp.panels_extract_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.panels_extract_spec(args, s)


struct LmPrepare(Op):
    """A language model's vocabulary ends (lm.mojo)."""
    comptime ID = 50
    comptime NAME = "lm_prepare"
    comptime HOST = True

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lm.lm_prepare_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lm.lm_prepare_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lm_prepare_spec(s)


struct LmEmbed(Op):
    comptime ID = 51
    comptime NAME = "lm_embed"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lm.lm_embed_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lm.lm_embed_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lm_embed_spec(args, s)


struct LmLogits(Op):
    comptime ID = 52
    comptime NAME = "lm_logits"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lm.lm_logits_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lm.lm_logits_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lm_logits_spec(args, s)


struct LmNext(Op):
    comptime ID = 53
    comptime NAME = "lm_next"
    comptime HOST = False

    @staticmethod
    def plan(args: I64Ptr, p: Int) -> Int: return lm.lm_next_plan(args, p)

    @staticmethod
    def task(args: I64Ptr, p: Int, t: Int): lm.lm_next_task(args, p, t)

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S): sp.lm_next_spec(args, s)
