"""The block contract: what every block class promises, checked the same way
for Mamba1Block, Mamba1BlockInference, Mamba2Block, Mamba2BlockInference,
Mamba3Block and Mamba3BlockInference (the `case` fixture, conftest.py).

- test_x_errors.py: the intake of x, step's x and lengths
- test_state_errors.py: state buffers, and "a failed call changes no byte"
- test_weight_errors.py: weights, numeric_mode, params, set_params
- test_sessions.py: decode sessions (refusals and their bits)
- test_bits.py: the bit properties of identical mode, each with its control
- test_backward.py: backward of the three trainable classes (intake of x and
  grad_output, bit properties with their controls)

What differs between the blocks (sizes, state arrays, reports, message
wording) is data in cases.py; the per-block files (tests/test_mamba*_*.py)
keep only what one block has.
"""
