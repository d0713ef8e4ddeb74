"""``%dt_doctor`` check of the data: shards that overlap, epochs in the same order, ranks
that wait for their next batch.

Which ranks should read different data comes from the device mesh when the jobs have one
(``JobInfo.mesh``, :mod:`dtlab.analysis.mesh_groups`): ranks with the same data-parallel
coordinate (tensor- or context-parallel peers) share their batches by design, so they are
compared as one data-parallel rank, and must read the same samples; without a mesh every
rank is its own replica.

1. collect (each rank, agent/): the sample indices, epoch and data time of every step;
2. combine (notebook, here): ``check_data_order(evidence) -> CheckResult``;
3. present (views/): ``%dt_doctor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from dtlab.analysis.data_wait import data_wait_findings
from dtlab.analysis.evidence import shape_of
from dtlab.analysis.mesh_groups import (
    data_coordinates,
    describe_coordinates,
    peer_groups,
    shared_mesh,
)
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.analysis.trends import aligned_steps
from dtlab.records import CheckResult, Evidence, Finding, JobInfo, MeshInfo, StepRecord
from dtlab.records.columns import StepColumns

Records = Mapping[int, Sequence[StepRecord]]

MIN_SAME_ORDER_STEPS = 2  # steps of two epochs that must match to call the order repeated
MIN_SAME_ORDER_SAMPLES = 8  # ... holding this many samples (tiny shuffles repeat by chance)

OVERLAP_FIX = (
    "give every rank its own shard: DataLoader(dataset, sampler=DistributedSampler(dataset, "
    "num_replicas=world_size, rank=rank)), with each rank's own rank, and no shuffle= there"
)
PADDING_FIX = "harmless for training; for exact eval metrics use DistributedSampler(drop_last=True)"
SET_EPOCH_FIX = (
    "call sampler.set_epoch(epoch) at the start of every epoch, or let dtlab do it: "
    "dtlab.attach(on_epoch=sampler.set_epoch)"
)

# --- data order ---------------------------------------------------------------------------


@check("data_order", order=80, compares="replicas", observes=("data loader", "forward"))
def check_data_order(evidence: Evidence) -> CheckResult:
    """Shards that overlap within an epoch, epochs in the same order, ranks that wait for data.

    Overlap: a sample index read by two ranks in one epoch is an error, unless exactly two
    ranks read it, one in its first batch of the epoch and one in its last, and fewer samples
    than there are ranks look like that in the epoch: DistributedSampler's padding (advice).
    """
    records = evidence.records
    has_indices = bool(np.any(evidence.step_columns.rows()["num_indices"]))
    has_inputs = not has_indices and any(
        rec.input_fingerprints for recs in records.values() for rec in recs
    )
    coordinates = data_coordinates(evidence.jobs, records)
    groups = peer_groups(coordinates) if coordinates is not None else []
    peers = [g for g in groups if len(g) > 1]  # ranks that share their data by design
    findings = []
    if has_indices:
        if peers:  # one rank of each data-parallel coordinate stands for its peers
            stand_ins = [g[0] for g in groups]
            columns = _only_ranks(evidence.step_columns, stand_ins)
            shards = {r: records[r] for r in stand_ins}
            overlaps = _overlap_findings(shards, evidence.jobs, columns)
            findings += [_with_peers(f, groups) for f in overlaps]
            findings += _peer_findings(records, peers, evidence.jobs)
        else:
            findings += _overlap_findings(records, evidence.jobs, evidence.step_columns)
        findings += _same_order_findings(evidence.step_columns)
    elif has_inputs:
        findings += _same_inputs_findings(records, evidence.jobs, coordinates)
    findings += data_wait_findings(records, evidence.table)
    what = (
        "sample indices by epoch and"
        if has_indices
        else "model input fingerprints (no sample indices) and"
        if has_inputs
        else "(sample indices not recorded)"
    )
    why = "no rank waited for data over 30% of a step" + (
        "; no two ranks read a sample in one epoch; each epoch came in a new order"
        if has_indices
        else "; no two ranks fed their model the same inputs (set_epoch not checked: no "
        "sample indices were recorded)"
        if has_inputs
        else " (shard overlap and set_epoch not checked: sample indices were not recorded)"
    )
    looked = f"{shape_of(records)} of {what} data time per step"
    if peers:
        mesh = shared_mesh(evidence.jobs, records)
        assert mesh is not None
        looked += (
            f"; on the {mesh.describe()}, ranks with the same data-parallel coordinate "
            f"({', '.join(label_ranks(g) for g in peers[:4])}{', ...' if len(peers) > 4 else ''})"
            " share their data by design"
        )
        if has_indices:
            why += "; ranks that share a data-parallel coordinate read the same samples"
    if not (has_indices or has_inputs or findings):
        return CheckResult(
            "data_order",
            "Data sharding and input pipeline",
            (),
            looked,
            "not checked: sample identity unknown (no sample indices and no input "
            "fingerprints were recorded), so ranks reading the same samples cannot be "
            "seen; no rank waited for data over 30% of a step",
            checked=False,
            needs="pass indices= to dtlab.attach, or draw batches from a DataLoader",
        )
    return CheckResult(
        "data_order",
        "Data sharding and input pipeline",
        tuple(findings),
        looked,
        "" if findings else why,
    )


SAME_INPUTS_FIX = (
    "draw each rank's batches differently: seed its sampling with its rank "
    "(torch.manual_seed(seed + rank), as nanoGPT does) or shard the data with "
    "DistributedSampler(dataset, num_replicas=world_size, rank=rank)"
)
SAME_SHARD_FIX = (
    "every rank's DistributedSampler hands out the same shard: build it with "
    "num_replicas=world_size and rank=dist.get_rank() (not a constant, not LOCAL_RANK "
    "across nodes)"
)
NO_SAMPLER_FIX = (
    "the DataLoader ({kind}) is the same on every rank: shard it, "
    "DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=world_size, "
    "rank=rank)), and call sampler.set_epoch(epoch) each epoch"
)
SEEDED_FIX = (
    "batches come from {kind}, not a DataLoader, and draw the same random numbers on "
    "every rank: seed the sampling with the rank (torch.manual_seed(seed + rank), as nanoGPT "
    "does), or give each rank its own slice of the data"
)


# a mesh whose ranks are not all data-parallel (tensor-parallel peers share batches): a
# rank's shard must follow its data-parallel rank and degree, never the global rank
ITERABLE_FIX = (
    "the DataLoader reads an IterableDataset, which every rank iterates whole unless it "
    "shards itself (a DistributedSampler cannot): give each rank its own shard in its "
    "__iter__, by {dp} (shard r of n takes items r, r + n, ...); if it draws at random, "
    "seeding it with {seed} parts the ranks too"
)
MESH_SEEDED_FIX = (
    "batches come from {kind}, not a DataLoader, and are the same on ranks of different "
    "data-parallel coordinates: give each rank its own shard of the data by {dp} (shard r "
    "of n takes items r, r + n, ...), so that tensor-parallel peers keep reading the same "
    "batches; or, if batches are drawn at random, seed the drawing with {seed}, not the "
    "global rank"
)
SHARD_FIRST_FIX = (
    "batches come from {kind}, not a DataLoader, and are the same on every rank: give each "
    "rank its own shard of the data by {dp} (shard r of n takes items r, r + n, ...); or, "
    "if batches are drawn at random, seed the drawing with {seed}"
)
MESH_SHARD_FIX = (
    "every data-parallel rank's DistributedSampler hands out the same shard: build it with "
    "num_replicas=dp_degree and rank=dp_rank, from {dp} (not a constant, not the global "
    "rank: tensor-parallel peers share a shard)"
)
MESH_NO_SAMPLER_FIX = (
    "the DataLoader ({kind}) is the same on every rank: shard it by data-parallel rank, "
    "DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=dp_degree, "
    "rank=dp_rank)) with {dp}, and call sampler.set_epoch(epoch) each epoch"
)
MESH_GENERAL_FIX = (
    "give each data-parallel rank its own shard, by {dp}: DistributedSampler(dataset, "
    "num_replicas=dp_degree, rank=dp_rank), or the dataset's own split; if batches are "
    "drawn at random, seed the drawing with {seed}. Tensor-parallel peers share their "
    "data-parallel rank and must read the same batches"
)
ITERABLE_SAMPLER = "_InfiniteConstantSampler"  # what a DataLoader over an IterableDataset uses


def dp_words(mesh: MeshInfo | None) -> tuple[str, str]:
    """How a script gets its data-parallel rank and degree (and what to seed with):
    from the mesh's data dimensions, or the world where there is no mesh or every rank is
    data-parallel."""
    if mesh is None or len(mesh.data_dims) == len(mesh.dim_names) or not mesh.data_dims:
        return (
            "its rank and the world size (dist.get_rank(), dist.get_world_size())",
            "the rank (torch.manual_seed(seed + rank))",
        )
    seed = "dp_rank (torch.manual_seed(seed + dp_rank))"
    if len(mesh.data_dims) == 1:
        d = mesh.data_dims[0]
        return (
            f'its data-parallel rank and degree (dp_rank = mesh["{d}"].get_local_rank(), '
            f'dp_degree = mesh["{d}"].size())',
            seed,
        )
    dims = ", ".join(f'"{d}"' for d in mesh.data_dims)
    return (
        f"its data-parallel rank and degree over the mesh's data dimensions ({dims}) "
        f"together (dp_mesh = mesh[({dims})]._flatten(); dp_rank = "
        "dp_mesh.get_local_rank(), dp_degree = dp_mesh.size())",
        seed,
    )


def data_fix(jobs: Mapping[int, JobInfo], general: str) -> str:
    """The fix for ranks that read the same data, chosen from how they draw batches (a
    DistributedSampler, another sampler, an IterableDataset, no DataLoader) and whether
    they train on a device mesh (then by data-parallel rank and degree), else
    ``general``."""
    kinds = sorted({job.data for job in jobs.values() if job.data})
    mesh = shared_mesh(jobs, jobs) if jobs else None
    dp, seed = dp_words(mesh)
    peers = mesh is not None and 0 < len(mesh.data_dims) < len(mesh.dim_names)
    if len(kinds) != 1:  # not known, or ranks differ: both ways stay open
        return MESH_GENERAL_FIX.format(dp=dp, seed=seed) if peers else general
    kind = kinds[0]
    if kind == f"DataLoader, {ITERABLE_SAMPLER}":
        return ITERABLE_FIX.format(dp=dp, seed=seed)
    if "DistributedSampler" in kind:
        return MESH_SHARD_FIX.format(dp=dp) if peers else SAME_SHARD_FIX
    if kind.startswith("DataLoader"):
        sampler = kind.removeprefix("DataLoader, ") + " sampler"
        if peers:
            return MESH_NO_SAMPLER_FIX.format(kind=sampler, dp=dp)
        return NO_SAMPLER_FIX.format(kind=sampler)
    if kind.startswith("no DataLoader"):
        source = kind.removeprefix("no DataLoader: ").strip() or "code"
        if peers:  # the script shards by a data-parallel index: that first
            return MESH_SEEDED_FIX.format(kind=source, dp=dp, seed=seed)
        if mesh is not None:
            return SHARD_FIRST_FIX.format(kind=source, dp=dp, seed=seed)
        return SEEDED_FIX.format(kind=source)
    return MESH_GENERAL_FIX.format(dp=dp, seed=seed) if peers else general


def _same_inputs_findings(
    records: Records,
    jobs: Mapping[int, JobInfo],
    coordinates: Mapping[int, tuple[int, ...]] | None = None,
) -> list[Finding]:
    """Ranks whose model got bit-identical inputs at the same step, in at least half of the
    steps (and two): without sample indices, the fingerprints of the model's input tensors
    tell that the ranks train on the same data. On a mesh (``coordinates``: each rank's
    data-parallel coordinate), ranks of one coordinate sharing inputs is by design: a group
    counts only when it spans two coordinates or more."""
    steps = [
        (s, at)
        for s, at in aligned_steps(records)
        if all(rec.input_fingerprints for rec in at.values())
    ]
    shared: dict[tuple[int, ...], list[int]] = {}
    for step, at in steps:
        groups: dict[tuple, list[int]] = {}
        for rank, rec in sorted(at.items()):
            groups.setdefault(rec.input_fingerprints, []).append(rank)
        for group in groups.values():
            if len(group) > 1 and (coordinates is None or len({coordinates[r] for r in group}) > 1):
                shared.setdefault(tuple(group), []).append(step)
    mesh = shared_mesh(jobs, records) if coordinates is not None else None
    found = []
    for ranks, at_steps in sorted(shared.items()):
        if len(at_steps) >= max(2, len(steps) / 2):
            if mesh is not None and coordinates is not None:
                shards = len({coordinates[r] for r in ranks})
                who = (
                    f"{label_ranks(ranks)} ({describe_coordinates(mesh, coordinates, ranks)} "
                    f"on the {mesh.describe()})"
                )
                waste = f"{shards} data-parallel ranks do the work of one"
            else:
                who, waste = label_ranks(ranks), f"{len(ranks)} ranks do the work of one"
            summary = (
                f"{who} fed their model the same inputs in {len(at_steps)} of "
                f"{len(steps)} steps, from step {at_steps[0]} (equal fingerprints of the input "
                f"tensors; no sample indices were recorded): they train on the same data, so "
                f"{waste}"
            )
            evidence = {"steps": at_steps[:20], "num_steps": len(steps)}
            if coordinates is not None:
                evidence["data_coordinates"] = {r: coordinates[r] for r in ranks}
            found.append(
                Finding(
                    "data_order",
                    ranks,
                    summary,
                    at_steps[0],
                    evidence,
                    data_fix(jobs, SAME_INPUTS_FIX),
                    "error",
                )
            )
    return found


def _with_peers(finding: Finding, groups: Sequence[tuple[int, ...]]) -> Finding:
    """A finding about the ranks standing in for their data-parallel coordinate, naming
    their peers (which read what they read) too."""
    named = set(finding.ranks)
    peers = sorted(r for g in groups if g[0] in named for r in g[1:])
    if not peers:
        return finding
    return replace(
        finding,
        ranks=tuple(sorted(named | set(peers))),
        summary=f"{finding.summary}; their tensor-parallel peers ({label_ranks(peers)}) "
        "read the same",
    )


def _only_ranks(columns: StepColumns, ranks: Sequence[int]) -> StepColumns:
    """The rows of ``ranks`` alone, as columns of their own."""
    rows = columns.rows()
    keep = np.isin(rows["rank"], np.asarray(ranks))
    mine = StepColumns(max(1, int(keep.sum())))
    mine.append_rows(rows[keep], columns.indices())
    return mine


PEER_FIX = (
    "ranks that share a data-parallel coordinate (tensor- or context-parallel peers) must "
    "be fed the same batch: shard the data by {dp}, not by the global rank (a "
    "DistributedSampler over the whole world gives each peer a different shard)"
)


def _peer_findings(
    records: Records, peers: Sequence[tuple[int, ...]], jobs: Mapping[int, JobInfo]
) -> list[Finding]:
    """Ranks of one data-parallel coordinate that read different samples at the same step,
    in at least half of the steps (and two): their tensor-parallel computation mixes two
    batches."""
    steps = aligned_steps({r: records[r] for g in peers for r in g})
    apart: dict[int, list[int]] = {}
    for step, at in steps:
        for group in peers:
            if len({at[r].indices for r in group}) > 1:
                apart.setdefault(group[0], []).append(step)
    ranks = tuple(
        sorted(r for g in peers if len(apart.get(g[0], ())) >= max(2, len(steps) / 2) for r in g)
    )
    if not ranks:
        return []
    first = min(apart[g[0]][0] for g in peers if g[0] in ranks)
    count = max(len(apart[g[0]]) for g in peers if g[0] in ranks)
    mesh = shared_mesh(jobs, records)
    summary = (
        f"{label_ranks(ranks)} share a data-parallel coordinate"
        + (f" on the {mesh.describe()}" if mesh is not None else "")
        + f" but read different samples in {count} of {len(steps)} steps, from step "
        f"{first}: tensor-parallel peers must compute on the same batch"
    )
    dp, _ = dp_words(mesh)
    evidence = {"groups": [g for g in peers if g[0] in ranks], "num_steps": len(steps)}
    return [Finding("data_order", ranks, summary, first, evidence, PEER_FIX.format(dp=dp), "error")]


_E, _I, _R, _S, _FIRST, _LAST = range(6)  # columns of the index table


def _sample_table(records: Records, columns: StepColumns | None = None) -> np.ndarray:
    """One row per sample read: epoch, index, rank, step (first?, last? left 0), in step
    then rank order. The epoch of each sample is dtlab's count, split inside a step where
    ``StepRecord.epoch_starts`` says a new one began."""
    if columns is None:
        columns = StepColumns.from_records(records)
    rows = columns.rows()
    have = rows["num_indices"] > 0
    # the few fields needed, each as its own array (a wide row copy costs ~10x more)
    field = {
        name: rows[name][have] if not have.all() else rows[name]
        for name in ("num_indices", "indices_at", "epoch", "rank", "step", "epoch_starts")
    }
    if not len(field["step"]):
        return np.zeros((0, 6), dtype=np.int64)
    lengths = field["num_indices"].astype(np.int64)
    table = np.zeros((int(lengths.sum()), 6), dtype=np.int64, order="F")  # column by column
    offsets = np.cumsum(lengths) - lengths  # where each row's samples start in the table
    table[:, _I] = columns.indices()[
        np.arange(len(table)) + np.repeat(field["indices_at"] - offsets, lengths)
    ]
    for column, name in ((_E, "epoch"), (_R, "rank"), (_S, "step")):
        table[:, column] = np.repeat(field[name], lengths)
    for i in np.flatnonzero(field["epoch_starts"]):  # a new epoch began in the step (rare)
        rank, step = int(field["rank"][i]), int(field["step"][i])
        rec = next(r for r in records[rank] if r.step == step)
        for start in rec.epoch_starts:
            table[offsets[i] + start : offsets[i] + lengths[i], _E] += 1
    return table


_KEY_BLOCK = 1 << 16  # rows per block while the keys are made (bounds the temporaries)


def _nothing_shared(records: Records, columns: StepColumns) -> bool:
    """True when no sample is read twice in an epoch, by two ranks or by one (the healthy
    case): every sample read becomes one int64 key (epoch, index, rank), made from the
    columns a block of rows at a time, and one sort tells. 8 bytes a sample at the peak,
    where the full sample table (:func:`_sample_table`, only made when this says False)
    holds 48. False when some sample might be shared, or the key would not fit in 63
    bits."""
    all_rows = columns.rows()
    have = all_rows["num_indices"] > 0
    if not have.any():
        return True
    # the few fields needed, each as its own array (a copy of the wide rows costs ~30x more)
    rows = {
        name: all_rows[name] if have.all() else all_rows[name][have]
        for name in ("num_indices", "indices_at", "rank", "epoch", "epoch_starts", "step")
    }
    indices = columns.indices()
    lengths = rows["num_indices"].astype(np.int64)
    low_i, high_i = int(indices.min()), int(indices.max())
    low_r, high_r = int(rows["rank"].min()), int(rows["rank"].max())
    epochs = rows["epoch"]
    low_e, high_e = int(epochs.min()), int((epochs + rows["epoch_starts"]).max())
    rank_width, index_width = high_r - low_r + 1, high_i - low_i + 1
    if rank_width * index_width * (high_e - low_e + 1) >= 1 << 62:
        return False
    per_epoch = rank_width * index_width
    key = np.empty(int(lengths.sum()), dtype=np.int64)
    at = 0
    for a in range(0, len(lengths), _KEY_BLOCK):
        block = {name: column[a : a + _KEY_BLOCK] for name, column in rows.items()}
        n = lengths[a : a + _KEY_BLOCK]
        size = int(n.sum())
        starts = np.cumsum(n) - n
        where = np.arange(size) + np.repeat(block["indices_at"] - starts, n)
        part = key[at : at + size]
        np.subtract(indices[where], low_i, out=part)
        part *= rank_width
        part += np.repeat(block["rank"] - low_r + (block["epoch"] - low_e) * per_epoch, n)
        at += size
    offsets = np.cumsum(lengths) - lengths
    for i in np.flatnonzero(rows["epoch_starts"]):  # a new epoch began in the step (rare)
        rank, step = int(rows["rank"][i]), int(rows["step"][i])
        rec = next(r for r in records[rank] if r.step == step)
        for begin in rec.epoch_starts:
            key[offsets[i] + begin : offsets[i] + lengths[i]] += per_epoch
    key.sort()
    key //= rank_width  # (epoch, index)
    return not bool(np.any(key[1:] == key[:-1]))


def _index_table(samples: np.ndarray) -> np.ndarray:
    """The sample table (:func:`_sample_table`) with each row's first batch of the epoch?
    and last? filled in.

    Where a rank reads again a sample it already read in the same epoch, dtlab missed an
    epoch's end (an endless iterator that reshuffles on its own): that epoch is compared
    only up to the first such step."""
    table = _before_first_reread(samples)
    if not len(table):
        return table
    # the first and last step of each rank's epoch: sorted by (epoch, rank), reduced per run
    keys = table[:, _E] * (int(table[:, _R].max()) + 1) + table[:, _R]
    order = np.argsort(keys, kind="stable")
    sorted_keys, steps = keys[order], table[order, _S]
    new = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]
    starts, group = np.flatnonzero(new), np.empty(len(order), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    table[:, _FIRST] = table[:, _S] == np.minimum.reduceat(steps, starts)[group]
    table[:, _LAST] = table[:, _S] == np.maximum.reduceat(steps, starts)[group]
    return table


def _before_first_reread(table: np.ndarray) -> np.ndarray:
    order = np.lexsort((table[:, _S], table[:, _I], table[:, _R], table[:, _E]))
    t = table[order]
    again = np.zeros(len(t), dtype=bool)
    again[1:] = np.all(t[1:, :3] == t[:-1, :3], axis=1)  # same epoch, index, rank
    keep = np.ones(len(table), dtype=bool)
    for epoch in np.unique(t[again, _E]):
        cutoff = t[again & (t[:, _E] == epoch), _S].min()
        keep &= ~((table[:, _E] == epoch) & (table[:, _S] >= cutoff))
    return table[keep]


def _shared_groups(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of samples two or more ranks read in one epoch (each rank's first read only),
    sorted by epoch, index, step; and where each (epoch, index) group starts."""
    t = table[np.lexsort((table[:, _S], table[:, _R], table[:, _I], table[:, _E]))]
    keep = np.ones(len(t), dtype=bool)
    keep[1:] = np.any(t[1:, :3] != t[:-1, :3], axis=1)
    t = t[keep]
    t = t[np.lexsort((t[:, _R], t[:, _S], t[:, _I], t[:, _E]))]
    new = np.ones(len(t), dtype=bool)
    new[1:] = np.any(t[1:, :2] != t[:-1, :2], axis=1)
    group = np.cumsum(new) - 1
    t = t[np.bincount(group)[group] > 1]
    if not len(t):
        return t, np.zeros(0, dtype=np.int64)
    return t, np.flatnonzero(np.r_[True, np.any(t[1:, :2] != t[:-1, :2], axis=1)])


def _overlap_findings(
    records: Records, jobs: Mapping[int, JobInfo], columns: StepColumns | None = None
) -> list[Finding]:
    if columns is None:
        columns = StepColumns.from_records(records)
    if _nothing_shared(records, columns):
        return []
    samples = _sample_table(records, columns)
    t, starts = _shared_groups(_index_table(samples))
    if not len(starts):
        return []
    sizes = np.diff(np.r_[starts, len(t)])
    first, second = t[starts], t[np.minimum(starts + 1, len(t) - 1)]
    pad_like = (sizes == 2) & (
        (first[:, _FIRST] & second[:, _LAST]) | (first[:, _LAST] & second[:, _FIRST])
    ).astype(bool)
    padding = pad_like.copy()
    for epoch in np.unique(first[:, _E]):
        in_epoch = first[:, _E] == epoch
        # DistributedSampler pads fewer samples than there are ranks
        if (pad_like & in_epoch).sum() >= len(records):
            padding &= ~in_epoch
    row_group = np.repeat(np.arange(len(starts)), sizes)
    found = []
    for is_padding in (False, True):
        chosen = padding == is_padding
        if chosen.any():
            rows = t[chosen[row_group]]
            found.append(_overlap_finding(rows, first[chosen], second[chosen], is_padding, jobs))
    return found


def _overlap_finding(rows, first, second, padding: bool, jobs) -> Finding:
    ranks = tuple(int(r) for r in np.unique(rows[:, _R]))
    step = int(second[:, _S].min())
    epochs = [int(e) for e in np.unique(first[:, _E])]
    examples = [int(i) for i in first[np.argsort(second[:, _S], kind="stable")[:5], _I]]
    evidence = {"num_shared": len(first), "example_indices": examples, "epochs": epochs}
    where = f"epoch{'s' if len(epochs) > 1 else ''} {', '.join(map(str, epochs))}"
    if padding:
        summary = (
            f"the last batch of {where} repeats {len(first)} samples from the epoch's start "
            f"({label_ranks(ranks)}, first at step {step}, e.g. index {examples[0]}): "
            "DistributedSampler pads each epoch to a multiple of the world size (drop_last=False)"
        )
        return Finding("data_order", ranks, summary, step, evidence, PADDING_FIX, "advice")
    summary = (
        f"{label_ranks(ranks)} read the same samples: {len(first)} sample indices seen by "
        f"more than one rank in {where}, first at step {step} (e.g. {examples})"
    )
    fix = data_fix(jobs, OVERLAP_FIX)
    return Finding("data_order", ranks, summary, step, evidence, fix, "error")


def _same_order_findings(columns: StepColumns) -> list[Finding]:
    """Ranks that read an epoch in the same order as the one before (set_epoch not
    called): each rank's first batches of two consecutive epochs compared as index arrays."""
    rows = columns.rows()
    have = rows["num_indices"] > 0
    names = ("rank", "step", "epoch", "num_indices", "indices_at")
    f = {name: rows[name][have] for name in names}
    if not len(f["epoch"]) or f["epoch"].min() == f["epoch"].max():
        return []  # one epoch: nothing to compare
    order = np.lexsort((f["step"], f["rank"]))
    f = {name: values[order] for name, values in f.items()}
    starts = np.flatnonzero(np.r_[True, f["rank"][1:] != f["rank"][:-1]])
    ends = np.r_[starts[1:], len(order)]

    def samples(at: np.ndarray) -> np.ndarray:  # the indices of these rows, one after another
        lengths = f["num_indices"][at].astype(np.int64)
        offsets = np.cumsum(lengths) - lengths
        where = np.arange(int(lengths.sum())) + np.repeat(f["indices_at"][at] - offsets, lengths)
        return columns.indices()[where]

    repeated = {}  # rank -> (epoch, its first step, steps compared)
    for a, b in zip(starts, ends, strict=True):
        epochs = f["epoch"][a:b]
        for epoch in np.unique(epochs)[:-1]:
            before = a + np.flatnonzero(epochs == epoch)
            now = a + np.flatnonzero(epochs == epoch + 1)
            n = min(len(before), len(now))
            before, now = before[:n], now[:n]
            enough = n >= MIN_SAME_ORDER_STEPS
            enough &= int(f["num_indices"][now].sum()) >= MIN_SAME_ORDER_SAMPLES
            if not enough or not np.array_equal(f["num_indices"][before], f["num_indices"][now]):
                continue
            first = samples(before)
            if np.array_equal(first, samples(now)) and not _sequential(samples, before):
                repeated[int(f["rank"][a])] = (int(epoch) + 1, int(f["step"][now[0]]), n)
                break
    if not repeated:
        return []
    ranks = tuple(repeated)
    epoch, step, n = min(repeated.values(), key=lambda v: v[1])
    summary = (
        f"{label_ranks(ranks)} read epoch {epoch} in the same order as epoch {epoch - 1} "
        f"(the first {n} batches match, from step {step}): the sampler's set_epoch is not called"
    )
    evidence: dict[str, object] = {
        "repeated": {
            r: {"epoch": e, "step": s, "num_steps": k} for r, (e, s, k) in repeated.items()
        }
    }
    return [Finding("data_order", ranks, summary, step, evidence, SET_EPOCH_FIX, "warning")]


def _sequential(samples, rows: np.ndarray) -> bool:
    """In ascending order: shuffle=False, where set_epoch changes nothing. The last batch
    may wrap around to the start (DistributedSampler's padding), so it is left out."""
    rows = rows[:-1] if len(rows) > 2 else rows
    return bool(np.all(np.diff(samples(rows)) > 0))
