"""The Prometheus endpoint: a real prometheus_client HTTP server on 127.0.0.1, scraped over
HTTP and parsed with prometheus_client's own parser (records from the demo job run in this
process; no cluster)."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dtlab.agent import job as jobs
from dtlab.agent.demo_job import attach_demo
from dtlab.agent.state import RANK
from dtlab.records.trace import Trace
from dtlab.views.prometheus_export import serve_metrics


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_scrape_shows_every_ranks_newest_step(tmp_path):
    info = attach_demo(num_samples=64)
    job = jobs.current()
    trace = Trace({0: info, 1: info})
    current = {"trace": None}
    server, thread = serve_metrics(lambda: current["trace"], port=0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"  # localhost unless asked otherwise
        url = f"http://127.0.0.1:{port}/metrics"
        assert scrape(url) == {}  # no trace yet: the families are there, empty
        current["trace"] = trace
        records = [job.step() for _ in range(3)]
        trace.add(0, records)
        trace.add(1, records[:2])  # rank 1 is a step behind
        seen = scrape(url)
        assert seen[("dtlab_step", (("rank", "0"),))] == 3
        assert seen[("dtlab_step", (("rank", "1"),))] == 2
        assert seen[("dtlab_loss", (("rank", "0"),))] == pytest.approx(records[2].loss)
        assert seen[("dtlab_lr", (("rank", "1"),))] == pytest.approx(records[1].lr)
        assert seen[("dtlab_phase_seconds", (("phase", "forward"), ("rank", "0")))] == (
            pytest.approx(records[2].times.forward)
        )
        assert seen[("dtlab_memory_bytes", (("kind", "rss"), ("rank", "0")))] > 0
        trace.add(0, [job.step()])  # live: the next scrape sees the new step
        assert scrape(url)[("dtlab_step", (("rank", "0"),))] == 4
        assert not any(name.startswith("process_") for name, _ in seen)  # dtlab's only
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)  # stopped means stopped
