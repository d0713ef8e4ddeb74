"""``%dt_doctor`` check of a DeepSpeed job's configuration against itself, across ranks and
against the steps the job made.

Each rank reports what its engine made of its ds_config (``JobInfo.deepspeed``: ZeRO
stage, micro-batch size, accumulation steps, precision, the whole config). DeepSpeed
checks ``train_batch_size = micro-batch x accumulation x data-parallel world`` on each
rank at ``deepspeed.initialize``, but never compares ranks, never sees how often the
script calls ``backward()`` per optimizer step, and ignores options that do nothing for
the stage or precision in use. Those are this check's findings:

1. **config differs across ranks**: the keys whose values differ, rank by rank (a rank
   that read another file, an override on one node);
2. **accumulation the script does not follow**: the recorded micro-batches (backward
   calls) per optimizer step differ from ``gradient_accumulation_steps``, so each update
   sums a different number of micro-batches than the config (and the LR schedule, loss
   division and ``train_batch_size`` built on it) says;
3. **options with no effect** for the ZeRO stage or precision in use (advice).
"""

from __future__ import annotations

import json
from collections import Counter

from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, DeepSpeedInfo, Evidence, Finding

TITLE = "DeepSpeed config consistent"
SHOWN_KEYS = 6  # differing keys named in a finding's summary

STAGE3_ONLY = ("offload_param", "stage3_")
PARTITIONING_OPTIONS = ("overlap_comm", "contiguous_gradients", "reduce_scatter")


def _flat(config: object, prefix: str = "") -> dict[str, object]:
    """``{"zero_optimization.stage": 2, ...}`` from a nested config."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, object] = {}
    for key, value in config.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _parsed(info: DeepSpeedInfo) -> dict[str, object]:
    try:
        return _flat(json.loads(info.config)) if info.config else {}
    except ValueError:
        return {}


# DeepSpeed's fp16 defaults (runtime/precision_config.py): dynamic scaling unless
# fp16.loss_scale > 0, a floor of min_loss_scale 1, and hysteresis 2 (the first overflow
# after a scale-up only uses up hysteresis: the scale halves from the second one on)
FP16_MIN_LOSS_SCALE = 1.0
FP16_HYSTERESIS = 2


def _number(value: object, default: float) -> float:
    """A config value as a number (``default`` for "auto", a missing or odd one)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else default
    except ValueError:
        return default


def fp16_scaler(info: DeepSpeedInfo) -> tuple[float | None, int]:
    """``(floor, hysteresis)`` of the rank's fp16 loss scaler as its ds_config sets them;
    the floor is None when there is no dynamic scaler to collapse (fp16 off, or a static
    ``fp16.loss_scale``)."""
    flat = _parsed(info)
    hysteresis = max(1, int(_number(flat.get("fp16.hysteresis"), FP16_HYSTERESIS)))
    static = _number(flat.get("fp16.loss_scale"), 0.0) > 0
    floor = _number(flat.get("fp16.min_loss_scale"), FP16_MIN_LOSS_SCALE)
    return (None if info.precision != "fp16" or static else floor), hysteresis


def _differences(infos: dict[int, DeepSpeedInfo]) -> dict[str, dict[int, object]]:
    """Config key -> value per rank, for the keys whose values are not the same on all."""
    flat = {rank: _parsed(info) for rank, info in infos.items()}
    for rank, info in infos.items():  # what the engine made of it, even if the JSON is gone
        flat[rank].update(
            {
                "(engine) zero stage": info.zero_stage,
                "(engine) micro-batch": info.micro_batch,
                "(engine) accumulation": info.accumulation,
                "(engine) precision": info.precision,
            }
        )
    keys = sorted({k for values in flat.values() for k in values})
    missing = object()
    return {
        key: {rank: values.get(key, "(not set)") for rank, values in flat.items()}
        for key in keys
        if len({repr(values.get(key, missing)) for values in flat.values()}) > 1
    }


def _config_findings(infos: dict[int, DeepSpeedInfo]) -> list[Finding]:
    differ = _differences(infos)
    if not differ:
        return []
    # the ranks that are not like most: named as the odd ones
    signature = {r: tuple(repr(differ[k][r]) for k in differ) for r in infos}
    common, count = Counter(signature.values()).most_common(1)[0]
    if 2 * count > len(signature):  # a majority: the others are the odd ones
        odd = tuple(sorted(r for r, sig in signature.items() if sig != common))
    else:  # none is taken as right
        odd = tuple(sorted(infos))
    shown = list(differ)[:SHOWN_KEYS]
    parts = []
    for key in shown:
        by_value: dict[str, list[int]] = {}
        for rank, value in differ[key].items():
            by_value.setdefault(json.dumps(value, default=str), []).append(rank)
        parts.append(
            f"{key}: " + ", ".join(f"{v} on {label_ranks(rs)}" for v, rs in by_value.items())
        )
    more = f" (and {len(differ) - len(shown)} more keys)" if len(differ) > len(shown) else ""
    return [
        Finding(
            "deepspeed_config",
            odd,
            f"the ranks run different DeepSpeed configs: {'; '.join(parts)}{more}",
            None,
            {"differences": {k: {str(r): v for r, v in d.items()} for k, d in differ.items()}},
            "give every rank the same ds_config (one file on a shared path, the same "
            "--deepspeed_config argument and overrides on every node)",
            "error",
        )
    ]


def _accumulation_findings(evidence: Evidence, infos: dict[int, DeepSpeedInfo]) -> list[Finding]:
    off: dict[int, tuple[int, int, int]] = {}  # rank -> (micro-batches, config's, first step)
    for rank, info in infos.items():
        counts = [
            (rec.micro_batches, rec.step)
            for rec in evidence.records.get(rank, ())
            if rec.micro_batches and rec.micro_batches != info.accumulation
        ]
        if counts:
            off[rank] = (
                Counter(c for c, _ in counts).most_common(1)[0][0],
                info.accumulation,
                counts[0][1],
            )
    if not off:
        return []
    ranks = tuple(sorted(off))
    micro, config, _ = off[ranks[0]]
    step = min(first for _, _, first in off.values())
    return [
        Finding(
            "deepspeed_accumulation",
            ranks,
            f"{label_ranks(ranks)}: the script calls backward() {micro} times per optimizer "
            f"step, but gradient_accumulation_steps is {config}: each update sums {micro} "
            f"micro-batches, each divided by {config}, and train_batch_size counts {config}",
            step,
            {"micro_batches": {r: m for r, (m, _, _) in off.items()}, "config": config},
            "call engine.backward(loss) and engine.step() once per micro-batch and let "
            "DeepSpeed count the accumulation, or set gradient_accumulation_steps to the "
            "script's own count",
            "error",
        )
    ]


def _no_effect(info: DeepSpeedInfo) -> list[str]:
    """Options of this rank's config that do nothing for its stage or precision."""
    flat = _parsed(info)
    useless = []
    for key in flat:
        zero_key = key.removeprefix("zero_optimization.")
        if key.startswith("zero_optimization.") and zero_key != "stage":
            if info.zero_stage < 3 and zero_key.startswith(STAGE3_ONLY):
                useless.append(f"{key} (ZeRO stage 3 only; stage {info.zero_stage} in use)")
            elif info.zero_stage == 0 and zero_key.startswith(PARTITIONING_OPTIONS):
                useless.append(f"{key} (ZeRO is off: stage 0)")
        for block, precision in (("fp16.", "fp16"), ("bf16.", "bf16")):
            # a block switched off on purpose ("enabled": false) is not idle by mistake
            off = flat.get(f"{block}enabled") is False
            if key.startswith(block) and info.precision != precision and not off:
                useless.append(f"{key} ({precision} is not enabled)")
    return useless


def _advice_findings(infos: dict[int, DeepSpeedInfo]) -> list[Finding]:
    by_rank = {rank: _no_effect(info) for rank, info in infos.items()}
    ranks = tuple(sorted(r for r, keys in by_rank.items() if keys))
    if not ranks:
        return []
    keys = by_rank[ranks[0]]
    return [
        Finding(
            "deepspeed_config",
            ranks,
            f"ds_config options that do nothing here: {'; '.join(keys[:SHOWN_KEYS])}"
            + (f" (and {len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else ""),
            None,
            {"no_effect": {str(r): k for r, k in by_rank.items() if k}},
            "remove them, or switch to the stage / precision they belong to if that was meant",
            "advice",
        )
    ]


@check("deepspeed", order=65, observes=("deepspeed",))
def check_deepspeed(evidence: Evidence) -> CheckResult:
    infos = {r: j.deepspeed for r, j in evidence.jobs.items() if j.deepspeed is not None}
    if not infos:
        return CheckResult(
            "deepspeed", TITLE, (), "each rank's job", "the job does not run in DeepSpeed"
        )
    steps = sum(len(evidence.records.get(r, ())) for r in infos)
    stages = sorted({i.zero_stage for i in infos.values()})
    accumulation = sorted({i.accumulation for i in infos.values()})
    looked = (
        f"{len(infos)} ranks' ds_config (ZeRO stage {', '.join(map(str, stages))}; "
        f"accumulation {', '.join(map(str, accumulation))}) and the micro-batches of "
        f"{steps} rank-steps"
    )
    findings = (
        _config_findings(infos) + _accumulation_findings(evidence, infos) + _advice_findings(infos)
    )
    why = (
        ""
        if findings
        else "every rank runs the same config, each step summed the configured number of "
        "micro-batches, and no option is idle for the stage and precision in use"
    )
    return CheckResult("deepspeed", TITLE, tuple(findings), looked, why)
