"""``dtlab`` on the command line: the doctor and the report of a run folder, no notebook.

    dtlab doctor RUN_DIR [--explain]   # findings; exit 0 clean, 1 findings, 2 unreadable
    dtlab report RUN_DIR [--out PATH]  # the HTML report (default RUN_DIR/report.html)
    ... --salvage                      # a corrupt journal read up to the corruption, said
    python -m dtlab doctor RUN_DIR     # the same

RUN_DIR is a job folder written by ``torchrun ... -m dtlab.run`` (finished, crashed or
still running: :mod:`dtlab.records.job_folder`) or a notebook's run folder (``runs/<time>/``).
The doctor is the notebook's (:func:`dtlab.analysis.doctor.run_checks`), on the records as
written; it also says how each rank's script ended and which ranks reported a hang, and
counts a failed, killed or hung rank as a finding.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtlab.records.job_folder import JobFolder
    from dtlab.records.trace import Trace

CLEAN, FOUND, UNREADABLE = 0, 1, 2


@dataclass
class Folder:
    """A run folder as the commands read it."""

    path: Path
    trace: Trace
    job: JobFolder | None = None  # a job folder's (python -m dtlab.run)
    problems: list[str] = field(default_factory=list)  # ranks failed, killed, hung


def load(path: str, salvage: bool = False) -> Folder:
    """Read RUN_DIR; a ValueError says what is wrong and where (``salvage``: see
    ``Trace.load``)."""
    from dtlab.records import job_folder
    from dtlab.records.trace import Trace

    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder (give the run folder, not a file in it)")
    if not (folder / "trace.json").exists() and not job_folder.is_job_folder(folder):
        raise ValueError(
            f"{folder}: not a dtlab run folder (no job.json, no rank-<r>/ folders, no "
            "trace.json): give the folder python -m dtlab.run wrote, runs/<script>-<time>/"
        )
    try:
        trace = Trace.load(folder, salvage=salvage)
        job = job_folder.read_job(folder) if job_folder.is_job_folder(folder) else None
    except (OSError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{folder}: cannot be read ({e!r})") from None
    return Folder(folder, trace, job)


def evidence_of(found: Folder):
    from dtlab.records import Evidence

    trace = found.trace
    if found.job is not None:
        return found.job.evidence(trace)
    return Evidence(
        records=trace.records,
        columns=trace.columns,
        history=trace.history.rows(),
        names=trace.param_names,
        jobs=dict(trace.jobs),
    )


def checks_of(found: Folder) -> list:
    from dtlab.analysis.doctor import run_checks

    if found.trace.last_step == 0 and not len(found.trace):
        return []
    return run_checks(evidence_of(found))


def describe(found: Folder) -> list[str]:
    """What the folder holds, how each rank ended, its hang reports; ``found.problems``
    gets the ranks that failed, were killed or hung."""
    trace, job = found.trace, found.job
    lines = []
    steps = {r: (recs[0].step, recs[-1].step) for r, recs in trace.records.items() if len(recs)}
    if job is not None:
        script = os.path.basename(str(job.meta.get("script") or "")) or "a script"
        size = job.world_size or len(job.rank_folders)
        ranks = f"{size} rank" + ("s" if size != 1 else "")
        lines.append(f"{found.path}: {script} on {ranks}, {_steps_text(steps, size)}")
        if job.missing:
            lines.append(f"no step recorded by rank(s) {_ranks(job.missing)}")
        lines += _endings(found)
    else:
        lines.append(f"{found.path}: a notebook's run folder, {_steps_text(steps, len(steps))}")
    return lines


def _steps_text(steps: dict, size: int) -> str:
    if not steps:
        return "no step recorded yet"
    lasts = {last for _, last in steps.values()}
    if len(lasts) == 1 and len(steps) == size:
        first = min(f for f, _ in steps.values())
        return f"steps {first}-{lasts.pop()} recorded on every rank"
    return "last step recorded: " + ", ".join(f"rank {r} {last}" for r, (_, last) in steps.items())


def _endings(found: Folder) -> list[str]:
    from dtlab.analysis.hangs import folder_verdict
    from dtlab.views.reports import last_lines, script_stack

    job = found.job
    assert job is not None
    lines = []
    bad = sorted((o.time, r) for r, o in job.outcomes.items() if o.kind == "failed")
    first = bad[0][1] if len(bad) > 1 else None
    for rank in sorted(job.rank_folders):
        outcome = job.outcomes.get(rank)
        if outcome is not None:
            text = outcome.describe()
            if outcome.bad:
                found.problems.append(text)
                if rank == first:
                    text += " (the first rank to fail)"
                if outcome.kind == "failed" and outcome.traceback:
                    text += "\n    " + last_lines(outcome.traceback, 4)
            lines.append(text)
        elif rank in job.jobs or rank in job.ranks or rank in job.fatal:
            lines.append(f"rank {rank}: {_no_outcome(job, rank)}")
            if rank in job.fatal:
                found.problems.append(lines[-1])
    for rank, hang in sorted(job.hangs.items()):
        text = hang.describe()
        if hang.resumed is None:
            found.problems.append(text)
            where = job.rank_folders[rank] / "stacks.txt"
            text += f"; where its script was ({where}):\n    " + script_stack(hang.stacks)
        lines.append(text)
    if (verdict := folder_verdict(job)) is not None:
        found.problems.append(f"hung: {verdict.summary}")
        lines.append(f"hung: {verdict.summary}")
        lines += [f"    rank {r} {place}" for r, place in sorted(verdict.where.items())]
    return lines


def _no_outcome(job, rank: int) -> str:
    from dtlab.views.reports import script_stack

    info = job.ranks.get(rank)
    if fatal := job.fatal.get(rank):
        path = job.rank_folders[rank] / "fatal.txt"
        return (
            f"died of a fatal signal ({fatal.strip().splitlines()[0]}) where its script was "
            f"({path}):\n    " + script_stack(fatal)
        )
    if info is not None and info.host == socket.gethostname():
        if _alive(info.pid):
            return f"still running (pid {info.pid})"
        return (
            f"its process (pid {info.pid}) is gone without saying how it ended: killed "
            "(SIGKILL, out of memory) or crashed in C code"
        )
    where = f" on {info.host}" if info is not None else ""
    return f"no outcome yet{where}: still running, or killed"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dtlab.run" in f.read()
    except OSError:
        return False


def _ranks(ranks) -> str:
    from dtlab.analysis.ranks import format_ranks

    return format_ranks(tuple(ranks))


def doctor(path: str, explain: bool = False, out=None, salvage: bool = False) -> int:
    from dtlab.analysis.doctor import all_findings
    from dtlab.views.reports import checks_table, doctor_summary
    from dtlab.views.tables import TEXT_WIDTH, wrapped

    out = out or sys.stdout
    try:
        found = load(path, salvage)
        lines = describe(found)
        results = checks_of(found)
    except ValueError as e:
        print(f"dtlab doctor: {e}", file=sys.stderr)
        return UNREADABLE
    print("\n".join(lines), file=out)
    if results:
        summary = doctor_summary(results, reasons=not explain, named=bool(found.problems))
        print(wrapped(summary), file=out)
        if explain:
            print(checks_table(results).text(TEXT_WIDTH), file=out)
    else:
        print("no step to check yet", file=out)
    return FOUND if all_findings(results) or found.problems else CLEAN


def report(path: str, out_path: str | None = None, salvage: bool = False) -> int:
    try:
        written = folder_report(path, out_path, salvage)
    except ValueError as e:
        print(f"dtlab report: {e}", file=sys.stderr)
        return UNREADABLE
    print(written)
    return CLEAN


def folder_report(
    path: str | Path, out_path: str | Path | None = None, salvage: bool = False
) -> Path:
    """The HTML report of the run folder ``path`` (default: its ``report.html``); -> where
    it was written. ValueError if the folder cannot be read."""
    from dtlab.analysis.consistency import find_inconsistencies
    from dtlab.analysis.doctor import all_findings
    from dtlab.views.html_report import SessionSummary, write_report

    found = load(str(path), salvage)
    describe(found)  # notes the ranks that failed, were killed or hung, and the verdict
    results = checks_of(found)
    trace, job = found.trace, found.job
    infos = dict(job.ranks) if job is not None else {}
    backends = sorted({i.backend for i in infos.values()}) or ["unknown backend"]
    summary = SessionSummary(
        world_size=(job.world_size if job is not None else None) or trace.world_size,
        backend="/".join(backends),
        infos=infos,
        inconsistencies=find_inconsistencies(infos) if infos else [],
        trace=trace,
        findings=all_findings(results),
        checkpoints=(),
        restarts=(),
        checks=tuple(results),
        endings=tuple(found.problems),
    )
    target = Path(out_path) if out_path else found.path / "report.html"
    return write_report(summary, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dtlab", description="dtlab on the command line: read a run folder."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "doctor",
        help="print the findings of a run folder (exit 0 clean, 1 findings, 2 unreadable)",
    )
    d.add_argument("run_dir", help="a job folder of python -m dtlab.run, or a notebook's")
    d.add_argument("--explain", action="store_true", help="what each check looked at")
    r = sub.add_parser("report", help="write the HTML report of a run folder")
    r.add_argument("run_dir")
    r.add_argument("--out", default=None, help="the file (default RUN_DIR/report.html)")
    for p in (d, r):
        p.add_argument(
            "--salvage",
            action="store_true",
            help="read a corrupt journal up to the corruption (what is left out is said)",
        )
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return doctor(args.run_dir, args.explain, salvage=args.salvage)
        return report(args.run_dir, args.out, salvage=args.salvage)
    except BrokenPipeError:  # `dtlab doctor DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLEAN


if __name__ == "__main__":
    sys.exit(main())
