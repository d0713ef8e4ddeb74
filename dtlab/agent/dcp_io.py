"""How dtlab reads and writes ``torch.distributed.checkpoint`` folders.

- :class:`SafeFileSystemReader`: DCP keeps its ``.metadata`` as a pickle, and
  ``pickle.load`` on a file from disk runs whatever the file says. This reader allows only
  the classes DCP itself puts there (its metadata dataclasses, ``torch.Size``, dtypes,
  paths); anything else is refused with the name of the class. dtlab gives DCP tensors
  only, so the data files hold no pickled objects either (DCP would ``torch.load`` those
  without ``weights_only``).
- :class:`ChecksummingFileSystem`: the XXH3-64 checksum of every data file, computed as
  DCP writes it (front to back), so a save need not read its files back.
"""

from __future__ import annotations

import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

_METADATA = "torch.distributed.checkpoint.metadata"
# exactly the globals DCP's own .metadata pickles refer to (pickle protocol 4 would let a
# dotted name such as "os.system" reach through a module's imports: names never have dots)
_ALLOWED = {
    *(
        (_METADATA, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks up torch.strided and the like only
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # DCP's StorageMeta keeps the checkpoint's path
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not (dtype or (module, name) in _ALLOWED):
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of DCP's metadata: refusing to load it"
            )
        return super().find_class(module, name)


def check_metadata(metadata) -> None:
    """Refuse metadata that would make DCP unpickle a data item (a ``BytesStorageMetadata``
    entry is read with ``torch.load(weights_only=False)``) or read outside the folder."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata is a {type(metadata).__name__}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise pickle.UnpicklingError(
                f"{key!r} is stored as {type(entry).__name__}, "
                "not a tensor: dtlab writes tensors only"
            )
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", "")
        if not isinstance(path, str) or os.path.basename(path) != path or path in ("", ".", ".."):
            raise pickle.UnpicklingError(f"DCP metadata points outside its folder: {path!r}")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        check_metadata(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensors_only_planner():
    """DCP's load planner, minus the one path that unpickles (a bytes item)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise pickle.UnpicklingError(
                f"{read_item.dest_index.fqn!r} is a pickled object: dtlab never loads one"
            )

    return TensorsOnly()


class _FlushingWriter(io.BufferedWriter):
    # DCP fsyncs its .metadata through fileno() without flushing: flush first, or the
    # fsync would find the bytes still in this buffer
    def fileno(self) -> int:
        self.flush()
        return super().fileno()


class _ChecksummedFile(io.FileIO):
    """A file opened for writing that keeps the checksum of what was written, in order."""

    def __init__(self, path, sums: dict):
        super().__init__(path, "wb")
        self.sums, self.key, self.sequential = sums, os.fspath(path), True
        self.hasher = xxhash.xxh3_64()

    def write(self, b) -> int:
        n = super().write(b)
        self.hasher.update(memoryview(b).cast("B")[:n])
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        before = super().tell()
        after = super().seek(offset, whence)
        self.sequential = self.sequential and after == before  # a jump: checksum unknown
        return after

    def close(self) -> None:
        if not self.closed and self.sequential:
            self.sums[self.key] = self.hasher.intdigest()
        super().close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, recording ``{path: XXH3-64}`` of the files it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, int] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _FlushingWriter(_ChecksummedFile(Path(path), self.sums), 1 << 20) as stream:
            yield stream
