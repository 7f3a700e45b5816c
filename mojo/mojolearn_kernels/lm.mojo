"""The ends of a language model: token embedding, final RMSNorm + LM head,
and the choice of the next token.

The vocabulary matrices live in a prepared blob, in the weight format they
were given in (float32 values, bfloat16 bits, int8 codes with a power-of-
two scale per row, or q4_0 / q8_0 blocks: mojolearn.lowbit), as linear.mojo's
panels:
    header | final norm weight (d) | head panels (V, d) | embedding panels
The embedding section is the head section itself when the weights are tied,
so a tied model holds one copy. Blob header word 1 is the head's offset,
word 2 the embedding's (weight_panels.mojo's section words); the head and
an untied embedding may each have its own format (the formats word: head
in bits 0..3, embedding in bits 4..7, equal when tied).

Canonical order (identical mode):
- embedding: a copy of the row (float32), or its exact widening (bfloat16
  bits << 16; int8 code * 2^e; q4_0 (q - 8) * d; q8_0 q * d): no arithmetic
  that could round.
- logits: h = norm_w * (x * r), r the RMSNorm scale of x (norms.mojo);
  logits = h @ W^T in linear.mojo's order (one sequential fma chain over k
  per output), so a row's logits do not depend on the other rows.
- next token (one task per row; a pure function of the row's logits, its
  parameters and its uniform number u):
    temperature 0: the first index of the largest logit;
    else the candidates are all ids in index order, or with top_k (0 < k <
    V) or top_p (< 1) the ids sorted by (logit descending, id ascending),
    cut to the first k; m = their largest logit; p_i = exp((l_i - m) / T)
    (numerics.exp_f32); with top_p, the shortest prefix whose sequential
    sum reaches top_p * (sum of all candidates' p) (at least one id); then
    target = u * (sequential sum of the kept p), and the token is the first
    kept id whose running sum exceeds target (the last kept id if none).
"""
from std.memory import Pointer, bitcast
from .abi import (
    F32Ptr, I64Ptr, PLAN_WORKSPACE, PHASE_END, ALIGN_FLOATS, arg_int, arg_f32, arg_i64,
    ceil_div, round_up, one_phase_plan,
)
from .linear import (
    NR, WF_F32, WF_BF16, WF_INT8, WF_Q4_0, WF_Q8_0, QBLOCK, packed_floats,
    panel_floats, panel_floats_wf, f16_widen,
)
from .linear import matmul_ntasks, matmul_task_wf
from .weight_panels import (
    pack_weight_panels, set_blob_formats, set_blob_section, blob_formats, valid_formats,
    section_format, O_SECTIONS,
)
from .norms import rmsnorm_row, NORM_ROWS_PER_TASK
from .numerics import exp_f32

comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

# OP_LM_PREPARE argument slots.
comptime LMP_D = 0
comptime LMP_V = 1
comptime LMP_NORM = 2  # float32 (d,) final RMSNorm weight
comptime LMP_HEAD = 3  # (V, d) lm_head weight: float32 values or packed codes
comptime LMP_HEAD_EXP = 4  # int8: int32 exponents (V,)
comptime LMP_EMB = 5  # (V, d) embedding; 0: tied (the head is the embedding)
comptime LMP_EMB_EXP = 6
comptime LMP_WFMT = 7  # formats word (weight_panels.mojo): head, then embedding
comptime LMP_BLOB = 8
# The call packs rows [row0, row0 + nrows) of the vocabulary (row0 a multiple
# of 16; the head/embedding pointers point at those rows), so a large
# vocabulary can be packed in pieces as it is read.
comptime LMP_ROW0 = 9
comptime LMP_NROWS = 10

# OP_LM_EMBED argument slots.
comptime LME_N = 0  # tokens
comptime LME_D = 1
comptime LME_V = 2
comptime LME_TOKENS = 3  # int64 (n,), each in [0, V) (the caller checks)
comptime LME_BLOB = 4
comptime LME_X = 5  # float32 (n, d) out

# OP_LM_LOGITS argument slots.
comptime LML_R = 0  # rows
comptime LML_D = 1
comptime LML_V = 2
comptime LML_X = 3  # float32 (R, d): the last block's outputs
comptime LML_BLOB = 4
comptime LML_WORK = 5
comptime LML_OUT = 6  # float32 (R, V) out

# OP_LM_NEXT argument slots.
comptime LMN_R = 0
comptime LMN_V = 1
comptime LMN_LOGITS = 2  # float32 (R, V)
comptime LMN_TEMP = 3  # float32 (R,): 0 for greedy
comptime LMN_TOPK = 4  # int64 (R,): 0 for no cut
comptime LMN_TOPP = 5  # float32 (R,): 1 for no cut
comptime LMN_U = 6  # float32 (R,) in [0, 1)
comptime LMN_WORK = 7  # int32 (R, V) candidate ids
comptime LMN_OUT = 8  # int64 (R,) out

comptime SEC_HEAD = 0  # sections (header words, formats word nibbles)
comptime SEC_EMB = 1

comptime EMBED_ROWS_PER_TASK = 16


struct LMDims(ImplicitlyCopyable):
    """Sizes of the vocabulary ends and the layout of their blob."""
    var d: Int
    var v: Int
    var wf: Int  # the head's format (linear.WF_*)
    var wf_emb: Int  # the embedding's (the head's when tied)
    var o_norm: Int
    var o_head: Int
    var o_emb: Int
    var blob: Int  # floats

    def __init__(out self, d: Int, v: Int, wfs: Int, tied: Bool):
        self.d = d
        self.v = v
        self.wf = section_format(wfs, SEC_HEAD)
        self.wf_emb = self.wf if tied else section_format(wfs, SEC_EMB)
        var o = ALIGN_FLOATS  # header (weight_panels.mojo)
        self.o_norm = o
        o += round_up(d, ALIGN_FLOATS)
        self.o_head = o
        o += packed_floats(v, d, self.wf)
        self.o_emb = self.o_head
        if not tied:
            self.o_emb = o
            o += packed_floats(v, d, self.wf_emb)
        self.blob = o


@always_inline
def _word(blob: F32Ptr, i: Int) -> Int:
    return Int(bitcast[DType.int32, 1](blob[unsafe_offset=i]))


def lm_blob_dims(blob: F32Ptr, d: Int, v: Int) -> LMDims:
    """The layout a prepared blob records (formats, tied) for sizes d, v;
    float32 untied for a null blob (the slot declaration's text form)."""
    if Int(blob) == 0:
        return LMDims(d, v, WF_F32, False)
    var tied = _word(blob, O_SECTIONS + SEC_HEAD) == _word(blob, O_SECTIONS + SEC_EMB)
    return LMDims(d, v, blob_formats(blob), tied)


def _valid_lm_formats(wfs: Int, tied: Bool) -> Bool:
    """Two formats (head, embedding), equal when the weights are tied."""
    if not valid_formats(wfs, 2):
        return False
    return not tied or section_format(wfs, SEC_HEAD) == section_format(wfs, SEC_EMB)


# ---------------------------------------------------------------- prepare


def lm_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    var wfs = arg_int(args, LMP_WFMT)
    var row0 = arg_int(args, LMP_ROW0)
    var n = arg_int(args, LMP_NROWS)
    var tied = arg_int(args, LMP_EMB) == 0
    if not _valid_lm_formats(wfs, tied) or row0 % NR != 0 or n < 0 \
            or row0 + n > arg_int(args, LMP_V):
        return -3
    var dm = LMDims(arg_int(args, LMP_D), arg_int(args, LMP_V), wfs, tied)
    return one_phase_plan(phase, 3, dm.blob * 4)


def lm_prepare_task(args: I64Ptr, phase: Int, task: Int):
    var wfs = arg_int(args, LMP_WFMT)
    var tied = arg_int(args, LMP_EMB) == 0
    var dm = LMDims(arg_int(args, LMP_D), arg_int(args, LMP_V), wfs, tied)
    var blob = arg_f32(args, LMP_BLOB)
    var row0 = arg_int(args, LMP_ROW0)
    var n = arg_int(args, LMP_NROWS)
    var p0 = row0 // NR  # the first panel of these rows
    if task == 0:
        pack_weight_panels(dm.wf, arg_int(args, LMP_HEAD), arg_int(args, LMP_HEAD_EXP), n, dm.d,
                           blob.unsafe_offset(dm.o_head + p0 * panel_floats_wf(dm.wf, dm.d)))
    elif task == 1:
        if not tied:
            pack_weight_panels(
                dm.wf_emb, arg_int(args, LMP_EMB), arg_int(args, LMP_EMB_EXP), n, dm.d,
                blob.unsafe_offset(dm.o_emb + p0 * panel_floats_wf(dm.wf_emb, dm.d)))
    else:
        set_blob_formats(blob, wfs)
        set_blob_section(blob, SEC_HEAD, dm.o_head)
        set_blob_section(blob, SEC_EMB, dm.o_emb)
        var w = arg_f32(args, LMP_NORM)
        for j in range(dm.d):
            blob[unsafe_offset=dm.o_norm + j] = w[unsafe_offset=j]


# ---------------------------------------------------------------- embed


def lm_embed_plan(args: I64Ptr, phase: Int) -> Int:
    if not valid_formats(blob_formats(arg_f32(args, LME_BLOB)), 2):
        return -3
    return one_phase_plan(phase, ceil_div(arg_int(args, LME_N), EMBED_ROWS_PER_TASK))


def lm_embed_task(args: I64Ptr, phase: Int, task: Int):
    var blob = arg_f32(args, LME_BLOB)
    var dm = lm_blob_dims(blob, arg_int(args, LME_D), arg_int(args, LME_V))
    var toks = arg_i64(args, LME_TOKENS)
    var x = arg_f32(args, LME_X)
    var n = arg_int(args, LME_N)
    var emb = blob.unsafe_offset(dm.o_emb)
    for i in range(task * EMBED_ROWS_PER_TASK, min(n, (task + 1) * EMBED_ROWS_PER_TASK)):
        var t = Int(toks[unsafe_offset=i])
        var p = t // NR
        var j = t % NR
        var dst = x.unsafe_offset(i * dm.d)
        if dm.wf_emb == WF_BF16:
            var h = emb.unsafe_offset(p * panel_floats[WF_BF16](dm.d)).unsafe_bitcast[UInt16]()
            for k in range(dm.d):
                var bits = UInt32(h[unsafe_offset=k * NR + j]) << 16
                dst[unsafe_offset=k] = bitcast[DType.float32, 1](bits)
        elif dm.wf_emb == WF_INT8:
            var panel = emb.unsafe_offset(p * panel_floats[WF_INT8](dm.d))
            var scale = panel[unsafe_offset=j]
            var codes = panel.unsafe_offset(NR).unsafe_bitcast[Int8]()
            for k in range(dm.d):
                dst[unsafe_offset=k] = Float32(codes[unsafe_offset=k * NR + j]) * scale
        elif dm.wf_emb == WF_Q4_0 or dm.wf_emb == WF_Q8_0:
            _embed_blocks(dm.wf_emb, emb.unsafe_offset(p * panel_floats_wf(dm.wf_emb, dm.d)), j,
                          dm.d, dst)
        else:
            var panel = emb.unsafe_offset(p * panel_floats[WF_F32](dm.d))
            for k in range(dm.d):
                dst[unsafe_offset=k] = panel[unsafe_offset=k * NR + j]


def _embed_blocks(wf: Int, panel: F32Ptr, j: Int, d: Int, dst: F32Ptr):
    """Row j of a q4_0 / q8_0 panel, widened as linear._wload does."""
    var bs = panel_floats_wf(wf, QBLOCK)
    for k in range(d):
        var blk = panel.unsafe_offset((k // QBLOCK) * bs)
        var scale = f16_widen[1](blk.unsafe_bitcast[UInt16]()[unsafe_offset=j])[0]
        var codes = blk.unsafe_offset(NR // 2).unsafe_bitcast[UInt8]()
        var t = k % QBLOCK
        if wf == WF_Q4_0:
            var b = Int(codes[unsafe_offset=(t % (QBLOCK // 2)) * NR + j])
            var q = (b >> 4) if t >= QBLOCK // 2 else (b & 0xF)
            dst[unsafe_offset=k] = Float32(q - 8) * scale
        else:
            var c = bitcast[DType.int8, 1](codes[unsafe_offset=t * NR + j])
            dst[unsafe_offset=k] = Float32(Int(c)) * scale


# ---------------------------------------------------------------- logits


def lm_logits_plan(args: I64Ptr, phase: Int) -> Int:
    if not valid_formats(blob_formats(arg_f32(args, LML_BLOB)), 2):
        return -3
    var r = arg_int(args, LML_R)
    if phase == PLAN_WORKSPACE:
        return round_up(r * arg_int(args, LML_D), ALIGN_FLOATS) * 4
    if phase == 0:
        return ceil_div(r, NORM_ROWS_PER_TASK)
    if phase == 1:
        return matmul_ntasks(r, arg_int(args, LML_V))
    return PHASE_END


def lm_logits_task(args: I64Ptr, phase: Int, task: Int):
    var blob = arg_f32(args, LML_BLOB)
    var dm = lm_blob_dims(blob, arg_int(args, LML_D), arg_int(args, LML_V))
    var r = arg_int(args, LML_R)
    var xn = arg_f32(args, LML_WORK)
    if phase == 0:
        var x = arg_f32(args, LML_X)
        var w = blob.unsafe_offset(dm.o_norm)
        for i in range(task * NORM_ROWS_PER_TASK, min(r, (task + 1) * NORM_ROWS_PER_TASK)):
            rmsnorm_row(x.unsafe_offset(i * dm.d), dm.d, w, xn.unsafe_offset(i * dm.d))
        return
    _ = matmul_task_wf(dm.wf, task, xn, dm.d, r, blob.unsafe_offset(dm.o_head), dm.d, dm.v,
                       arg_f32(args, LML_OUT), dm.v)


# ---------------------------------------------------------------- next token


def lm_next_plan(args: I64Ptr, phase: Int) -> Int:
    var r = arg_int(args, LMN_R)
    return one_phase_plan(phase, r, r * arg_int(args, LMN_V) * 4)


@always_inline
def _better(lg: F32Ptr, a: Int32, b: Int32) -> Bool:
    """Whether id a ranks before id b: larger logit, then smaller id."""
    var la = lg[unsafe_offset=Int(a)]
    var lb = lg[unsafe_offset=Int(b)]
    return la > lb or (la == lb and a < b)


def _sift_down(h: I32Ptr, n: Int, start: Int, lg: F32Ptr):
    """Restore a heap whose root is its worst-ranked id."""
    var i = start
    while True:
        var c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _better(lg, h[unsafe_offset=c], h[unsafe_offset=c + 1]):
            c += 1  # the worse child
        if not _better(lg, h[unsafe_offset=i], h[unsafe_offset=c]):
            return
        var t = h[unsafe_offset=i]
        h[unsafe_offset=i] = h[unsafe_offset=c]
        h[unsafe_offset=c] = t
        i = c


def _rank(h: I32Ptr, v: Int, k: Int, lg: F32Ptr):
    """h[0:k] = the k best-ranked of ids 0..v-1, best first."""
    for i in range(k):
        h[unsafe_offset=i] = Int32(i)
    var i = k // 2 - 1
    while i >= 0:
        _sift_down(h, k, i, lg)
        i -= 1
    for t in range(k, v):
        if _better(lg, Int32(t), h[unsafe_offset=0]):
            h[unsafe_offset=0] = Int32(t)
            _sift_down(h, k, 0, lg)
    var end = k - 1
    while end > 0:
        var t = h[unsafe_offset=0]
        h[unsafe_offset=0] = h[unsafe_offset=end]
        h[unsafe_offset=end] = t
        _sift_down(h, end, 0, lg)
        end -= 1


@always_inline
def _weight(l: Float32, m: Float32, t: Float32) -> Float32:
    return exp_f32[1]((l - m) / t)[0]


def lm_next_task(args: I64Ptr, phase: Int, task: Int):
    var v = arg_int(args, LMN_V)
    var lg = arg_f32(args, LMN_LOGITS).unsafe_offset(task * v)
    var out = arg_i64(args, LMN_OUT)
    var t = arg_f32(args, LMN_TEMP)[unsafe_offset=task]
    if t <= 0.0:
        var best = 0
        for i in range(1, v):
            if lg[unsafe_offset=i] > lg[unsafe_offset=best]:
                best = i
        out[unsafe_offset=task] = Int64(best)
        return
    var k = Int(arg_i64(args, LMN_TOPK)[unsafe_offset=task])
    var top_p = arg_f32(args, LMN_TOPP)[unsafe_offset=task]
    var ids = arg_f32(args, LMN_WORK).unsafe_offset(task * v).unsafe_bitcast[Int32]()
    var n = v
    var sorted = False
    if k > 0 and k < v:
        n = k
        sorted = True
    elif top_p < 1.0:
        sorted = True
    if sorted:
        _rank(ids, v, n, lg)
    else:
        for i in range(v):
            ids[unsafe_offset=i] = Int32(i)
    var m = lg[unsafe_offset=Int(ids[unsafe_offset=0])]
    if not sorted:
        for i in range(1, v):
            m = max(m, lg[unsafe_offset=i])
    var kept = n
    if top_p < 1.0:
        var total: Float32 = 0.0
        for i in range(n):
            total += _weight(lg[unsafe_offset=Int(ids[unsafe_offset=i])], m, t)
        var goal = top_p * total
        var run: Float32 = 0.0
        kept = 0
        while kept < n:
            run += _weight(lg[unsafe_offset=Int(ids[unsafe_offset=kept])], m, t)
            kept += 1
            if run >= goal:
                break
    var mass: Float32 = 0.0
    for i in range(kept):
        mass += _weight(lg[unsafe_offset=Int(ids[unsafe_offset=i])], m, t)
    var target = arg_f32(args, LMN_U)[unsafe_offset=task] * mass
    var run: Float32 = 0.0
    var pick = Int(ids[unsafe_offset=kept - 1])
    for i in range(kept):
        var id = Int(ids[unsafe_offset=i])
        run += _weight(lg[unsafe_offset=id], m, t)
        if run > target:
            pick = id
            break
    out[unsafe_offset=task] = Int64(pick)
