"""IPython magics: thin adapters from what a user types to control/ and back to views/.

%load_ext dtlab
%dt_launch 8                 # 8 ranks; the session is bound to `dt`
%%dt --ranks 0-3             # run a cell on some ranks, outputs collated by rank
%dt_pull loss                # {rank: value}
%dt_push lr                  # notebook variable -> every rank
%dt_status                   # idle / busy / dead per rank
%dt_shutdown                 # stop everything
"""

from __future__ import annotations

import os
import sys
import time
import warnings

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

import dtlab
from dtlab.control import lifecycle
from dtlab.control.config import LaunchOptions
from dtlab.control.errors import NoSessionError, RankError
from dtlab.views.cells import collate_cell
from dtlab.views.magic_support import (
    current_session,
    current_target,
    dtlab_magics,
    option_arguments,
    seconds,
)
from dtlab.views.tables import launch_summary, rank_table, status_table


def show_cell(outputs) -> None:
    stdout, stderr, results = collate_cell(outputs)
    if stdout:
        sys.stdout.write(stdout)
    if stderr:
        sys.stderr.write(stderr)
    if results:
        sys.stdout.write(results)
    sys.stdout.flush()


@dtlab_magics
class DtlabMagics(Magics):
    @line_magic
    @magic_arguments()
    @option_arguments(LaunchOptions)
    def dt_launch(self, line):
        """Start N ranks (or reuse the live ones) and show the rank table."""
        args = parse_argstring(self.dt_launch, line)
        start = time.monotonic()
        previous = lifecycle.current_or_none()
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            session = dtlab.launch(**vars(args))  # the flags are LaunchOptions' fields
        package = os.path.dirname(dtlab.__file__)
        for note in notes:  # dtlab's notes as plain lines, not "<library file>:52: UserWarning"
            if note.category is UserWarning and note.filename.startswith(package):
                print(f"note: {note.message}")
            else:
                warnings.showwarning(note.message, note.category, note.filename, note.lineno)
        self.shell.user_ns["dt"] = session
        print(launch_summary(session, time.monotonic() - start, reused=session is previous))
        _leave_connected_job()
        display(rank_table(session.infos, session.inconsistencies()))

    @line_cell_magic
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to run on: all (default), even, odd, 0,3 or 0-3")
    @argument(
        "--timeout",
        type=seconds,
        default=None,
        help="seconds before unfinished ranks are interrupted and named in an error",
    )
    def dt(self, line, cell=None):
        """Run code on the ranks: `%dt code` on all, or `%%dt [--ranks R] [--timeout S]`."""
        if cell is None:
            code, ranks, timeout = line, None, None
        else:
            args = parse_argstring(self.dt, line)
            code, ranks, timeout = cell, args.ranks, args.timeout
        session = current_target()  # a connected job's held ranks, too
        try:
            outputs = session.execute(
                code, ranks=ranks, **({"timeout": timeout} if timeout else {})
            )
        except RankError as e:
            show_cell(getattr(e, "outputs", {}))
            raise
        show_cell(outputs)

    @line_magic
    @magic_arguments()
    @argument("name", help="variable to read on the ranks")
    @argument("--ranks", default=None, help="ranks to read from (default all)")
    def dt_pull(self, line):
        """`%dt_pull NAME` -> {rank: value of NAME on that rank}."""
        args = parse_argstring(self.dt_pull, line)
        return current_target().pull(args.name, ranks=args.ranks)

    @line_magic
    @magic_arguments()
    @argument("names", nargs="+", help="notebook variables to send to the ranks")
    @argument("--ranks", default=None, help="ranks to send to (default all)")
    def dt_push(self, line):
        """`%dt_push NAME [NAME ...]`: bind notebook variables on the ranks."""
        args = parse_argstring(self.dt_push, line)
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"no notebook variable named {', '.join(missing)}; define it first")
        values = {n: self.shell.user_ns[n] for n in args.names}
        current_target().push(values, ranks=args.ranks)

    @line_magic
    def dt_status(self, line):
        """Each rank: idle, busy or dead; once they stepped, how they reach the notebook."""
        session = current_session()
        title = f"{session.world_size} ranks, {session.backend}"
        jobs = session.engines.job_ids()
        if jobs:
            title += f", {session.config.launcher} job {', '.join(jobs)}"
        if how := session.stepper.connection.describe():
            title += f"; {how}"
        display(status_table(session.status(), session.infos, title))

    @line_magic
    def dt_shutdown(self, line):
        """Stop every rank, engine and the controller."""
        try:
            session = lifecycle.current()
        except NoSessionError:
            print("no live dtlab session; nothing to stop")
            return
        start = time.monotonic()
        session.shutdown()
        print(f"stopped {session.world_size} ranks in {time.monotonic() - start:.2f} s")


def _leave_connected_job() -> None:
    """After a launch the magics act on the launched ranks: a connected job (%dt_connect)
    is left running (disconnected), an ended one's records closed."""
    from dtlab.control import connect

    job = connect.current_or_none()
    if job is not None:
        connect.forget()
        how = "closed its records" if job.read_only else "disconnected; it runs on"
        print(f"note: the magics now act on these ranks: the job in {job.folder}: {how}")


def register(ipython) -> None:
    from dtlab.views.checkpoint_magics import CheckpointMagics
    from dtlab.views.comm_magics import CommMagics
    from dtlab.views.connect_magics import ConnectMagics
    from dtlab.views.partition_magics import PartitionMagics
    from dtlab.views.recovery_magics import RecoveryMagics
    from dtlab.views.script_magics import ScriptMagics
    from dtlab.views.training_magics import TrainingMagics

    ipython.register_magics(DtlabMagics)
    ipython.register_magics(TrainingMagics)
    ipython.register_magics(CheckpointMagics)
    ipython.register_magics(RecoveryMagics)
    ipython.register_magics(PartitionMagics)
    ipython.register_magics(CommMagics)
    ipython.register_magics(ScriptMagics)
    ipython.register_magics(ConnectMagics)
    from dtlab.control.session import Session

    html = ipython.display_formatter.formatters["text/html"]
    html.for_type(
        Session, lambda s: rank_table(s.infos, s.inconsistencies(), repr(s))._repr_html_()
    )
