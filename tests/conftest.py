"""Each notebook runs once in the full tier where it can. The browser tests (test_browser.py) run their notebooks in
JupyterLab and check every cell ran without an error, as nbval does, and more; the reference-answer test
(test_exercises.py) runs its notebooks start to finish too, with the exercises answered. Where either will run in this
session (selected; for the browser, Playwright and a Chromium here), the nbval run of the same notebook is left out.
Without them nbval runs every notebook as before."""
import pytest

from tests.lab_browser import browser_available


def _notebooks_run_by(items, test_file: str, param: str) -> set[str]:
    return {item.callspec.params[param].name for item in items
            if item.path.name == test_file and hasattr(item, "callspec") and param in item.callspec.params}


@pytest.hookimpl(trylast=True)  # after -k and -m (and the root conftest's tiers): only runs that will happen
def pytest_collection_modifyitems(config, items):
    elsewhere = _notebooks_run_by(items, "test_exercises.py", "path")
    if browser_available():
        elsewhere |= _notebooks_run_by(items, "test_browser.py", "notebook")
    twice = [item for item in items if item.path.suffix == ".ipynb" and item.path.name in elsewhere]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
