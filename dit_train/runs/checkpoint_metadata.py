"""DCP's `.metadata` file read as data: a checkpoint from elsewhere can name no code and reach no file.

`.metadata` is a pickle, and a pickle can call anything it can name. It is read here with:
- an allow-list of exact (module, name) pairs, each mapped to the object we imported ourselves: a name is never
  resolved by the pickle machinery, so dotted names (protocol 4 follows `a.b.c`, e.g. `...filesystem` +
  `...subprocess.Popen`) and aliases reach nothing;
- the pure-Python unpickler, whose BUILD sets state only on new instances of DCP's dataclasses (BUILD on a
  class, a function or an enum member would set attributes of our own code), and no persistent ids;
- a check of the result's shape: DCP's dataclasses in the places DCP puts them, and storage entries that name a
  plain file in the checkpoint folder (`__0_0.distcp`, never `../x` or `/etc/passwd`) with no byte transforms;
- the files themselves: regular files, never a symbolic link (to a file elsewhere) or a FIFO (a reader that hangs);
- the sizes: the tensors it declares fit in its shard files (the readers allocate what it declares: a crafted size of
  terabytes was an allocation failure, or an out-of-memory where the allocator gave the memory).
Anything else is refused with one line: `RefusedMetadata` (could run code or read elsewhere) or `DamagedMetadata`
(empty, truncated, declaring more than it holds, or not DCP's).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pathlib
import pickle
import re

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md

SHARD_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp$")  # DCP writes __<rank>_<n>.distcp
# The largest `.metadata` a real checkpoint has, with a wide margin; a larger one is refused before it is read (it is
# read whole: a sparse 3 GB file took 3.4 GB and 48 s before it was found damaged; 30 GB was an out-of-memory kill).
# It holds one entry per tensor per chunk, and FSDP2 writes one chunk per rank: dit_15b has 611 parameters, so
# model + EMA + AdamW's exp_avg, exp_avg_sq and step ~ 3,100 tensors; x 1 chunk per rank x 512 ranks (16x the preset's
# 4 nodes x 8 GPUs) x 300 bytes per entry (measured: 246 B at 1 rank in the `experiment=debug` checkpoint, 178 B per
# entry at 32 ranks in its metadata re-chunked 32 ways) = 476 MB, under 512 MiB.
MAX_METADATA_BYTES = 512 << 20


class RefusedMetadata(pickle.UnpicklingError):
    """The metadata names something a checkpoint never holds, or a file outside its folder."""


class DamagedMetadata(ValueError):
    """The metadata is empty, truncated or not a DCP metadata record."""


def _allowed() -> dict[tuple[str, str], object]:
    """(module, name) -> the object itself. DCP's metadata dataclasses and enum, its per-entry storage record,
    torch's dtypes (pickled by their canonical name), torch.Size, the layout lookup, paths and OrderedDict."""
    md_types = [dcp_md.Metadata, dcp_md.StorageMeta, dcp_md.MetadataIndex, dcp_md.TensorStorageMetadata,
                dcp_md.BytesStorageMetadata, dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties,
                dcp_md._MEM_FORMAT_ENCODING]
    allowed = {(dcp_md.__name__, t.__name__): t for t in md_types}
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a dict look-up by name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):  # StorageMeta.checkpoint_id
        allowed[("pathlib", cls.__name__)] = cls
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[("torch", str(value).removeprefix("torch."))] = value
    return allowed


ALLOWED = _allowed()
# the only objects whose state a pickle may set (BUILD): new instances of DCP's dataclasses
BUILDABLE = {t for t in ALLOWED.values() if isinstance(t, type) and hasattr(t, "__dataclass_fields__")}


class _Unpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be overridden (the C one's cannot)
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise RefusedMetadata(f"its metadata names {module}.{name}, which a checkpoint never holds") from None

    def persistent_load(self, pid):
        raise RefusedMetadata("its metadata holds a persistent id, which a checkpoint never holds")

    def _build(self):
        if type(self.stack[-2]) not in BUILDABLE:  # e.g. a class, a function or a shared enum member of ours
            raise RefusedMetadata(f"its metadata sets attributes of {self.stack[-2]!r}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def read(path: str) -> dcp_md.Metadata:
    """The checkpoint folder's `.metadata`, checked, and the shard files it names. Raises RefusedMetadata or
    DamagedMetadata (one line each)."""
    check_plain_file(path, ".metadata")
    meta_file = os.path.join(path, ".metadata")
    check_size(path)
    with open(meta_file, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)  # bounded even if it grew since
    if len(data) > MAX_METADATA_BYTES:
        raise DamagedMetadata(f"its .metadata grew past {MAX_METADATA_BYTES:,} bytes while it was read: not read")
    metadata = loads(data)
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    for name in shards:
        check_plain_file(path, name)
    files = [os.path.join(path, name) for name in shards]
    stored = sum(os.path.getsize(file) for file in files if os.path.isfile(file))  # a missing one: damage, later
    declared = sum(math.prod(item.size) * item.properties.dtype.itemsize
                   for item in metadata.state_dict_metadata.values() if type(item) is dcp_md.TensorStorageMetadata)
    if declared > stored:  # no byte transforms: every tensor byte is in a shard (readers allocate what is declared)
        raise DamagedMetadata(f"its .metadata declares {declared} bytes of tensors, more than its shard files hold "
                              f"({stored} bytes)")
    return metadata


def check_size(path: str) -> None:
    """DamagedMetadata unless the folder's `.metadata` (if any: a missing one is left to its reader) is within
    MAX_METADATA_BYTES: checked before it is read or hashed (checkpoint_checksums hashed a sparse 8 GB one whole
    before this cap refused it)."""
    meta_file = os.path.join(path, ".metadata")
    size = os.path.getsize(meta_file) if os.path.isfile(meta_file) else 0
    if size > MAX_METADATA_BYTES:
        raise DamagedMetadata(f"its .metadata is {size:,} bytes, more than the {MAX_METADATA_BYTES:,} bytes the "
                              f"metadata of any dit_train checkpoint takes (dit_15b on 512 ranks): not read")


def check_plain_file(folder: str, name: str) -> None:
    """A file of a checkpoint folder is read only as a regular file of its own: a symbolic link would read a file
    elsewhere, a FIFO would hang the reader forever. A missing file is left to the reader (damage)."""
    file = os.path.join(folder, name)
    if os.path.islink(file):
        raise RefusedMetadata(f"its {name} is a symbolic link (to {os.readlink(file)}), which a checkpoint never holds")
    if os.path.exists(file) and not os.path.isfile(file):
        raise RefusedMetadata(f"its {name} is not a regular file (a FIFO, socket, device or folder), which a "
                              f"checkpoint never holds")


def loads(data: bytes) -> dcp_md.Metadata:
    """`read` for the bytes of a `.metadata` file."""
    if not data:
        raise DamagedMetadata("its .metadata is empty (the save was cut short?)")
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except RefusedMetadata:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to parse is damage: truncation, garbage, a bad argument
        raise DamagedMetadata(f"its .metadata cannot be read ({type(e).__name__}: {e})"[:300]) from None
    check(metadata)
    return metadata


def check(metadata) -> None:
    """DCP's record in DCP's shape; storage entries name plain shard files in the folder, with no transforms."""
    def damaged(what):
        return DamagedMetadata(f"its .metadata is not a DCP metadata record ({what})")

    if type(metadata) is not dcp_md.Metadata:
        raise damaged(f"a {type(metadata).__name__}")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise damaged("state_dict_metadata is not a dict")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or type(item) not in (dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata):
            raise damaged(f"entry {key!r} is a {type(item).__name__}")
        tensor = type(item) is dcp_md.TensorStorageMetadata
        if tensor and not (isinstance(item.size, torch.Size) and all(type(n) is int and n >= 0 for n in item.size)
                           and type(item.properties) is dcp_md.TensorProperties
                           and isinstance(item.properties.dtype, torch.dtype)):
            raise damaged(f"entry {key!r} has size {item.size!r} and properties {item.properties!r}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise damaged("storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not dcp_md.MetadataIndex or type(info) is not dcp_fs._StorageInfo:
            raise damaged(f"a storage entry is a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or not SHARD_FILE.match(name):
            raise RefusedMetadata(f"its metadata points at {name!r}, which is not a shard file in its folder")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise damaged(f"entry {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")
        if info.transform_descriptors:
            raise RefusedMetadata(f"its metadata asks for byte transforms {list(info.transform_descriptors)!r}, "
                                  f"which dit_train never writes")
