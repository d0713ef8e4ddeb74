"""Magics for the pipeline partition of the attached job (``%dt_demo --pipeline`` makes one).

%dt_partition                        # the running plan and its measured balance
%dt_partition --profile              # measure each block's forward/backward/activations
%dt_partition --predict parameters   # a plan's predicted balance, nothing moves
%dt_partition --apply 2,4,6          # move the boundaries of the running job
%dt_partition --schedule             # one step's schedule per rank, on one time base
%dt_partition --export megatron      # the plan as deepspeed | megatron | torchtitan
%dt_partition --editor               # the partition editor widget

A plan is written as a method (``uniform``, ``parameters``, ``measured``), boundary
indices (``2,4,6``: stages start at blocks 2, 4 and 6; or DeepSpeed's ``0,2,4,6,7``), or
the blocks of each stage (``embed,blocks.0|blocks.1,blocks.2|...``). Regexes per stage:
``dt.repartition({r"blocks\\.[01]|embed": 0, ...})`` from Python.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dtlab.analysis import timing
from dtlab.analysis.partition import METHODS
from dtlab.analysis.partition_export import to_deepspeed, to_megatron, to_torchtitan
from dtlab.control.partitions import NotAPipeline
from dtlab.views.magic_support import current_session, dtlab_magics
from dtlab.views.partition_figures import balance_figure, schedule_figure
from dtlab.views.partition_tables import balance_table

EXPORTS = {"deepspeed": to_deepspeed, "megatron": to_megatron, "torchtitan": to_torchtitan}


def plan_from_text(text: str):
    """A plan as the API takes it, from its text form (UsageError names the forms)."""
    text = text.strip()
    if text in METHODS:
        return text
    tokens = [t.strip() for t in text.replace("|", ",").split(",")]
    if all(t.lstrip("-").isdigit() for t in tokens if t):
        return [int(t) for t in tokens if t]
    if "|" in text:
        return [
            [name.strip() for name in stage.split(",") if name.strip()] for stage in text.split("|")
        ]
    raise UsageError(
        f"cannot read the plan {text!r}: write a method ({', '.join(METHODS)}), boundary "
        "indices like 2,4,6, or each stage's blocks like 'embed,blocks.0|blocks.1|...'"
    )


@dtlab_magics
class PartitionMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument("--profile", action="store_true", help="measure every block on its rank first")
    @argument("--predict", metavar="PLAN", help="show PLAN's predicted balance; moves nothing")
    @argument("--apply", metavar="PLAN", help="move the running job's boundaries to PLAN")
    @argument("--schedule", action="store_true", help="the last step's schedule per rank")
    @argument(
        "--try",
        dest="trial",
        metavar="PLAN",
        help="move to PLAN and time it against the running plan in alternating rounds "
        "(keeps PLAN; says 'within noise' when the rounds cannot tell them apart)",
    )
    @argument("--rounds", type=int, default=3, help="alternating rounds for --try")
    @argument("--export", choices=sorted(EXPORTS), help="print the plan in another system's form")
    @argument("--editor", action="store_true", help="open the partition editor widget")
    def dt_partition(self, line):
        """See and move the pipeline partition of the running job."""
        args = parse_argstring(self.dt_partition, line)
        try:
            return self._partition(args, current_session())
        except NotAPipeline as e:
            raise UsageError(str(e)) from None

    def _partition(self, args, dt):
        if args.editor:
            return dt.partition_editor()
        if args.profile:
            costs = dt.profile_blocks()
            print(f"profiled {len(costs)} blocks on their ranks")
        if args.export:
            print(EXPORTS[args.export](dt.partition()))
            return None
        if args.predict:
            predicted = dt.predict(plan_from_text(args.predict))
            print(f"predicted: {predicted.plan.describe()}")
            display(balance_table(predicted))
            return balance_figure(predicted)
        if args.trial:
            if args.rounds < 1:
                raise UsageError(f"--rounds takes a number >= 1, got {args.rounds}")
            trial = dt.try_plan(plan_from_text(args.trial), rounds=args.rounds, progress=print)
            print(trial.summary())
            return balance_figure(trial.after)
        if args.apply:
            moved = dt.repartition(plan_from_text(args.apply))
            print(
                f"moved {len(moved['moved'])} block(s) in {moved['seconds'] * 1e3:.0f} ms: "
                f"{moved['plan'].describe()}; %dt_step a few steps, then %dt_partition "
                "shows the measured balance"
            )
            return None
        balance = dt.balance()
        if args.schedule:
            return schedule_figure(balance.events, clock=balance.clock)
        print(balance.plan.describe())
        display(balance_table(balance, _recent_steps(dt)))
        return balance_figure(balance)


def _recent_steps(dt, last: int = 10):
    """The spread of the last steps' times (None before any step is recorded)."""
    trace = dt.trace
    times = timing.step_times(trace.records)[-last:] if trace is not None else []
    return timing.spread(times) if times else None
