"""Op ids and argument slots of the binaries' C ABI.

Mirrors mojo/mojolearn_kernels/abi.mojo and the slot constants at the top of
each kernel module; keep them equal (ABI_VERSION guards a mismatch).
"""

ABI_VERSION = 3

VENDORS = {0: "cpu", 1: "cuda", 2: "hip", 3: "metal"}
NUMERIC_MODES = {0: "identical", 1: "fast"}

OP_FIRST_NONFINITE = 1
OP_MATH_EVAL = 2
OP_M1_PREPARE = 10
OP_M1_FORWARD = 11
OP_M1_BACKWARD = 12
OP_M2_PREPARE = 20
OP_M2_FORWARD = 21
OP_M2_BACKWARD = 22
OP_M3_PREPARE = 30
OP_M3_FORWARD = 31
OP_M3_BACKWARD = 32
OP_PACK_TRANSPOSED = 33
OP_LOWBIT_PACK = 40
OP_LOWBIT_UNPACK = 41
OP_PANELS_EXTRACT = 42
