"""The course in a real browser (full tier): JupyterLab and the system's Chromium, driven by Playwright.

nbval runs every notebook with static widgets; these tests run, as a learner does (open, Run All), every notebook
that starts a memory panel or shows the pipeline playground, found by walking the notebooks, plus 00, 07 and 12,
with the live widgets on, and check in the page:
- every code cell ran (a number in its prompt) and none has an error output;
- every widget rendered (its JavaScript loaded: no text fallback, no "Error displaying widget");
- each memory panel draws a row per device, and per rank of each run where ranks report, rows with a height; its
  values change while its cell runs (at least one refresh between the first and the last drawing, so a panel that
  only draws at start and stop fails) and settle when it ends (no change later than SETTLE_S after its cell
  finished; the same at two moments a second apart);
- markdown headings render as headings (as many h1-h6 as the sources' '#' lines, and no paragraph that starts with
  '#');
- no JavaScript error in the console or the page;
- the pipeline playground: moving a slider, then the schedule, redraws the timeline.
Screenshots of each notebook at the end, and of each panel and the playground, go to SCREENSHOTS (results/browser,
or LAB_SCREENSHOTS), with timings.json: each notebook's time in the browser.

Skips, with the reason, where Playwright or a Chromium is missing; `.ci/install-browser` installs both, and CI
(LAB_REQUIRE_BROWSER=1) fails instead of skipping. The server, its kernels
and their ranks, and the browser are all stopped, pass or fail, and the last teardown fails if any is left.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from conftest import NOT_STRICT
from helpers.runtime.rig import detect_rig
from tests.lab_browser import JupyterLab, descendants, find_chromium, lab_env, left_behind

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = Path(os.environ.get("LAB_SCREENSHOTS", ROOT / "results" / "browser"))
REQUIRE_ENV = "LAB_REQUIRE_BROWSER"
ALWAYS = ("00", "07", "12")  # the three: the start, a run per rank, the biggest run
NOTEBOOK_TIMEOUT_S = 900  # one notebook's Run All; the slowest takes 85 s on a quiet 2-core machine
SETTLE_S = 5  # a panel's last drawing may reach the page after its cell's reply (another channel); not later than this
VIEWPORT = {"width": 1280, "height": 900}
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}(\s|$)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def starts_panel(source: str) -> bool:
    return "MemoryMonitor(" in source


def shows_playground(source: str) -> bool:
    return "Playground" in source and ".show()" in source


def browser_notebooks() -> list[Path]:
    """00, 07, 12 and every notebook whose code starts a memory panel or shows the playground."""
    return [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if p.name[:2] in ALWAYS or any(starts_panel(s) or shows_playground(s) for s in _code_cells(p))]


def source_headings(path: Path) -> int:
    """The ATX headings ('# Title') of the notebook's markdown cells, code fences left out."""
    count = 0
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if FENCE.match(line):
                fenced = not fenced
            elif not fenced and ATX_HEADING.match(line):
                count += 1
    return count


# --- the page's side ----------------------------------------------------------------------------------------------

NOTEBOOK = "window.jupyterapp.shell.currentWidget"
KERNEL_IDLE = ("() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel?.status"
               " === 'idle'")  # the app may not be exposed yet when the page has just loaded
PROMPTS = "Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')).map(e => e.textContent)"

# Every 100 ms, each panel's text when it changed, and when its cell was first seen finished (its prompt no longer
# '[*]'). A panel is keyed by its cell's index and its order in that cell.
SAMPLE_PANELS = """() => {
  window.labPanels = [];
  window.labEnded = {};
  const last = new Map();
  window.labSampler = setInterval(() => {
    const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'));
    const inCell = new Map();
    for (const panel of document.querySelectorAll('.lab-memory-panel')) {
      const cell = panel.closest('.jp-Cell');
      const index = cells.indexOf(cell), n = inCell.get(index) || 0;
      inCell.set(index, n + 1);
      const key = index + ':' + n, text = panel.innerText, t = performance.now();
      const running = cell.querySelector('.jp-InputPrompt').textContent.includes('*');
      if (!running && !(key in window.labEnded)) window.labEnded[key] = t;
      if (last.get(key) !== text) {
        last.set(key, text);
        window.labPanels.push({key, t, running, text});
      }
    }
  }, 100);
}"""

PANELS_NOW = """() => {
  const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'));
  return Array.from(document.querySelectorAll('.lab-memory-panel')).map(panel => ({
    cell: cells.indexOf(panel.closest('.jp-Cell')),
    text: panel.innerText,
    rows: Array.from(panel.querySelectorAll('.lab-memory-row')).map(row => ({
      label: row.querySelector('.lab-memory-label').textContent,
      height: row.getBoundingClientRect().height})),
  }));
}"""

# From the notebook's model in the page: each code cell's execution count and the types of its outputs; and each
# widget output as drawn: JupyterLab falls back to the widget's text ('HTML(value=...)') where the widgets' JavaScript
# did not load, or shows 'Error displaying widget'. (A widget closed by its code, such as tqdm's, draws nothing.)
CELLS = f"""() => {{
  const model = {NOTEBOOK}.content.model, cells = [];
  const drawn = document.querySelectorAll('.jp-Notebook .jp-Cell');
  const WIDGET = 'application/vnd.jupyter.widget-view+json';
  for (let i = 0; i < model.cells.length; i++) {{
    const cell = model.cells.get(i);
    if (cell.type !== 'code') continue;
    const outputs = cell.outputs.toJSON();
    const children = drawn[i].querySelectorAll('.jp-OutputArea-child .jp-OutputArea-output');
    cells.push({{index: i, count: cell.executionCount, source: cell.sharedModel.getSource().slice(0, 80),
                 errors: outputs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
                 broken_widgets: outputs.map((o, j) => [o, children[j]])
                   .filter(([o, out]) => o.data && o.data[WIDGET] && out
                           && (out.getAttribute('data-mime-type') === 'text/plain'
                               || /Error displaying widget/.test(out.textContent)))
                   .map(([o, out]) => out.textContent.slice(0, 120))}});
  }}
  return cells;
}}"""

HEADINGS = """() => ({
  headings: document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown :is(h1, h2, h3, h4, h5, h6)').length,
  literal: Array.from(document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown p'))
    .map(p => p.textContent).filter(t => /^#{1,6}\\s/.test(t)),
})"""


# --- fixtures -----------------------------------------------------------------------------------------------------

def _missing(reason: str) -> None:
    """Skip, with the reason; fail where LAB_REQUIRE_BROWSER=1 (CI, which installs both: a skip would hide it)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> str:
    try:
        import playwright  # noqa: F401
    except ImportError:
        _missing("Playwright for Python is not installed (pip install playwright; .ci/install-browser installs it)")
    path = find_chromium()
    if path is None:
        _missing("no Chromium on this machine (Debian: apt-get install chromium; .ci/install-browser installs it; "
                 "LAB_CHROMIUM=/path names another)")
    return path


@pytest.fixture(scope="module")
def lab_and_browser(chromium, tmp_path_factory):
    """One Chromium for the module and a JupyterLab server per strictness, started when first needed (the ranks a
    notebook's kernel starts are device-strict, as under nbval, unless conftest.NOT_STRICT names the notebook);
    afterwards nothing any of them started may be left."""
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in descendants()}
    labs: dict[bool, JupyterLab] = {}
    browser = playwright = None

    def lab_for(path: Path) -> JupyterLab:
        strict = path.name not in NOT_STRICT
        if strict not in labs:
            labs[strict] = JupyterLab(ROOT / "notebooks", tmp_path_factory.mktemp("jupyterlab"), strict=strict)
        return labs[strict]

    try:
        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=chromium)
        yield lab_for, browser
    finally:
        ours = [p for p in descendants() if p.pid not in before]
        if browser is not None:
            browser.close()
        if playwright is not None:
            playwright.stop()
        for lab in labs.values():
            lab.stop()
        left = left_behind(ours)
        assert not left, f"the browser tests left these processes running (now killed): {left}"


@pytest.fixture(scope="module")
def timings():
    times: dict[str, float] = {}
    yield times
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "timings.json").write_text(json.dumps(times, indent=1) + "\n")


class Notebook:
    """One notebook open in its own page, run all, its console watched."""

    def __init__(self, lab: JupyterLab, browser, path: Path):
        self.lab, self.path, self.name = lab, path, path.name
        self.console: list[str] = []
        self.page = browser.new_page(viewport=VIEWPORT)
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console.append(f"page error: {e}"))
        self.page.goto(lab.page_url(self.name))
        self.page.wait_for_function(KERNEL_IDLE, timeout=120_000)
        self.page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the notebook's full width

    def run_all(self) -> None:
        """Run > Run All Cells, as a learner does, and wait until no cell is queued or running."""
        self.page.evaluate(SAMPLE_PANELS)
        self.page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        self.page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        self.page.wait_for_function(f"() => {PROMPTS}.some(p => p.includes('*'))", timeout=30_000)
        self.page.wait_for_function(f"() => !{PROMPTS}.some(p => p.includes('*'))", timeout=NOTEBOOK_TIMEOUT_S * 1000,
                                    polling=500)
        self.page.wait_for_function(KERNEL_IDLE, timeout=60_000)

    def screenshot(self, locator, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        locator.scroll_into_view_if_needed()
        locator.screenshot(path=SCREENSHOTS / f"{self.path.stem}-{name}.png")

    def close(self) -> None:
        self.page.evaluate("() => clearInterval(window.labSampler)")
        self.lab.shutdown_kernels()
        self.page.close()
        assert not self.lab.changed(), f"the run wrote into the repository's notebooks: {self.lab.changed()}"


@pytest.fixture
def notebook(lab_and_browser, request):
    lab_for, browser = lab_and_browser
    nb = Notebook(lab_for(request.param), browser, request.param)
    try:
        yield nb
    finally:
        nb.close()


# --- the checks -----------------------------------------------------------------------------------------------------

def check_cells_ran(nb: Notebook) -> None:
    cells = nb.page.evaluate(CELLS)
    not_run = [f"cell {c['index']} ({c['source']!r})" for c in cells if c["count"] is None]
    errors = [f"cell {c['index']}: {e}" for c in cells for e in c["errors"]]
    broken = [f"cell {c['index']}: {w!r}" for c in cells for w in c["broken_widgets"]]
    assert not errors, f"{nb.name}: error outputs: {errors}"
    assert not not_run, f"{nb.name}: cells that did not run: {not_run}"
    assert not broken, f"{nb.name}: widgets not drawn (their JavaScript did not load?): {broken}"


def check_headings(nb: Notebook) -> None:
    page = nb.page.evaluate(HEADINGS)
    assert not page["literal"], f"{nb.name}: headings shown as text: {page['literal'][:3]}"
    assert page["headings"] >= source_headings(nb.path), \
        f"{nb.name}: {page['headings']} headings rendered, {source_headings(nb.path)} in the markdown"


def check_panel_rows(name: str, panel: dict, devices: tuple[str, ...]) -> None:
    """A row per device (a panel of this process's ledger), or per rank of each run (label 'title · device')."""
    labels = [row["label"] for row in panel["rows"]]
    assert labels and all(row["height"] > 0 for row in panel["rows"]), f"{name}: panel of cell {panel['cell']}: " \
                                                                       f"no rows, or rows with no height: {panel}"
    runs: dict[str, set[str]] = {}
    for label in labels:
        title, _, device = label.rpartition(" · ")
        runs.setdefault(title, set()).add(device)
    for title, seen in runs.items():
        assert set(devices) <= seen, f"{name}: panel of cell {panel['cell']}, {title or 'this process'}: rows " \
                                     f"{sorted(seen)}, but the rig has {list(devices)}"


def check_panels(nb: Notebook) -> None:
    """Every cell that starts a panel shows one; each has its rows, changed while running and settled after."""
    sources = json.loads(nb.path.read_text())["cells"]
    panel_cells = {i for i, c in enumerate(sources) if c["cell_type"] == "code" and starts_panel("".join(c["source"]))}
    first = nb.page.evaluate(PANELS_NOW)
    time.sleep(1.0)
    second = nb.page.evaluate(PANELS_NOW)
    assert panel_cells <= {p["cell"] for p in second}, \
        f"{nb.name}: cells {sorted(panel_cells)} start a memory panel; the page shows panels in cells " \
        f"{sorted({p['cell'] for p in second})}"
    assert [p["text"] for p in first] == [p["text"] for p in second], \
        f"{nb.name}: a panel still changes a second after the notebook finished"
    devices = detect_rig().labels
    for panel in second:
        check_panel_rows(nb.name, panel, devices)
    log, ended = nb.page.evaluate("() => [window.labPanels, window.labEnded]")
    for key in sorted({e["key"] for e in log}):
        entries = [e for e in log if e["key"] == key]
        final = entries[-1]["text"]  # stop()'s drawing; it may reach the page just after the cell's reply
        refreshes = {e["text"] for e in entries[:-1] if e["running"]} - {final}
        assert len(refreshes) >= 2, \
            f"{nb.name}: panel {key} (cell:order) drew {len(refreshes)} value(s) before its last while its cell " \
            f"ran: it did not refresh between its first drawing and its last"
        late = [e["text"] for e in entries if e["t"] > ended[key] + SETTLE_S * 1000]
        assert not late, f"{nb.name}: panel {key} still changed {SETTLE_S} s after its cell finished: {late[:2]}"


def check_playground(nb: Notebook) -> None:
    """Moving the micro-batches slider (its handle, by keyboard), then the schedule, redraws the timeline."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = nb.page.locator(".widget-vbox", has=nb.page.locator(".widget-dropdown")).last
    try:  # the first drawing is the last output of its cell: it may reach the page after the kernel went idle
        box.locator(".widget-output img").first.wait_for(timeout=30_000)
    except PlaywrightTimeout:
        pass
    assert box.locator(".widget-output img").count() > 0, \
        f"{nb.name}: the playground drew no timeline: {box.locator('.widget-output').first.inner_text()[:200]!r}"
    redrawn = """([box, before]) => {
      const img = box.querySelector('.widget-output img');
      return img && img.src !== before && img.complete && img.naturalWidth > 0;
    }"""
    image = box.locator(".widget-output img").first
    drawn = image.get_attribute("src")
    handle = box.locator(".widget-slider", has_text="micro-batches").locator(".noUi-handle").first
    handle.focus()
    handle.press("ArrowRight")
    nb.page.wait_for_function(redrawn, arg=[box.element_handle(), drawn], timeout=60_000)
    moved = image.get_attribute("src")
    schedule = box.locator(".widget-dropdown select")
    schedule.select_option(index=schedule.evaluate("s => (s.selectedIndex + s.options.length - 1) % s.options.length"))
    nb.page.wait_for_function(redrawn, arg=[box.element_handle(), moved], timeout=60_000)
    chosen = schedule.evaluate("s => s.options[s.selectedIndex].text")
    described = box.locator(".widget-output").first
    nb.page.wait_for_function("([out, name]) => out.textContent.toLowerCase().includes(name)",
                              arg=[described.element_handle(), chosen.lower()], timeout=60_000)
    nb.screenshot(box, "playground")


NOTEBOOKS = browser_notebooks()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS], indirect=True)
def test_notebook_in_jupyterlab(notebook: Notebook, timings):
    start = time.monotonic()
    notebook.run_all()
    timings[notebook.name] = round(time.monotonic() - start, 1)
    code = _code_cells(notebook.path)
    try:
        check_cells_ran(notebook)
        check_headings(notebook)
        if any(starts_panel(s) for s in code):
            check_panels(notebook)
        if any(shows_playground(s) for s in code):
            check_playground(notebook)
        assert not notebook.console, f"{notebook.name}: JavaScript errors: {notebook.console[:5]}"
    finally:  # the notebook at the end, with its first panel in view; each panel alone
        panels = notebook.page.locator(".lab-memory-panel").all()
        for k, panel in reversed(list(enumerate(panels))):
            notebook.screenshot(panel, f"panel{k}")
        notebook.page.screenshot(path=SCREENSHOTS / f"{notebook.path.stem}.png")


def test_browser_kernels_start_strict_ranks_as_nbval_does():
    """The browser's notebooks stand in for their nbval runs (tests/conftest.py): their ranks run device-strict as
    nbval's would, all but the notebooks conftest.NOT_STRICT names with a reason; the live widgets are on either way."""
    environ = {"LAB_DEVICE_STRICT": "1", "LAB_STATIC_WIDGETS": "1", "PATH": "/bin"}
    assert lab_env(environ, strict=True) == {"LAB_DEVICE_STRICT": "1", "PATH": "/bin"}
    assert lab_env(environ, strict=False) == {"PATH": "/bin"}
    assert all(reason for reason in NOT_STRICT.values())


def test_every_panel_and_playground_notebook_is_walked():
    """The list is the notebooks' own code: a new notebook with a panel joins without an edit here."""
    names = [p.name[:2] for p in NOTEBOOKS]
    assert set(ALWAYS) <= set(names) and "10" in names, names
