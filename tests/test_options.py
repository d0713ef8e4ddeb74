"""Launch options declared once (``LaunchOptions``): ``%dt_launch``'s flags and
``dtlab.launch``'s keywords come from the same fields, and a refused value becomes a
UsageError in one place (``views/magic_support.py: dtlab_magics``), while any other error,
a ValueError from a bug included, passes through unchanged. No cluster is started."""

from __future__ import annotations

import ast
import inspect
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

import dtlab
from dtlab.analysis.partition import PlanError
from dtlab.control.config import LaunchOptions, launch_config
from dtlab.control.errors import DtlabError, OptionError
from dtlab.control.options import flag_of
from dtlab.records.errors import InputError
from dtlab.views.magic_support import dtlab_magics

PYTHON_ONLY = {"launcher_config"}


def words(text: str) -> str:
    return " ".join(text.split())


def launch_actions(ip) -> dict:
    """The argparse actions of %dt_launch, by the name their value lands under."""
    parser = ip.find_line_magic("dt_launch").parser
    return {action.dest: action for action in parser._actions}


def test_every_option_is_a_flag_of_the_magic_with_its_help_and_default(ip):
    actions = launch_actions(ip)
    assert set(actions) == {f.name for f in fields(LaunchOptions)} - PYTHON_ONLY
    for f in fields(LaunchOptions):
        if f.name in PYTHON_ONLY:
            assert flag_of(f) is None
            continue
        action = actions[f.name]
        assert action.help == f.metadata["help"]
        if f.name == "num_ranks":
            assert action.option_strings == [] and action.required  # the positional N
        else:
            assert action.option_strings == [flag_of(f)]
            expected = list(f.default) if isinstance(f.default, tuple) else f.default
            assert action.default == expected
    doc = words(ip.find_line_magic("dt_launch").__doc__)  # what %dt_launch? shows
    for f in fields(LaunchOptions):
        if f.name not in PYTHON_ONLY:
            assert words(f.metadata["help"]) in doc, f.name


def test_the_existing_flags_keep_their_names(ip):
    flags = {a for action in launch_actions(ip).values() for a in action.option_strings}
    assert flags >= {
        "--backend",
        "--launcher",
        "--timeout",
        "--threads",
        "--env",
        "--port",
        "--pg-timeout",
        "--hosts",
        "--partition",
        "--sbatch-arg",
        "--listen",
        "--restart",
        "--force",
    }


def test_dtlab_launch_takes_the_same_options_as_keywords():
    params = inspect.signature(dtlab.launch).parameters
    names = [f.name for f in fields(LaunchOptions)]
    assert list(params) == [*names, "progress"]
    assert params["num_ranks"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for f in fields(LaunchOptions):
        if f.default is not MISSING:
            assert params[f.name].default == f.default
    doc = words(inspect.getdoc(dtlab.launch))
    for f in fields(LaunchOptions):
        if f.name != "num_ranks":
            assert f"{f.name}=" in doc and words(f.metadata["help"]) in doc, f.name
    # the keywords notebooks and tests have always used are still there
    assert {"timeout", "pg_timeout", "sbatch_args", "launcher_config", "force"} <= set(params)


def test_an_unknown_keyword_names_the_options_before_anything_starts():
    with pytest.raises(TypeError, match=r"unknown option 'bakend' \(did you mean 'backend'\?\)"):
        dtlab.launch(2, bakend="gloo")
    with pytest.raises(TypeError, match="its options are num_ranks, backend, launcher"):
        dtlab.launch(2, pg_timeout_s=5)


def test_the_magic_and_python_make_the_same_config(ip):
    line = (
        "4 --launcher slurm --partition gpu --sbatch-arg=--cpus-per-task=1 --env A=1 B=x=y "
        "--pg-timeout 30 --timeout 5 --threads 2"
    )
    args = parse_argstring(ip.find_line_magic("dt_launch"), line)
    from_magic = launch_config(LaunchOptions(**vars(args)))
    from_python = launch_config(
        LaunchOptions(
            num_ranks=4,
            launcher="slurm",
            partition="gpu",
            sbatch_args=("--cpus-per-task=1",),
            env={"A": "1", "B": "x=y"},
            pg_timeout=30,
            timeout=5,
            threads=2,
        )
    )
    assert from_magic == from_python
    assert from_magic.timeout_s == 5.0 and from_magic.pg_timeout_s == 30.0
    assert "--cpus-per-task=1" in str(from_magic.launcher_config)


@pytest.mark.parametrize(
    "line, message",
    [
        ("2 --backend foo", "unknown backend 'foo'; choose one of auto, gloo, nccl"),
        ("2 --timeout 0", "argument --timeout: a timeout must be a positive number of seconds"),
        ("2 --pg-timeout -5", "argument --pg-timeout: a timeout must be a positive number"),
        ("2 --timeout soon", "must be a positive number of seconds, got 'soon'"),
        ("2 --listen no-such-nic0", "neither an IPv4 address nor an interface"),
        ("2 --sbatch-arg cpus", "bad --sbatch-arg 'cpus'"),
        ("2 --launcher ssh --hosts node1:x", "bad --hosts item 'node1:x'"),
    ],
)
def test_a_bad_value_through_the_magic_is_a_usage_error_with_the_check_s_words(ip, line, message):
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("dt_launch", line)
    assert message in str(refused.value)


def test_refusals_are_value_errors_and_dtlab_errors():
    assert issubclass(OptionError, ValueError) and issubclass(OptionError, DtlabError)
    assert issubclass(OptionError, InputError) and issubclass(PlanError, InputError)
    with pytest.raises(OptionError, match="unknown backend"):
        launch_config(LaunchOptions(num_ranks=2, backend="mpi"))


@dtlab_magics
class _Probe(Magics):
    @line_magic
    @magic_arguments()
    @argument("what")
    def dt_probe_refusal(self, line):
        what = parse_argstring(self.dt_probe_refusal, line).what  # the parser survives
        if what == "option":
            raise OptionError("--x must be 1")
        if what == "plan":
            raise PlanError("stage 1 is empty")
        if what == "bug":
            raise ValueError("a bug in dtlab, not the user's input")
        return what


def test_only_refusals_become_usage_errors(ip):
    ip.register_magics(_Probe)
    assert ip.run_line_magic("dt_probe_refusal", "fine") == "fine"
    with pytest.raises(UsageError, match="--x must be 1"):
        ip.run_line_magic("dt_probe_refusal", "option")
    with pytest.raises(UsageError, match="stage 1 is empty"):
        ip.run_line_magic("dt_probe_refusal", "plan")
    with pytest.raises(ValueError, match="a bug in dtlab") as bug:
        ip.run_line_magic("dt_probe_refusal", "bug")
    assert not isinstance(bug.value, UsageError)
    with pytest.raises(UsageError, match="required: what"):  # argparse's own, as before
        ip.run_line_magic("dt_probe_refusal", "")


def test_every_dtlab_magic_goes_through_the_one_place(ip):
    magics = ip.magics_manager.magics
    ours = [
        (name, fn)
        for kind in ("line", "cell")
        for name, fn in magics[kind].items()
        if getattr(fn, "__module__", "").startswith("dtlab.")
    ]
    assert len(ours) > 20
    for name, fn in ours:
        assert fn.__func__.__qualname__.endswith(name) and hasattr(fn, "__wrapped__"), name


def test_no_view_dresses_whatever_value_error_came_as_a_usage_error():
    """``except ValueError as e: raise UsageError(str(e))`` is gone: it showed a bug's
    ValueError as the user's mistake. Refusals are OptionError (InputError in analysis/),
    shown by dtlab_magics; a view may still say in its own words that text it parsed is
    not a number (comm_magics.parse_size)."""
    found = []
    for path in sorted((Path(dtlab.__file__).parent / "views").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ExceptHandler) or node.name is None:
                continue
            dressed = f"UsageError(str({node.name}))"
            raised = [
                ast.unparse(n.exc) for n in ast.walk(node) if isinstance(n, ast.Raise) and n.exc
            ]
            if "ValueError" in ast.unparse(node.type) and dressed in raised:
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], "raise OptionError where the value is checked instead"
