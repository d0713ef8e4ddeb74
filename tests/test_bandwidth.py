"""All_reduce bandwidth sweeps: nccl-tests' arithmetic on made-up times, then a real sweep
on live gloo ranks through ``%dt_bandwidth``."""

import pytest
from IPython.core.error import UsageError

from dtlab.analysis.bandwidth import combine, compare_sweeps, sizes_between
from dtlab.views.bandwidth_views import bandwidth_figure, bandwidth_table
from dtlab.views.comm_magics import parse_size


def test_the_slowest_rank_sets_the_time_and_busbw_follows_nccl_tests():
    times = {
        0: [(1024, 1e-4), (2**20, 1e-3)],
        1: [(1024, 2e-4), (2**20, 5e-4)],
        2: [(1024, 1e-4), (2**20, 5e-4)],
        3: [(1024, 1e-4), (2**20, 5e-4)],
    }
    sweep = combine(times, label="A", backend="gloo", dtype="float32")
    small, large = sweep.points
    assert small.time_s == 2e-4 and large.time_s == 1e-3
    assert large.algbw == pytest.approx(2**20 / 1e-3)
    assert large.busbw == pytest.approx(large.algbw * 2 * 3 / 4)  # 2(n-1)/n for n = 4
    assert sweep.peak_busbw == large.busbw
    faster = combine(
        {r: [(s, t / 2) for s, t in rows] for r, rows in times.items()},
        label="B",
        backend="gloo",
        dtype="float32",
    )
    line = compare_sweeps(sweep, faster)
    assert line.startswith("B vs A") and "(2.00x, no spread measured: no verdict)" in line
    table = bandwidth_table(sweep)
    assert table.rows[1] == (
        "1 MiB",
        "1000.0",
        f"{2**20 / 1e-3 / 1e9:.3f}",
        f"{2**20 / 1e-3 * 1.5 / 1e9:.3f}",
    )
    figure = bandwidth_figure([sweep, faster])
    assert [t.name for t in figure.data] == ["A", "B"] and figure.layout.xaxis.type == "log"


def test_a_comparison_of_sweeps_is_judged_against_the_spread_of_their_timed_groups():
    def sweep(label, small, large):  # seconds per all_reduce of each of 5 timed groups
        rows = [(1024, sum(small) / 5, tuple(small)), (2**20, sum(large) / 5, tuple(large))]
        return combine({0: rows, 1: rows}, label=label, backend="gloo", dtype="float32")

    a = sweep("A", [1.0e-4, 1.1e-4, 0.9e-4, 1.0e-4, 1.2e-4], [1e-3, 1.1e-3, 0.9e-3, 1e-3, 1e-3])
    noisy = sweep("B", [0.9e-4, 1.3e-4, 1.0e-4, 0.8e-4, 1.1e-4], [5e-4, 5.1e-4, 4.9e-4, 5e-4, 5e-4])
    line = compare_sweeps(a, noisy)
    assert "latency at 1024 B" in line and "x, within noise); bus bandwidth" in line
    assert line.endswith("(2.00x, faster, beyond the spread)")
    assert a.points[0].samples == (1.0e-4, 1.1e-4, 0.9e-4, 1.0e-4, 1.2e-4)


def test_bad_sweeps_are_refused_with_the_reason():
    assert sizes_between(8, 2048, 4) == [8, 32, 128, 512, 2048]
    with pytest.raises(ValueError, match="factor >= 2"):
        sizes_between(8, 64, 1)
    with pytest.raises(ValueError, match="different sizes"):
        combine({0: [(8, 1.0)], 1: [(16, 1.0)]}, label="x", backend="gloo", dtype="float32")
    assert parse_size("16M") == 16 * 2**20 and parse_size("1KiB") == 1024
    assert parse_size("8") == 8
    with pytest.raises(UsageError, match="cannot read the size"):
        parse_size("lots")


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_sweep_on_live_ranks(live2, ip, capsys):
    figure = ip.run_line_magic("dt_bandwidth", "--min 1K --max 64K --iters 5 --label default")
    shown = capsys.readouterr().out
    assert "all_reduce of float32 on 2 ranks (gloo)" in shown and "64 KiB" in shown
    sweep = live2.sweeps[-1]
    assert [p.size for p in sweep.points] == [1024, 4096, 16384, 65536]
    assert all(p.time_s > 0 and p.busbw > 0 for p in sweep.points)
    assert figure.data[0].name == "default"
    ip.run_line_magic("dt_bandwidth", "--min 1K --max 64K --iters 5 --dtype bfloat16 --label bf16")
    compared = ip.run_line_magic("dt_bandwidth", "--compare")
    assert [t.name for t in compared.data][-2:] == ["default", "bf16"]
    assert "bf16 vs" in capsys.readouterr().out
    with pytest.raises(UsageError, match="min_bytes <= max_bytes"):
        ip.run_line_magic("dt_bandwidth", "--min 1M --max 1K")
