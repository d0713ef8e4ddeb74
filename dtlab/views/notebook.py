"""``dt`` in a notebook: the Session with the views made from it.

control/ never imports views (its Session runs ranks and holds what they said); what a
person looks at (the dashboard, the partition editor, the checkpoint browser, the HTML
report, TensorBoard files, Prometheus gauges) is made here, from data control/ hands over.
``launch`` (``dtlab.launch``; ``%dt_launch`` calls it) gives a NotebookSession.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from dtlab.control import lifecycle
from dtlab.control.config import LaunchOptions, launch_config, oversubscription
from dtlab.control.connected_job import ConnectedJob
from dtlab.control.options import describe, given, signature
from dtlab.control.session import Session
from dtlab.views.progress import auto_progress


class ConnectedNotebook(ConnectedJob):
    """A job connected to (``%dt_connect``) plus the views a person looks at it with."""

    def dashboard(self):
        """Step / Run N / Run until / Pause controls over live per-rank figures, driving
        the connected job (Pause ends a run after its step, the job held there)."""
        from dtlab.views.widgets import Dashboard

        return Dashboard(self)

    def report(self, path=None):
        """The job's HTML report, from every step its folder holds now (default:
        ``report.html`` in the job folder); -> its path."""
        from dtlab.cli import folder_report

        return folder_report(self.folder, path)


def connect(run_dir, **options) -> ConnectedJob:
    """``dtlab.connect``: :func:`dtlab.control.connect.connect`, views included."""
    from dtlab.control.connect import connect as connect_to

    return connect_to(run_dir, kind=ConnectedNotebook, **options)


class NotebookSession(Session):
    """A Session plus its views (each built on request, so nothing here costs a launch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metrics = None  # the Prometheus HTTP server, while served

    def dashboard(self):
        """Step / Run / Pause controls with live per-rank figures (an ipywidgets panel)."""
        from dtlab.views.widgets import Dashboard

        return Dashboard(self)

    def partition_editor(self):
        """The partition editor widget (blocks, stage boundaries, preview, Apply, Auto)."""
        from dtlab.views.partition_widgets import PartitionEditor

        return PartitionEditor(self)

    def checkpoint_browser(self, resume_steps: int = 10):
        """The loss curve with a marker per checkpoint: select one and replay from it, or
        check that resuming now is exact (an ipywidgets panel)."""
        from dtlab.views.checkpoint_widgets import CheckpointBrowser

        return CheckpointBrowser(self, resume_steps=resume_steps)

    def report(self, path=None):
        """One self-contained HTML file of this session: ranks, findings, checkpoints,
        restarts and interactive figures, for people without dtlab. Returns its path
        (default: ``report.html`` in the run folder, under ``runs/``, so that nothing is
        written beside the notebook)."""
        from dtlab.analysis.doctor import all_findings
        from dtlab.records.run_folder import new_run_folder
        from dtlab.views.html_report import SessionSummary, write_report

        trace = self.trace
        if path is None:
            folder = trace.folder if trace is not None and trace.folder else new_run_folder()
            path = folder / "report.html"
        stepped = trace is not None and trace.last_step > 0
        checks = self.checks() if stepped else []
        summary = SessionSummary(
            world_size=self.world_size,
            backend=self.backend,
            infos=self.infos,
            inconsistencies=self.inconsistencies(),
            trace=trace,
            findings=all_findings(checks),
            checkpoints=self.checkpoints(),
            restarts=tuple(self.restarts),
            checks=tuple(checks),
        )
        return write_report(summary, path)

    def export_tensorboard(self, folder=None):
        """The trace as TensorBoard event files, one run per rank (default: the run
        folder's ``tensorboard/``). Returns the folder: ``tensorboard --logdir FOLDER``."""
        from dtlab.views.tb_export import export_tensorboard

        trace = self.require_trace()
        return export_tensorboard(trace, folder or trace.folder / "tensorboard")

    def serve_metrics(self, port: int = 9464, addr: str = "127.0.0.1") -> str:
        """Expose live per-rank gauges (loss, grad norm, LR, step time, memory) for
        Prometheus at ``http://addr:port/metrics``; off until called, localhost by default.
        ``dt.stop_metrics()`` stops it. Returns the URL."""
        from dtlab.control.network import is_loopback
        from dtlab.views.prometheus_export import serve_metrics

        self.stop_metrics()
        self._metrics, _ = serve_metrics(lambda: self.trace, port=port, addr=addr)
        url = f"http://{addr}:{self._metrics.server_port}/metrics"
        try:
            private = addr == "localhost" or is_loopback(addr)
        except ValueError:  # a host name: who can reach it is not known here
            private = False
        if not private:
            warnings.warn(
                f"{url} serves every rank's loss, LR, step times and memory, without a "
                "password, to anyone who can reach this machine on that address; serve on "
                "127.0.0.1 (the default) unless that is what you want",
                stacklevel=2,
            )
        return url

    def stop_metrics(self) -> None:
        server, self._metrics = self._metrics, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def shutdown(self) -> None:
        from dtlab.views.panels import retire_panels

        self.stop_metrics()
        retire_panels()  # dashboards and editors become text: their ranks are gone
        super().shutdown()


def launch(
    num_ranks: int, *, progress: Callable[[str, int, int], None] | None = None, **options
) -> NotebookSession:
    """Start ``num_ranks`` ranks (or reuse the live session) and return the Session.

    The options are ``%dt_launch``'s, as keywords (``--pg-timeout 60``: ``pg_timeout=60``);
    an unknown one is a TypeError naming them, a bad value an OptionError saying what
    would do. ``progress(phase, done, total)`` is called as engines register and ranks join
    (default: a widget in a notebook, text elsewhere). More local ranks than cores is
    warned about.

    Options (declared once, in ``dtlab.control.config.LaunchOptions``):
    """
    chosen = given(LaunchOptions, "dtlab.launch()", {"num_ranks": num_ranks, **options})
    config = launch_config(chosen)
    if note := oversubscription(config):
        warnings.warn(f"{note}; the doctor says when timings are too noisy to judge", stacklevel=2)
    return lifecycle.launch(
        config, progress or auto_progress(), restart=chosen.restart, session_class=NotebookSession
    )


launch.__doc__ = f"{launch.__doc__.rstrip()}\n\n{describe(LaunchOptions, skip=('num_ranks',))}\n"
launch.__signature__ = signature(LaunchOptions, positional=("num_ranks",), extra={"progress": None})
