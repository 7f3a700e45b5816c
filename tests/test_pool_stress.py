"""Regression: the host thread pool under many short phases (decode steps).

A stale ticket once let a worker claim a task of the next phase: a task ran
twice and the caller could spin forever. Run many steps on several threads
in a subprocess with a timeout, and check every output against 1 thread."""
import subprocess
import sys

CODE = r"""
import mojolearn
from tests.reference.weights import mamba1_weights, random_input
from tests.bits import assert_same_bits
import numpy as np
blk = mojolearn.Mamba1Block(mamba1_weights(16, 0))
x = random_input(2, 1500, 16, 1)
def run(n):
    mojolearn.set_num_threads(n)
    st = blk.allocate_state(2)
    with blk.decode_session(st) as s:
        return np.concatenate([np.asarray(s.step(x[:, t])) for t in range(x.shape[1])], 1)
ref = run(1)
for n in (2, 3, 2):
    assert_same_bits(run(n), ref, f"{n} threads")
print("OK")
"""


def test_many_short_phases_on_several_threads():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
