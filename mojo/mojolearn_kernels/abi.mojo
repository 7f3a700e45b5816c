"""The C ABI between the compiled binaries and the Python layer.

Every operation is driven through two exports, `ml_plan` and `ml_task`, over
one array of Int64 argument slots (pointers as addresses, sizes as ints). An
operation is a sequence of phases; each phase is a set of independent tasks
that a host thread pool may run in any order, on any thread. Tasks of one
phase never write what another task of that phase reads or writes, so the
bits never depend on how tasks are scheduled.

The op ids and version here are mirrored in python/mojolearn/_abi.py (a test
checks them against the binary's ml_op_spec); the argument slots are not:
Python packs arguments by the names opspec.mojo gives them.
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
comptime ABI_VERSION = 8

# ml_plan(op, args, PLAN_WORKSPACE) returns the workspace bytes an op needs.
comptime PLAN_WORKSPACE = -1
# ml_plan returns PHASE_END once the phase index is past the last phase.
comptime PHASE_END = -1

# Operation ids.
comptime OP_FIRST_NONFINITE = 1
comptime OP_MATH_EVAL = 2
comptime OP_M1_PREPARE = 10
comptime OP_M1_FORWARD = 11
comptime OP_M1_BACKWARD = 12
comptime OP_M2_PREPARE = 20
comptime OP_M2_FORWARD = 21
comptime OP_M2_BACKWARD = 22
comptime OP_M3_PREPARE = 30
comptime OP_M3_FORWARD = 31
comptime OP_M3_BACKWARD = 32
comptime OP_PACK_TRANSPOSED = 33  # weight transposes for backward (linear_grad)
comptime OP_LOWBIT_PACK = 40
comptime OP_LOWBIT_UNPACK = 41
comptime OP_PANELS_EXTRACT = 42  # packed codes back out of a prepared blob
comptime OP_LM_PREPARE = 50  # a language model's vocabulary ends (lm.mojo)
comptime OP_LM_EMBED = 51
comptime OP_LM_LOGITS = 52
comptime OP_LM_NEXT = 53

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
