"""ipywidgets faces. The only module that builds widgets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import ipywidgets as widgets

from dtlab.views.panels import Panel

if TYPE_CHECKING:
    from dtlab.records import Condition, RunResult
    from dtlab.records.trace import Trace


class Steppable(Protocol):
    """What the dashboard drives: a Session (``%dt_launch``, ``%dt_script``) or a job
    connected to (``%dt_connect``)."""

    @property
    def trace(self) -> Trace | None: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def current_step(self) -> int: ...
    def pause(self) -> object: ...
    async def run_async(
        self, steps: int, until: Condition | None = None, *, on_progress: Callable[[], None]
    ) -> RunResult: ...


class Dashboard(Panel):
    """Step / Run N / Run until / Pause controls over one live plotly figure.

    Runs go through ``run_async`` (a Session's stepper, or a connected job's) as a task on
    the kernel's event loop, so the
    Pause button (and the rest of the notebook) stays usable while the ranks step. One
    FigureWidget with subplots (docs/design.md: each FigureWidget ships ~5 MB of plotly.js),
    updated in one batch at most every ``refresh_s``, each line downsampled.
    """

    title = "dashboard"

    def __init__(self, session: Steppable, *, max_points: int = 1000, refresh_s: float = 0.5):
        import plotly.graph_objects as go

        from dtlab.records.trace import Trace
        from dtlab.views.figures import dashboard_figure

        self.session = session
        self.max_points = max_points
        self.refresh_s = refresh_s
        self.task: asyncio.Task | None = None
        self.last_result = None
        self._last_refresh = 0.0
        trace = session.trace or Trace.empty(session.ranks)
        # a plain figure, redrawn in an Output: a FigureWidget (an anywidget carrying
        # plotly.js in its state) stayed blank, no data and no title, when its first
        # updates came while the browser was still building it on a busy machine
        self.figure = go.Figure(dashboard_figure(trace, max_points=max_points))
        self.plot = widgets.Output()
        self.step_button = widgets.Button(description="Step", tooltip="one optimizer step")
        self.run_button = widgets.Button(description="Run N", tooltip="N optimizer steps")
        self.num_steps = widgets.BoundedIntText(
            value=20, min=1, max=10**7, layout={"width": "90px"}
        )
        self.until = widgets.Text(placeholder="loss>5 | nonfinite | diverged | step>=100")
        self.until_button = widgets.Button(description="Run until")
        self.pause_button = widgets.Button(description="Pause", disabled=True)
        self.status = widgets.Label("idle")
        self.output = widgets.Output()  # callback errors land here, not in the void
        self.step_button.on_click(lambda _: self.start(1))
        self.run_button.on_click(lambda _: self.start(self.num_steps.value))
        self.until_button.on_click(lambda _: self.start_until(self.until.value))
        self.pause_button.on_click(lambda _: self.pause())
        controls = widgets.HBox(
            [
                self.step_button,
                self.run_button,
                self.num_steps,
                self.until,
                self.until_button,
                self.pause_button,
            ]
        )
        self.widget = widgets.VBox([controls, self.status, self.output, self.plot])
        self._draw()

    # --- controls ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, num_steps: int, condition=None) -> None:
        if self.running:
            self.status.value = "a run is in progress: pause it first"
            return
        self._set_running(True)  # at once: a second click must not start a second run
        self.last_result = None
        self.task = asyncio.ensure_future(self._run(num_steps, condition))

    def start_until(self, text: str) -> None:
        from dtlab.analysis.conditions import parse_condition
        from dtlab.control.training import DEFAULT_MAX_STEPS

        try:
            condition = parse_condition(text)
        except ValueError as e:
            self.status.value = str(e)
            return
        self.start(DEFAULT_MAX_STEPS, condition)

    def pause(self) -> None:
        self.session.pause()
        self.status.value = "pausing after the current step"

    async def wait(self):
        """Await the run in progress (for code and tests); returns its RunResult."""
        if self.task is not None:
            await self.task
        return self.last_result

    async def _run(self, num_steps: int, condition) -> None:
        from dtlab.views.reports import run_summary

        start = time.monotonic()

        def progress():
            step = self.session.current_step
            self.status.value = f"running: step {step} ({time.monotonic() - start:.1f} s)"
            self.refresh(force=False)

        try:
            result = await self.session.run_async(num_steps, condition, on_progress=progress)
            self.last_result = result
            self.status.value = run_summary(result, self.session.trace)
        except Exception as e:  # shown in the panel: a callback has no cell to raise into
            self.status.value = f"failed: {type(e).__name__}"
            with self.output:
                print(e)
        finally:
            self._set_running(False)
            self.refresh()

    def _set_running(self, running: bool) -> None:
        for button in (self.step_button, self.run_button, self.until_button):
            button.disabled = running
        self.pause_button.disabled = not running
        self.pause_button.button_style = "warning" if running else ""  # orange: it can act

    def refresh(self, force: bool = True) -> None:
        """Redraw the figure from the trace (one batched update)."""
        from dtlab.analysis.rank_groups import GROUP_ABOVE
        from dtlab.views.figures import (
            dashboard_figure,
            dashboard_series,
            dashboard_titles,
            step_ticks,
        )

        now = time.monotonic()
        trace = self.session.trace
        if trace is None or (not force and now - self._last_refresh < self.refresh_s):
            return
        self._last_refresh = now
        if len(trace.ranks) > GROUP_ABOVE:  # bands, and outliers that may change: anew
            self.figure = dashboard_figure(trace, max_points=self.max_points)
            self._draw()
            return
        series = dashboard_series(trace, self.max_points)
        if len(series) != len(self.figure.data):
            self.status.value = "the number of ranks changed: run dt.dashboard() again"
            return
        titles = dashboard_titles(series, len(trace.ranks))
        with self.figure.batch_update():
            for line, (x, y) in zip(self.figure.data, series, strict=True):
                line.x, line.y = x, y
            for note, title in zip(self.figure.layout.annotations, titles, strict=False):
                note.text = title
            step_ticks(self.figure)  # every step while few, plotly's ticks past that
        self._draw()

    def _draw(self) -> None:
        """Show the figure as it is now: one plotly output, replaced whole (the arrays are
        resent either way: plotly has no incremental extend)."""
        import json

        import plotly.io as pio

        bundle = {
            "application/vnd.plotly.v1+json": json.loads(pio.to_json(self.figure, validate=False)),
            "text/plain": "Training per rank (a plotly figure)",
        }
        self.plot.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
