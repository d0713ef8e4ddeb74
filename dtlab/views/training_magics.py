"""Magics for the attached job: %dt_demo, %dt_step, %dt_run, %dt_findings.

%dt_demo                     # the built-in demo job on every rank
%dt_step 10                  # 10 optimizer steps on every rank
%dt_run --until nonfinite    # step until a condition holds on some rank, then pause all
%dt_doctor [--explain]       # every check: environment, sync, numerics, data, LR, memory...
%dt_findings                 # the same findings as a table
%dt_plot deviation           # loss, memory, times, deviation or spread, as a plotly figure
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dtlab.analysis.conditions import parse_condition
from dtlab.analysis.doctor import all_findings
from dtlab.control import demo
from dtlab.control.errors import OptionError, RankError, StepInterrupted
from dtlab.control.training import DEFAULT_MAX_STEPS
from dtlab.records import PlanError, RunResult
from dtlab.records.trace import Trace
from dtlab.views.magic_support import (
    connected_job,
    current_session,
    current_target,
    dtlab_magics,
    seconds,
)
from dtlab.views.partition_magics import plan_from_text
from dtlab.views.plots import KINDS, figure_for
from dtlab.views.progress import delayed_progress
from dtlab.views.reports import (
    checks_table,
    doctor_summary,
    findings_table,
    job_summary,
    restart_summary,
    run_summary,
    script_summary,
)
from dtlab.views.script_magics import show_other_ranks
from dtlab.views.tables import wrapped


def _automatic_restarts(session, before: int) -> None:
    """The restarts ``%dt_restart --auto`` made during a run: why, and where it went on."""
    for event in session.restarts[before:]:
        print(f"automatic restart: {event['reason']}")
        print(restart_summary(session.world_size, event))


def _config_items(pairs: list[str]) -> dict:
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set takes KEY=VALUE (e.g. num_layers=6), got {pair!r}")
        try:
            config[key] = int(value)
        except ValueError:
            try:
                config[key] = float(value)  # e.g. dropout=0.1
            except ValueError:
                raise UsageError(f"--set {key}: {value!r} is not a number") from None
    return config


def _said(session, before: int, run) -> RunResult:
    """``run()``'s RunResult, after saying what it did (``_say``). On Ctrl-C (the ranks
    paused) that is said too, then the KeyboardInterrupt ends the cell."""
    try:
        result = run()
    except StepInterrupted as e:
        _say(session, before, e.result)
        raise
    _say(session, before, result)
    return result


def _say(session, before: int, result: RunResult) -> None:
    """The automatic restarts a run made, a script's other ranks' output, the summary
    line and a script's end."""
    _automatic_restarts(session, before)
    show_other_ranks(session)  # a script's; rank 0's came as it printed
    print(run_summary(result, session.trace))  # dt.step() / dt.run_until() return it
    _script_end(session, result)


def _script_end(session, result) -> None:
    """A run that ended the user's script: how it ended (exit code, error) per rank."""
    if result.stopped == "ended":
        status = session.scripts.refresh()
        if status is not None:
            print(script_summary(status))


@dtlab_magics
class TrainingMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument("--no-ddp", action="store_true", help="leave the model bare (no DDP wrapper)")
    @argument("--no-record", action="store_true", help="record only loss, LR, times, memory")
    @argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    @argument("--scaler", action="store_true", help="step through a GradScaler (as AMP jobs do)")
    @argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="K micro-batches per step (DDP syncs only the last)",
    )
    @argument(
        "--pipeline",
        action="store_true",
        help="split the model into one pipeline stage per rank (see %%dt_partition)",
    )
    @argument(
        "--plan",
        default="uniform",
        help="with --pipeline: uniform | parameters | cuts like 2,4,6 | stages "
        "like 'embed,blocks.0|blocks.1|...'",
    )
    @argument("--microbatches", type=int, default=4, help="with --pipeline (default 4)")
    @argument(
        "--schedule",
        default="gpipe",
        choices=["gpipe", "1f1b"],
        help="with --pipeline: the micro-batch schedule (default gpipe)",
    )
    @argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=N",
        help="DemoConfig fields, e.g. --set num_layers=6 dropout=0.1",
    )
    def dt_demo(self, line):
        """Attach the built-in demo job (tiny DeepSeek-style MoE LM) on every rank."""
        args = parse_argstring(self.dt_demo, line)
        config = _config_items(args.set)
        try:
            if args.pipeline:
                infos = demo.attach_pipeline(
                    current_session(),
                    plan=plan_from_text(args.plan),
                    microbatches=args.microbatches,
                    schedule=args.schedule,
                    record=not args.no_record,
                    lr=args.lr,
                    **config,
                )
            else:
                infos = demo.attach(
                    current_session(),
                    ddp=not args.no_ddp,
                    record=not args.no_record,
                    lr=args.lr,
                    scaler=args.scaler,
                    accumulate=args.accumulate,
                    **config,
                )
        except PlanError as e:  # said with the flag it came from
            raise OptionError(f"--plan: {e}") from None
        except RankError as e:  # a bad --set value fails the same way on every rank
            kinds = {f.ename for f in e.failures.values()}
            if kinds <= {"ValueError", "TypeError"} and not (e.finished or e.stuck):
                raise UsageError(next(iter(e.failures.values())).evalue) from None
            raise
        print(job_summary(infos))

    @line_magic
    @magic_arguments()
    @argument("num_steps", type=int, nargs="?", default=1, help="optimizer steps (default 1)")
    @argument("--no-record", action="store_true", help="skip per-parameter stats for these steps")
    @argument("--timeout", type=seconds, default=None, help="seconds before ranks are interrupted")
    def dt_step(self, line):
        """Run N optimizer steps on every rank; Ctrl-C pauses all after the same step."""
        args = parse_argstring(self.dt_step, line)
        if args.num_steps < 1:
            raise UsageError(f"the number of steps must be at least 1, got {args.num_steps}")
        job = connected_job()
        if job is not None:
            timeout = {"timeout": args.timeout} if args.timeout else {}
            print(run_summary(job.step(args.num_steps, **timeout), job.trace))
            return
        session = current_session()
        _said(
            session,
            len(session.restarts),
            lambda: session.step(
                args.num_steps,
                record=False if args.no_record else None,
                timeout=args.timeout,
                progress=delayed_progress(),
            ),
        )

    @line_magic
    @magic_arguments()
    @argument(
        "--until",
        required=True,
        help="step>=N, loss>X, loss<X, nonfinite or diverged (on any rank)",
    )
    @argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help=f"stop after this many steps anyway (default {DEFAULT_MAX_STEPS})",
    )
    @argument("--timeout", type=seconds, default=None, help="seconds before ranks are interrupted")
    def dt_run(self, line):
        """Step until a condition holds on some rank; every rank pauses at the same step."""
        args = parse_argstring(self.dt_run, line)
        condition = parse_condition(args.until)
        if args.max_steps < 1:
            raise UsageError(f"--max-steps must be at least 1, got {args.max_steps}")
        job = connected_job()
        if job is not None:
            timeout = {"timeout": args.timeout} if args.timeout else {}
            result = job.run_until(
                condition, args.max_steps, progress=delayed_progress(), **timeout
            )
            print(run_summary(result, job.trace))
            return
        session = current_session()
        _said(
            session,
            len(session.restarts),
            lambda: session.run_until(
                condition,
                max_steps=args.max_steps,
                timeout=args.timeout,
                progress=delayed_progress(),
            ),
        )

    @line_magic
    def dt_findings(self, line):
        """The doctor's findings on the records so far, as a table."""
        display(findings_table(current_target().doctor()))

    @line_magic
    @magic_arguments()
    @argument(
        "--explain",
        action="store_true",
        help="also show each check: what it looked at and why it passed",
    )
    def dt_doctor(self, line):
        """Run every check on the live job; findings ranked, most severe first."""
        args = parse_argstring(self.dt_doctor, line)
        results = current_target().checks()
        findings = all_findings(results)
        # with --explain the table says why a check could not look: said once, there
        print(wrapped(doctor_summary(results, reasons=not args.explain)))
        if findings:
            display(findings_table(findings))
        if args.explain:
            display(checks_table(results))

    @line_magic
    @magic_arguments()
    @argument("kind", help=f"what to plot: {', '.join(KINDS)}")
    @argument("--step", type=int, default=None, help="step for times / deviation (default last)")
    @argument("--field", default="rss", help="memory counter: rss, param_bytes, cuda_allocated…")
    @argument(
        "--compare",
        default=None,
        metavar="RUN_FOLDER",
        help="overlay the loss of another run (a runs/<timestamp> folder)",
    )
    def dt_plot(self, line):
        """Plot the records so far: per-rank loss, memory, time breakdown, deviation, spread."""
        args = parse_argstring(self.dt_plot, line)
        job = connected_job()
        session = job or current_session()
        trace = job.trace if job is not None else session.require_trace()
        if not len(trace):
            raise UsageError("no step recorded yet: let the job make a step first")
        step = trace.last_step if args.step is None else args.step
        if args.kind == "deviation" and not 1 <= step <= trace.last_step:
            raise UsageError(f"no step {step}: steps 1-{trace.last_step} were recorded")
        details = session.step_details(step) if args.kind == "deviation" else None
        try:
            other = Trace.load(args.compare) if args.compare else None
        except ValueError as e:  # not a run folder, or a damaged one: the user's input
            raise OptionError(f"--compare {args.compare}: {e}") from None
        return figure_for(
            trace, args.kind, step=step, field=args.field, other=other, details=details
        )  # shown as the cell's result, and usable as a value
