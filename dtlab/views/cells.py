"""Collate what the ranks printed for one ``%%dt`` cell: identical outputs once, by rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.records import CellOutput


def collate(
    by_rank: Mapping[int, str], label: Callable[[tuple[int, ...]], str] = label_ranks
) -> str:
    """``{0: "hi\\n", 1: "hi\\n"}`` -> ``"ranks 0-1: hi\\n"``; multi-line text goes under
    its label. Ranks that printed nothing are left out."""
    blocks = []
    for ranks, text in group_by_value({r: t for r, t in by_rank.items() if t}):
        body = text.rstrip("\n")
        if "\n" in body:
            blocks.append(f"{label(ranks)}:\n{body}\n")
        else:
            blocks.append(f"{label(ranks)}: {body}\n")
    return "".join(blocks)


def collate_cell(outputs: Mapping[int, CellOutput]) -> tuple[str, str, str]:
    """(stdout, stderr, results) of a cell, each collated across ranks."""
    stdout = collate({r: o.stdout for r, o in outputs.items()})
    stderr = collate({r: o.stderr for r, o in outputs.items()})
    results = collate(
        {r: o.result or "" for r, o in outputs.items()}, lambda ranks: f"Out[{label_ranks(ranks)}]"
    )
    return stdout, stderr, results
