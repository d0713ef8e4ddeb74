"""What a live rank imports: after a session that used every kind of request (a job,
stepping, the doctor, checkpoints, a pipeline move, a script, the sidecar, a bandwidth
sweep), a rank holds no notebook-side dtlab module. ipyparallel ships a function by
reference, so an engine imports whatever module a function shipped to it lives in: this
test is what keeps rank code in agent/ (dtlab/agent/api.py lists the requests)."""

from __future__ import annotations

import ast

import pytest

import dtlab
from tests.conftest import quiet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# what a rank may hold besides the package itself: rank code, the records it sends, and
# pure analysis both sides share (torch-free, notebook-library-free: plans, rank labels)
RANK_SIDE = (
    "dtlab.agent",
    "dtlab.records",
    "dtlab.analysis",
)
# the engines are forked from dtlab.control.forkserver (run as __main__): its empty
# package comes with them, nothing of its modules
FORKED_WITH = {"dtlab", "dtlab.control"}
PROBE = "sorted(m for m in sys.modules if m.startswith('dtlab'))"


def test_a_rank_holds_only_rank_side_modules_after_a_full_session(cluster_cleanup, tmp_path):
    dt = dtlab.launch(2, progress=quiet)
    dtlab.demo.attach(dt)
    dt.step(2)
    dt.doctor()
    dt.checkpoint()
    dt.load_checkpoint("latest")
    dt.hang_report()
    dt.bandwidth_sweep(min_bytes=1024, max_bytes=4096, iters=2, warmup=1)
    dtlab.demo.attach_pipeline(dt, microbatches=2)
    dt.step(1)
    dt.balance()
    dt.repartition("parameters")
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    opt.step()\n"
    )
    dt.run_script(str(script))
    dt.step(1)
    dt.continue_script()
    # a code string: a function defined here would make the ranks import this test module
    held = {r: ast.literal_eval(o.result) for r, o in dt.execute("import sys\n" + PROBE).items()}
    for rank, modules in held.items():
        others = [m for m in modules if m not in FORKED_WITH and not m.startswith(RANK_SIDE)]
        assert others == [], f"rank {rank} imported notebook-side modules: {others}"
        assert "dtlab.agent.api" in modules  # the requests came through it
