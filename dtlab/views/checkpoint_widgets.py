"""The checkpoint browser (``dt.checkpoint_browser()``): the loss curve with a marker per
checkpoint; click one, then replay from it; or check that resuming now is exact.

Callbacks only call the session and the pure figures; their errors are shown in the
panel's Output rather than lost.
"""

from __future__ import annotations

import ipywidgets as widgets

from dtlab.control.errors import StepInterrupted
from dtlab.records.checkpoints import CheckpointInfo
from dtlab.records.trace import Trace
from dtlab.views.checkpoint_figures import checkpoint_loss_figure, replay_figure
from dtlab.views.panels import Panel
from dtlab.views.reports import replay_summary


class CheckpointBrowser(Panel):
    title = "checkpoint browser"

    def __init__(self, session, *, resume_steps: int = 10):
        import plotly.graph_objects as go

        self.session = session
        self.resume_steps = resume_steps
        self.selected: CheckpointInfo | None = None
        self.last_result = None
        # built with its data: messages that update an empty widget before its view is
        # made can be lost on a busy machine (seen: a figure with no data and no title)
        self.figure = go.FigureWidget(self._fresh())
        self.status = widgets.HTML("click a checkpoint marker to select it")
        self.replay_button = widgets.Button(description="Replay from here", disabled=True)
        self.resume_button = widgets.Button(description=f"Check resume ({resume_steps} steps)")
        self.save_button = widgets.Button(description="Checkpoint now")
        self.replay_button.on_click(lambda _: self._guarded(self.replay_selected))
        self.resume_button.on_click(lambda _: self._guarded(self.check_resume))
        self.save_button.on_click(lambda _: self._guarded(self.save))
        self.output = widgets.Output()
        buttons = widgets.HBox([self.save_button, self.replay_button, self.resume_button])
        self.widget = widgets.VBox([buttons, self.status, self.figure, self.output])
        self.figure.data[-1].on_click(self._clicked)

    def _guarded(self, action) -> None:
        try:
            action()
        except (Exception, StepInterrupted) as e:  # a callback's error would otherwise vanish
            self.output.append_stdout(f"{type(e).__name__}: {e}\n")

    # --- what it shows ------------------------------------------------------------------
    def _fresh(self):
        """The loss figure with the catalogue's markers, read anew."""
        trace = self.session.trace or Trace.empty(self.session.ranks)
        self.catalogue = self.session.checkpoints()
        return checkpoint_loss_figure(trace, self.catalogue)

    def refresh(self) -> None:
        fresh = self._fresh()
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(fresh.data)
            self.figure.layout = fresh.layout
        self.figure.data[-1].on_click(self._clicked)

    def _clicked(self, trace, points, selector) -> None:
        if points.point_inds:
            self._guarded(lambda: self.select(self.catalogue[points.point_inds[0]]))

    def select(self, info: CheckpointInfo) -> None:
        self.selected = info
        usable = (
            info.ok and self.session.trace is not None and info.step < self.session.trace.last_step
        )
        self.replay_button.disabled = not usable
        what = f"checkpoint of step {info.step} ({info.status})"
        self.status.value = what + (f": {info.problem}" if info.problem else "")

    # --- what it does -------------------------------------------------------------------
    def save(self) -> None:
        saved = self.session.checkpoint()
        self.refresh()
        self.select(saved)

    def replay_selected(self) -> None:
        if self.selected is None:
            raise ValueError("select a checkpoint marker first")
        self.status.value = f"replaying from step {self.selected.step}..."
        result = self.session.replay(self.selected.step + 1)
        self.last_result = result
        first = result.comparison.first
        self.status.value = replay_summary(result)
        figure = replay_figure(
            self.session.trace, result.trace, first_difference=first.step if first else None
        )
        self.output.clear_output()
        self.output.append_display_data(figure)

    def check_resume(self) -> None:
        self.status.value = f"resume check: {self.resume_steps} steps on fresh engines..."
        report = self.session.resume_check(self.resume_steps)
        self.last_result = report
        self.status.value = report.summary()
        self.refresh()
