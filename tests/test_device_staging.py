"""The buffer tables a GPU binary stages by (ml_buffers), checked on the CPU.

With emulate_device the host layer stages every op's buffers in fresh host
copies exactly as a GPU binary does on the device (python/native/device.h):
inputs copied in, output-only and scratch copies starting as NaN bytes,
outputs copied back, a guard after each copy. Every case of the GPU check's
matrix (bench/gpu_cases.py) must give the same bytes as the direct run; a
short size or a wrong direction would change them or raise. A missing slot
could go unseen that way (its pointer keeps the host address, which the
CPU tasks can read), so the emulation also refuses any argument outside the
table that points into caller memory, and the drop_op/drop_row hook plays a
binary whose table misses a row: every row of every op must be caught.
"""
import array

import pytest

np = pytest.importorskip("numpy")

import mojolearn  # noqa: E402
from mojolearn import _abi, _loader  # noqa: E402
from bench import gpu_cases, math_cases  # noqa: E402
from tests.errors import raises_naming  # noqa: E402
from mojolearn.reference.weights import random_input  # noqa: E402


@pytest.fixture
def emulated():
    lib = _loader.library()
    before = lib.emulate_device
    yield lib
    lib.emulate_device = before


@pytest.mark.parametrize("shape", gpu_cases.SHAPES, ids=lambda s: f"m{s[0]}-d{s[1]}-B{s[2]}-L{s[3]}")
def test_staged_run_gives_the_direct_bytes(shape, emulated):
    emulated.emulate_device = False
    direct = gpu_cases.run_case(mojolearn, *shape)
    emulated.emulate_device = True
    staged = gpu_cases.run_case(mojolearn, *shape)
    assert list(staged) == list(direct)
    for name in direct:
        assert staged[name] == direct[name], name


@pytest.mark.parametrize("shape", gpu_cases.PACKED, ids=lambda s: f"m{s[0]}-packed")
def test_staged_run_on_packed_weights_gives_the_direct_bytes(shape, emulated):
    emulated.emulate_device = False
    direct = gpu_cases.run_packed(mojolearn, *shape)
    emulated.emulate_device = True
    assert gpu_cases.run_packed(mojolearn, *shape) == direct


def test_staged_math_gives_the_direct_bytes(emulated):
    emulated.emulate_device = False
    direct = math_cases.run_math(emulated)
    emulated.emulate_device = True
    staged = math_cases.run_math(emulated)
    assert len(direct) == math_cases.MATH_FUNCTIONS and staged == direct


def test_staging_compares_bytes_that_can_differ():
    # the comparison above can fail: another seed's weights change the bytes
    a = gpu_cases.run_case(mojolearn, *gpu_cases.SHAPES[0])
    w = gpu_cases._weights(1, 32)
    w["D"] = w["D"] + np.float32(1e-3)
    y = mojolearn.Mamba1Block(w).forward(random_input(1, 5, 32, seed=7))
    assert np.asarray(y).tobytes() != a["m1 d32 B1 L5 forward"]


def _math_eval_args(src_addr, dst_addr, n):
    """exp, elementwise (OP_MATH_EVAL)."""
    lib = _loader.library()
    return _abi.op_spec(lib, _abi.OP_MATH_EVAL).pack(fn=0, src=src_addr, dst=dst_addr,
                                                     n=n, width=1)


def test_staging_writes_outputs_back_and_keeps_inputs(emulated):
    src = array.array("f", [0.0, 1.0, -2.0, 3.5])
    dst = array.array("f", [9.0] * 4)
    emulated.emulate_device = True
    emulated.run(_abi.OP_MATH_EVAL, _math_eval_args(
        _loader.native().address(src), _loader.native().address(dst, True), 4))
    assert list(src) == [0.0, 1.0, -2.0, 3.5]
    assert dst[0] == 1.0 and dst[1] != 9.0


def test_overlapping_buffers_are_refused_when_staged(emulated):
    buf = array.array("f", [0.5] * 8)
    base = _loader.native().address(buf, True)
    args = _math_eval_args(base, base + 8, 4)  # dst overlaps src by 2 floats
    emulated.emulate_device = False
    emulated.run(_abi.OP_MATH_EVAL, list(args))  # fine on the host
    emulated.emulate_device = True
    with raises_naming(RuntimeError, "overlap", "separate buffers"):
        emulated.run(_abi.OP_MATH_EVAL, list(args))


def _every_path(kind, fmt="float32"):
    """One small block run through every call that reaches a device op:
    forward, ragged forward, forward with a state, step, a decode session
    step, backward (float32 only; also from a state with final-state
    cotangents, and ragged)."""
    def run():
        d, b, l = 32, 2, 6
        w = gpu_cases._weights(kind, d)
        if fmt != "float32":
            w = mojolearn.lowbit.pack(w, fmt)
        block = gpu_cases.block_for(mojolearn, kind, d) if fmt == "float32" else \
            {1: mojolearn.Mamba1Block, 2: mojolearn.Mamba2Block, 3: mojolearn.Mamba3Block}[kind](w)
        x = random_input(b, l, d, seed=3)
        block.forward(x, lengths=[l, 2])
        state = block.allocate_state(b)
        block.forward(x[:, :4], state)
        block.step(x[:, 4], state)
        with block.decode_session(state) as s:
            s.step(np.ascontiguousarray(x[:, 5]))
        if fmt == "float32":
            g = random_input(b, l, d, seed=4)
            block.backward(x, g)
            if kind == 1:
                block.backward(x, g, state, grad_state=state, lengths=[l, 3])
            if kind == 3:  # through a state (an open chunk), with final-state cotangents
                block.backward(x, g, state, grad_state={"h": np.asarray(state.h),
                                                        "buffer_v": np.asarray(state.buffer_v)})
                block.backward(x, g, lengths=[l, 2])
            if kind == 2:  # through a state (an open chunk), with final-state cotangents
                block.backward(x, g, state, grad_state={"h": np.asarray(state.h),
                                                        "buffer_xbc": np.asarray(state.buffer_xbc)})
                block.backward(x, g, lengths=[l, 2])
    return run


PATHS = [(k, f) for k in (1, 2, 3) for f in ("float32", "bfloat16", "int8", "q4_0")]


@pytest.mark.parametrize("kind,fmt", PATHS, ids=lambda v: str(v))
def test_every_missing_table_row_is_caught(kind, fmt, emulated):
    # A binary whose table misses a row would hand that slot's host pointer
    # to a device. The emulation must refuse it for every row of every op
    # these calls reach (the drop_op/drop_row hook plays that binary).
    run = _every_path(kind, fmt)
    emulated.emulate_device = True
    emulated.staged_rows = {}
    run()
    rows = dict(emulated.staged_rows)
    assert rows, "no op was staged"
    ops = _abi.op_names()
    assert ops[f"OP_M{kind}_FORWARD"] in rows
    if fmt == "float32":
        assert ops[f"OP_M{kind}_BACKWARD"] in rows
    try:
        for op, n in rows.items():
            for row in range(n):
                emulated.drop_op, emulated.drop_row = op, row
                with pytest.raises(RuntimeError, match=r"not in the op's buffer table"):
                    run()
    finally:
        emulated.drop_op, emulated.drop_row = -1, -1


def test_math_eval_missing_row_is_caught(emulated):
    emulated.emulate_device = True  # (addresses taken before are not tracked)
    src, dst = array.array("f", [0.5] * 8), array.array("f", [0.0] * 8)
    args = _math_eval_args(_loader.native().address(src), _loader.native().address(dst, True), 8)
    emulated.staged_rows = {}
    emulated.run(_abi.OP_MATH_EVAL, list(args))
    assert emulated.staged_rows == {_abi.OP_MATH_EVAL: 2}
    try:
        for row in range(2):
            emulated.drop_op, emulated.drop_row = _abi.OP_MATH_EVAL, row
            slot = _abi.op_spec(emulated, _abi.OP_MATH_EVAL).slot(("src", "dst")[row])
            with pytest.raises(RuntimeError, match=r"slot %d holds the address" % slot):
                emulated.run(_abi.OP_MATH_EVAL, list(args))
    finally:
        emulated.drop_op, emulated.drop_row = -1, -1


def _lm_run(folder, fmt):
    """A small MambaLM through every LM op: logits (embed, head) and
    generation with greedy and top-k / top-p sampling (next-token)."""
    def run():
        lm = mojolearn.MambaLM(folder, weight_format=fmt)
        logits = np.asarray(lm.logits([[1, 2, 3], [4, 5, 6]])).tobytes()
        toks = lm.generate([[1, 2, 3], [7]], max_new_tokens=3, temperature=[0.0, 0.9],
                           top_k=[0, 5], top_p=[1.0, 0.8], seed=[1, 2])
        return logits, toks
    return run


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    from mojolearn.save import save_checkpoint
    w = gpu_cases._weights(1, 32)
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((40, 32)).astype(np.float32)
    return save_checkpoint(tmp_path_factory.mktemp("lm"), "mamba", [w, w], emb,
                           np.ones(32, np.float32))


@pytest.mark.parametrize("fmt", ["float32", "int8", "q4_0"])
def test_lm_ops_stage_every_row_and_give_the_direct_bytes(lm_folder, fmt, emulated):
    run = _lm_run(lm_folder, fmt)
    emulated.emulate_device = False
    direct = run()
    emulated.emulate_device = True
    emulated.staged_rows = {}
    assert run() == direct
    rows = dict(emulated.staged_rows)
    lm_ops = [_abi.OP_LM_EMBED, _abi.OP_LM_LOGITS, _abi.OP_LM_NEXT]
    assert all(op in rows for op in lm_ops)
    try:
        for op in lm_ops:
            for row in range(rows[op]):
                emulated.drop_op, emulated.drop_row = op, row
                with pytest.raises(RuntimeError, match=r"not in the op's buffer table"):
                    run()
    finally:
        emulated.drop_op, emulated.drop_row = -1, -1
