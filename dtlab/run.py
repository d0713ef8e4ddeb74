"""Run a training script as torchrun (or the deepspeed launcher) would, recording every
step of every rank into a job folder, with no notebook:

    torchrun --nproc-per-node 8 -m dtlab.run [--run-dir DIR] [--no-record]
             [--hang-timeout S] train.py ARGS...
    deepspeed --module dtlab.run train.py ARGS...
    dtlab doctor DIR          # the findings of the job, finished, crashed or running

The script gets what the launcher gives it: its environment, ``sys.argv = [train.py,
*ARGS]`` (the deepspeed launcher's ``--local_rank=N`` first, as it passes it), ``__main__``,
its own process group, streams, signals and exit code; it is never paused. Each rank
writes ``DIR/rank-<r>/`` (default DIR: ``$DTLAB_RUNS_DIR`` or ``runs/``, then
``<script>-<time>/``; :mod:`dtlab.records.job_folder`). This module runs inside every
rank: it imports torch (through :mod:`dtlab.agent.batch_run`), never a notebook library.
"""

from __future__ import annotations

import os
import sys

USAGE = """\
usage: python -m dtlab.run [--run-dir DIR] [--no-record] [--hang-timeout S]
                          [--listen ADDR | --no-connect] SCRIPT [ARGS...]

Runs SCRIPT with ARGS on this rank as the launcher (torchrun, deepspeed) would, recording
every optimizer step into a job folder; `dtlab doctor DIR` reads it.

  --run-dir DIR      the job folder (default: $DTLAB_RUNS_DIR or runs/, then <script>-<time>/)
  --no-record        no per-parameter statistics (losses, LR, times and memory are kept)
  --hang-timeout S   a rank that makes no step for S seconds writes its stacks into the
                     folder (default 600; 0: never)
  --listen ADDR      where the job's ipyparallel controller listens for a notebook
                     (`dtlab.connect(DIR)`; default 127.0.0.1: this host only; 0.0.0.0 or
                     an address of this host to connect from another)
  --no-connect       no controller, no engines: the job cannot be connected to
"""


class UsageError(ValueError):
    """A command line dtlab.run cannot take."""


def parse(argv: list[str]):
    """-> (Options, the script's arguments): dtlab.run's options come before SCRIPT; what
    follows it is the script's, untouched. A ``--local_rank=N`` given to dtlab.run (the
    deepspeed launcher's) goes first to the script, as that launcher passes it."""
    from dtlab.agent.batch_run import DEFAULT_HANG_TIMEOUT_S, DEFAULT_LISTEN, Options

    run_dir, record, hang, local_rank = None, True, DEFAULT_HANG_TIMEOUT_S, []
    listen: str | None = DEFAULT_LISTEN
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, value = arg.partition("=")

        def take(name=name, eq=eq, value=value) -> str:
            nonlocal i
            if eq:
                return value
            i += 1
            if i >= len(argv):
                raise UsageError(f"{name} needs a value")
            return argv[i]

        if name in ("-h", "--help"):
            raise SystemExit(_print_usage())
        if name == "--run-dir":
            run_dir = take()
            if not run_dir:
                raise UsageError("--run-dir needs a folder")
        elif name == "--no-record":
            if eq:
                raise UsageError("--no-record takes no value")
            record = False
        elif name == "--hang-timeout":
            text = take()
            try:
                hang = float(text)
            except ValueError:
                raise UsageError(f"--hang-timeout {text!r}: give seconds (0: off)") from None
            if not hang >= 0:
                raise UsageError(f"--hang-timeout {text!r}: give seconds >= 0 (0: off)")
        elif name == "--listen":
            listen = take().strip()
            if not listen:
                raise UsageError("--listen needs an address (127.0.0.1, 0.0.0.0, a host's)")
        elif name == "--no-connect":
            if eq:
                raise UsageError("--no-connect takes no value")
            listen = None
        elif name in ("--local_rank", "--local-rank"):
            local_rank = [f"{name}={take()}"]
        else:
            raise UsageError(f"unknown option {arg!r} (dtlab.run's options come before SCRIPT)")
        i += 1
    if i >= len(argv):
        raise UsageError("no SCRIPT given")
    script, args = argv[i], [*local_rank, *argv[i + 1 :]]
    return Options(script, args, run_dir, record, hang, listen)


def _print_usage() -> int:
    print(USAGE, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        options = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"{USAGE}\ndtlab.run: error: {e}", file=sys.stderr)
        return 2
    if not os.path.isfile(options.script):
        print(
            f"dtlab.run: error: no script {options.script!r} (from {os.getcwd()})", file=sys.stderr
        )
        return 2
    _as_a_script()
    from dtlab.agent.batch_run import RunDirInUse, run

    try:
        return run(options)
    except RunDirInUse as e:
        print(f"dtlab.run: error: {e}", file=sys.stderr)
        return 2


def _as_a_script() -> None:
    """``python -m`` puts the working folder first on sys.path, ``python train.py`` puts
    the script's folder there (the run adds that): the working folder goes, unless dtlab
    itself is found only there."""
    here = os.getcwd()
    if not sys.path or sys.path[0] not in ("", here):
        return
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.abspath(package_root) != os.path.abspath(here):
        del sys.path[0]


if __name__ == "__main__":
    sys.exit(main())
