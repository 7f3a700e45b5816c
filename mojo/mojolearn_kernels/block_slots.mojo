"""The argument slots every Mamba block op has in the same place.

The prepare, forward and backward ops of Mamba-1, -2 and -3 all start their
argument vectors alike: prepare with d_model, norm.weight and in_proj.weight;
forward and backward with the batch, the tokens per row and d_model (the
sizes the op tables read first), x, and the prepared blob. Each family's
layout module imports these and numbers its own slots after them.
"""

# OP_M*_PREPARE
comptime PREP_D = 0
comptime PREP_NORM = 1
comptime PREP_IN = 2

# OP_M*_FORWARD
comptime FWD_B = 0
comptime FWD_L = 1
comptime FWD_D = 2
comptime FWD_X = 3
comptime FWD_Y = 4
comptime FWD_BLOB = 5

# OP_M*_BACKWARD
comptime BW_B = 0
comptime BW_L = 1
comptime BW_D = 2
comptime BW_X = 3
comptime BW_G = 4  # grad_output (B, L, d)
comptime BW_BLOB = 5  # the prepared forward blob
comptime BW_WORK = 6
comptime BW_DX = 7
