"""The magics reference (docs/magics.md), built from the magics themselves.

Every magic the extension registers, found by running ``register`` (what
``%load_ext dtlab`` runs) against a stand-in shell that records ``register_magics``; for
each, the first paragraph of its docstring and the argparse parser IPython's
``magic_arguments`` attached to it (``fn.parser``, whatever declared the arguments), so the
reference says what the parser accepts and cannot drift from it.

    python -m dtlab.views.magic_reference > docs/magics.md

``tests/test_docs.py`` checks that docs/magics.md is what this prints.
"""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import dataclass, field

WIDTH = 88  # usage lines are wrapped here, whatever the terminal's width

HEADER = """\
# Magics reference

Every dtlab magic, its arguments and their defaults, generated from the magics' own
argument parsers and docstrings: do not edit by hand. After changing a magic, run
`python -m dtlab.views.magic_reference > docs/magics.md` (`tests/test_docs.py` checks
that this file is current). What the magics are for, with examples: the guides linked
from the [README](../README.md#magics).
"""


@dataclass
class MagicDoc:
    name: str
    kinds: set[str] = field(default_factory=set)  # "line", "cell"
    function: object = None

    @property
    def parser(self) -> argparse.ArgumentParser | None:
        return getattr(self.function, "parser", None)

    @property
    def heading(self) -> str:
        return f"%%{self.name}" if "cell" in self.kinds else f"%{self.name}"


class _Anything:
    """Accepts any attribute, call or item: the parts of the shell ``register`` touches
    besides ``register_magics`` (display formatters, ...)."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self


class _RecordingShell(_Anything):
    def __init__(self) -> None:
        self.registered: list[type] = []

    def register_magics(self, *magics) -> None:
        self.registered.extend(m if isinstance(m, type) else type(m) for m in magics)


def registered_magic_classes() -> list[type]:
    """The Magics classes ``%load_ext dtlab`` registers, in its order."""
    import dtlab

    shell = _RecordingShell()
    dtlab.load_ipython_extension(shell)
    return shell.registered


def registered_magics() -> dict[str, MagicDoc]:
    """{name: MagicDoc} of every registered magic, line and cell forms merged."""
    found: dict[str, MagicDoc] = {}
    for cls in registered_magic_classes():
        for kind, table in getattr(cls, "magics", {}).items():
            for name, method in table.items():
                doc = found.setdefault(name, MagicDoc(name))
                doc.kinds.add(kind)
                doc.function = getattr(cls, method)
    return dict(sorted(found.items()))


def summary(magic: MagicDoc) -> str:
    """The first paragraph of the magic's own docstring, on one line. (With
    ``magic_arguments`` the docstring is the parser's description; IPython replaces the
    function's ``__doc__`` with the full help.)"""
    parser = magic.parser
    text = parser.description if parser is not None else magic.function.__doc__
    text = inspect.cleandoc(text or "")
    return " ".join(text.split("\n\n")[0].split())


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices is not None:
        choices = action.choices
        if isinstance(choices, set | frozenset):
            choices = sorted(choices, key=str)
        return "{" + ",".join(str(c) for c in choices) + "}"
    return action.dest.upper()


def _values(action: argparse.Action) -> str:
    """What follows the flag (or stands for a positional), as argparse writes it."""
    mv = _metavar(action)
    nargs = action.nargs
    if nargs is None:
        return mv
    if nargs == argparse.OPTIONAL:
        return f"[{mv}]"
    if nargs == argparse.ZERO_OR_MORE:
        return f"[{mv} ...]"
    if nargs == argparse.ONE_OR_MORE:
        return f"{mv} [{mv} ...]"
    if nargs == argparse.REMAINDER:
        return f"[{mv} ...]"
    if isinstance(nargs, int):
        return " ".join([mv] * nargs)
    return mv


def argument_form(action: argparse.Action) -> str:
    """``--backend BACKEND``, ``--restart``, ``NUM_RANKS``, ``[LAST]``."""
    if not action.option_strings:
        return _values(action)
    flag = max(action.option_strings, key=len)
    return flag if action.nargs == 0 else f"{flag} {_values(action)}"


def usage(magic: MagicDoc) -> str:
    """One usage line, wrapped at WIDTH: positionals first, unless one of them takes the
    rest of the line (then options must come before them, as argparse parses)."""
    prog = magic.heading
    parser = magic.parser
    if parser is None:
        return prog
    actions = _visible(parser)
    positionals = [a for a in actions if not a.option_strings]
    optionals = [f"[{argument_form(a)}]" for a in actions if a.option_strings]
    positional = [argument_form(a) for a in positionals]
    if any(a.nargs == argparse.REMAINDER for a in positionals):
        parts = optionals + positional
    else:
        parts = positional + optionals
    lines, line = [], prog
    for part in parts:
        if len(line) + 1 + len(part) > WIDTH and line.strip():
            lines.append(line)
            line = " " * len(prog)
        line += " " + part
    lines.append(line)
    return "\n".join(lines)


def default_text(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 and isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == argparse.SUPPRESS or default in ([], (), ""):
        return ""
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    text = str(default)
    if " at 0x" in text:  # an object's repr: says nothing and changes every run
        return ""
    return f"`{text}`"


def help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own placeholders and %% escapes, expanded as argparse does
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return " ".join(text.split())


def markdown(text: str, table: bool = True) -> str:
    """Plain text as Markdown: outside code spans, what Markdown would read as HTML or
    emphasis is escaped; in a table cell, pipes too (code spans included)."""
    out = []
    for i, part in enumerate(text.split("`")):
        if i % 2 == 0:
            part = part.replace("<", "&lt;").replace("*", r"\*")
        out.append(part.replace("|", r"\|") if table else part)
    return "`".join(out)


def anchor(magic: MagicDoc) -> str:
    """The heading's anchor as GitHub makes it: ``## %dt_launch`` -> ``dt_launch``."""
    return re.sub(r"[^\w\- ]", "", magic.heading.lower()).replace(" ", "-")


def section(magic: MagicDoc) -> str:
    kinds = {
        frozenset({"line"}): "Line magic.",
        frozenset({"cell"}): "Cell magic.",
        frozenset({"line", "cell"}): f"Cell magic; also a line magic, `%{magic.name}`.",
    }[frozenset(magic.kinds)]
    lines = [f"## {magic.heading}", "", f"{markdown(summary(magic), table=False)} {kinds}", ""]
    lines += ["```", usage(magic), "```", ""]
    parser = magic.parser
    actions = _visible(parser) if parser is not None else []
    if actions:
        lines += ["| argument | default | what it is |", "|---|---|---|"]
        for action in actions:
            form = markdown(f"`{argument_form(action)}`")
            help_ = markdown(help_text(action, magic.heading))
            lines.append(f"| {form} | {default_text(action)} | {help_} |")
        lines.append("")
    else:
        lines += ["No arguments.", ""]
    return "\n".join(lines)


def magic_reference() -> str:
    """docs/magics.md: an index of every magic, then a section per magic, by name."""
    magics = list(registered_magics().values())
    lines = [HEADER, "| magic | what it does |", "|---|---|"]
    for magic in magics:
        lines.append(f"| [`{magic.heading}`](#{anchor(magic)}) | {markdown(summary(magic))} |")
    lines.append("")
    return "\n".join(lines) + "\n" + "\n".join(section(m) for m in magics)


if __name__ == "__main__":
    print(magic_reference(), end="")
