"""Where the notebook side listens: the controller, the stepping and sidecar channels.

Loopback by default: with the local launcher (and MPI or Slurm on this one host) nothing
needs to be reachable from elsewhere. Ranks on other hosts need ``--listen`` (an interface
name such as ``eth0`` or ``ib0``, an address of this machine, or ``*`` for all); ipyparallel
keeps signing every message with the cluster's key and writes its connection files
owner-only, and dtlab's channels carry a per-session key and never unpickle.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

import psutil

from dtlab.control.errors import DtlabError, OptionError
from dtlab.control.launchers import Launcher
from dtlab.records import RankInfo

LOOPBACK = "127.0.0.1"
EVERYWHERE = "0.0.0.0"


def listen_address(listen: str) -> str:
    """``""`` -> 127.0.0.1; ``*``/``0.0.0.0`` -> 0.0.0.0; an IPv4 address -> itself; an
    interface name -> its IPv4 address. OptionError names the interfaces there are."""
    if not listen:
        return LOOPBACK
    if listen in ("*", EVERYWHERE):
        return EVERYWHERE
    try:
        return str(ipaddress.IPv4Address(listen))
    except ValueError:
        pass
    interfaces = psutil.net_if_addrs()
    if listen in interfaces:
        for addr in interfaces[listen]:
            if addr.family == socket.AF_INET:
                return addr.address
        raise OptionError(f"--listen {listen}: that interface has no IPv4 address")
    names = ", ".join(sorted(interfaces))
    raise OptionError(
        f"--listen {listen!r} is neither an IPv4 address nor an interface here ({names}), "
        "nor * for all"
    )


def is_loopback(address: str) -> bool:
    return ipaddress.IPv4Address(address).is_loopback


def route_ip(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet sent;
    the ranks' relays ask the same of their own host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def channel_hosts(listen: str, launcher: str, infos: Mapping[int, RankInfo]) -> tuple[str, str]:
    """(where to listen, what address to give the ranks): loopback while every rank is on
    this host (or the launcher is the local one), else the ``--listen`` address."""
    here = socket.gethostname()
    address = listen_address(listen)
    if launcher == Launcher.LOCAL or (
        is_loopback(address) and all(i.host == here for i in infos.values())
    ):
        return LOOPBACK, LOOPBACK
    if is_loopback(address):
        remote = sorted({i.host for i in infos.values()} - {here})
        raise DtlabError(
            f"ranks run on other hosts ({', '.join(remote)}) but dtlab listens on loopback "
            "only: launch with --listen <interface or address> (e.g. --listen eth0)"
        )
    if address == EVERYWHERE:  # the address of this machine that remote ranks can reach
        remote = [i.host for i in infos.values() if i.host != here]
        return "*", route_ip(remote[0]) if remote else LOOPBACK
    return address, address
