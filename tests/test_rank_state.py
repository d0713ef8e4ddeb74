"""A rank's state is one object (dtlab/agent/state.py: RANK): agent modules keep none in
globals of their own, and ``reset`` gives a fresh process's state back."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import dtlab.agent
from dtlab.agent.state import RANK, RankState

AGENT = Path(dtlab.agent.__file__).parent
# not state: a cache of pure constants, a saved original, and the state object itself
NOT_STATE = {"recorder.py": {"_weights"}, "script.py": {"_real_signal"}, "state.py": {"RANK"}}


def test_agent_modules_keep_no_state_in_module_globals():
    found = []
    for path in sorted(AGENT.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and not t.id.isupper():
                    if t.id not in NOT_STATE.get(path.name, ()):
                        found.append(f"{path.name}: {t.id}")
        found += [
            f"{path.name}:{node.lineno}: global {', '.join(node.names)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Global)
        ]
    assert found == [], "a rank's state belongs in dtlab/agent/state.py (RankState)"


def test_reset_gives_a_fresh_state_but_keeps_what_is_still_patched():
    saved = {f.name: getattr(RANK, f.name) for f in dataclasses.fields(RANK)}
    try:
        RANK.job, RANK.attach_count, RANK.fault_repartition_die = object(), 3, True
        RANK.fault_omitted_parts.add("torch")
        RANK.retired_groups.add("old")
        RANK.script_env_patched = patched = {"init": print}
        RANK.reset()
        fresh = RankState()
        assert RANK.job is None and RANK.attach_count == 0
        assert not RANK.fault_repartition_die and RANK.fault_omitted_parts == set()
        assert RANK.retired_groups == set() and RANK.retired_groups is not fresh.retired_groups
        assert RANK.script_env_patched is patched
    finally:
        for name, value in saved.items():
            setattr(RANK, name, value)


def test_every_field_is_documented_where_it_is_declared():
    source = (AGENT / "state.py").read_text().splitlines()
    for f in dataclasses.fields(RankState):
        line = next(i for i, text in enumerate(source) if text.strip().startswith(f"{f.name}:"))
        assert source[line - 1].strip().startswith("#"), f"{f.name} has no comment above it"
