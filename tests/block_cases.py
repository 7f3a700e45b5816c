"""Cases the per-family block tests share, built in one place so that the
forward and backward tests of a family (or the same test of several
families) check the same weights and inputs."""
import numpy as np

from mojolearn.reference.weights import mamba1_weights, random_input

# (dt_proj.bias shift, x scale) of mamba1_softplus_case
SOFTPLUS_SHIFTS = [(19.5, 3.0), (0.0, 10.0)]


def mamba1_softplus_case(bias_shift, x_scale):
    """Mamba-1 weights (d 32) with dt_proj.bias shifted by bias_shift, and x
    (2, 33, 32) scaled by x_scale: softplus inputs around its threshold 20
    (both branches), large gates."""
    w = mamba1_weights(32, seed=3)
    w["dt_proj.bias"] = w["dt_proj.bias"] + np.float32(bias_shift)
    return w, random_input(2, 33, 32, seed=4, scale=x_scale)


def perturbed_out_proj(make_weights, reference, d):
    """The negative control of a forward tolerance: (w = make_weights(d,
    seed=1), x (1, 9, d), the reference output of w, w with out_proj.weight
    0.1% larger). reference(w, x) returns the output first."""
    w = make_weights(d, seed=1)
    x = random_input(1, 9, d, seed=2)
    ref = reference(w, x)[0]
    w2 = dict(w)
    w2["out_proj.weight"] = w["out_proj.weight"] * np.float32(1.001)
    return w, x, ref, w2


def continuation_case(block_cls, make_weights, length):
    """(weights, x, block, fresh state) at d 64, B 2, x of length tokens."""
    w = make_weights(64, seed=7)
    x = random_input(2, length, 64, seed=8)
    block = block_cls(w)
    return w, x, block, block.allocate_state(2)
