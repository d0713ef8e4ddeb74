"""Bring ranks up, reuse them, rebuild their process group, and track the live session.

``launch(config, progress)`` stages:
1. reuse: a live session whose engines were started the same way (N, launcher, env) and
   are all idle is kept. Its group is re-checked with an all_reduce, or rebuilt in place
   when the backend, threads, port or process-group timeout changed. A check that fails
   means fresh engines; a bad new setting (nccl without GPUs, a taken port) raises and
   leaves the live ranks as they were. Any other session is shut down first;
2. ``EngineCluster.start``: N engines registered (progress k/N);
3. ``describe_engine`` on each -> ``assign_ranks`` -> backend and per-rank plans;
4. ``open_store`` on rank 0's engine, then ``join`` on every rank (progress k/N), whose
   all_reduce of the rank ids proves the group;
5. every rank's namespace gets rank, world_size, local_rank, device, torch, dist.
A fresh launch that fails anywhere stops what it started: nothing is left half-up.
"""

from __future__ import annotations

import time
import warnings

from dtlab.agent import api
from dtlab.control.cluster import EngineCluster, Progress
from dtlab.control.config import LaunchConfig
from dtlab.control.connection import remove_stale_sockets
from dtlab.control.errors import (
    DtlabError,
    LaunchError,
    NoSessionError,
    RankError,
    RankTimeoutError,
)
from dtlab.control.rankmap import LOCALHOST, assign_ranks, choose_backend, make_plans, master_addr
from dtlab.control.session import Session
from dtlab.control.world import EngineStatus, World

CHECK_TIMEOUT_S = 10.0
_NAMESPACE_CODE = (
    "from dtlab.agent.rendezvous import rank_namespace as _dtlab_ns\n"
    "globals().update(_dtlab_ns())\n"
    "del _dtlab_ns\n"
)

_current: Session | None = None


def current() -> Session:
    """The live session, or NoSessionError saying how to get one."""
    session = current_or_none()
    if session is None:
        raise NoSessionError("no live dtlab session: run %dt_launch N (or dtlab.launch(N)) first")
    return session


def current_or_none() -> Session | None:
    return None if _current is None or _current.world.closed else _current


def launch(
    config: LaunchConfig,
    progress: Progress,
    *,
    restart: bool = False,
    session_class: type[Session] = Session,
) -> Session:
    """A ready session of ``config.num_ranks`` ranks, reusing the live one when it can."""
    global _current
    old = current_or_none()
    if old is not None:
        if not restart and _reusable(old, config) and _regroup(old, config, progress):
            return old
        folder = old.trace.folder if old.trace is not None else None
        old.shutdown()
        kept = f"; its records stay in {folder}" if folder else ""
        warnings.warn(
            f"stopped the live {old.world.world_size}-rank session and the job attached to "
            f"it, to launch {config.num_ranks} ranks{kept}",
            stacklevel=3,
        )
    _current = start(config, progress, session_class)
    return _current


def _reusable(session: Session, config: LaunchConfig) -> bool:
    if session.world.config.engine_settings() != config.engine_settings():
        return False
    if session.training.collectives_may_hang():  # leaving their group could block
        return False
    try:
        return set(session.world.status().values()) == {EngineStatus.IDLE}
    except DtlabError:  # e.g. the controller died: nothing of it can be reused
        return False


def _expected_sum(world_size: int) -> int:
    return world_size * (world_size - 1) // 2


def _backend(config: LaunchConfig, world: World) -> str:
    try:
        return choose_backend(config.backend, world.rank_map, world.facts)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def _regroup(session: Session, config: LaunchConfig, progress: Progress) -> bool:
    """Keep the engines; True when their group is sound (checked or rebuilt), False when
    the check failed and the engines should be replaced."""
    world = session.world
    backend = _backend(config, world)  # a bad choice raises before anything is touched
    unchanged = config.group_settings() == world.config.group_settings()
    if unchanged and backend == world.backend:
        try:
            sums = world.run(api.check_group, timeout=CHECK_TIMEOUT_S)
        except RankTimeoutError as e:
            if e.reason == "interrupted":
                raise
            return False
        except DtlabError:
            return False
        if set(sums.values()) != {_expected_sum(world.world_size)}:
            return False
        progress("ranks initialised", world.world_size, world.world_size)
        world.config = config
        return True
    deadline = time.monotonic() + config.timeout_s
    # a paused script ends first, on every rank at once (its finally blocks may still use
    # the group): its group, its environment and thread count are about to be replaced
    _launch_step(lambda: world.run(api.stop_script, timeout=max(0.1, deadline - time.monotonic())))
    join(world, config, progress, deadline, backend)
    _start_sidecars(session, deadline)
    return True


def start(
    config: LaunchConfig, progress: Progress, session_class: type[Session] = Session
) -> Session:
    """A new session on fresh engines, with each rank's sidecar started."""
    deadline = time.monotonic() + config.timeout_s
    remove_stale_sockets()  # relays' socket files that a killed session left
    session = session_class(start_world(config, progress))
    _start_sidecars(session, deadline)
    return session


def start_world(config: LaunchConfig, progress: Progress) -> World:
    """Fresh engines, joined as ranks (what ``World.renew`` asks for again)."""
    deadline = time.monotonic() + config.timeout_s
    engines = EngineCluster(config)
    engines.start(progress)
    try:
        facts = _describe_engines(engines, deadline)
        world = World(config, engines, assign_ranks(facts), facts, start=start_world)
        join(world, config, progress, deadline, _backend(config, world))
        return world
    except BaseException:
        engines.stop()
        raise


def _start_sidecars(session: Session, deadline: float) -> None:
    """Before anything can hang (then it is too late); without them, less is said."""
    try:
        session.hangs.restart_sidecars(timeout=max(0.1, deadline - time.monotonic()))
    except BaseException:
        session.shutdown()
        raise


def _describe_engines(engines: EngineCluster, deadline: float):
    client = engines.client
    assert client is not None  # connected by engines.start()
    ars = {eid: client[eid].apply_async(api.describe_engine) for eid in client.ids}
    try:
        return {
            eid: ar.get(timeout=max(0.1, deadline - time.monotonic())) for eid, ar in ars.items()
        }
    except TimeoutError:
        raise LaunchError("engines did not describe themselves in time; raise --timeout") from None
    except Exception as e:
        raise LaunchError(f"an engine failed to describe itself: {e}") from None


def join(
    world: World, config: LaunchConfig, progress: Progress, deadline: float, backend: str
) -> None:
    """Open the store on rank 0, make every engine its rank, prove it, fill namespaces.

    If the store cannot open (a taken --port), the ranks keep their old group; any later
    failure leaves the session without a sound group, so it is shut down.
    """

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    progress("ranks initialised", 0, world.world_size)
    port = _launch_step(
        lambda: world.run(
            api.open_store,
            config.port,
            world.world_size,
            config.pg_timeout_s,
            _store_bind(world),
            ranks=[0],
            timeout=remaining(),
        )[0]
    )
    try:
        plans = make_plans(
            world.rank_map,
            world.facts,
            backend=backend,
            port=port,
            threads=config.threads,
            timeout_s=config.pg_timeout_s,
            env=config.env,
        )
        infos = _launch_step(
            lambda: world.run_each(
                api.join,
                {r: (plan,) for r, plan in plans.items()},
                what="initialising ranks",
                timeout=remaining(),
                progress=lambda k, n: progress("ranks initialised", k, n),
            )
        )
        expected = _expected_sum(world.world_size)
        wrong = {r: i.allreduce_sum for r, i in infos.items() if i.allreduce_sum != expected}
        if wrong:
            raise LaunchError(
                f"all_reduce of the rank ids gave {wrong} instead of {expected}: the process "
                f"group is broken; run %dt_launch {world.world_size} --restart"
            )
        world.infos = dict(sorted(infos.items()))
        world.config = config
        _launch_step(
            lambda: world.submit(
                lambda view, r: view.execute(_NAMESPACE_CODE, silent=True, block=False),
                what="setting up rank namespaces",
                timeout=remaining(),
            )
        )
    except BaseException:
        world.stop()
        raise


def _launch_step(step):
    """Run a launch step; turn any rank failure into a LaunchError with its full story."""
    try:
        return step()
    except DtlabError as e:
        if isinstance(e, RankError):  # its advice for a session that lives on is wrong here
            e.launching = True
            e.args = (e._message(),)
        raise LaunchError(f"launch failed:\n{e}") from None


def _store_bind(world: World) -> str:
    """Where rank 0's rendezvous store listens: loopback when every rank is on one host."""
    return LOCALHOST if master_addr(world.rank_map) == LOCALHOST else ""
