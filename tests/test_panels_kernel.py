"""A panel still live when its kernel restarts or shuts down turns into text first, in a
real kernel driven over its own protocol (jupyter_client): what a notebook saved after
the restart holds. The browser test checks the same in JupyterLab."""

from __future__ import annotations

import time

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(300)

PANEL = """import ipywidgets
from dtlab.views.panels import Panel
panel = Panel()
panel.widget = ipywidgets.Label("live")
panel"""


def _display_id(client, msg_id: str, deadline: float) -> str:
    """The display id the panel was shown under (its cell's display_data), once the cell
    is over (the kernel idle again)."""
    shown = None
    while time.monotonic() < deadline:
        msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "display_data":
            shown = msg["content"]["transient"]["display_id"]
        elif msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            assert shown is not None, "the panel was never displayed"
            return shown
    raise AssertionError("the cell never ended")


@pytest.mark.parametrize("restart", [True, False])
def test_a_live_panel_becomes_text_when_the_kernel_goes(restart):
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        deadline = time.monotonic() + 120
        shown = _display_id(client, client.execute(PANEL), deadline)
        client.shutdown(restart=restart)
        while time.monotonic() < deadline:
            msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["msg_type"] == "update_display_data":
                assert msg["content"]["transient"]["display_id"] == shown
                text = msg["content"]["data"]["text/plain"]
                why = "restarted" if restart else "shut down"
                assert text == f"panel closed: the kernel was {why}", text
                return
            if msg["msg_type"] == "shutdown_reply":  # the kernel goes: what it sent still
                deadline = min(deadline, time.monotonic() + 10)  # arrives, in any order
        raise AssertionError("no update of the panel's output before the kernel went")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
