"""The partition editor (``dt.partition_editor()``): move a running pipeline's boundaries.

Shows the model's blocks in order, coloured by stage; one slider per boundary (stage k
starts at block ...); the predicted balance of the draft as it changes (from the blocks'
measured costs: *Profile* measures them); *Auto* proposes the ``measured`` plan; *Apply*
re-partitions the live job (``dt.try_plan``: old and new plan in alternating rounds, so a
machine whose load drifts meanwhile does not decide the verdict), shows the measured
balance after and judges the step time against its spread (within noise or not).

Callbacks only call the session and the pure functions; their errors are shown in the
panel (status line and Output) rather than lost.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from dtlab.analysis.balance import predict_balance
from dtlab.control.errors import StepInterrupted
from dtlab.records import Plan, PlanError
from dtlab.views.panels import Panel
from dtlab.views.partition_figures import balance_figure, stage_colour

MEASURE_STEPS = 4  # steps timed per round of each plan on Apply ...
ROUNDS = 3  # ... in this many alternating rounds: 12 a side, load drift cancelled (timing.py)


class PartitionEditor(Panel):
    title = "partition editor"

    def __init__(self, session, *, measure_steps: int = MEASURE_STEPS, rounds: int = ROUNDS):
        import plotly.graph_objects as go

        self.session = session
        self.measure_steps, self.rounds = measure_steps, rounds
        self.trial = None  # the last Apply's dt.try_plan result
        reports = session.stage_reports()
        first = next(iter(reports.values()))
        self.microbatches, self.schedule = first.microbatches, first.schedule
        self.plan = session.partition_from(reports)
        self.costs = session.costs(reports)  # one ask of the ranks, not one per slider move
        self.before = None  # measured balance before the last Apply
        self.after = None  # and after it
        # built with its data: messages that update an empty widget before its view is
        # made can be lost on a busy machine (seen: a figure with no data and no title)
        self.figure = go.FigureWidget(
            balance_figure(
                predict_balance(
                    self.plan, self.costs, schedule=self.schedule, microbatches=self.microbatches
                )
            )
        )
        self.blocks = widgets.HTML()
        self.status = widgets.HTML()
        self.sliders = [self._slider(k) for k in range(1, self.plan.num_stages)]
        self.apply_button = widgets.Button(description="Apply", button_style="primary")
        self.auto_button = widgets.Button(description="Auto (measured)")
        self.profile_button = widgets.Button(description="Profile blocks")
        self.reset_button = widgets.Button(description="Reset")
        self.apply_button.on_click(lambda _: self._guarded(self.apply))
        self.auto_button.on_click(lambda _: self._guarded(self.auto))
        self.profile_button.on_click(lambda _: self._guarded(self.profile))
        self.reset_button.on_click(lambda _: self._guarded(lambda: self.set_draft(self.plan)))
        self.output = widgets.Output()
        buttons = [self.apply_button, self.auto_button, self.profile_button, self.reset_button]
        self.widget = widgets.VBox(
            [
                self.blocks,
                widgets.VBox(self.sliders),
                widgets.HBox(buttons),
                self.status,
                self.figure,
                self.output,
            ]
        )
        self.preview()

    def _slider(self, k: int) -> widgets.IntSlider:
        top = len(self.plan.blocks) - 1
        slider = widgets.IntSlider(
            value=self.plan.bounds[k],
            min=1,
            max=top,
            description=f"stage {k} from",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        slider.observe(lambda _: self._guarded(self.preview), names="value")
        return slider

    def _guarded(self, action) -> None:
        try:
            action()
        except (Exception, StepInterrupted) as e:  # a callback's error would otherwise vanish
            self.status.value = f"<b>{html.escape(type(e).__name__)}</b>: {html.escape(str(e))}"
            self.output.append_stdout(f"{type(e).__name__}: {e}\n")

    # --- the draft ----------------------------------------------------------------------
    def draft(self) -> Plan:
        """The plan the sliders show (PlanError when they overlap or leave a stage empty)."""
        bounds = (0, *(s.value for s in self.sliders), len(self.plan.blocks))
        return Plan(self.plan.blocks, bounds)

    def set_draft(self, plan: Plan) -> None:
        for slider, bound in zip(self.sliders, plan.bounds[1:-1], strict=True):
            with slider.hold_trait_notifications():
                slider.value = bound
        self.preview()

    def preview(self) -> None:
        """Colour the blocks by the draft's stages and predict its balance."""
        try:
            draft = self.draft()
        except PlanError as e:
            self.apply_button.disabled = True
            self.status.value = f"<b>not a valid plan</b>: {html.escape(str(e))}"
            return
        self.apply_button.disabled = draft == self.plan
        self.blocks.value = _block_strip(draft)
        predicted = predict_balance(
            draft, self.costs, schedule=self.schedule, microbatches=self.microbatches
        )
        self._show(balance_figure(predicted))
        moved = self.plan.moves_to(draft)
        self.status.value = (
            f"draft: {len(moved)} block(s) would move" if moved else "the running plan"
        )

    def _show(self, fresh) -> None:
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(fresh.data)
            self.figure.layout = fresh.layout

    # --- what it does -------------------------------------------------------------------
    def profile(self) -> None:
        self.status.value = "profiling every block on its rank..."
        self.session.profile_blocks()
        self.costs = self.session.costs()
        self.preview()

    def auto(self) -> None:
        if not self.session.block_costs:
            self.profile()
        self.set_draft(self.session.plan("measured"))

    def apply(self) -> None:
        """Move to the draft, timed against the running plan in alternating rounds."""
        draft = self.draft()

        def say(text: str) -> None:
            self.status.value = html.escape(text)

        trial = self.session.try_plan(
            draft, rounds=self.rounds, steps=self.measure_steps, progress=say
        )
        self.plan = draft  # it runs now, whatever the next steps do
        self.blocks.value = _block_strip(draft)
        self.before, self.after, self.trial = trial.before, trial.after, trial
        self._show(balance_figure(self.after))
        self.apply_button.disabled = True
        self.status.value = html.escape(trial.summary())


def _block_strip(plan: Plan) -> str:
    """The blocks in order as coloured boxes, one colour per stage."""
    cells = []
    for stage in range(plan.num_stages):
        for name in plan.blocks[plan.bounds[stage] : plan.bounds[stage + 1]]:
            cells.append(
                f'<span title="stage {stage}" style="background:{stage_colour(stage)};'
                "color:white;padding:2px 6px;margin:1px;border-radius:3px;"
                f'display:inline-block">{html.escape(name)}</span>'
            )
    return "<div>" + "".join(cells) + "</div>"
