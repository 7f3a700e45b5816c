"""The steps of a block's prepare op that Mamba-1, -2 and -3 share: its
plan, packing each projection's weight into panels in the format the
formats word gives it, and the blob header (the formats word and where
each projection's panels start)."""
from .abi import F32Ptr, I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int
from .weight_panels import pack_weight_panels, set_blob_formats, set_blob_section, valid_formats


@fieldwise_init
struct Projection(ImplicitlyCopyable):
    """One projection of a block as its prepare op packs it."""
    var weight: Int  # argument slot of the (rows, cols) weight
    var exps: Int  # argument slot of its int32 exponents (int8 weights)
    var rows: Int
    var cols: Int
    var wf: Int  # its format (linear.WF_*)
    var at: Int  # where its panels start in the blob


trait PreparedBlob:
    """A block's blob layout as its prepare op sees it."""

    def projection(self, sec: Int) -> Projection:
        """Projection sec (SEC_*): its argument slots, shape, format and place."""
        ...


def prepare_plan(phase: Int, wfs: Int, nproj: Int, blob_floats: Int, ntasks: Int) -> Int:
    """The plan of a prepare op: -3 when wfs is not a formats word of nproj
    projections; the blob's bytes (PLAN_WORKSPACE); ntasks tasks in phase 0."""
    if not valid_formats(wfs, nproj):
        return -3
    if phase == PLAN_WORKSPACE:
        return blob_floats * 4
    if phase == 0:
        return ntasks
    return PHASE_END


def pack_projection[D: PreparedBlob](args: I64Ptr, dims: D, sec: Int, blob: F32Ptr):
    """Projection sec's weight (and exponents) from the arguments into its
    panels in the blob."""
    var p = dims.projection(sec)
    pack_weight_panels(p.wf, arg_int(args, p.weight), arg_int(args, p.exps), p.rows, p.cols,
                       blob.unsafe_offset(p.at))


def set_blob_header[D: PreparedBlob](blob: F32Ptr, wfs: Int, dims: D, nproj: Int):
    """The formats word and each projection's section offset."""
    set_blob_formats(blob, wfs)
    for sec in range(nproj):
        set_blob_section(blob, sec, dims.projection(sec).at)
