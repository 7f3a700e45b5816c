"""The blocks' calls reach the native op in few Python frames: a block's
forward / step goes Block.forward -> Runner.forward -> the family's launch
-> Runner.run -> lib.run (mamba/_runner.py), no layer that only forwards
the call."""
import inspect

import numpy as np
import pytest

import mojolearn
from mojolearn.families import FAMILIES
from tests.native_calls import watching_runs

# Block.forward, Runner.forward, the family's launch, Runner.run
MAX_FRAMES = 4


def frames_to_native(block, call):
    """Python frames from call()'s callee to the frame that calls the
    binary's run (the forward op: the last run of the call)."""
    base = len(inspect.stack(0))
    stacks = []
    # the frames above on_run and the watching binary's run
    with watching_runs(block, lambda op, args: stacks.append(len(inspect.stack(0)) - 2)):
        call()
    assert stacks, "the call never reached the binary"
    return stacks[-1] - base - 1  # less the call lambda itself


@pytest.fixture(params=[f.kind for f in FAMILIES])
def block(request):
    fam = mojolearn.families.family(request.param)
    return fam.block_class(mojolearn.init_weights(request.param, 32, seed=0))


def test_forward_and_step_reach_the_native_call_in_at_most_four_frames(block):
    x = np.random.default_rng(0).random((2, 3, 32), dtype=np.float32)
    state = block.allocate_state(2)
    assert frames_to_native(block, lambda: block.forward(x)) <= MAX_FRAMES
    assert frames_to_native(block, lambda: block.forward(x, state)) <= MAX_FRAMES
    assert frames_to_native(block, lambda: block.step(x[:, :1], state)) <= MAX_FRAMES


def test_frame_count_control_one_more_layer_is_seen(block):
    # negative control: a layer that only forwards the call is counted
    x = np.random.default_rng(0).random((1, 2, 32), dtype=np.float32)

    def forwarding_layer():
        return block.forward(x)

    direct = frames_to_native(block, lambda: block.forward(x))
    assert frames_to_native(block, lambda: forwarding_layer()) == direct + 1
