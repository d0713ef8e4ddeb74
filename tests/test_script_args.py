"""The command line a user's script gets under %dt_script (no cluster: the rule alone)."""

from dtlab.agent.script import launcher_args

DECLARES = 'p.add_argument("--local_rank", type=int, default=-1)\n'


def test_a_deepspeed_command_line_gets_local_rank_as_the_deepspeed_launcher_passes_it(
    monkeypatch,
):
    monkeypatch.setenv("LOCAL_RANK", "3")
    args = ["--deepspeed", "--deepspeed_config", "ds.json"]
    assert launcher_args(DECLARES, args) == ["--local_rank=3", *args]
    assert launcher_args(DECLARES, ["--deepspeed_config=ds.json"])[0] == "--local_rank=3"
    dashed = "p.add_argument('--local-rank', type=int)"
    assert launcher_args(dashed, args)[0] == "--local-rank=3"


def test_other_command_lines_are_left_as_torchrun_leaves_them(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    plain = ["--lr", "3e-4"]
    assert launcher_args(DECLARES, plain) == plain  # no DeepSpeed options: torchrun's way
    given = ["--deepspeed", "--local_rank=0"]
    assert launcher_args(DECLARES, given) == given  # the user's own value stays
    undeclared = "p.add_argument('--deepspeed', action='store_true')"
    assert launcher_args(undeclared, ["--deepspeed"]) == ["--deepspeed"]  # argparse would refuse
