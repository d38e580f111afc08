"""JupyterLab and Chromium for the browser tests (tests/test_browser.py): the course as a learner sees it.

- `find_chromium()`, `browser_available()`: the system's Chromium (Debian's `chromium` package; `LAB_CHROMIUM` names another). Playwright
  drives it through `executable_path`: its own browser download needs the internet.
- `JupyterLab`: a server on a free loopback port with a token, serving the notebooks folder (autosave off: a run
  writes no output into them, which `changed()` checks), with the live widgets on (the tests' LAB_STATIC_WIDGETS is
  taken out of its environment), the ranks its kernels start device-strict or not (`strict`: LAB_DEVICE_STRICT set
  or taken out, as nbval runs the same notebook), its own Jupyter folders and settings in a temporary folder, and the
  notebook's cells all in the page (no windowing: the checks read every cell).
- `stop_all()`: kernels asked to shut down as JupyterLab does, then the server, then a check that no process the
  server or the browser started is left; `left_behind` says which were (and they are killed).

The server is started in a session of its own, with a parent-death signal, and a finalizer stops it, so neither a
failing test nor a killed pytest leaves it running.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from pathlib import Path

import psutil

CHROMIUM_ENV = "LAB_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "chromium-headless-shell")
STATIC_WIDGETS_ENV = "LAB_STATIC_WIDGETS"  # conftest's, for nbval: not for a learner's kernels
STRICT_ENV = "LAB_DEVICE_STRICT"
START_TIMEOUT_S = 90

# JupyterLab's settings for the test: every cell in the page, no autosave (the notebooks stay as committed), no news or
# update checks (no network here, and their notifications would cover the page).
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def lab_env(environ, strict: bool) -> dict[str, str]:
    """The server's environment, which its kernels inherit and pass to the ranks they start: live widgets, and
    LAB_DEVICE_STRICT=1 exactly when `strict`."""
    env = {k: v for k, v in environ.items() if k not in (STATIC_WIDGETS_ENV, STRICT_ENV)}
    if strict:
        env[STRICT_ENV] = "1"
    return env


def find_chromium() -> str | None:
    """The path of the system's Chromium, or None."""
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        return named if Path(named).exists() else None
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def browser_available() -> bool:
    """Playwright for Python and a Chromium are both here."""
    import importlib.util

    return importlib.util.find_spec("playwright") is not None and find_chromium() is not None


def _terminate_with_parent() -> None:
    """Linux: SIGTERM the server when pytest dies (a SIGTERM, unlike a SIGKILL, lets it shut its kernels down)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(pid: int, timeout_s: float = 30) -> None:
    """SIGTERM a process (the server shuts its kernels down on it), then SIGKILL its session's group."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class JupyterLab:
    """`jupyter lab` on 127.0.0.1:<free port> with a token, serving the folder `root` as a learner's `jupyter lab
    notebooks/` does (the notebooks find the repository's scripts and data where they are); its Jupyter folders in
    `workdir`; the ranks its kernels start are device-strict when `strict`."""

    def __init__(self, root: Path, workdir: Path, strict: bool):
        self.root = root
        self._committed = {path: path.read_bytes() for path in root.glob("*.ipynb")}
        self._checkpoints = root / ".ipynb_checkpoints"
        self._had_checkpoints = self._checkpoints.exists()
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = lab_env(os.environ, strict)
        jupyter = workdir / "jupyter"
        for name, values in SETTINGS.items():
            path = jupyter / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env.update(JUPYTER_CONFIG_DIR=str(jupyter / "config"), JUPYTER_DATA_DIR=str(jupyter / "data"),
                   JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(jupyter / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(jupyter / "workspaces"))
        self.log = (workdir / "jupyterlab.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             "--port-retries=0", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--allow-root", "--LabApp.expose_app_in_browser=True"],
            env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_terminate_with_parent)
        self._finalizer = weakref.finalize(self, _stop_group, self.process.pid)
        self._wait_ready()

    def changed(self) -> list[str]:
        """The notebooks whose file differs from before the server started (autosave is off: none should)."""
        return [p.name for p, text in self._committed.items() if not p.exists() or p.read_bytes() != text]

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}: {self.log_tail()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within {START_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-chars:]

    def page_url(self, notebook: str) -> str:
        """The notebook in a workspace of its own (no layout restored from the notebook before)."""
        return f"{self.url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?token={self.token}"

    def shutdown_kernels(self) -> None:
        """What JupyterLab does when a learner shuts a kernel down: the kernel runs its exit handlers."""
        for kernel in self.api("kernels"):
            self.api(f"kernels/{kernel['id']}", method="DELETE")

    def stop(self) -> None:
        try:
            self.shutdown_kernels()
        except OSError:
            pass  # the server is gone already: its group is stopped below all the same
        self._finalizer()
        self.log.close()
        if not self._had_checkpoints:
            shutil.rmtree(self._checkpoints, ignore_errors=True)


def descendants() -> list[psutil.Process]:
    """Every process this one started, and theirs (the server, its kernels and their ranks, the browser)."""
    return psutil.Process().children(recursive=True)


def left_behind(processes: list[psutil.Process], timeout_s: float = 15) -> list[str]:
    """Which of `processes` are still running after `timeout_s`; those are killed."""
    gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    names = []
    for p in alive:
        try:
            names.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return names
