"""Bring ranks up, reuse them, rebuild their process group, and track the live session.

``launch(config, progress)`` stages:
1. reuse: a live session with the same N and launcher whose ranks are all idle is kept;
   its group is re-checked with an all_reduce, or rebuilt when the settings changed;
   any other session is shut down first;
2. ``EngineCluster.start``: N engines registered (progress k/N);
3. ``describe_engine`` on each -> ``assign_ranks`` -> backend and per-rank plans;
4. ``open_store`` on rank 0's engine, then ``join`` on every rank (progress k/N), whose
   all_reduce of the rank ids proves the group;
5. every rank's namespace gets rank, world_size, local_rank, device, torch, dist.
A failure anywhere stops what was started and raises LaunchError: nothing is left half-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dtlab.agent import identity, rendezvous
from dtlab.control.cluster import EngineCluster
from dtlab.control.config import LaunchConfig
from dtlab.control.errors import DtlabError, LaunchError, NoSessionError
from dtlab.control.rankmap import assign_ranks, choose_backend, make_plans
from dtlab.control.session import Session

Progress = Callable[[str, int, int], None]
CHECK_TIMEOUT_S = 10.0
_NAMESPACE_CODE = (
    "from dtlab.agent.rendezvous import rank_namespace as _dtlab_ns\n"
    "globals().update(_dtlab_ns())\n"
    "del _dtlab_ns\n"
)

_current: Session | None = None


def current() -> Session:
    """The live session, or NoSessionError saying how to get one."""
    if _current is None or _current.closed:
        raise NoSessionError("no live dtlab session: run %dt_launch N (or dtlab.launch(N)) first")
    return _current


def current_or_none() -> Session | None:
    return None if _current is None or _current.closed else _current


def forget(session: Session) -> None:
    global _current
    if _current is session:
        _current = None


def launch(config: LaunchConfig, progress: Progress, *, restart: bool = False) -> Session:
    """A ready session of ``config.num_ranks`` ranks, reusing the live one when it can."""
    global _current
    old = _current
    if old is not None and not old.closed:
        if not restart and _reusable(old, config):
            reconfigure(old, config, progress)
            return old
        old.shutdown()
    _current = start(config, progress)
    return _current


def _reusable(session: Session, config: LaunchConfig) -> bool:
    same = (session.world_size, session.config.launcher, session.config.profile) == (
        config.num_ranks,
        config.launcher,
        config.profile,
    )
    try:
        return same and set(session.status().values()) == {"idle"}
    except DtlabError:  # e.g. the controller died: nothing of it can be reused
        return False


def start(config: LaunchConfig, progress: Progress) -> Session:
    deadline = time.monotonic() + config.timeout_s
    engines = EngineCluster(config)
    engines.start(progress)
    try:
        facts = _describe_engines(engines, deadline)
        session = Session(config, engines, assign_ranks(facts), facts)
        join(session, config, progress, deadline)
        return session
    except BaseException:
        engines.stop()
        raise


def _describe_engines(engines: EngineCluster, deadline: float):
    client = engines.client
    ids = list(client.ids)
    ars = {eid: client[eid].apply_async(identity.describe_engine) for eid in ids}
    try:
        return {
            eid: ar.get(timeout=max(0.1, deadline - time.monotonic())) for eid, ar in ars.items()
        }
    except TimeoutError:
        raise LaunchError("engines did not describe themselves in time; raise --timeout") from None
    except Exception as e:
        raise LaunchError(f"an engine failed to describe itself: {e}") from None


def reconfigure(session: Session, config: LaunchConfig, progress: Progress) -> None:
    """Keep the engines; keep the group if it passes the check and nothing changed."""
    if config.group_settings() == session.config.group_settings():
        try:
            sums = session.run(rendezvous.check_group, timeout=CHECK_TIMEOUT_S)
            if set(sums.values()) == {_expected_sum(session.world_size)}:
                progress("ranks initialised", session.world_size, session.world_size)
                session.config = config
                return
        except DtlabError:
            pass  # a broken group is rebuilt below
    try:
        join(session, config, progress, time.monotonic() + config.timeout_s)
    except BaseException:
        session.shutdown()
        raise


def _expected_sum(world_size: int) -> int:
    return world_size * (world_size - 1) // 2


def join(session: Session, config: LaunchConfig, progress: Progress, deadline: float) -> None:
    """Open the store on rank 0, make every engine its rank, prove it, fill namespaces."""
    rank_map = session.rank_map
    try:
        backend = choose_backend(config.backend, rank_map, session.facts)
    except ValueError as e:
        raise LaunchError(str(e)) from None

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    progress("ranks initialised", 0, session.world_size)
    port = _launch_step(
        lambda: session.run(
            rendezvous.open_store,
            config.port,
            session.world_size,
            config.pg_timeout_s,
            ranks=[0],
            timeout=remaining(),
        )[0]
    )
    plans = make_plans(
        rank_map,
        session.facts,
        backend=backend,
        port=port,
        threads=config.threads,
        timeout_s=config.pg_timeout_s,
        env=config.env,
    )
    infos = _launch_step(
        lambda: session.run_each(
            rendezvous.join,
            {r: (plan,) for r, plan in plans.items()},
            what="initialising ranks",
            timeout=remaining(),
            progress=lambda k, n: progress("ranks initialised", k, n),
        )
    )
    wrong = {
        r: i.allreduce_sum for r, i in infos.items() if i.allreduce_sum != _expected_sum(len(plans))
    }
    if wrong:
        raise LaunchError(
            f"all_reduce of the rank ids gave {wrong} instead of {_expected_sum(len(plans))}: "
            "the process group is broken; run %dt_launch N --restart"
        )
    session.infos = dict(sorted(infos.items()))
    session.config = config
    _launch_step(
        lambda: session.submit(
            lambda view, r: view.execute(_NAMESPACE_CODE, silent=True, block=False),
            what="setting up rank namespaces",
            timeout=remaining(),
        )
    )


def _launch_step(step):
    """Run a launch step; turn any rank failure into a LaunchError with its full story."""
    try:
        return step()
    except DtlabError as e:
        raise LaunchError(f"launch failed, nothing was left running:\n{e}") from None
