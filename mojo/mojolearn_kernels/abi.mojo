"""The C ABI between the compiled binaries and the Python layer.

Every operation is driven through two exports, `ml_plan` and `ml_task`, over
one array of Int64 argument slots (pointers as addresses, sizes as ints). An
operation is a sequence of phases; each phase is a set of independent tasks
that a host thread pool may run in any order, on any thread. Tasks of one
phase never write what another task of that phase reads or writes, so the
bits never depend on how tasks are scheduled.

The op ids live in the op table (ops.mojo) and reach Python through
`ml_op_table`; the other numbers Python needs through `ml_constants`
(constants.mojo). Only ABI_VERSION is mirrored in python/mojolearn/_abi.py,
which checks it. Python packs arguments by the names opspec.mojo gives them.
"""
from std.memory import Pointer

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]

# Bumped whenever an op id, an argument slot or a layout changes.
# 2: blobs start with a weight-format header; PREP_WFMT slots.
# 3: OP_PACK_TRANSPOSED; the Mamba-2/3 backwards' BW_PANELS slot.
# 4: ml_op_spec (every op's slots by name, opspec.mojo); the OP_LM_* ops.
# 5: OP_M1_PREPARE bcdt_eps_bits (the blob header's option word, O_OPTION).
# 6: weight formats 3 (q4_0) and 4 (q8_0), panels of float16 scales then codes.
# 7: the prepare ops' wfmt slot and blob header word 0 hold one 4-bit format per
#    projection (weight_panels.mojo's formats word): blocks that mix formats.
# 8: OP_M2_PREPARE n_groups (recorded in the blob header's option word).
# 9: ml_op_table and ml_constants (op ids and shared numbers are read, not copied).
comptime ABI_VERSION = 9

# ml_plan(op, args, PLAN_WORKSPACE) returns the workspace bytes an op needs.
comptime PLAN_WORKSPACE = -1
# ml_plan returns PHASE_END once the phase index is past the last phase.
comptime PHASE_END = -1

# Alignment of every sub-array inside a workspace or weight blob, in floats.
comptime ALIGN_FLOATS = 16


@always_inline
def arg_int(args: I64Ptr, slot: Int) -> Int:
    return Int(args[unsafe_offset=slot])


@always_inline
def arg_f32(args: I64Ptr, slot: Int) -> F32Ptr:
    return F32Ptr(unsafe_from_address=Int(args[unsafe_offset=slot]))


@always_inline
def arg_i64(args: I64Ptr, slot: Int) -> I64Ptr:
    return I64Ptr(unsafe_from_address=Int(args[unsafe_offset=slot]))


@always_inline
def round_up(n: Int, m: Int) -> Int:
    return (n + m - 1) // m * m


@always_inline
def ceil_div(n: Int, m: Int) -> Int:
    return (n + m - 1) // m


@always_inline
def one_phase_plan(phase: Int, ntasks: Int, workspace_bytes: Int = 0) -> Int:
    """The plan of an op with one phase of ntasks tasks: workspace_bytes for
    PLAN_WORKSPACE, ntasks for phase 0, PHASE_END after it."""
    if phase == PLAN_WORKSPACE:
        return workspace_bytes
    return ntasks if phase == 0 else PHASE_END
