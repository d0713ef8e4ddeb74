"""The device mesh a job trains on, read from its parameters: ``JobInfo.mesh``.

Modern trainers lay their ranks out on a device mesh (FSDP2 on DTensor, tensor parallel on
a 2-D mesh, HSDP): ranks that differ only along a data-parallel dimension train on
different data, and ranks that differ along another one (tensor, context, pipeline,
expert parallel) share their batches. The doctor needs to know which is which before it
calls ranks that read the same samples a bug (``analysis/checks_data.py``).

:func:`describe` reads, without a collective:

- the mesh: the root mesh of the parameters' DTensors (``param.device_mesh``) or of the
  mesh ``fully_shard`` was given; the one with the most dimensions;
- this rank's coordinate on it (``mesh.get_coordinate()``);
- which dimensions are data-parallel: those ``fully_shard`` shards or replicates over (its
  state's mesh; its ``dp_mesh_dims`` where given), and those whose name says so (``dp``,
  ``dp_shard``, ``dp_replicate``, ``fsdp``, ``hsdp``...); never ``tp``, ``cp``, ``pp``,
  ``ep`` (:func:`dtlab.records.steps.is_data_dim_name`).

Call it once the model is wrapped (after ``fully_shard`` / ``parallelize_module``), e.g.
when the job is described: ``JobInfo(..., mesh=mesh.describe(model))``. It is cheap (one
pass over the parameters), never raises, and returns None when the job has no mesh (plain
DDP, FSDP1, one process) or it could not be read (the caller may note that).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from dtlab.records.steps import MODEL_DIM_NAMES, MeshInfo, is_data_dim_name

FSDP_MODULE = "torch.distributed.fsdp"


def describe(modules) -> MeshInfo | None:
    """The mesh ``modules`` (a module, or several: a model in parts) train on, as this rank
    sees it; None where there is none or it cannot be read."""
    try:
        return _describe(_modules(modules))
    except Exception:  # a torch without these internals, an odd mesh: no mesh, said so
        return None


def _modules(modules) -> list:
    if hasattr(modules, "named_parameters"):
        return [modules]
    return [m for m in modules if hasattr(m, "named_parameters")]


def _describe(modules: list) -> MeshInfo | None:
    fsdp_infos = list(_fsdp_mesh_infos(modules))
    meshes: dict[int, Any] = {}
    for module in modules:
        for param in module.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
    for info in fsdp_infos:
        for mesh in (getattr(info, "spmd_mesh", None), getattr(info, "mesh", None)):
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
    if not meshes:
        return None
    roots: dict[int, Any] = {}
    for mesh in meshes.values():
        root = _root(mesh)
        roots.setdefault(id(root), root)
    mesh = max(roots.values(), key=lambda m: (m.ndim, m.size()))
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    shape = tuple(int(s) for s in mesh.shape)
    data = {name for name in names if is_data_dim_name(name)}
    for info in fsdp_infos:
        data |= _fsdp_dims(info, mesh, names, tuple(coordinate))
    data = {name for name in data if name.lower() not in MODEL_DIM_NAMES}
    return MeshInfo(
        dim_names=names,
        shape=shape,
        coordinate=tuple(int(c) for c in coordinate),
        data_dims=tuple(name for name in names if name in data),
        source="fully_shard" if fsdp_infos else "DTensor",
    )


def _root(mesh):
    """The mesh ``mesh`` was sliced or flattened from (itself if none)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root() or mesh
    from torch.distributed.device_mesh import _mesh_resources  # older torch

    return _mesh_resources.get_root_mesh(mesh) or mesh


def _fsdp_mesh_infos(modules: list) -> Iterable:
    """The mesh info of every FSDP2 parameter group under ``modules``."""
    fsdp = sys.modules.get(FSDP_MODULE)  # not imported: nothing is under fully_shard
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return
    seen = set()
    for module in modules:
        for sub in module.modules():
            if not isinstance(sub, fsdp_module):
                continue
            state = sub._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                info = getattr(group, "mesh_info", None)
                if info is not None and id(info) not in seen:
                    seen.add(id(info))
                    yield info


def _fsdp_dims(info, mesh, names: tuple[str, ...], coordinate: tuple[int, ...]) -> set[str]:
    """The dimensions of ``mesh`` that FSDP shards or replicates over: named in its
    ``dp_mesh_dims``, else those along which this rank's peers all belong to FSDP's mesh
    (its mesh may be ``mesh`` itself, a slice of it, or a flattened slice)."""
    dims = getattr(info, "dp_mesh_dims", None)
    if dims is not None:
        found = set()
        for value in (getattr(dims, "shard", None), getattr(dims, "replicate", None)):
            found |= {value} if isinstance(value, str) else set(value or ())
        return found & set(names)
    fsdp_mesh = getattr(info, "mesh", None)
    if fsdp_mesh is None:
        return set()
    if fsdp_mesh is mesh:
        return set(names)
    members = set(fsdp_mesh.mesh.flatten().tolist())
    ranks = mesh.mesh  # the global ranks laid out as the mesh
    if tuple(ranks.shape) != tuple(mesh.shape):
        return set()
    found = set()
    for d, name in enumerate(names):
        if ranks.shape[d] < 2:
            continue
        at = tuple(slice(None) if i == d else c for i, c in enumerate(coordinate))
        if set(ranks[at].flatten().tolist()) <= members:  # my peers along d are FSDP's
            found.add(name)
    return found
