"""This rank's state, in one object: ``RANK``, the process's only :class:`RankState`.

Everything a rank keeps between the notebook's requests is a field of ``RANK`` (its rank
and store, the attached job, dtlab's gloo group, the stepping server, the sidecar, a
running script and what it patched, faults injected on purpose); agent modules read and
write it there, never in module globals of their own. Caches of pure constants (the
fingerprint weights of :mod:`dtlab.agent.recorder`) and saved originals
(``signal.signal`` in :mod:`dtlab.agent.script`) are not state and stay where they are.
docs/design.md, "Where state lives", lists the notebook's state beside it.

This module imports nothing of dtlab's (every agent module may import it without a
cycle), so the fields' types are named in their comments: ``Any`` stands for them.

From a ``%%dt`` cell: ``from dtlab.agent.state import RANK; RANK.job``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    """What this rank holds. Each field: what it is; who sets it; when it is cleared."""

    # --- the rank (agent/rendezvous.py) -----------------------------------------------
    # torch.distributed.TCPStore: the rendezvous store; set by open_store (rank 0, before
    # join) and join (every rank); cleared by leave()
    store: Any = None
    # records.RankPlan: what this process was told to become; set by join; cleared by leave
    plan: Any = None
    # torch.device the rank computes on; set by join; cleared by leave
    device: Any = None
    # int: the sum join's all_reduce of the rank ids gave; set by join; cleared by leave
    allreduce_sum: int | None = None

    # --- dtlab's own gloo group (agent/groups.py) ---------------------------------------
    # the default group (dist.group.WORLD) the control group was made for; set by
    # control_group; cleared with the two below when the world is another one
    control_world: Any = None
    # torch ProcessGroup: the gloo group of the stepping agreements, checkpoints and moves;
    # made by control_group (a collective: when the stepping channel connects)
    control_group: Any = None
    # names of control groups replaced since (left, not destroyed): hang reports skip them
    retired_groups: set[str] = field(default_factory=set)

    # --- the job (agent/job.py, agent/demo_job.py) ---------------------------------------
    # a jobs_base.RankJob (Job, PipelineJob, StepFnJob, DeepSpeedJob, ScriptJob): the
    # attached job; set by job.install (every attach, and a script at its first step);
    # replaced, never cleared
    job: Any = None
    # int: how many jobs were attached in this process (the notebook tells a new job by
    # it); counted by job.install
    attach_count: int = 0
    # demo_model.DemoJob: the built-in demo's parts (its sampler for dtlab.inject), for a
    # closer look from a %%dt cell; set by demo_job.attach_demo, replaced by the next one
    demo: Any = None

    # --- channels to the notebook -------------------------------------------------------
    # stepping.StepServer: the stepping channel's rank end; set by stepping.serve (which
    # closes the one before); cleared by stepping.stop_serving
    step_server: Any = None
    # relay.Relay: this host's relay, on the host's first rank of a relayed job; set by
    # stepping.serve, closed and cleared by stepping.stop_serving
    relay: Any = None
    # sidecar.Sidecar: the hang-report thread; set by sidecar.start (which stops the one
    # before); never cleared (a daemon thread)
    sidecar: Any = None

    # --- a script run by %dt_script (agent/script.py) ------------------------------------
    # script.ScriptRun: the script running or paused (or over, until the next one); set by
    # script.start; cleared by script.stop
    script_run: Any = None
    # step_observer.Observer receiving the optimizer/backward/forward/DataLoader events of
    # a script (or a StepFnJob's step); set by script_observe.install, cleared by uninstall
    observer: Any = None
    # handles of the hooks script_observe registered ("pre", "post", "fwd_pre",
    # "fwd_post"); removed and cleared by uninstall ("fwd_*" also when recording stops)
    observer_hooks: dict[str, Any] = field(default_factory=dict)
    # (owner, name) -> the original script_observe replaced; put back and cleared by
    # uninstall
    observer_patched: dict[tuple, Any] = field(default_factory=dict)

    # --- the torchrun world a script meets (agent/script_env.py) -------------------------
    # list the running script's notes go to; None: no script runs (script_env.active());
    # set by script_env.install, cleared by script_env.uninstall
    script_notes: list[str] | None = None
    # keys of the notes said once already in this run; set empty by install
    script_said: set[str] = field(default_factory=set)
    # (func, args, kwargs) the script registered with atexit, run and emptied by
    # script_env.run_exit_handlers at its end; set empty by install
    script_exits: list[tuple] = field(default_factory=list)
    # the script's folder (with a trailing separator): atexit functions from there are
    # its own; set by install
    script_folder: str = ""
    # multiprocessing's start method before the script (None: unset); set by install, put
    # back and cleared by uninstall
    script_start_method: str | None = None
    # the originals of the process-wide patches script_env made (init/destroy_process_group,
    # spawn, start_processes); set by the first install, kept for the process's life (the
    # wrappers stay, calling the originals when no script runs)
    script_env_patched: dict[str, Any] | None = None

    # --- faults made on purpose (agent/inject.py) -----------------------------------------
    # checkpoint parts this rank leaves out of its saves (inject.checkpoint_without); read
    # by checkpoint.save until changed again
    fault_omitted_parts: set[str] = field(default_factory=set)
    # run by checkpoint.save after this rank's files are written, before the ranks compare
    # reports (inject.stall_save, inject.kill_in_save("before_commit")); kept until changed
    fault_before_commit: Callable[[], None] | None = None
    # run by checkpoint.save after rank 0 committed, before the ranks' last agreement
    # (inject.kill_in_save("after_commit")); kept until changed
    fault_after_commit: Callable[[], None] | None = None
    # the next live re-partition fails while building the new stage (inject.fail_repartition);
    # cleared by the re-partition that meets it
    fault_repartition_build: bool = False
    # this rank is killed mid-exchange in the next re-partition (inject.die_in_repartition);
    # cleared by the re-partition that meets it
    fault_repartition_die: bool = False
    # dtlab's observations of a script (step_observer.OBSERVATIONS) that raise on purpose,
    # name -> the step (from 1) from which they do (inject.fail_observation); read by
    # Observer.observe, kept until changed
    fault_observations: dict[str, int] = field(default_factory=dict)

    def clear_rendezvous(self) -> None:
        """The rank left its group (rendezvous.leave): no store, plan or device."""
        self.store = self.plan = self.device = self.allreduce_sum = None

    def clear_control_groups(self) -> None:
        """A new world: the control group and the retired ones went with the old one."""
        self.control_world = self.control_group = None
        self.retired_groups = set()

    def reset(self) -> None:
        """Every field as in a fresh process (for tests that reuse one process), except
        the records of patches still in place (``observer_hooks``, ``observer_patched``,
        ``script_env_patched``): forgetting those would patch twice. It only drops
        references: it closes no server, stops no thread and uninstalls nothing."""
        kept = {"observer_hooks", "observer_patched", "script_env_patched"}
        fresh = RankState()
        for f in dataclasses.fields(self):
            if f.name not in kept:
                setattr(self, f.name, getattr(fresh, f.name))


RANK = RankState()  # this process's rank state: the one instance
