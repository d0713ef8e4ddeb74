"""Past one machine, without another machine: what dtlab hands to ipyparallel's SSH
launcher for a list of hosts, where the notebook side listens, and that a live cluster
keeps ipyparallel's message signing and owner-only connection files."""

from __future__ import annotations

import json
import socket
import stat
import sys
from pathlib import Path

import psutil
import pytest
from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

from dtlab.control.cluster import make_cluster
from dtlab.control.config import LaunchConfig
from dtlab.control.launchers import parse_hosts, ssh_config
from dtlab.control.network import listen_address


def test_hosts_are_read_as_mpirun_writes_them():
    assert parse_hosts("node1:4,node2:4") == {"node1": 4, "node2": 4}
    assert parse_hosts("node1, node2:2, node1") == {"node1": 2, "node2": 2}
    for bad in ("node1:0", "node1:x", ":4", ""):
        with pytest.raises(ValueError, match="--hosts"):
            parse_hosts(bad)


def test_listen_takes_an_interface_an_address_or_everywhere():
    assert listen_address("") == "127.0.0.1"
    assert listen_address("*") == "0.0.0.0"
    assert listen_address("10.1.2.3") == "10.1.2.3"
    loopback = next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)
    )
    assert listen_address(loopback) == "127.0.0.1"
    with pytest.raises(ValueError, match="neither an IPv4 address nor an interface"):
        listen_address("no-such-nic0")


def test_what_the_ssh_launcher_is_given_for_two_hosts():
    hosts = {"alice@node1": 4, "node2": 4}
    launcher_config = ssh_config(hosts, python="/opt/env/bin/python")
    config = LaunchConfig(num_ranks=8, launcher="ssh", listen="*", launcher_config=launcher_config)
    cluster = make_cluster(config)
    assert cluster.config.SSHEngineSetLauncher.engines == hosts
    assert cluster.controller_ip == "0.0.0.0"  # reachable from node1 and node2
    assert cluster.engine_launcher_class is SSHEngineSetLauncher  # ipyparallel's own
    # the set launcher makes one SSHEngineLauncher per engine from this config
    engines = SSHEngineSetLauncher(
        config=cluster.config, profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id
    )
    assert engines.engines == hosts
    one = SSHEngineLauncher(
        config=cluster.config,
        profile_dir=cluster.profile_dir,
        cluster_id=cluster.cluster_id,
        hostname="node1",
        user="alice",
    )
    assert one.location == "alice@node1"
    assert one.program == ["/opt/env/bin/python", "-m", "ipyparallel.engine"]
    assert any(
        local.endswith(f"ipcontroller-{cluster.cluster_id}-engine.json") for local, _ in one.to_send
    )  # the connection file travels by scp


def test_ssh_launches_without_hosts_or_with_loopback_only_are_refused():
    with pytest.raises(ValueError, match="needs hosts"):
        LaunchConfig(num_ranks=2, launcher="ssh")
    with pytest.raises(ValueError, match="cannot reach a controller on 127.0.0.1"):
        LaunchConfig(num_ranks=2, launcher="ssh", launcher_config=ssh_config({"node1": 2}))
    with pytest.raises(ValueError, match="local launcher"):
        LaunchConfig(num_ranks=2, listen="*")
    default_python = ssh_config({"node1": 2})["SSHEngineLauncher"]["remote_python"]
    assert default_python == sys.executable


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_live_cluster_signs_messages_and_keeps_its_files_private(live2):
    folder = Path(live2.engines.cluster.profile_dir) / "security"
    files = sorted(folder.glob(f"ipcontroller-{live2.engines.cluster_id}-*.json"))
    assert {f.name.rsplit("-", 1)[1] for f in files} == {"client.json", "engine.json"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} readable by others"
        info = json.loads(path.read_text())
        assert info["key"] and info["signature_scheme"].startswith("hmac-"), path.name
        assert info["location"] in ("127.0.0.1", "localhost") or info["interface"].endswith(
            "127.0.0.1"
        )
    exits = Path(live2.engines.cluster.profile_dir) / "security"
    assert all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in exits.glob("*-exits.jsonl"))
    listening = {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == "LISTEN" and c.pid in set(live2.pids())
    }
    assert listening and listening <= {"127.0.0.1"}, listening
