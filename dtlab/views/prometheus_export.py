"""Live per-rank gauges for Prometheus (``dt.serve_metrics()``), for people who watch jobs
in Grafana. Off by default; bound to 127.0.0.1 unless told otherwise.

Each scrape reads the newest step record of every rank from the session's trace (no rank
is asked anything, and the ipyparallel client is never touched from the server's thread):
``dtlab_step``, ``dtlab_loss``, ``dtlab_grad_norm``, ``dtlab_lr``, ``dtlab_loss_scale``,
``dtlab_step_seconds`` and ``dtlab_phase_seconds{phase}``, ``dtlab_memory_bytes{kind}``,
each labelled ``rank``. Nothing of a rank's environment is exported.
"""

from __future__ import annotations

from dtlab.views.tb_export import PHASES

PREFIX = "dtlab_"


class TraceCollector:
    """A prometheus_client collector over ``trace_of()`` (the trace as of each scrape)."""

    def __init__(self, trace_of):
        self.trace_of = trace_of

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        def gauge(name, doc, labels=("rank",)):
            return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))

        families = {
            "step": gauge("step", "last optimizer step the rank recorded"),
            "loss": gauge("loss", "loss of the last step"),
            "grad_norm": gauge("grad_norm", "total gradient norm of the last step"),
            "lr": gauge("lr", "learning rate of the last step"),
            "loss_scale": gauge("loss_scale", "GradScaler scale of the last step"),
            "step_seconds": gauge("step_seconds", "wall time of the last step on the rank"),
            "phase": gauge(
                "phase_seconds", "time of each phase of the last step", ("rank", "phase")
            ),
            "memory": gauge("memory_bytes", "memory at the end of the last step", ("rank", "kind")),
        }
        trace = self.trace_of()
        for rank, records in sorted((trace.records if trace is not None else {}).items()):
            if records:
                _add(families, str(rank), records[-1])
        yield from families.values()


def _add(families: dict, rank: str, rec) -> None:
    for name, value in (
        ("step", rec.step),
        ("loss", rec.loss),
        ("grad_norm", rec.grad_norm),
        ("lr", rec.lr),
        ("loss_scale", rec.scale),
        ("step_seconds", rec.times.total),
    ):
        if value is not None:
            families[name].add_metric([rank], float(value))
    for phase in PHASES:
        families["phase"].add_metric([rank, phase], float(getattr(rec.times, phase)))
    memory = rec.memory
    for kind in (
        "rss",
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "cuda_allocated",
        "cuda_reserved",
        "cuda_peak",
    ):
        value = getattr(memory, kind)
        if value is not None:
            families["memory"].add_metric([rank, kind.removesuffix("_bytes")], float(value))


def serve_metrics(trace_of, *, port: int = 9464, addr: str = "127.0.0.1"):
    """Start the endpoint (``http://addr:port/metrics``); returns ``(server, thread)``;
    ``server.shutdown()`` stops it. ``port=0`` picks a free port (``server.server_port``)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ImportError(
            "the metrics endpoint needs prometheus_client: pip install 'dtlab[metrics]'"
        ) from None
    registry = CollectorRegistry()  # dtlab's gauges only, not the kernel's process metrics
    registry.register(TraceCollector(trace_of))
    return start_http_server(port, addr=addr, registry=registry)
