"""Magics for ranks that die or hang.

%dt_stacks                              # what every rank is doing, asked out of band
%dt_restart [--from-checkpoint latest]  # new engines, same world size, job rebuilt, loaded
%dt_restart --auto 3                    # restart by itself when a run loses a rank or hangs
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dtlab.views.checkpoint_magics import which_checkpoint
from dtlab.views.magic_support import connected_job, current_session, dtlab_magics
from dtlab.views.progress import delayed_progress
from dtlab.views.reports import connected_stacks, hang_table, restart_summary


@dtlab_magics
class RecoveryMagics(Magics):
    @line_magic
    def dt_stacks(self, line):
        """Every rank's Python stack and collectives, taken by its sidecar thread (works
        while ranks are stuck), and why they are stuck."""
        job = connected_job()
        if job is not None:  # a connected job: each rank's engine answers on its own thread
            stacks = job.stacks()
            print(connected_stacks(stacks))
            return stacks
        report = current_session().hang_report()
        display(hang_table(report))
        return report

    @line_magic
    @magic_arguments()
    @argument(
        "--from-checkpoint",
        default="latest",
        metavar="WHICH",
        help="'latest' (the last complete one), a step, a folder, or 'none'",
    )
    @argument(
        "--auto",
        type=int,
        default=None,
        metavar="N",
        help="restart by itself, up to N times, when a run fails (0: off)",
    )
    def dt_restart(self, line):
        """Replace every engine, rejoin at the same world size, rebuild the job and load
        a checkpoint; the kernel and the session object stay."""
        args = parse_argstring(self.dt_restart, line)
        session = current_session()
        if args.auto is not None:
            if args.auto < 0:
                raise UsageError(f"--auto takes a number of restarts >= 0, got {args.auto}")
            session.auto_restart(args.auto, from_checkpoint=which_checkpoint(args.from_checkpoint))
            print(
                f"restarting by itself up to {args.auto} times"
                if args.auto
                else "automatic restarts off"
            )
            return
        event = session.restart(which_checkpoint(args.from_checkpoint), progress=delayed_progress())
        print(restart_summary(session.world_size, event))
