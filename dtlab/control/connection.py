"""How the ranks reach the notebook's stepping channel, and connecting them to it.

Straight (small jobs), through one relay per host (from ``$DTLAB_RELAY_AT`` ranks on), or
with those host relays joined again by group relays (from ``$DTLAB_RELAY_FAN_IN`` host
relays on); :mod:`dtlab.control.relays` says which rank relays for which, and
:mod:`dtlab.agent.relay` is the relay itself. Connecting is one ipyparallel call on
every rank (``api.serve``, which also rebuilds the ranks' control group), after one on
the group relays' ranks (``api.open_group_relay``: each returns the TCP address the other
hosts' relays send up to) when there are group relays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import tempfile
import warnings

from dtlab.agent import api
from dtlab.analysis.ranks import label_ranks
from dtlab.control.channel import Channel
from dtlab.control.errors import DtlabError
from dtlab.control.network import channel_hosts
from dtlab.control.relays import FAN_IN_ENV, fan_in, relay_at, relay_groups, relay_plan
from dtlab.control.world import World
from dtlab.records.wire import key_token

CONNECT_TIMEOUT_S = 30.0

Plan = tuple[dict[int, int], dict[int, int]]  # (rank -> host relay, host relay -> group relay)
# the name of a host relay's ipc socket file in the temp folder (agent/relay.py:
# local_address: dtlab-<key_token>-<relay rank>.sock)
SOCKET_NAME = re.compile(r"dtlab-(?P<token>[0-9a-f]{8})-\d+\.sock")


class Connection:
    """The stepping channel of a session (``dt.stepper.connection``)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.channel: Channel | None = None
        self.plan: Plan = ({}, {})  # how the connected ranks reach the channel ({}: straight)
        self._planned: tuple[object, tuple[int, int], Plan] | None = None  # (infos, env, plan)
        self.relay_failed = False  # a relay said it failed: reconnect before the next run
        self._no_groups: tuple[object, tuple[int, int]] | None = None  # (infos, env) they failed

    def connect(self) -> None:
        """Connect the ranks to a new Channel, unless connected already the way the job's
        size asks (a changed $DTLAB_RELAY_AT or $DTLAB_RELAY_FAN_IN takes effect at the next
        run, and a relay that failed is replaced). If group relays cannot be started or
        reached, the ranks connect without them (a warning says why) until the ranks or
        those settings change."""
        plan = self._plan()
        if self.channel is not None:
            if plan == self.plan and not self.relay_failed:
                return
            self.close()
        try:
            self._connect(plan)
        except _GroupRelaysFailed as e:
            warnings.warn(
                f"{e}. Connecting without group relays instead (each host's relay sends "
                f"straight to the notebook) until the ranks or ${FAN_IN_ENV} change; set "
                f"{FAN_IN_ENV}=1 to skip trying them",
                stacklevel=3,
            )
            assert self._planned is not None  # (_plan made it)
            self._no_groups = (self._planned[0], self._planned[1])
            self._connect(self._plan())

    def _connect(self, plan: Plan) -> None:
        relays, groups = plan
        channel = Channel(*channel_hosts(*self.world.listening()))
        try:
            try:
                upstream = self._open_group_relays(channel, groups)
            except DtlabError as e:
                if getattr(e, "dead_ranks", ()):  # a dead rank: not the group relays' doing
                    raise
                raise _GroupRelaysFailed(f"the group relays could not start: {e}") from e
            ranks = self.world.ranks
            self.world.run_each(
                api.serve,
                {
                    r: (channel.address, channel.key, r, relays.get(r), upstream.get(r))
                    for r in ranks
                },
                what="connect the stepping channel",
                timeout=CONNECT_TIMEOUT_S,
            )
            missing = channel.wait_connected(ranks, CONNECT_TIMEOUT_S)
            if missing:
                said = _not_connected(missing, channel.address, relays, upstream)
                if any(relays.get(r) in upstream for r in missing):
                    raise _GroupRelaysFailed(said)
                raise DtlabError(said)
        except BaseException:
            _close(channel)
            raise
        self.channel, self.plan, self.relay_failed = channel, plan, False

    def describe(self) -> str | None:
        """How the ranks reach the notebook now, in words (None: not connected)."""
        if self.channel is None:
            return None
        relays, groups = self.plan
        if not relays:
            return "stepping: every rank straight to the notebook"
        hosts, joined = len(set(relays.values())), len(set(groups.values()))
        said = f"stepping: through {hosts} host relay{'s' * (hosts != 1)}"
        if joined:
            said += f", joined by {joined} group relay{'s' * (joined != 1)}"
        return said

    def close(self) -> None:
        if self.channel is not None:
            _close(self.channel)
            self.channel = None

    def _open_group_relays(self, channel: Channel, groups: dict[int, int]) -> dict[int, str]:
        """Start the group relays; returns where each other host relay sends up."""
        leaders = sorted(set(groups.values()))
        if not leaders:
            return {}
        opened = self.world.run_each(
            api.open_group_relay,
            {r: (channel.address, channel.key, r) for r in leaders},
            what="start the group relays",
            timeout=CONNECT_TIMEOUT_S,
        )
        return {r: opened[leader] for r, leader in groups.items() if r != leader}

    def _plan(self) -> Plan:
        """(relay_plan, relay_groups) of the session's ranks, worked out again only when
        they or the settings changed (a launch replaces ``world.infos``; 0.2 ms at 512);
        no group relays while they failed for these ranks and settings."""
        infos, at, per_group = self.world.infos, relay_at(), fan_in()
        found = self._planned
        if found is None or found[0] is not infos or found[1] != (at, per_group):
            relays = relay_plan(infos, at)
            plan = (relays, relay_groups(relays, per_group))
            found = self._planned = (infos, (at, per_group), plan)
        failed = self._no_groups
        if failed is not None and failed[0] is infos and failed[1] == (at, per_group):
            return (found[2][0], {})
        return found[2]


class _GroupRelaysFailed(DtlabError):
    """Group relays could not be started, or some ranks could not reach theirs."""


def _not_connected(
    missing: set[int], address: str, relays: dict[int, int], upstream: dict[int, str]
) -> str:
    """What to say when ``missing`` ranks never said hello: the link they needed."""
    behind = sorted(r for r in missing if relays.get(r) in upstream)
    if not behind:
        return (
            f"{label_ranks(missing)} did not connect to the notebook's stepping channel at "
            f"{address} (a firewall between the hosts?)"
        )
    via = sorted({upstream[relays[r]] for r in behind})
    return (
        f"{label_ranks(missing)} did not connect to the notebook's stepping channel; "
        f"{label_ranks(behind)} send through the group relays at {', '.join(via)}, which "
        "other hosts reach over TCP (a firewall between the hosts?)"
    )


def _close(channel: Channel) -> None:
    """Close the channel and remove its relays' socket files on this host: the ranks that
    made them leave through os._exit, so a relay's own close does not always run."""
    channel.close()
    for path in _socket_files(tempfile.gettempdir()):
        match = SOCKET_NAME.fullmatch(os.path.basename(path))
        if match is not None and match["token"] == key_token(channel.key):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def remove_stale_sockets(folder: str | None = None) -> list[str]:
    """Remove relays' socket files that a killed session left in ``folder`` (the temp
    folder): only files named as dtlab names them, sockets owned by this user, that no
    process listens on any more (connecting is refused). Returns the paths removed."""
    removed = []
    for path in _socket_files(folder or tempfile.gettempdir()):
        if _listened_on(path) is False:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def _socket_files(folder: str) -> list[str]:
    """The relays' socket files in ``folder`` that are this user's (links never followed)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        if SOCKET_NAME.fullmatch(name) is None:
            continue
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid():
            found.append(path)
    return found


def _listened_on(path: str) -> bool | None:
    """Does a live process listen on the socket file ``path``? (None: cannot tell.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            return None  # (busy, timed out: someone may be there) kept
        return True
