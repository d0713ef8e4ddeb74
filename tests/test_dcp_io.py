"""Reading DCP metadata from disk never runs code: the restricted unpickler and the
checks after it, against hand-made hostile files."""

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dtlab.agent.dcp_io import SafeFileSystemReader


def read(folder, payload: bytes):
    (folder / ".metadata").write_bytes(payload)
    return SafeFileSystemReader(str(folder)).read_metadata()


def global_call(module: str, name: str) -> bytes:
    """A protocol-4 pickle that calls ``module.name()``."""

    def text(s):
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + b")" + b"R" + b"."


def test_a_dotted_name_cannot_reach_through_an_allowed_module(tmp_path):
    payload = global_call("torch.distributed.checkpoint.metadata", "os.getpid")
    assert pickle.loads(payload) == os.getpid()  # plain pickle runs it: the threat is real
    with pytest.raises(pickle.UnpicklingError, match="os.getpid is not part of DCP"):
        read(tmp_path, payload)
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        read(tmp_path, global_call("builtins", "eval"))


def tensor_entry():
    props = TensorProperties(dtype=torch.float32)
    return TensorStorageMetadata(
        props, torch.Size([2]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))]
    )


def test_real_metadata_loads_and_a_pickled_item_or_a_path_outside_is_refused(tmp_path):
    index = MetadataIndex("model.w", (0,))
    good = Metadata(
        {"model.w": tensor_entry()}, storage_data={index: _StorageInfo("__0_0.distcp", 0, 8)}
    )
    assert set(read(tmp_path, pickle.dumps(good)).state_dict_metadata) == {"model.w"}
    bytes_item = Metadata({"model.w": BytesStorageMetadata()})
    with pytest.raises(pickle.UnpicklingError, match="BytesStorageMetadata"):
        read(tmp_path, pickle.dumps(bytes_item))
    outside = Metadata(
        {"model.w": tensor_entry()}, storage_data={index: _StorageInfo("../x", 0, 8)}
    )
    with pytest.raises(pickle.UnpicklingError, match="outside its folder"):
        read(tmp_path, pickle.dumps(outside))
