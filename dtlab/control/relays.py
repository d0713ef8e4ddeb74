"""Which ranks reach the notebook through a host relay (the relay itself: agent/relay.py).

Jobs of RELAY_AT ranks or more (``$DTLAB_RELAY_AT``) go through one relay per host with
two or more ranks, run by the host's lowest rank; smaller jobs, and a host's only rank,
connect straight to the notebook's Channel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dtlab.control.errors import OptionError
from dtlab.records import RankInfo

RELAY_AT = 64  # from this many ranks on, one relay per host (one message per host a step)
RELAY_ENV = "DTLAB_RELAY_AT"


def relay_at() -> int:
    """Jobs of this many ranks or more reach the notebook through one relay per host
    (``$DTLAB_RELAY_AT``, default RELAY_AT; agent/relay.py)."""
    text = os.environ.get(RELAY_ENV, "").strip()
    if not text:
        return RELAY_AT
    try:
        at = int(text)
    except ValueError:
        at = 0
    if at < 2:
        raise OptionError(f"${RELAY_ENV}={text!r}: give a number of ranks >= 2")
    return at


def relay_plan(infos: Mapping[int, RankInfo], at: int) -> dict[int, int]:
    """``{rank: the rank whose relay it goes through}`` (the lowest rank of each host with
    two or more ranks), or ``{}`` for a job of fewer than ``at`` ranks."""
    if len(infos) < at:
        return {}
    hosts: dict[str, list[int]] = {}
    for rank, info in infos.items():
        hosts.setdefault(info.host, []).append(rank)
    return {rank: min(local) for local in hosts.values() if len(local) >= 2 for rank in local}
