"""Each notebook runs once in the full tier. The browser tests (test_browser.py) run their notebooks in JupyterLab
and check every cell ran without an error, as nbval does, and more; where they will run in this session (selected,
and Playwright and a Chromium are here), the nbval runs of the same notebooks are left out, which saves the full tier
those notebooks' time (six of the slowest). Without a browser, or with the browser tests not selected, nbval runs
every notebook as before."""
import pytest

from tests.lab_browser import browser_available


@pytest.hookimpl(trylast=True)  # after -k and -m (and the root conftest's tiers): only browser runs that will happen
def pytest_collection_modifyitems(config, items):
    in_browser = {item.callspec.params["notebook"].name for item in items
                  if item.path.name == "test_browser.py" and hasattr(item, "callspec")
                  and "notebook" in item.callspec.params}
    if not in_browser or not browser_available():
        return
    twice = [item for item in items if item.path.suffix == ".ipynb" and item.path.name in in_browser]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
