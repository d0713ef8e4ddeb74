"""Which ranks reach the notebook through relays (the relay itself: agent/relay.py).

Jobs of RELAY_AT ranks or more (``$DTLAB_RELAY_AT``) go through one relay per host with
two or more ranks, run by the host's lowest rank; smaller jobs, and a host's only rank,
connect straight to the notebook's Channel.

From FAN_IN host relays on (``$DTLAB_RELAY_FAN_IN``), host relays are joined again: each
run of FAN_IN of them (in rank order) sends up through the first one's relay, a *group
relay*, which other hosts' relays reach over TCP. The notebook then gets one message a
step per FAN_IN hosts (8 at 512 ranks on 64 hosts, not 64): at hundreds of ranks its
cost of a step is mostly per message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dtlab.control.errors import OptionError
from dtlab.records import RankInfo

RELAY_AT = 64  # from this many ranks on, one relay per host (one message per host a step)
RELAY_ENV = "DTLAB_RELAY_AT"
FAN_IN = 8  # host relays joined by one group relay (from this many host relays on)
FAN_IN_ENV = "DTLAB_RELAY_FAN_IN"


def _env_count(name: str, default: int, least: int, what: str) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise OptionError(f"${name}={text!r}: give a number of {what} >= {least}")
    return value


def relay_at() -> int:
    """Jobs of this many ranks or more reach the notebook through one relay per host
    (``$DTLAB_RELAY_AT``, default RELAY_AT; agent/relay.py)."""
    return _env_count(RELAY_ENV, RELAY_AT, 2, "ranks")


def fan_in() -> int:
    """Host relays per group relay (``$DTLAB_RELAY_FAN_IN``, default FAN_IN; 1: none)."""
    return _env_count(FAN_IN_ENV, FAN_IN, 1, "host relays")


def relay_plan(infos: Mapping[int, RankInfo], at: int) -> dict[int, int]:
    """``{rank: the rank whose relay it goes through}`` (the lowest rank of each host with
    two or more ranks), or ``{}`` for a job of fewer than ``at`` ranks."""
    if len(infos) < at:
        return {}
    hosts: dict[str, list[int]] = {}
    for rank, info in infos.items():
        hosts.setdefault(info.host, []).append(rank)
    return {rank: min(local) for local in hosts.values() if len(local) >= 2 for rank in local}


def relay_groups(plan: Mapping[int, int], per_group: int) -> dict[int, int]:
    """``{host relay rank: its group relay's rank}`` for the host relays of ``plan``, in
    runs of ``per_group`` by rank (the first of each run leads it, itself included), or
    ``{}`` when there are fewer than ``per_group`` host relays (or ``per_group`` is 1).
    A last run of one host relay is left out: it sends straight to the notebook."""
    hosts = sorted(set(plan.values()))
    if per_group < 2 or len(hosts) < per_group:
        return {}
    runs = [hosts[i : i + per_group] for i in range(0, len(hosts), per_group)]
    return {r: run[0] for run in runs if len(run) >= 2 for r in run}
