"""Shared fixtures for tests that start real ipyparallel clusters.

Every process-starting test has a hard timeout (pytest-timeout) and cleans up: a live
session is reused across tests (relaunching an idle one takes milliseconds), and
whatever session is left is shut down at the end, checked by pid.
"""

from __future__ import annotations

import psutil
import pytest

import dtlab
from dtlab.control import lifecycle
from dtlab.control.cluster import running


def quiet(phase, done, total):
    pass


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="session")
def cluster_cleanup():
    yield
    session = lifecycle._current
    if session is not None and not session.closed:
        pids = session.pids()
        session.shutdown()
        assert running(pids) == [], "processes left after the last test"


@pytest.fixture
def live2(cluster_cleanup):
    """A healthy 2-rank session (reused if the last test left one, else started)."""
    return dtlab.launch(2, progress=quiet)


@pytest.fixture
def no_leftovers(cluster_cleanup):
    """Fails the test if it leaves any process of its own running (dtlab's or not)."""
    before = child_pids()
    yield
    current = lifecycle._current
    keep = set(current.pids()) if current is not None and not current.closed else set()
    left = running(sorted(child_pids() - before - keep))
    assert left == [], f"processes left behind: {left}"
