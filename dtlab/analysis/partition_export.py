"""Export a :class:`~dtlab.analysis.partition.Plan` in the forms other frameworks read.

Pure (runs anywhere). The reverse direction, reading these forms back, is
:func:`~dtlab.analysis.partition.parse_plan` (DeepSpeed's and torchtitan's forms);
Megatron's layout can only be written, and :func:`to_megatron` raises a
:class:`~dtlab.analysis.partition.PlanError` for a model it cannot express.

    to_deepspeed(plan), to_torchtitan(plan), to_megatron(plan)
"""

from __future__ import annotations

import re

from dtlab.records import Plan, PlanError

_LAYER = re.compile(r"(?:.*\.)?(?:blocks|layers|h)\.\d+")
_EMBED_PARTS = ("embed", "wte", "wpe", "tok_embeddings")
_HEADS = {"head", "output", "lm_head"}
_NORMS = {"norm", "ln_f", "final_norm"}


def to_deepspeed(plan: Plan) -> list[int]:
    """DeepSpeed's ``parts`` list (``PipelineModule.parts``): the plan's bounds."""
    return list(plan.bounds)


def to_torchtitan(plan: Plan) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: one list of block names per stage."""
    return [list(plan.stage_blocks(s)) for s in range(plan.num_stages)]


def to_megatron(plan: Plan) -> str:
    """Megatron-core's ``--pipeline-model-parallel-layout`` string, e.g. ``"Et|t*2|t|L"``."""
    kinds = [_megatron_kind(b) for b in plan.blocks]
    _check_megatron_order(plan, kinds)
    stages = []
    for s in range(plan.num_stages):
        symbols = "".join(kinds[plan.bounds[s] : plan.bounds[s + 1]]).replace("n", "")
        symbols = re.sub("E+", "E", symbols)  # token and position embeddings are one E
        stages.append(re.sub("t{2,}", lambda m: f"t*{len(m.group())}", symbols))
    return "|".join(stages)


# -- Megatron naming --------------------------------------------------------------------


def _megatron_kind(block: str) -> str:
    leaf = block.rsplit(".", 1)[-1]
    if _LAYER.fullmatch(block):
        return "t"
    if leaf in _HEADS:
        return "L"
    if leaf in _NORMS:
        return "n"  # Megatron builds the final norm with the loss layer
    if any(part in leaf for part in _EMBED_PARTS):
        return "E"
    raise PlanError(
        f"Megatron's layout cannot express block {block!r}: it knows embeddings (E), numbered "
        "transformer layers (t), and the output layer with its final norm (L)"
    )


def _check_megatron_order(plan: Plan, kinds: list[str]) -> None:
    order = "".join(kinds)
    # Megatron validates the flattened layout: one E first, one L last, decoders between
    if not re.fullmatch(r"E+t*n*L", order):
        raise PlanError(
            f"Megatron's layout needs the blocks in the order embedding, transformer layers, "
            f"final norm, output layer; this model's blocks read {order} "
            f"(E embedding, t layer, n norm, L output): {', '.join(plan.blocks)}"
        )
    stages = plan.stage_map()
    head = plan.blocks[-1]
    embeds = [b for b, k in zip(plan.blocks, kinds, strict=True) if k == "E"]
    for norm in (b for b, k in zip(plan.blocks, kinds, strict=True) if k == "n"):
        if stages[norm] != stages[head]:
            raise PlanError(
                f"final norm {norm!r} is on stage {stages[norm]} but the output layer {head!r} "
                f"on stage {stages[head]}: Megatron's L holds both, so put them on one stage"
            )
    if stages[embeds[-1]] != 0:
        raise PlanError(
            f"embeddings {', '.join(embeds)} span stages 0..{stages[embeds[-1]]}: Megatron's E "
            "is one layer, so put them all on stage 0"
        )
