"""What a person sees: JupyterLab in a real headless Chromium, driven by playwright.

Starts JupyterLab on localhost (a copy of the quick start in a private folder, autosave
off), opens it in Debian's chromium (``executable_path``; no browser is downloaded), runs
it as a person would (Run All Above the shutdown cell), then clicks the dashboard's Step
button, opens the partition editor on a pipeline, moves a boundary and clicks Apply, and
opens ``dt.report()``'s HTML file in the same browser. Screenshots go to
``$DTLAB_SCREENSHOTS`` (default ``docs/gallery/``, tracked: docs/gallery.md shows them).
Without chromium the test is skipped with the reason, unless ``DTLAB_REQUIRE_BROWSER=1``
(``.ci/run`` sets it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from dtlab.control.cluster import running

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# docs/gallery.md shows these: kept in git, so a page on a code host shows them; every run
# writes them afresh (a changed image is a diff to look at, never a failure)
SCREENSHOTS = Path(os.environ.get("DTLAB_SCREENSHOTS", ROOT / "docs" / "gallery"))
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PIPELINE_CELL = """%dt_demo --pipeline --microbatches 2 --set num_layers=6
%dt_step 2
editor = dt.partition_editor()
editor"""
REPORT_CELL = 'report = dt.report("report.html")\nprint(report)'
PLOTS = ("%dt_plot memory", "%dt_plot times", "%dt_plot spread")  # besides loss, deviation
CHECKPOINT_CELL = "%dt_checkpoint\ndt.checkpoint_browser()"
# the pipeline's balance and schedule, the doctor's table of every check, a bandwidth sweep
VIEWS = (
    ("%dt_partition", "09-balance.png"),
    ("%dt_partition --schedule", "10-schedule.png"),
    ("%dt_doctor --explain", "11-doctor.png"),
    ("%dt_bandwidth --max 256K --iters 2", "12-bandwidth.png"),
)
# per graph: tick labels ellipsized, outside the graph or over one another; legends outside
# the graph or over a tick label or another legend. A tilted tick label is its rotated box
# (four corners on the page; two boxes overlap unless an edge of one separates them), since
# the upright boxes of neighbouring tilted labels overlap where the letters do not.
TICKS_AND_LEGENDS_JS = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .flatMap(gd => {
    const box = gd.getBoundingClientRect(), bad = [];
    const corners = n => { const b = n.getBBox(), m = n.getScreenCTM();
      return [[b.x, b.y], [b.x + b.width, b.y], [b.x + b.width, b.y + b.height],
              [b.x, b.y + b.height]].map(([x, y]) => new DOMPoint(x, y).matrixTransform(m)); };
    const apart = (p, q) => [p, q].some(poly => poly.some((a, i) => {
      const b = poly[(i + 1) % 4], nx = b.y - a.y, ny = a.x - b.x;
      const side = pts => pts.map(c => (c.x - a.x) * nx + (c.y - a.y) * ny);
      const s = side(p), t = side(q), sq = Math.hypot(nx, ny);
      return Math.min(...s) >= Math.max(...t) - sq || Math.min(...t) >= Math.max(...s) - sq;
    }));
    const inside = poly => poly.every(c => c.x >= box.left - 1 && c.x <= box.right + 1
      && c.y >= box.top - 1 && c.y <= box.bottom + 1);
    const drawn = nodes => nodes.map(n => [n.textContent, corners(n)])
      .filter(([_, p]) => p[2].x !== p[0].x && p[2].y !== p[0].y);
    const ticks = drawn([...gd.querySelectorAll('.xtick text, .ytick text')]);
    const legends = drawn([...gd.querySelectorAll('g.legend .bg')]);
    ticks.forEach(([t, p], i) => {
      if (t.includes('\\u2026')) bad.push(['ellipsized tick', t]);
      if (!inside(p)) bad.push(['tick outside the graph', t]);
      ticks.slice(i + 1).filter(([_, q]) => !apart(p, q))
        .forEach(([u]) => bad.push(['ticks overlap', t, u])); });
    legends.forEach(([t, p], i) => {
      if (!inside(p)) bad.push(['legend outside the graph', i]);
      ticks.filter(([_, q]) => !apart(p, q)).forEach(([u]) => bad.push(['legend over tick', u]));
      legends.slice(i + 1).filter(([_, q]) => !apart(p, q))
        .forEach(() => bad.push(['legends overlap'])); });
    return bad; })"""
VIEWPORT = {"width": 1280, "height": 900}  # a laptop's screen: what must fit, fits here

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]
# every wait is on a condition; this only bounds a failure (a machine with a load average
# of 20-30 on 2 cores takes minutes to start JupyterLab or draw a figure)
WAIT_S = float(os.environ.get("DTLAB_BROWSER_WAIT_S", 300))


def _browser_available() -> None:
    if Path(CHROMIUM).exists():
        return
    why = f"no {CHROMIUM}: apt-get install chromium (.ci/run does)"
    if os.environ.get("DTLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _settings(folder: Path) -> None:
    """Autosave off (it would rewrite the notebook under test), no news requests."""
    docs = folder / "@jupyterlab" / "docmanager-extension"
    docs.mkdir(parents=True)
    (docs / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    # every cell rendered, not only those in view (JupyterLab 4 windows long notebooks)
    tracker = folder / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    news = folder / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving a private copy of the notebooks."""
    _browser_available()
    home = tmp_path_factory.mktemp("lab")
    work = home / "work"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", work)
    _settings(home / "settings")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ServerApp.ip=127.0.0.1",
        "--ServerApp.token=",
        "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        f"--ServerApp.root_dir={work}",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(
            lambda: urllib.request.urlopen(f"{url}/api/status", timeout=2).status == 200,
            WAIT_S,
            f"JupyterLab did not start; see {home / 'server.log'}",
        )
        yield url, work
    finally:
        started = [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()
        # processes still exiting are not left behind: on a busy machine an engine's exit
        # can take seconds after the cluster was told to stop; wait for them, bounded
        procs = [p for p in map(_process, started) if p is not None]
        _, alive = psutil.wait_procs(procs, timeout=30)
        left = [p.pid for p in alive if p.pid in running([p.pid])]
        for pid in left:  # the cluster runs in sessions of its own: stop it by pid
            os.kill(pid, signal.SIGKILL)
        assert left == [], f"processes left behind by the notebook: {left}"


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _wait_for(probe, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(message)


class Lab:
    """The notebook panel open in the page, driven through JupyterLab's own commands."""

    def __init__(self, page, errors: list[str] | None = None):
        self.page = page
        self.errors = errors if errors is not None else []  # the page's console errors

    def wait_for_kernel(self) -> None:
        self.page.wait_for_function(
            """() => {
            const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session
                      && w.sessionContext.session.kernel;
            return k && k.connectionStatus === 'connected' && k.status === 'idle'; }""",
            timeout=WAIT_S * 1000,
        )

    def run(self, command: str, index: int) -> None:
        """Make cell ``index`` active and run a notebook command from there."""
        self.page.evaluate(f"""() => {{
            const app = window.jupyterapp, nb = app.shell.currentWidget.content;
            nb.activeCellIndex = {index};
            app.commands.execute('{command}'); }}""")

    def insert_and_run(self, index: int, source: str) -> None:
        """A new cell below ``index`` holding ``source``, run (as typed and Shift-Enter)."""
        self.page.evaluate(f"""async () => {{
            const app = window.jupyterapp, nb = app.shell.currentWidget.content;
            nb.activeCellIndex = {index};
            await app.commands.execute('notebook:insert-cell-below');
            nb.activeCell.model.sharedModel.setSource({json.dumps(source)});
            app.commands.execute('notebook:run-cell'); }}""")
        self.wait_until_ran(index + 1)

    def wait_until_ran(self, index: int, timeout_s: float = 2 * WAIT_S) -> None:
        self.page.wait_for_function(
            f"""() => {{
            const w = window.jupyterapp.shell.currentWidget, cell = w.content.widgets[{index}];
            return cell.model.executionCount !== null && !cell.node.classList.contains(
                'jp-mod-pending') && w.sessionContext.session.kernel.status === 'idle'; }}""",
            timeout=timeout_s * 1000,
        )

    def cell_text(self, index: int) -> str:
        """The text of a cell's outputs, from the notebook model (what the kernel sent)."""
        return self.page.evaluate(f"""() => window.jupyterapp.shell.currentWidget.content
            .widgets[{index}].model.outputs.toJSON().map(o => {{
                const t = o.text || (o.data && o.data['text/plain']) || '';
                return Array.isArray(t) ? t.join('') : t; }}).join('')""")

    def num_cells(self) -> int:
        return self.page.evaluate(
            "() => window.jupyterapp.shell.currentWidget.content.widgets.length"
        )

    def plots(self) -> list[dict]:
        """Every rendered plotly graph: its traces' point counts and its title."""
        return self.page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
            .map(gd => ({points: (gd.data || []).map(t => (t.x || []).length),
                         title: ((gd.layout || {}).title || {}).text || ''}))""")

    def wait_for_plots(self, at_least: int, timeout_s: float = WAIT_S) -> None:
        """Until ``at_least`` plotly graphs are drawn, each with data and a title (a busy
        machine draws late; the message says what the page held when time ran out)."""
        from playwright.sync_api import TimeoutError as PageTimeout

        try:
            self.page.wait_for_function(
                f"""() => {{ const gds = [...document.querySelectorAll('.js-plotly-plot')];
                return gds.length >= {at_least} && gds.every(gd => (gd.data || []).length > 0
                    && ((gd.layout || {{}}).title || {{}}).text); }}""",
                timeout=timeout_s * 1000,
            )
        except PageTimeout:
            raise AssertionError(
                f"wanted {at_least} drawn graphs, saw {self.plots()}; console: {self.errors}"
            ) from None

    def check_figures_fit(self) -> None:
        """Every graph's title (and subtitle) lies inside its graph: nothing clipped; no
        title, subtitle or note lies over another; tick labels and legends fit (below)."""
        outside = self.page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
            .flatMap(gd => { const box = gd.getBoundingClientRect();
              return [...gd.querySelectorAll('.gtitle, .gtitle-subtitle')].filter(t => {
                const r = t.getBoundingClientRect();
                return r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1); })
              .map(t => t.textContent); })""")
        assert outside == [], f"titles wider than their figure: {outside}"
        # titles, subtitles and notes (annotations) of one figure never overlap each other
        overlaps = self.page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
            .flatMap(gd => { const texts = [...gd.querySelectorAll(
                '.gtitle, .gtitle-subtitle, .annotation-text-g')].map(t => [t.textContent,
                t.getBoundingClientRect()]).filter(([_, r]) => r.width > 0 && r.height > 0);
              return texts.flatMap(([a, r], i) => texts.slice(i + 1).filter(([_, q]) =>
                r.left < q.right - 1 && q.left < r.right - 1 && r.top < q.bottom - 1
                && q.top < r.bottom - 1).map(([b]) => [a, b])); })""")
        assert overlaps == [], f"texts drawn over each other: {overlaps}"
        self.check_ticks_and_legends_fit()

    def check_ticks_and_legends_fit(self) -> None:
        """Every graph's tick labels are whole (none cut to an ellipsis), inside the graph
        and apart from each other; every legend lies inside its graph and over no tick
        label or other legend."""
        bad = self.page.evaluate(TICKS_AND_LEGENDS_JS)
        assert bad == [], f"tick labels or legends that do not fit: {bad}"

    def show_output(self, index: int) -> None:
        """Scroll cell ``index``'s output to the top of the window (for its screenshot)."""
        self.page.evaluate(f"""() => window.jupyterapp.shell.currentWidget.content
            .widgets[{index}].outputArea.node.scrollIntoView({{block: 'start'}})""")

    def shot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / name), full_page=True)


def test_quickstart_dashboard_editor_and_report_in_a_real_browser(lab):
    from playwright.sync_api import sync_playwright

    url, work = lab
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT_S * 1000)  # clicks and locators too
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/lab/tree/01_quickstart.ipynb?reset")
            nb = Lab(page, errors)
            nb.wait_for_kernel()
            _run_the_quickstart(nb)
            _step_from_the_dashboard(nb, page)
            _every_plot_kind_and_the_checkpoint_browser(nb)
            _move_a_boundary_in_the_editor(nb, page)
            _balance_schedule_doctor_and_bandwidth(nb)
            _open_the_report(nb, browser, work, errors)
            shutdown = nb.num_cells() - 1  # %dt_shutdown, the quick start's last cell
            nb.run("notebook:run-cell", shutdown)
            nb.wait_until_ran(shutdown, WAIT_S)
            assert "stopped 8 ranks" in nb.cell_text(shutdown)
            _saved_restarted_and_reloaded(nb, page)
        finally:
            browser.close()
    assert errors == [], f"JavaScript errors in the console: {errors}"


def _run_the_quickstart(nb: Lab) -> None:
    last = nb.num_cells() - 1
    nb.run("notebook:run-all-above", last)  # everything but %dt_shutdown
    nb.wait_until_ran(last - 1)
    assert "8 ranks ready (gloo, local launcher)" in nb.cell_text(3)
    nb.show_output(3)  # the launch: its progress lines and the table of ranks
    nb.shot("01-quickstart-run.png")
    table = nb.page.locator(".jp-OutputArea-output table").filter(
        has=nb.page.locator("th", has_text="threads")
    )  # the launch's rank table, rendered
    assert table.count() >= 1 and table.first.locator("tbody tr").count() == 8
    nb.page.get_by_role("button", name="Step", exact=True).first.wait_for()
    nb.wait_for_plots(3)  # a busy machine draws late: wait on what the page shows
    nb.check_figures_fit()
    _dashboard_fits_the_window(nb.page)


def _step_from_the_dashboard(nb: Lab, page) -> None:
    status = page.locator(".widget-label", has_text="in ").filter(has_text="step")
    before = max(sum(p["points"]) for p in nb.plots())
    text = status.first.inner_text()  # the dashboard's last run, e.g. "steps 21-30 in ..."
    last = int(text.split("-")[1].split(" ")[0]) if text.startswith("steps") else 0
    page.get_by_role("button", name="Step", exact=True).first.click()
    page.locator(".widget-label", has_text=f"step {last + 1} in ").wait_for(timeout=WAIT_S * 1000)
    page.wait_for_function(
        f"""() => Math.max(...[...document.querySelectorAll(
        '.js-plotly-plot')].map(gd => gd.data.reduce((n, t) => n + (t.x || []).length, 0)))
        > {before}""",
        timeout=WAIT_S * 1000,
    )
    nb.shot("02-dashboard-after-step.png")


def _move_a_boundary_in_the_editor(nb: Lab, page) -> None:
    at = nb.num_cells() - 2  # below the last cell before %dt_shutdown
    nb.insert_and_run(at, PIPELINE_CELL)
    assert "pipeline attached on 8 ranks" in nb.cell_text(at + 1)
    readout = page.locator(".widget-hslider", has_text="stage 1 from").locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    page.locator(".widget-html", has_text="would move").wait_for(timeout=WAIT_S * 1000)
    page.locator(".widget-html", has_text="would move").scroll_into_view_if_needed()
    nb.shot("05-editor-draft.png")
    page.get_by_role("button", name="Apply", exact=True).click()
    page.locator(".widget-html", has_text="moved 1 block(s)").wait_for(timeout=WAIT_S * 1000)
    page.wait_for_function(
        """() => [...document.querySelectorAll('.js-plotly-plot')]
        .some(gd => ((gd.layout.title || {}).text || '').startsWith('Measured'))""",
        timeout=WAIT_S * 1000,
    )
    page.locator(".widget-html", has_text="moved 1 block(s)").scroll_into_view_if_needed()
    nb.check_figures_fit()  # the measured balance's title with its numbers (once clipped)
    nb.shot("06-editor-applied.png")


def _balance_schedule_doctor_and_bandwidth(nb: Lab) -> None:
    """Each view in a cell of its own, drawn with data and a title that fits, shot."""
    at = nb.num_cells() - 2
    for line, name in VIEWS:
        drawn = len(nb.plots())
        nb.insert_and_run(at, line)
        at += 1
        nb.show_output(at)
        if not line.startswith("%dt_doctor"):
            nb.wait_for_plots(drawn + 1)
            nb.check_figures_fit()
        if line == "%dt_partition":  # the table above fills the window: show the figure
            nb.page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
                .pop().scrollIntoView({block: 'end'})""")
        nb.shot(name)
        if line == "%dt_partition --schedule":
            # every micro-batch number drawn in a bar is readable (too-short bars show
            # none; plotly shrinks text to fit otherwise)
            sizes = nb.page.evaluate("""() => { const gds = [...document.querySelectorAll(
                '.js-plotly-plot')]; return [...gds[gds.length - 1].querySelectorAll(
                '.bartext')].map(t => parseFloat(getComputedStyle(t).fontSize)); }""")
            assert sizes and min(sizes) >= 10, sizes
    doctor = nb.page.locator(".dtlab-table", has=nb.page.locator("th", has_text="looked at"))
    doctor.first.wait_for()
    prose = doctor.first.locator("td")
    assert prose.count() > 10
    aligned = {prose.nth(i).evaluate("td => getComputedStyle(td).textAlign") for i in range(5)}
    assert aligned == {"left"}, aligned  # JupyterLab right-aligns cells unless told


def _open_the_report(nb: Lab, browser, work: Path, errors: list[str]) -> None:
    at = nb.num_cells() - 2
    nb.insert_and_run(at, REPORT_CELL)
    report = work / "report.html"
    assert report.exists(), nb.cell_text(at + 1)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("console", lambda m: m.type == "error" and errors.append(f"report: {m.text}"))
    page.on("pageerror", lambda e: errors.append(f"report: {e}"))
    page.goto(report.as_uri())
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length > 0")
    drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
        .map(gd => gd.querySelectorAll('.trace, .barlayer .point, .scatterlayer path').length)""")
    assert drawn and all(n > 0 for n in drawn), drawn
    Lab(page, errors).check_figures_fit()
    page.screenshot(path=str(SCREENSHOTS / "07-report.png"), full_page=True)
    page.close()


def _dashboard_fits_the_window(page) -> None:
    """Scrolled to its top, the dashboard shows its buttons and its whole figure at once."""
    panel = page.locator(".widget-vbox", has=page.get_by_role("button", name="Pause")).first
    panel.evaluate("node => node.scrollIntoView({block: 'start'})")
    box = panel.bounding_box()
    assert box is not None and box["height"] <= VIEWPORT["height"], box
    pause = page.get_by_role("button", name="Pause").first
    assert pause.is_disabled()  # idle: nothing to pause
    klass = pause.get_attribute("class") or ""
    assert "mod-warning" not in klass, klass  # not orange while idle


def _every_plot_kind_and_the_checkpoint_browser(nb: Lab) -> None:
    before = len(nb.plots())
    at = nb.num_cells() - 2
    for line in PLOTS:  # a cell shows its last value only: one cell each
        nb.insert_and_run(at, line)
        at += 1
    nb.wait_for_plots(before + len(PLOTS))
    nb.check_figures_fit()
    nb.shot("03-plots.png")
    nb.insert_and_run(at, CHECKPOINT_CELL)
    assert "checkpoint of step " in nb.cell_text(at + 1), nb.cell_text(at + 1)
    nb.page.get_by_role("button", name="Replay from here").first.wait_for()
    nb.wait_for_plots(before + len(PLOTS) + 1)
    nb.shot("04-checkpoint-browser.png")


def _saved_restarted_and_reloaded(nb: Lab, page) -> None:
    """Save, restart the kernel, reload the page: every output still reads (progress bars
    and panels left text behind), none says 'Error displaying widget'."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.restartKernel()")
    page.reload()
    nb.wait_for_kernel()
    page.wait_for_function(
        "() => document.querySelectorAll('.jp-OutputArea-output').length > 10",
        timeout=WAIT_S * 1000,
    )
    nb.shot("08-reloaded.png")
    broken = page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output')]
        .map(o => o.textContent).filter(t => t.includes('Error displaying widget')
                                             || t.includes('Error creating widget'))""")
    assert broken == [], f"outputs that no longer display after a restart: {broken}"
