"""Read ``torch.distributed.checkpoint`` folders without unpickling arbitrary objects.

DCP keeps its ``.metadata`` as a pickle, and ``pickle.load`` on a file from disk runs
whatever the file says. This reader allows only the classes DCP itself puts there
(its metadata dataclasses, ``torch.Size``, dtypes, paths); anything else is refused
with the name of the class. dtlab gives DCP tensors only, so the data files hold no
pickled objects either (DCP would ``torch.load`` those without ``weights_only``).
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader

_MODULES = {"torch.distributed.checkpoint.metadata"}
_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # DCP's StorageMeta keeps the checkpoint's path
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        allowed = dtype or module in _MODULES or (module, name) in _NAMES
        if not allowed:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of DCP's metadata: refusing to load it"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
