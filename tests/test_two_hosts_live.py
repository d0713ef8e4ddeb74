"""A job across two hosts, connected to live from a third: two network namespaces on this
machine stand for the hosts (each its own address on a bridge, its own hostname, gloo on
its own interface), ``torchrun --nnodes 2 --rdzv-backend c10d`` runs one rank on each under
``-m dtlab.run``, and this process, in the root namespace, connects to the controller that
rank 0 started on the first host: pause, read where each rank runs, change the script's
step count, continue, disconnect; the losses are those of the same job under plain
torchrun across the same two hosts.

The test sets up and tears down the namespaces itself (root and ``ip`` needed: skipped
with the reason elsewhere, required in CI by DTLAB_REQUIRE_LAUNCHERS). The run folder is
one folder both hosts write, as a shared filesystem would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dtlab
from dtlab.control.connect import ConnectError
from dtlab.records import job_folder as jf
from tests.conftest import GLOO_TEARDOWN, needs
from tests.test_connect_live import connected
from tests.test_run_wrapper_live import SCRIPTS, TIMEOUT_S, stop

pytestmark = pytest.mark.timeout(600)
IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET = 10 + os.getpid() % 200  # 10.78.<SUBNET>.0/24: apart from a parallel run's
PORT = 29400 + os.getpid() % 500


def _problem() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "the `ip` command (iproute2) is not installed"
    probe = subprocess.run([IP, "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns` does not work here: {probe.stderr}"


class Hosts:
    """Two namespaces, ``hosts[i]`` at 10.78.SUBNET.(11+i) named ``dtlab-host<i>``, on a
    bridge whose root-namespace side is 10.78.SUBNET.1."""

    def __init__(self, tag: str):
        self.tag = tag
        self.bridge = f"dtbr{tag}"
        self.names = [f"dtlab{tag}h{i}" for i in range(2)]
        self.addresses = [f"10.78.{SUBNET}.{11 + i}" for i in range(2)]
        self.hostnames = [f"dtlab-host{i}" for i in range(2)]
        self.devices = [f"dtv{tag}{i}" for i in range(2)]

    def up(self) -> None:
        ip = self._ip
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"10.78.{SUBNET}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames, strict=True)
        )
        for name, address, device in zip(self.names, self.addresses, self.devices, strict=True):
            # `ip netns exec` mounts these over /etc: names resolve without DNS (none is
            # reachable from inside; torchrun's agent asks for its host's name)
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
            ip("netns", "add", name)
            ip("link", "add", device, "type", "veth", "peer", "name", f"{device}p")
            ip("link", "set", f"{device}p", "netns", name)
            ip("link", "set", device, "master", self.bridge)
            ip("link", "set", device, "up")
            ip("netns", "exec", name, IP, "addr", "add", f"{address}/24", "dev", f"{device}p")
            ip("netns", "exec", name, IP, "link", "set", f"{device}p", "up")
            ip("netns", "exec", name, IP, "link", "set", "lo", "up")

    def down(self) -> None:
        for name, device in zip(self.names, self.devices, strict=True):
            subprocess.run([IP, "netns", "del", name], capture_output=True)
            subprocess.run([IP, "link", "del", device], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        subprocess.run([IP, "link", "del", self.bridge], capture_output=True)

    def start(
        self, i: int, args: list[str], cwd: Path, rdzv_id: str, port: int = PORT
    ) -> subprocess.Popen:
        """torchrun on host ``i`` (its own hostname: a UTS namespace of its own)."""
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", rdzv_id,
            "--rdzv-endpoint", f"{self.addresses[0]}:{port}",
            "--local-addr", self.addresses[i],
        ]  # fmt: skip
        line = " ".join(subprocess.list2cmdline([part]) for part in [*torchrun, *args])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": f"{self.devices[i]}p"}
        cmd = [IP, "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
               f"hostname {self.hostnames[i]} && exec {line}"]  # fmt: skip
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    def _ip(self, *args: str) -> None:
        done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


@pytest.fixture
def hosts():
    needs(_problem())
    made = Hosts(f"{os.getpid() % 10000}")
    try:
        made.up()
        yield made
    finally:
        made.down()


def finished(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each host's torchrun to its end: [(exit code, stderr)]."""
    said = []
    for proc in procs:
        _, err = proc.communicate(timeout=TIMEOUT_S)
        said.append((proc.returncode, err))
    return said


def losses(folder: Path) -> dict[int, list]:
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)}


def test_a_job_on_two_hosts_is_paused_inspected_changed_and_continued_from_a_third(hosts, tmp_path):
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "ddp_sampler.py")
    wrap = ["-m", "dtlab.run", "--listen", hosts.addresses[0], "--run-dir", str(run_dir)]
    args = [*wrap, script, "--steps", "100000", "--out", "dtlab"]
    procs = [hosts.start(i, args, tmp_path, "dtlab-two-hosts") for i in range(2)]
    try:
        try:
            dt = connected(run_dir, procs[0], timeout=180)
        except ConnectError as e:
            errs = [p.stderr.read() if p.poll() is not None else "(running)" for p in procs]
            raise AssertionError(f"{e}; the hosts said: {errs}") from None
        held = dt.pause()
        said = dt.run_code("import socket; print(socket.gethostname(), rank)")
        assert said == {0: ("dtlab-host0 0\n", ""), 1: ("dtlab-host1 1\n", "")}
        assert dt.step(2).last_step == held + 2
        end = held + 2 + 10
        dt.run_code(f"script_locals['args'].steps = {end}")  # the job now ends there
        dt.continue_()
        dt.disconnect()
        ours = finished(procs)
    finally:
        for proc in procs:
            stop(proc)
    # gloo's teardown abort at exit is torch's (conftest); the losses are compared next
    assert all(code == 0 or GLOO_TEARDOWN in err for code, err in ours), ours
    trace = dtlab.connect(run_dir).trace  # ended: read-only, both hosts' records
    assert {r: len(recs) for r, recs in trace.records.items()} == {0: end, 1: end}
    ranks = jf.read_job(run_dir).ranks  # where each rank said it ran
    assert {r: info.host for r, info in ranks.items()} == {0: "dtlab-host0", 1: "dtlab-host1"}
    plain = [
        hosts.start(
            i, [script, "--steps", str(end), "--out", "torchrun"], tmp_path, "plain", PORT + 1
        )
        for i in range(2)
    ]
    try:
        theirs = finished(plain)
    finally:
        for proc in plain:
            stop(proc)
    assert all(code == 0 or GLOO_TEARDOWN in err for code, err in theirs), theirs
    assert losses(tmp_path / "dtlab") == losses(tmp_path / "torchrun")  # bit for bit
