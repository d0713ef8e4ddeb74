"""Which ranks should train on different data: from the device mesh, not the world.

On a device mesh (``JobInfo.mesh``, read by ``dtlab.agent.mesh``) ranks that differ only
along a data-parallel dimension (dp, dp_shard, ...) train on different data, and ranks with
the same coordinate along every data dimension (tensor- or context-parallel peers) share
their batches by design. Without a mesh, every rank is its own data-parallel replica: what
the checks assumed before meshes, and still do where the ranks' meshes do not describe
them consistently.

Pure: ``data_coordinates(jobs, ranks)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dtlab.records import JobInfo, MeshInfo


def shared_mesh(jobs: Mapping[int, JobInfo], ranks: Iterable[int]) -> MeshInfo | None:
    """The mesh every one of ``ranks`` trains on, when their jobs describe one consistently
    (the same dimensions and data dimensions, a coordinate each, the mesh holding exactly
    these ranks); else None."""
    ranks = sorted(set(ranks))
    meshes = [jobs[r].mesh if r in jobs else None for r in ranks]
    if not meshes or any(m is None for m in meshes):
        return None
    first = meshes[0]
    assert first is not None
    layout = (first.dim_names, first.shape, first.data_dims)
    if any(m is None or (m.dim_names, m.shape, m.data_dims) != layout for m in meshes):
        return None
    coordinates = {m.coordinate for m in meshes if m is not None}
    if first.size != len(ranks) or len(coordinates) != len(ranks):
        return None
    if any(len(m.coordinate) != len(m.shape) for m in meshes if m is not None):
        return None
    return first


def data_coordinates(
    jobs: Mapping[int, JobInfo], ranks: Iterable[int]
) -> dict[int, tuple[int, ...]] | None:
    """Each rank's coordinate along the mesh's data-parallel dimensions (ranks with equal
    ones share their data by design), or None when the ranks have no consistent mesh:
    then each rank is its own replica. A mesh without any data dimension (tensor parallel
    alone) gives every rank the same coordinate, ``()``."""
    ranks = sorted(set(ranks))
    if shared_mesh(jobs, ranks) is None:
        return None
    found = {}
    for r in ranks:
        mesh = jobs[r].mesh
        assert mesh is not None
        found[r] = mesh.data_coordinate
    return found


def peer_groups(coordinates: Mapping[int, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The ranks that share a data coordinate, group by group (lowest rank first)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, at in sorted(coordinates.items()):
        groups.setdefault(at, []).append(rank)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def describe_coordinates(
    mesh: MeshInfo, coordinates: Mapping[int, tuple[int, ...]], ranks: Iterable[int]
) -> str:
    """E.g. "data-parallel ranks 0 and 1 of 2 (dp)": the data shards ``ranks`` stand for."""
    degree = mesh.data_degree
    shards = sorted({_flat(mesh, coordinates[r]) for r in ranks})
    if len(shards) > 1:
        which = ", ".join(map(str, shards[:-1])) + f" and {shards[-1]}"
    else:
        which = str(shards[0]) if shards else "none"
    dims = ", ".join(mesh.data_dims) or "no data dimension"
    word = "ranks" if len(shards) > 1 else "rank"
    return f"data-parallel {word} {which} of {degree} ({dims})"


def _flat(mesh: MeshInfo, data_coordinate: tuple[int, ...]) -> int:
    """A data coordinate as one number (MeshInfo.data_rank of the rank holding it)."""
    sizes = [s for n, s in zip(mesh.dim_names, mesh.shape, strict=True) if n in mesh.data_dims]
    rank = 0
    for size, at in zip(sizes, data_coordinate, strict=True):
        rank = rank * size + at
    return rank


__all__ = ["data_coordinates", "describe_coordinates", "peer_groups", "shared_mesh"]
