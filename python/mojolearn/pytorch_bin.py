"""``pytorch_model.bin`` (``torch.save`` of a state_dict) read without PyTorch.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (a pickle of the
state_dict) and one uncompressed member ``<name>/data/<key>`` per storage
(raw little-endian values). A pickle is a program: loading one with
``pickle.load`` may run any function it names. This reader runs the
pickle through an unpickler whose ``find_class`` hands out only stand-ins
of its own for the names a state_dict needs:

- ``collections.OrderedDict`` (the dict and each tensor's empty hooks);
- ``torch._utils._rebuild_tensor_v2`` (a tensor: storage, offset, size,
  stride) and ``torch._utils._rebuild_parameter`` (an ``nn.Parameter``
  around one);
- the storage types ``torch.FloatStorage``, ``torch.BFloat16Storage``,
  ``torch.HalfStorage`` (float32, and the two widened exactly).

Every other name (``os.system``, ``builtins.eval``, a custom class, another
dtype's storage) is refused with a ValueError naming it, before anything is
called: the stand-ins only record their arguments. Each tensor becomes a
:class:`mojolearn.safetensors.LazyTensor` over its bytes in the archive, so
nothing is read until a block needs it. The legacy (pre-zip) ``torch.save``
format is refused.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

from .safetensors import LazyTensor

__all__ = ["read_pytorch_bin", "PickleRefused"]

_STORAGES = {"FloatStorage": ("F32", 4), "BFloat16Storage": ("BF16", 2),
             "HalfStorage": ("F16", 2)}
_ALLOWED = ("collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
            "torch._utils._rebuild_parameter") + tuple(f"torch.{s}" for s in _STORAGES)
_MAX_PICKLE = 64 << 20  # data.pkl of a state_dict is a few hundred bytes per tensor


class PickleRefused(ValueError):
    """A pickle named something a state_dict does not hold (or malformed
    records): raised before anything it names is called."""


class _Storage:
    """A storage type named by the pickle (a stand-in, never called)."""

    def __init__(self, name):
        self.name = name
        self.dtype, self.itemsize = _STORAGES[name]


class _TensorRecord:
    """What _rebuild_tensor_v2 was asked to build."""

    def __init__(self, storage, offset, size, stride, *rest):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor_v2(*args):
    if len(args) < 4:
        raise ValueError("a tensor record has fewer than 4 arguments")
    return _TensorRecord(*args)


def _rebuild_parameter(data, *rest):
    if not isinstance(data, _TensorRecord):
        raise ValueError("a parameter record does not hold a tensor")
    return data


def _ordered_dict(*args):
    if args:  # a state_dict's OrderedDict is built empty, then filled
        raise ValueError("collections.OrderedDict is called with arguments")
    return collections.OrderedDict()


_STANDINS = {"collections.OrderedDict": _ordered_dict,
             "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
             "torch._utils._rebuild_parameter": _rebuild_parameter}


class _Unpickler(pickle.Unpickler):
    """Only the stand-ins above; storages arrive as persistent ids."""

    def __init__(self, data, where):
        super().__init__(io.BytesIO(data))
        self.where = where
        self.storages = {}

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if full in _STANDINS:
            return _STANDINS[full]
        if module == "torch" and name in _STORAGES:
            return _Storage(name)
        raise PickleRefused(f"{self.where}: the pickle names {full}, which is not part of a "
                         f"state_dict of float32/bfloat16/float16 tensors: refused "
                         f"(accepted: {', '.join(_ALLOWED)})")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Storage) and isinstance(pid[2], str)
                and isinstance(pid[4], int) and not isinstance(pid[4], bool)):
            raise PickleRefused(f"{self.where}: a persistent id is not a storage record: "
                             f"{pid!r:.200}")
        return self.storages.setdefault(pid[2], (pid[1], pid[2], pid[4]))


def _member_offset(f, info) -> int:
    """Where a stored zip member's bytes start in the file."""
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ValueError(f"zip member {info.filename} has no local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read_pytorch_bin(path) -> dict:
    """{name: LazyTensor} of a ``torch.save``'d state_dict (zip format).

    Raises
    ------
    ValueError naming the file and what is wrong: not a zip archive (the
    legacy format), a pickle naming anything but a tensor record (named),
    a tensor that is not a dense row-major view inside its storage (named),
    a big-endian archive.
    """
    path = Path(path)
    where = f"{path}"
    try:
        zf = zipfile.ZipFile(path)
    except _ZIP_ERRORS as e:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"\x80\x02":
            raise ValueError(f"{where} is in the legacy (pre-zip) torch.save format, which is "
                             "not read: save it again with a current torch.save, or as "
                             "safetensors") from None
        raise ValueError(f"{where} is not a torch.save zip archive ({e})") from None
    try:
        with zf:
            return _read_archive(zf, path, where)
    except _ZIP_ERRORS as e:
        raise ValueError(f"{where}: a damaged zip archive ({type(e).__name__}: {e})") from None


# what zipfile raises on damaged archives (a bad CRC, a short member, bad sizes)
_ZIP_ERRORS = (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, OverflowError,
               zlib.error, UnicodeDecodeError)


def _read_archive(zf, path, where) -> dict:
    infos = {i.filename: i for i in zf.infolist()}
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise ValueError(f"{where}: no <name>/data.pkl in the archive")
    prefix = pkl[0][: -len("data.pkl")]
    order = infos.get(prefix + "byteorder")
    if order is not None and zf.read(order).strip() != b"little":
        raise ValueError(f"{where}: a big-endian archive is not read")
    if infos[pkl[0]].file_size > _MAX_PICKLE:
        raise ValueError(f"{where}: data.pkl is larger than {_MAX_PICKLE} bytes")
    unpickler = _Unpickler(zf.read(pkl[0]), where)
    try:
        obj = unpickler.load()
    except PickleRefused:
        raise
    except Exception as e:  # malformed pickle bytes: any of pickle's error kinds
        raise ValueError(f"{where}: data.pkl is not a readable pickle "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ValueError(f"{where}: the pickle is not a state_dict (a dict of names "
                         f"to tensors), got {type(obj).__name__}")
    out = {}
    with open(path, "rb") as f:
        for name, rec in obj.items():
            out[name] = _lazy(f, infos, prefix, name, rec, path, where)
    return out


def _lazy(f, infos, prefix, name, rec, path, where) -> LazyTensor:
    if not isinstance(rec, _TensorRecord):
        raise ValueError(f"{where}: {name} is not a tensor ({type(rec).__name__})")
    storage, offset, size, stride = rec.storage, rec.offset, rec.size, rec.stride
    ints = lambda t: isinstance(t, tuple) and all(  # noqa: E731
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in t)
    if not (isinstance(storage, tuple) and ints((offset,)) and ints(size) and ints(stride)
            and len(size) == len(stride)):
        raise ValueError(f"{where}: tensor {name} has a malformed record")
    kind, key, numel = storage
    want, step = [], 1
    for s in reversed(size):
        want.append(step)
        step *= s
    if any(s > 1 and st != w for s, st, w in zip(size, stride, reversed(want))):
        raise ValueError(f"{where}: tensor {name} is not dense row-major (stride {stride} "
                         f"for size {size}); save .contiguous() tensors")
    info = infos.get(f"{prefix}data/{key}")
    if info is None:
        raise ValueError(f"{where}: tensor {name}'s storage {key} is not in the archive")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{where}: tensor {name}'s storage {key} is compressed")
    if info.file_size != numel * kind.itemsize or offset + step > numel:
        raise ValueError(f"{where}: tensor {name} lies outside its storage {key} "
                         f"({numel} values)")
    begin = _member_offset(f, info) + offset * kind.itemsize
    return LazyTensor(path, name, kind.dtype, size, begin, 0)
