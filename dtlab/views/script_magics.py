"""Magics for the user's own script: %dt_script, %dt_continue.

%dt_script train.py --lr 3e-4     # run it on every rank as torchrun would; pause at step 0
%dt_step 5                        # its next five optimizer steps, recorded
%%dt print(script.model)          # the script's globals, on every rank, while paused
%dt_continue                      # let it run to its end
"""

from __future__ import annotations

import argparse
import shlex
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from dtlab.control.errors import OptionError, RankError, StepInterrupted
from dtlab.views.cells import collate
from dtlab.views.magic_support import connected_job, current_session, dtlab_magics, seconds
from dtlab.views.progress import delayed_progress
from dtlab.views.reports import run_summary, script_summary

USAGE_ERRORS = {"FileNotFoundError", "IsADirectoryError", "ValueError", "ScriptWorldError"}


def split_line(line: str) -> list[str]:
    """``%dt_script``'s line as a shell splits a command line: quotes group words
    (``"dir with space/train me.py"``, ``--name 'a b'``), a backslash escapes the next
    character (``dir\\ with\\ space/train.py``), and neither is kept; so the script gets
    the ``sys.argv`` it gets from ``torchrun`` on the same line."""
    try:
        return shlex.split(line)
    except ValueError:  # shlex says only "No closing quotation" / "No escaped character"
        pass
    quote, at = _open_quote(line)
    if quote is None:
        raise OptionError(
            "%dt_script's line ends with a backslash, which escapes nothing: remove it, "
            "or write \\\\ for a backslash"
        )
    shown = line[at:] if len(line) - at <= 40 else line[at : at + 37] + "..."
    raise OptionError(
        f"%dt_script's line has a {quote} that is never closed, at character {at + 1} "
        f"({shown}): close it, or write \\{quote} for the character itself"
    )


def _open_quote(line: str) -> tuple[str | None, int]:
    """The quote a POSIX shell would still be inside at the line's end, and where it
    opened; (None, -1) if none (then the line ends with a lone backslash)."""
    quote, at, i = None, -1, 0
    while i < len(line):
        c = line[i]
        if c == "\\" and quote != "'":  # escapes the next character, but inside '...'
            i += 2
            continue
        if quote is None and c in "'\"":
            quote, at = c, i
        elif c == quote:
            quote, at = None, -1
        i += 1
    return quote, at


def _rank0_output(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def show_other_ranks(session) -> None:
    """What ranks other than 0 printed meanwhile (rank 0's came live), identical text once."""
    text = collate(session.scripts.unshown())
    if text.strip():  # a replaced run can leave a bare newline
        print(f"printed on other ranks:\n{text}", end="")


@dtlab_magics
class ScriptMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument(
        "--cwd",
        default=None,
        metavar="DIR",
        help="the script's working directory on every rank (default: the notebook's)",
    )
    @argument(
        "--no-record",
        action="store_true",
        help="record only loss, LR, times and memory at each step",
    )
    @argument(
        "--timeout",
        type=seconds,
        default=None,
        help="seconds the set-up (up to the first optimizer step) may take",
    )
    @argument("path", help="the script, as you would give it to torchrun")
    @argument(
        "args", nargs=argparse.REMAINDER, help="the script's own arguments (everything after PATH)"
    )
    def dt_script(self, line):
        """Run your own torchrun script, unchanged, on every rank; it pauses at step 0 (just
        before its first optimizer step updates the weights), then %dt_step / %dt_run /
        %dt_continue drive it and %%dt cells see its globals as `script`."""
        args = self.dt_script.parser.parse_args(split_line(line))
        session = current_session()
        try:
            status = session.run_script(
                args.path,
                args.args,
                args.cwd,
                record=not args.no_record,
                timeout=args.timeout,
                on_output=_rank0_output,
            )
        except RankError as e:  # the same bad input on every rank: say it once, plainly
            kinds = {f.ename for f in e.failures.values()}
            messages = {f.evalue for f in e.failures.values()}
            if kinds <= USAGE_ERRORS and len(messages) == 1 and not (e.finished or e.stuck):
                raise UsageError(messages.pop()) from None
            raise
        show_other_ranks(session)
        print(script_summary(status))

    @line_magic
    @magic_arguments()
    @argument("--timeout", type=seconds, default=None, help="seconds before ranks are interrupted")
    def dt_continue(self, line):
        """Let the paused script run free to its end; Ctrl-C pauses every rank again."""
        args = parse_argstring(self.dt_continue, line)
        job = connected_job()
        if job is not None:
            job.continue_()
            print("the job runs on; %dt_pause holds it again, %dt_disconnect leaves it")
            return
        session = current_session()
        try:
            result = session.continue_script(timeout=args.timeout, progress=delayed_progress())
        except StepInterrupted as e:  # Ctrl-C: the ranks paused; said, then the cell ends
            show_other_ranks(session)
            print(run_summary(e.result, session.trace))
            raise
        show_other_ranks(session)
        print(run_summary(result, session.trace))
        if result.stopped == "ended":
            print(script_summary(session.scripts.refresh()))
