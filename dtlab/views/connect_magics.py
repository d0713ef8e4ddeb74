"""Magics for a job started by ``torchrun ... -m dtlab.run`` (control/connect.py).

%dt_connect RUN_DIR     # connect to the running job (read-only once it has ended): `dt`
%dt_pause               # every rank holds after the same optimizer step
%dt_disconnect          # continue it if paused, leave it running

While connected, %%dt (on held ranks: `script`, `script_locals`), %dt_pull, %dt_push,
%dt_step, %dt_run --until, %dt_continue, %dt_doctor, %dt_findings, %dt_plot and
%dt_stacks act on the job
(views/magic_support.py: current_target); dt.dashboard() and dt.report() are the
connected job's views (views/notebook.py: ConnectedNotebook).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from dtlab.control import connect
from dtlab.views.magic_support import dtlab_magics, seconds
from dtlab.views.reports import held_summary


@dtlab_magics
class ConnectMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument("run_dir", help="the job folder dtlab.run printed (runs/<script>-<time>/)")
    @argument("--timeout", type=seconds, default=connect.CONNECT_TIMEOUT_S, help="seconds to wait")
    @argument(
        "--lease",
        type=seconds,
        default=connect.LEASE_S,
        help="seconds after which a job this notebook paused goes on, should it stop answering",
    )
    def dt_connect(self, line):
        """Connect to a job started by `torchrun ... -m dtlab.run` and bind it to `dt`:
        dt.pause(), dt.step(n), dt.run_code(code), dt.continue_(), dt.doctor(), dt.trace."""
        from dtlab import cli
        from dtlab.views.notebook import ConnectedNotebook

        args = parse_argstring(self.dt_connect, line)
        try:
            job = connect.connect(
                args.run_dir, timeout=args.timeout, lease_s=args.lease, kind=ConnectedNotebook
            )
        except connect.ConnectError as e:
            raise UsageError(str(e)) from None
        try:
            for text in cli.describe(cli.load(str(job.folder))):  # hang reports first
                print(text)
        except ValueError as e:
            print(f"(its records cannot be read yet: {e})")
        self.shell.user_ns["dt"] = job
        print(repr(job))
        return None

    @line_magic
    @magic_arguments()
    @argument("--timeout", type=seconds, default=connect.PAUSE_TIMEOUT_S, help="seconds to wait")
    def dt_pause(self, line):
        """Hold every rank of the connected job after the same optimizer step; then %%dt,
        %dt_step N, %dt_run --until and %dt_continue."""
        args = parse_argstring(self.dt_pause, line)
        job = connect.current_or_none()
        if job is None:
            raise UsageError(
                "%dt_pause holds a job you connected to (%dt_connect RUN_DIR); a %dt_script "
                "or %dt_launch job is already paused between %dt_step calls (Ctrl-C pauses "
                "a run)"
            )
        step = job.pause(timeout=args.timeout)
        if step is None:
            print("the dashboard's run ends after the step it is in; the job holds there")
            return
        print(held_summary(step, job.trace))

    @line_magic
    def dt_disconnect(self, line):
        """Continue the connected job if it is paused, and leave it running."""
        job = connect.current_or_none()
        if job is None:
            print("not connected to a job; nothing to leave")
            return
        if job.read_only:
            connect.forget()
            print(f"closed the records of the ended job in {job.folder}")
            return
        job.disconnect()
        print(f"disconnected; the job in {job.folder} runs on")
