"""Do two runs of the same steps agree bit for bit, and if not, what differs first.

A run resumed from a checkpoint (or a replay) should repeat the steps of the run that never
stopped to the last bit. Where it does not, the first differing step and, at that step, the
first differing *cause* name what was not restored: an RNG, the data position, the LR
schedule, the GradScaler; with all of those equal, the model or optimizer state.

1. collect (each rank, agent/): a :class:`dtlab.records.StepRecord` per step, with RNG
   fingerprints taken as the step began and, while outputs are recorded, one fingerprint
   per module output.
2. combine (notebook, here): :func:`compare_runs` walks the steps both runs hold, checking
   fields in cause order; :func:`first_module_difference` finds the first module output
   that differs.
3. present (views/): :meth:`Comparison.summary` and each ``Difference.explanation``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from dtlab.analysis.ranks import format_ranks, label_ranks
from dtlab.records import StepRecord

RNG_LABELS = {
    "python": "Python random RNG",
    "numpy": "numpy RNG",
    "torch": "torch CPU RNG",
    "cuda": "CUDA RNG",
}
# what a step starts from: a difference here explains every difference computed from it
CAUSES = (*(f"rng:{name}" for name in RNG_LABELS), "indices", "input_fingerprints", "lr", "scale")
EFFECTS = ("module_outputs", "loss", "grad_fingerprint", "param_fingerprint", "buffer_fingerprint")
_RNGS = CAUSES[:4]
# within one step, which fields can change which: the LR of step S only acts on its update,
# so a loss that differs beside it is not its consequence
_UPSTREAM = {
    "module_outputs": (*_RNGS, "indices", "input_fingerprints"),
    "loss": (*_RNGS, "indices", "input_fingerprints", "module_outputs"),
    "grad_fingerprint": (
        *_RNGS,
        "indices",
        "input_fingerprints",
        "scale",
        "module_outputs",
        "loss",
    ),
    "param_fingerprint": (*CAUSES, "module_outputs", "loss", "grad_fingerprint"),
    "buffer_fingerprint": (*_RNGS, "indices", "input_fingerprints", "module_outputs"),
}
_NOUNS = {f"rng:{name}": label for name, label in RNG_LABELS.items()} | {
    "indices": "data",
    "input_fingerprints": "model input",
    "lr": "learning-rate",
    "scale": "loss-scale",
    "module_outputs": "module output",
    "loss": "loss",
    "grad_fingerprint": "gradient",
}
_INPUTS = {
    "data": ("indices", "input_fingerprints"),
    "RNGs": _RNGS,
    "LR": ("lr",),
    "loss scale": ("scale",),
}
_TEXT = {
    "rng": "of {who} not restored: at the start of step {step} its state differs from {ref}",
    "lr": "learning-rate schedule not restored: step {step} ran at lr {found!r} on {who}, "
    "{ref} at {expected!r}",
    "scale": "GradScaler state not restored: step {step} used loss scale {found!r} on {who}, "
    "{ref} used {expected!r}",
    "input_fingerprints": "the model's inputs of step {step} differ on {who} from {ref}'s "
    "(no sample indices to say which: its own batching drew other data)",
    "module_outputs": "the module outputs of step {step} differ",
    "loss": "the loss of step {step} differs ({found!r} vs {expected!r} in {ref})",
    "grad_fingerprint": "the gradients of step {step} differ",
    "param_fingerprint": "the parameters after step {step} differ",
    "buffer_fingerprint": "the buffers after step {step} differ",
}
_EFFECT_CAUSES = {
    "loss": "model or optimizer state was not restored, or the step is non-deterministic",
    "grad_fingerprint": "model state was not restored, or backward is non-deterministic",
    "param_fingerprint": "optimizer state not restored? (moments, step count)",
    "buffer_fingerprint": "buffers such as BatchNorm running statistics were not restored",
}
_UNRECORDED = object()  # () / 0 in a record: nothing to compare, unlike a recorded None


@dataclass(frozen=True)
class Difference:
    """One field that differs at one step; ``expected``/``found`` are from ``ranks[0]``."""

    step: int
    field: str  # "rng:torch", "indices", "lr", ..., "missing" (a rank only one run has)
    ranks: tuple[int, ...]
    expected: object  # in the reference run
    found: object  # in the other run
    explanation: str


@dataclass(frozen=True)
class Comparison:
    """Two runs over the steps both hold on every rank; ``first`` is None when they agree."""

    steps: tuple[int, ...]
    first: Difference | None
    at_first_step: tuple[Difference, ...]  # every differing field there, causes first
    ranks: tuple[int, ...] = ()  # ranks compared (in both runs)

    @property
    def identical(self) -> bool:
        return self.first is None and bool(self.steps)

    def summary(self) -> str:
        if self.first is not None:
            return f"first difference at step {self.first.step}: {self.first.explanation}"
        if not self.steps:
            return "nothing to compare: the two runs hold no step in common on every rank"
        n, r = len(self.steps), len(self.ranks)
        span = format_ranks(self.steps)  # runs of integers print the same as rank runs
        return (
            f"identical over step{'s' * (n > 1)} {span} "
            f"({n} step{'s' * (n > 1)}, {r} rank{'s' * (r > 1)})"
        )


@dataclass(frozen=True)
class ModuleDifference:
    """The first module whose forward output differs between two runs."""

    rank: int  # the rank where it differs earliest in forward order
    module: str
    index: int  # position in forward completion order
    explanation: str
    ranks: tuple[int, ...] = ()  # every rank whose output differs first at this module


def compare_runs(
    reference: Mapping[int, Sequence[StepRecord]],
    other: Mapping[int, Sequence[StepRecord]],
    *,
    steps: Iterable[int] | None = None,
    reference_name: str = "the run that never stopped",
    other_name: str = "the resumed run",
) -> Comparison:
    """Where ``other`` first stops repeating ``reference`` bit for bit.

    Compares the steps every rank of both runs holds (and in ``steps``, when given) in
    ascending order. At the first step where anything differs, reports every differing
    field, causes first (RNGs, samples, LR, loss scale) then what was computed from them
    (module outputs, loss, gradients, parameters, buffers). A field left unrecorded on
    either side (``()``, fingerprint 0) is not compared. Ranks only one run has come
    first, as "missing".
    """
    ref, oth = _by_step(reference), _by_step(other)
    ranks = tuple(sorted(ref.keys() & oth.keys()))
    common = set.intersection(*(ref[r].keys() & oth[r].keys() for r in ranks)) if ranks else set()
    if steps is not None:
        common &= set(steps)
    compared = tuple(sorted(common))
    missing = _missing_ranks(ref, oth, compared, reference_name, other_name)
    for step in compared:
        pairs = {r: (ref[r][step], oth[r][step]) for r in ranks}
        found = _step_differences(step, pairs, ref, reference_name, other_name)
        if found or missing:
            return Comparison(compared, (missing + found)[0], missing + found, ranks)
    return Comparison(compared, missing[0] if missing else None, missing, ranks)


def first_module_difference(
    reference: Mapping[int, Sequence[tuple[str, int]]],
    other: Mapping[int, Sequence[tuple[str, int]]],
    *,
    reference_name: str = "the run that never stopped",
    other_name: str = "the resumed run",
) -> ModuleDifference | None:
    """The earliest module output (by forward position, then rank) that differs, or None.

    A rank with no outputs in either run was not recorded there and is skipped.
    """
    mismatch = {}
    for rank in sorted(reference.keys() & other.keys()):
        a, b = tuple(reference[rank]), tuple(other[rank])
        if a and b and (index := _first_mismatch(a, b)) is not None:
            mismatch[rank] = index
    if not mismatch:
        return None
    rank = min(mismatch, key=lambda r: (mismatch[r], r))
    index = mismatch[rank]
    x, y = _entry(tuple(reference[rank]), index), _entry(tuple(other[rank]), index)
    text = _module_text(rank, index, x, y, reference_name, other_name)
    ranks = tuple(r for r in sorted(mismatch) if mismatch[r] == index)
    return ModuleDifference(rank, (x or y)[0], index, text, ranks)


def _module_text(rank, index, x, y, reference_name, other_name) -> str:
    if x and y and x[0] == y[0]:
        return (
            f"on rank {rank} the output of module {x[0]!r} (position {index} in forward "
            f"order) is the first to differ from {reference_name}; every module that finished "
            "before it agreed, so look at its inputs, parameters, buffers and randomness"
        )
    ran = [
        f"{name} ran {e[0]!r}" if e else f"{name} had ended its forward"
        for name, e in ((reference_name, x), (other_name, y))
    ]
    return f"on rank {rank} the forward took a different path: at position {index} " + (
        " and ".join(ran)
    )


def _by_step(run: Mapping[int, Sequence[StepRecord]]) -> dict[int, dict[int, StepRecord]]:
    # a resumed run's history may hold a step twice (before the stop and after the resume):
    # the later record is the one the resumed run continued from
    return {rank: {rec.step: rec for rec in records} for rank, records in run.items()}


def _missing_ranks(ref, oth, compared, reference_name, other_name) -> tuple[Difference, ...]:
    every = (s for run in (ref, oth) for recs in run.values() for s in recs)
    step = compared[0] if compared else min(every, default=0)
    out = []
    for only, here, absent in (
        (sorted(ref.keys() - oth.keys()), reference_name, other_name),
        (sorted(oth.keys() - ref.keys()), other_name, reference_name),
    ):
        if only:
            verb = "is" if len(only) == 1 else "are"
            text = f"{label_ranks(only)} {verb} only in {here}, not in {absent}"
            expected, found = len(ref.get(only[0], {})), len(oth.get(only[0], {}))
            out.append(Difference(step, "missing", tuple(only), expected, found, text))
    return tuple(out)


def _value(rec: StepRecord, field: str) -> object:
    if field.startswith("rng:"):
        # a generator recorded on one side only is a difference (None != fingerprint)
        return dict(rec.rng).get(field[4:]) if rec.rng else _UNRECORDED
    if field == "module_outputs":
        return tuple(getattr(rec, "module_outputs", ())) or _UNRECORDED
    value = getattr(rec, field)
    if field in ("indices", "input_fingerprints") or field.endswith("_fingerprint"):
        return value or _UNRECORDED
    return value


def _equal(a: object, b: object) -> bool:
    if a is _UNRECORDED or b is _UNRECORDED:
        return True
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def _step_differences(step, pairs, ref, reference_name, other_name) -> tuple[Difference, ...]:
    differing = {}
    for field in CAUSES + EFFECTS:
        ranks = tuple(
            r for r, (a, b) in pairs.items() if not _equal(_value(a, field), _value(b, field))
        )
        if ranks:
            differing[field] = ranks
    same = [noun for noun, fields in _INPUTS.items() if _same(fields, pairs, differing)]
    out = []
    for field, ranks in differing.items():
        a, b = pairs[ranks[0]]
        expected, found, why = _value(a, field), _value(b, field), _EFFECT_CAUSES.get(field)
        if field == "module_outputs":
            expected, found, why = _module_values(pairs, ranks, reference_name, other_name)
        facts = {"step": step, "who": label_ranks(ranks), "ref": reference_name}
        text = _TEXT.get(field.split(":")[0], "").format(expected=expected, found=found, **facts)
        if field == "indices":
            text = _explain_indices(step, ranks, a, b, ref[ranks[0]], reference_name)
        elif field.startswith("rng:"):
            text = f"{RNG_LABELS[field[4:]]} {text}"
        elif field in EFFECTS:
            upstream = next((f for f in _UPSTREAM[field] if f in differing), None)
            text = _effect_sentence(text, facts["who"], upstream, same, why)
        out.append(Difference(step, field, ranks, expected, found, text))
    return tuple(out)


def _module_values(pairs, ranks, reference_name, other_name) -> tuple[object, object, str]:
    """The first differing (module, fingerprint) on ``ranks[0]`` in each run, and why."""
    outputs = [{r: getattr(pairs[r][side], "module_outputs", ()) for r in ranks} for side in (0, 1)]
    diff = first_module_difference(*outputs, reference_name=reference_name, other_name=other_name)
    assert diff is not None  # these ranks were picked because their outputs differ
    a, b = outputs[0][ranks[0]], outputs[1][ranks[0]]
    index = _first_mismatch(a, b)
    return _entry(a, index), _entry(b, index), diff.explanation


def _same(fields, pairs, differing) -> bool:
    """Was this input recorded on both sides of every rank, and equal: may we say "same"?"""
    recorded = all(
        _value(rec, fields[0]) not in (_UNRECORDED, None) for pair in pairs.values() for rec in pair
    )
    return recorded and not any(f in differing for f in fields)


def _entry(outputs, index):
    return outputs[index] if index < len(outputs) else None


def _first_mismatch(a: Sequence, b: Sequence) -> int | None:
    """First position where two output sequences differ in name or fingerprint, or length."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _explain_indices(step, ranks, a, b, ref_history, reference_name) -> str:
    rank = f"rank {ranks[0]}"
    if sorted(a.indices) == sorted(b.indices):
        text = f"data order lost: {rank} read the same samples in a different order at step {step}"
    else:
        # samples the reference had already consumed this epoch: the loader restarted too early
        seen = {
            i
            for s, rec in ref_history.items()
            if s < step and rec.epoch == a.epoch
            for i in rec.indices
        }
        verb = "re-read" if set(b.indices) <= seen else "read"
        text = (
            f"data position lost: {rank} {verb} samples {format_samples(b.indices)} at step "
            f"{step}; {reference_name} read {format_samples(a.indices)}"
        )
    if a.epoch != b.epoch:
        text += f" (epoch {b.epoch} vs {a.epoch})"
    return text + (f"; {label_ranks(ranks)} differ" if len(ranks) > 1 else "")


def _effect_sentence(what, who, upstream, same, why) -> str:
    if upstream is not None:
        return f"{what} on {who}, which follows from the {_NOUNS[upstream]} difference"
    prefix = f"with the same {_join(same)}, " if same else ""
    return f"{prefix}{what} on {who}: {why}"


def _join(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def format_samples(indices: Sequence[int], shown: int = 3) -> str:
    """``(8, 9, 10, 11)`` -> ``"8-11"``; otherwise the first few and a count."""
    if not indices:
        return "no samples"
    first = indices[0]
    if tuple(indices) == tuple(range(first, first + len(indices))):
        return f"{first}-{indices[-1]}" if len(indices) > 1 else f"{first}"
    if len(indices) <= shown + 1:
        return ", ".join(map(str, indices))
    return f"{', '.join(map(str, indices[:shown]))}, ... ({len(indices)} samples)"


def without_rng(records: dict) -> dict:
    """Records without RNG fingerprints: a fresh process seeds Python's and numpy's from
    the OS unless the script seeds them, which matters only if something it computed
    differs too (and then the full comparison names the generator)."""
    return {r: [replace(rec, rng=()) for rec in recs] for r, recs in records.items()}
