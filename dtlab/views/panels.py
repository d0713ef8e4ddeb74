"""Panels that live while the ranks do (dashboard, partition editor, checkpoint browser).

A panel is an ipywidgets tree. Shown in a cell, it keeps a display handle; when the
session shuts down (``%dt_shutdown``, ``dt.shutdown()``) every panel is *retired*: its
output is replaced by a line of plain text saying what it last showed, and its widgets
are closed. A notebook saved afterwards holds text, never a widget whose model is gone
once the kernel restarts (JupyterLab shows such an output as "Error displaying widget:
model not found"). Progress bars do the same when their cell ends (views/progress.py).
"""

from __future__ import annotations

_LIVE: list[Panel] = []  # shown and not retired


class Panel:
    """Base of dtlab's widget panels: ``self.widget`` is the tree to show."""

    widget = None
    title = "panel"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self._handle = display(self.widget, display_id=True)
        _LIVE.append(self)

    def _repr_mimebundle_(self, **kwargs):  # shown by other means (e.g. nbconvert)
        return self.widget._repr_mimebundle_(**kwargs)

    def last_said(self) -> str:
        """What the panel last showed, in a few words (its status line by default)."""
        status = getattr(self, "status", None)
        return _plain(getattr(status, "value", "")) if status is not None else ""

    def retire(self, why: str = "the session was shut down") -> None:
        """Replace the shown panel by text and close its widgets (once)."""
        if self in _LIVE:
            _LIVE.remove(self)
        handle = getattr(self, "_handle", None)
        if handle is not None:
            said = self.last_said()
            text = f"{self.title} closed: {why}" + (f"; it last said: {said}" if said else "")
            handle.update({"text/plain": text}, raw=True)
            self._handle = None
        _close_tree(self.widget)


def retire_panels(why: str = "the session was shut down") -> int:
    """Retire every live panel; returns how many there were."""
    panels = list(_LIVE)
    for panel in panels:
        panel.retire(why)
    return len(panels)


def _close_tree(widget) -> None:
    for child in getattr(widget, "children", ()) or ():
        _close_tree(child)
    close = getattr(widget, "close", None)
    if close is not None:
        close()


def _plain(value: str) -> str:
    """A status that may be HTML, as one line of text."""
    import html
    import re

    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", value)).split())
