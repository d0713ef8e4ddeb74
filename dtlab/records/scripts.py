"""Where a user's own script stands on the ranks (``%dt_script``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScriptStatus:
    """Where a script stands on every rank after ``%dt_script`` (from their status dicts)."""

    path: str
    argv: tuple[str, ...]
    states: dict[int, str]  # rank -> "paused" | "ended"
    steps: dict[int, int]  # rank -> optimizer steps made
    outcomes: dict[int, dict | None]  # rank -> how it ended (kind, code, ename, evalue, ...)
    notes: tuple[str, ...]  # what dtlab did for the script (its init_process_group...)
    seconds: float
    setup_s: float | None = None  # rank 0: from the start to its first optimizer step
    model: str | None = None
    wrapper: str | None = None
    optimizers: tuple[str, ...] = ()
    backward_calls: dict[int, int] = field(default_factory=dict)  # made since the last step

    @classmethod
    def from_ranks(cls, path: str, argv, states: dict, seconds: float) -> ScriptStatus:
        first = states[min(states)]
        notes = tuple(dict.fromkeys(n for s in states.values() for n in s["notes"]))
        return cls(
            path=first.get("path", path),
            argv=tuple(argv),
            states={r: s["state"] for r, s in states.items()},
            steps={r: s["step"] for r, s in states.items()},
            outcomes={r: s["outcome"] for r, s in states.items()},
            notes=notes,
            seconds=seconds,
            setup_s=first.get("setup_s"),
            model=first.get("model"),
            wrapper=first.get("wrapper"),
            optimizers=tuple(first.get("optimizers") or ()),
            backward_calls={r: s.get("backward_calls", 0) for r, s in states.items()},
        )

    @property
    def paused(self) -> bool:
        return bool(self.states) and set(self.states.values()) == {"paused"}

    def where(self, rank: int) -> str:
        """``"step 3, train.py:42"`` for a rank whose script failed."""
        o = self.outcomes.get(rank) or {}
        place = f", {o['file'].rsplit('/', 1)[-1]}:{o['line']}" if o.get("line") else ""
        return f"step {self.steps.get(rank, 0)}{place}"
