"""`python -m tools.wheelhouse`: the offline install for workshop venues.

Venue Wi-Fi is often the first failure of a workshop. Before the day, the instructor builds a *wheelhouse*, a folder
of wheels for every learner platform and Python version, proves it complete without the network, and copies it (with
the course folder) onto a USB stick or a local share. On the day, learners install with `pip install --no-index
--find-links WHEELHOUSE -r requirements.txt`: no network at all.

    python -m tools.wheelhouse build DIR [--platform linux-x86_64 macos-arm64] [--python 3.10 3.11 3.12]
    python -m tools.wheelhouse check DIR [--platform ...] [--python ...]
    python -m tools.wheelhouse platforms

`build` downloads, for each platform and Python version, the CPU build of torch (on Linux from PyTorch's CPU index,
on macOS from PyPI, whose macOS wheels are the CPU/MPS build), everything in requirements.txt, and the build backend
that the editable install of `helpers` (`-e .`) needs (pyproject's build-system: setuptools, plus wheel). Then it runs
`check` and prints the size per platform.

`check` resolves the same requirements with `pip download --no-index --find-links DIR -d DIR` for each target
platform and Python version, with pip's configuration and PIP_* variables ignored (so a machine's own mirrors cannot
hide a gap), and says in plain words what is missing. It writes nothing: every file it resolves is already in DIR.
(Not `pip install --dry-run --report`: pip install checks Requires-Python against the running interpreter, not
`--python-version`.)

Environment markers: `pip download --platform P --python-version V` picks wheels for P and V but evaluates
dependency markers (`sys_platform == "darwin"`, `python_version < "3.11"`) for the machine it runs on, so a
wheelhouse built on Linux for macOS would miss Darwin-only dependencies (appnope) and fail on Linux-only ones (the
macOS torch wheel lists cuda-toolkit, nvidia-* and triton under `platform_system == "Linux"`), and one built on
Python 3.11 for 3.10 would miss the backports (tomli, exceptiongroup). This module runs pip with its marker
environment set to the target's, so both commands resolve as the learner's machine will. That, and recording the
final resolution, reach into pip's internals (pip._vendor.packaging.markers, RequirementPreparer); tried with pip
23.2 and 26.3.

Standard library and pip only: no torch, so it runs on the instructor's machine before anything is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

TORCH_VERSION = "2.13.0"  # the build README's install lines name
PYTHONS = ("3.10", "3.11", "3.12")  # the course's Python versions (pyproject: >=3.10; CI runs 3.11)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REPO = Path(__file__).resolve().parent.parent
MANIFEST = "wheelhouse.json"
LEARNER_NOTE = "README.txt"


def _manylinux(arch: str, newest_glibc_minor: int) -> tuple[str, ...]:
    """Every manylinux tag a machine with glibc 2.`newest_glibc_minor` accepts. pip does not expand
    `--platform manylinux_2_28_x86_64` to the older tags itself, so list them all (PEP 600 names and the legacy
    aliases manylinux2014 = 2.17, manylinux2010 = 2.12, manylinux1 = 2.5)."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest_glibc_minor, 4, -1)]
    return tuple(tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"])


@dataclass(frozen=True)
class Platform:
    name: str
    summary: str
    tags: tuple[str, ...] = ()  # pip --platform values
    markers: dict = field(default_factory=dict)  # PEP 508 marker environment of a learner's machine
    torch_index: str | None = None  # None: pip's default index (PyPI)
    torch_local: str = ""  # local version label of the CPU build ("+cpu" on PyTorch's CPU index)
    refused: str | None = None  # why no wheelhouse can be built for it


PLATFORMS = {
    p.name: p for p in (
        Platform(
            "linux-x86_64", "Linux x86_64 with glibc 2.28+ (Ubuntu 20.04+, Debian 10+), and Windows through WSL2",
            tags=_manylinux("x86_64", 28),  # torch 2.13's wheels are manylinux_2_28
            markers={"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                     "os_name": "posix"},
            torch_index=CPU_INDEX, torch_local="+cpu"),
        Platform(
            "macos-arm64", "macOS 14+ on Apple Silicon (M1 and later)",
            tags=("macosx_14_0_arm64",),  # torch 2.13's wheels are macosx_14_0_arm64; pip adds 11.0-13.x and universal2
            markers={"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64",
                     "os_name": "posix"}),
        Platform(
            "macos-x86_64", "macOS on Intel",
            refused=("PyTorch publishes no macOS x86_64 (Intel) wheels after torch 2.2.2 (pytorch/pytorch#114602), "
                     f"so torch {TORCH_VERSION} cannot be installed there with pip. Intel Mac users: run the course "
                     "in a Linux x86_64 virtual machine or container and install from the linux-x86_64 wheelhouse.")),
    )
}
DEFAULT_PLATFORMS = ("linux-x86_64", "macos-arm64")


def marker_environment(platform: Platform, python: str) -> dict:
    """The marker environment of a learner's machine. `python_full_version` is the .0 release: markers on patch
    levels are rare, and an early patch level errs towards including backports."""
    return {**platform.markers, "python_version": python, "python_full_version": f"{python}.0",
            "implementation_name": "cpython", "implementation_version": f"{python}.0",
            "platform_python_implementation": "CPython"}


def target_args(platform: Platform, python: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in platform.tags:
        args += ["--platform", tag]
    return args


def torch_requirement(platform: Platform, version: str) -> str:
    """`torch==2.13.0+cpu` on Linux, where a bare `torch==2.13.0` from PyPI is the CUDA build with several GB of
    nvidia-* dependencies; `torch==2.13.0` on macOS, where PyPI's wheel is the CPU/MPS build."""
    return f"torch=={version}{platform.torch_local}"


# --- requirements ---------------------------------------------------------------------------------------------

def _toml_list(text: str, table: str, key: str) -> list[str]:
    """`key = [...]` in `[table]` of a TOML file: tomllib where it exists (3.11+), a small parser on 3.10."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return _toml_list_without_tomllib(text, table, key)
    data = tomllib.loads(text)
    for part in table.split("."):
        data = data.get(part, {})
    return list(data.get(key, []))


def _toml_list_without_tomllib(text: str, table: str, key: str) -> list[str]:
    """Enough TOML for pyproject's `requires = [...]` and `dependencies = [...]` on Python 3.10."""
    section = re.search(rf"^\[{re.escape(table)}\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not section:
        return []
    value = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", section.group(1), re.M | re.S)
    return re.findall(r"""["']([^"']+)["']""", value.group(1)) if value else []


def course_requirements(requirements: Path | list[Path] | None = None) -> list[str]:
    """The requirement strings a learner's `pip install -r requirements.txt` resolves (several files: all of them,
    e.g. requirements-deepspeed.txt beside it). `-e DIR` (the editable install of `helpers`) becomes what building
    DIR offline needs: its build-system requirements plus `wheel` (older setuptools asks for it when building; 70 KB)
    and its own dependencies."""
    if isinstance(requirements, (list, tuple)):
        return list(dict.fromkeys(r for path in requirements for r in course_requirements(path)))
    requirements = Path(requirements or REPO / "requirements.txt")
    out: list[str] = []
    for raw in requirements.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        editable = re.match(r"^(-e|--editable)\s*(\S+)$", line)
        if editable:
            pyproject = (requirements.parent / editable.group(2) / "pyproject.toml").read_text()
            out += _toml_list(pyproject, "build-system", "requires") + ["wheel"]
            out += _toml_list(pyproject, "project", "dependencies")
        elif line.startswith("-"):
            raise ValueError(f"{requirements}: the wheelhouse tool does not understand the option line {raw!r}")
        else:
            out.append(line)
    return list(dict.fromkeys(out))


# --- pip ------------------------------------------------------------------------------------------------------

# Runs pip in-process with the target's marker environment: pip evaluates every marker through
# packaging.markers.default_environment(), and replacing it is the one change to how pip resolves. With a record
# path, `pip download` also writes the file names of its final resolution there (what it saves into -d; with -d the
# wheelhouse itself, every file is already there and nothing is copied).
_RUNNER = r"""
import json, sys
target, record = json.loads(sys.argv[1]), sys.argv[2]
if target:
    try:
        from pip._vendor.packaging import markers
        env = markers.default_environment()
    except (ImportError, AttributeError) as exc:
        sys.exit(f"this pip cannot be pointed at another platform's markers ({exc}): upgrade pip")
    env.update(target)
    markers.default_environment = lambda: dict(env)
if record:
    try:
        from pip._internal.operations.prepare import RequirementPreparer
        save, chosen = RequirementPreparer.save_linked_requirement, []
        def recording_save(self, req):
            if req.link is not None and req.link.is_file:
                chosen.append(req.link.filename)
                with open(record, "w") as f:
                    json.dump(chosen, f)
            return save(self, req)
        RequirementPreparer.save_linked_requirement = recording_save
    except (ImportError, AttributeError):
        pass  # then the caller reads pip's log instead
from pip._internal.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def _isolated_env() -> dict:
    """The environment with pip's configuration switched off: no config files, no PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run_pip(args: list[str], markers: dict | None = None, isolated: bool = False, echo: bool = False,
            record: Path | None = None) -> tuple[int, str]:
    """Run `pip ARGS` with this Python, its markers evaluated for `markers`; return (exit status, output)."""
    cmd = [sys.executable, "-c", _RUNNER, json.dumps(markers or {}), str(record or ""), *args]
    env = dict(_isolated_env() if isolated else os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8",
                            errors="replace", env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            print("    " + line, end="", flush=True)
    return proc.wait(), "".join(lines)


def _project(filename: str) -> str:
    """The normalised project name of a distribution file: `Jinja2-3.1.4-py3-none-any.whl` -> `jinja2`."""
    return re.sub(r"[-_.]+", "-", filename.split("-")[0]).lower()


def _resolved_files(record: Path, output: str, directory: Path) -> list[Path]:
    """The wheels of the final resolution: from the record, or (a pip without the hook) from pip's log, which also
    names candidates the resolver looked at and dropped."""
    if record.exists():
        names = json.loads(record.read_text())
    else:
        names = [Path(f).name for f in re.findall(r"^\s*(?:File was already downloaded|Saved) (.+?)\s*$", output, re.M)]
    return sorted({directory / name for name in names})


def explain_failure(output: str, directory: Path, platform: Platform, python: str, torch_version: str | None,
                    ) -> str:
    """pip's refusal, said in plain words: which requirement has no wheel here, and what the wheelhouse holds."""
    where = f"{platform.name}, Python {python}"
    missing = re.search(r"No matching distribution found for (.+?)\s*$", output, re.M)
    if missing:
        # pip 23 says `gamma; python_version < "3.11"`, pip 26 `gamma (from alpha)`: keep the requirement alone (the
        # marker was true for this target, or pip would not ask)
        req = re.sub(r"\s*\(from [^)]*\)\s*$", "", missing.group(1).split(";")[0]).strip()
        name = _project(re.match(r"[A-Za-z0-9._-]+", req).group(0))
        have = sorted(f.name for f in directory.iterdir() if f.is_file() and _project(f.name) == name)
        users = _required_by(directory, name)
        needed = f" (needed by {', '.join(users)})" if users else ""
        if name == "torch" and platform.torch_local and have and not any(platform.torch_local in f for f in have):
            return (f"{where}: the CPU build of torch ({torch_requirement(platform, torch_version or '')}) is "
                    f"missing; the wheelhouse has {', '.join(have)}. On Linux PyPI's torch is the CUDA build (it "
                    f"pulls several GB of nvidia-* wheels): take torch from {CPU_INDEX} (build --torch-index-url).")
        if have:
            return (f"{where}: no wheel in {directory} satisfies `{req}`{needed} for this platform and Python; it "
                    f"has {', '.join(have)}. Run build for this platform and Python again.")
        return f"{where}: `{req}`{needed} is missing from {directory}: no file of it at all. Run build again."
    if "ResolutionImpossible" in output or "conflict" in output.lower():
        return f"{where}: the requirements conflict with each other:\n" + _tail(output)
    return f"{where}: pip failed:\n" + _tail(output)


def _required_by(directory: Path, name: str) -> list[str]:
    """The wheels in `directory` whose metadata asks for project `name` (read from the wheels' METADATA)."""
    users = []
    for wheel in sorted(directory.glob("*.whl")):
        try:
            with zipfile.ZipFile(wheel) as z:
                meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
                text = z.read(meta).decode("utf-8", "replace") if meta else ""
        except (OSError, zipfile.BadZipFile):
            continue
        for dep, rest in re.findall(r"^Requires-Dist:\s*([A-Za-z0-9._-]+)(.*)$", text, re.M):
            if _project(dep) == name and "extra ==" not in rest.replace("extra==", "extra =="):
                users.append(" ".join(wheel.name.split("-")[:2]))
                break
    return list(dict.fromkeys(users))


def _tail(output: str, n: int = 15) -> str:
    return "\n".join("    " + line for line in output.strip().splitlines()[-n:])


# --- check ----------------------------------------------------------------------------------------------------

@dataclass
class Result:
    platform: str
    python: str
    ok: bool
    files: list[Path] = field(default_factory=list)
    problem: str = ""

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files if f.exists())


def _platforms(names) -> list[Platform]:
    unknown = [n for n in names if n not in PLATFORMS]
    if unknown:
        raise ValueError(f"unknown platform {', '.join(unknown)}: choose from {', '.join(PLATFORMS)}")
    return [PLATFORMS[n] for n in names]


def check(directory, platforms=DEFAULT_PLATFORMS, pythons=PYTHONS, requirements: list[str] | None = None,
          torch_version: str | None = TORCH_VERSION, echo: bool = False) -> list[Result]:
    """Resolve torch and the course's requirements from `directory` alone, for each platform and Python version,
    as a learner's `pip install --no-index --find-links` will. The network and this machine's pip configuration
    are not used; nothing is written."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"no wheelhouse at {directory}")
    reqs = course_requirements() if requirements is None else list(requirements)
    results = []
    for platform in _platforms(platforms):
        if platform.refused:
            results.append(Result(platform.name, "-", False, problem=f"{platform.name}: {platform.refused}"))
            continue
        for python in pythons:
            wanted = ([torch_requirement(platform, torch_version)] if torch_version else []) + reqs
            with tempfile.TemporaryDirectory() as scratch:
                # -d DIR: every file resolved from DIR is already there, so nothing is copied or written.
                record = Path(scratch) / "resolved.json"
                args = ["download", "--no-index", "--find-links", str(directory), "-d", str(directory),
                        "--progress-bar", "off", *target_args(platform, python), *wanted]
                status, output = run_pip(args, marker_environment(platform, python), isolated=True, echo=echo,
                                         record=record)
                if status == 0:
                    results.append(Result(platform.name, python, True, _resolved_files(record, output, directory)))
                else:
                    results.append(Result(platform.name, python, False, problem=explain_failure(
                        output, directory, platform, python, torch_version)))
    return results


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def report(results: list[Result], directory: Path) -> str:
    lines = [f"{'platform':<14} {'python':<7} {'wheels':>6} {'size':>9}  status"]
    for r in results:
        status = "complete" if r.ok else "INCOMPLETE"
        lines.append(f"{r.platform:<14} {r.python:<7} {len(r.files):>6} {_mb(r.bytes):>9}  {status}")
    per_platform: dict[str, set] = {}
    for r in results:
        if r.ok:
            per_platform.setdefault(r.platform, set()).update(r.files)
    for name, files in per_platform.items():
        pythons = ", ".join(r.python for r in results if r.platform == name and r.ok)
        size = sum(f.stat().st_size for f in files)
        lines.append(f"{name} (Python {pythons}): {len(files)} wheels, {_mb(size)}")
    every = [f for f in Path(directory).iterdir() if f.is_file() and f.suffix == ".whl"]
    lines.append(f"whole wheelhouse {directory}: {len(every)} wheels, {_mb(sum(f.stat().st_size for f in every))}")
    problems = [r.problem for r in results if not r.ok]
    if problems:
        lines.append("")
        lines.append("MISSING (pip stops at the first gap of each platform and Python; fix it and check again):")
        lines += [f"- {p}" for p in problems]
    else:
        lines.append("Complete: learners on these platforms can install with --no-index --find-links.")
    return "\n".join(lines)


# --- build ----------------------------------------------------------------------------------------------------

def build(directory, platforms=DEFAULT_PLATFORMS, pythons=PYTHONS, torch_version: str = TORCH_VERSION,
          torch_index_url: str | None = None, find_links=(), requirements: Path | None = None) -> list[Result]:
    """Download the CPU build of torch and the course's requirements for each platform and Python into
    `directory`, then check it. Uses this machine's pip configuration (proxies, mirrors)."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    reqs = course_requirements(requirements)
    extra = [a for fl in find_links for a in ("--find-links", str(fl))]
    build_sdist_wheels(directory, reqs, extra)
    failed: dict[tuple[str, str], str] = {}
    for platform in _platforms(platforms):
        if platform.refused:
            print(f"{platform.name}: not built. {platform.refused}")
            continue
        for python in pythons:
            markers = marker_environment(platform, python)
            torch_req = torch_requirement(platform, torch_version)
            index = torch_index_url or platform.torch_index
            start = time.perf_counter()
            print(f"== {platform.name}, Python {python}: {torch_req} from {index or 'the default index (PyPI)'}",
                  flush=True)
            args = ["download", "--no-deps", "-d", str(directory), "--progress-bar", "off",
                    *target_args(platform, python), *(["--index-url", index] if index else []), *extra, torch_req]
            status, output = run_pip(args, markers, echo=True)
            if status:
                unreachable = re.search(r"NewConnectionError|Max retries exceeded|Name or service not known|"
                                        r"Temporary failure in name resolution|timed out", output)
                failed[(platform.name, python)] = (
                    f"{platform.name}, Python {python}: could not download {torch_req} (a cp{python.replace('.', '')} "
                    f"wheel) from {index or 'the default index'}"
                    + (": that index cannot be reached from this machine" if unreachable else "")
                    + ". Pass --torch-index-url URL, or --find-links a folder that holds the wheel.")
            else:
                print(f"== {platform.name}, Python {python}: the requirements, resolved for this platform", flush=True)
                args = ["download", "-d", str(directory), "--find-links", str(directory), "--progress-bar", "off",
                        *target_args(platform, python), *extra, torch_req, *reqs]
                status, output = run_pip(args, markers, echo=True)
                if status:
                    failed[(platform.name, python)] = explain_failure(output, directory, platform, python,
                                                                      torch_version)
            print(f"== {platform.name}, Python {python}: {'failed' if status else 'done'} in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    # The manifest keeps every (platform, Python) built into this folder, over several builds: `check` checks those.
    built = [tuple(pair) for pair in _manifest(directory).get("built", [])]
    built += [(p, v) for p in platforms if not PLATFORMS[p].refused for v in pythons]
    built = sorted(set(built))
    (directory / MANIFEST).write_text(json.dumps(
        {"torch": torch_version, "built": built, "requirements": reqs, "date": time.strftime("%Y-%m-%d")},
        indent=1) + "\n")
    (directory / LEARNER_NOTE).write_text(learner_note(built, torch_version))
    results = check(directory, platforms, pythons, reqs, torch_version)  # a refused platform stays a failure
    for r in results:  # pip's own words from the download, where the check has only "missing"
        if (r.platform, r.python) in failed and not r.ok:
            r.problem = failed[(r.platform, r.python)]
    return results


def build_sdist_wheels(directory: Path, reqs: list[str], extra: list[str]) -> list[Path]:
    """Wheels built here for the requirements published only as a source distribution (DeepSpeed): `pip download`
    for another platform takes wheels alone, so each such one is built once with `pip wheel --no-deps`; a
    pure-Python wheel (py3-none-any) then serves every platform and Python. Returns the wheels built."""
    import tempfile

    built = []
    for req in reqs:
        with tempfile.TemporaryDirectory() as probe:
            status, _ = run_pip(["download", "--no-deps", "--only-binary=:all:", "-d", probe, "--progress-bar", "off",
                                 *extra, req])
        if status == 0:
            continue
        before = set(directory.glob("*.whl"))
        status, output = run_pip(["wheel", "--no-deps", "-w", str(directory), "--progress-bar", "off", *extra, req])
        new = sorted(set(directory.glob("*.whl")) - before)
        if status or not new:
            print(f"{req}: no wheel published, and building one failed:\n{_tail(output)}", flush=True)
            continue
        for wheel in new:
            pure = wheel.name.endswith("-none-any.whl")
            print(f"{req}: no wheel published; built {wheel.name}" + ("" if pure else
                  " (for this machine's platform only: learners on others need a compiler)"), flush=True)
        built += new
    return built


def learner_note(built, torch_version: str = TORCH_VERSION) -> str:
    pythons = {}
    for platform, python in built:
        pythons.setdefault(platform, []).append(python)
    for_ = "; ".join(f"{p} (Python {', '.join(v)})" for p, v in pythons.items())
    return (f"Wheelhouse of the Two-GPU Model Parallelism Lab: torch {torch_version} (CPU build) and the course's "
            f"requirements\nfor {for_}. No network needed.\n\n"
            "Copy the course folder to your laptop, then in it (W: the path of this folder):\n"
            "    python3 -m venv .venv\n"
            "    source .venv/bin/activate\n"
            "    pip install --no-index --find-links W -r requirements.txt\n"
            "    pytest -x -q tests/test_rig.py\n"
            "    jupyter lab notebooks/\n")


# --- command line ---------------------------------------------------------------------------------------------

def _manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.wheelhouse", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("build", "download the wheels for the learners' platforms, then check"),
                        ("check", "prove the wheelhouse complete, without the network")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("directory", type=Path)
        p.add_argument("--platform", nargs="+", metavar="NAME", choices=list(PLATFORMS),
                       help=f"default: {' '.join(DEFAULT_PLATFORMS)} (check: what the wheelhouse was built for)")
        p.add_argument("--python", nargs="+", metavar="X.Y",
                       help=f"default: {' '.join(PYTHONS)} (check: what the wheelhouse was built for)")
        p.add_argument("--requirements", type=Path, nargs="+", default=[REPO / "requirements.txt"],
                       help="requirement files (default requirements.txt; add requirements-deepspeed.txt for DeepSpeed)")
        p.add_argument("--torch", help=f"torch version (default {TORCH_VERSION}; check: what the wheelhouse was "
                       "built for)")
    b = sub.choices["build"]
    b.add_argument("--torch-index-url", help=f"where the Linux CPU build comes from (default {CPU_INDEX})")
    b.add_argument("--find-links", action="append", default=[], metavar="PATH_OR_URL",
                   help="extra places to take wheels from (a local mirror), repeatable")
    sub.add_parser("platforms", help="the platforms this tool knows")
    ns = parser.parse_args(argv)

    if ns.command == "platforms":
        for p in PLATFORMS.values():
            print(f"{p.name:<14} {p.summary}" + (f"\n{'':<14} not supported: {p.refused}" if p.refused else ""))
        return 0
    for v in ns.python or ():
        if not re.fullmatch(r"3\.\d+", v):
            parser.error(f"--python takes versions like 3.11, got {v!r}")
    directory = ns.directory.resolve()
    if ns.command == "build":
        results = build(directory, ns.platform or DEFAULT_PLATFORMS, ns.python or PYTHONS, ns.torch or TORCH_VERSION,
                        ns.torch_index_url, ns.find_links, ns.requirements)
    else:
        if not directory.is_dir():
            print(f"no wheelhouse at {directory}", file=sys.stderr)
            return 1
        manifest = _manifest(directory)
        reqs, torch_version = course_requirements(ns.requirements), ns.torch or manifest.get("torch") or TORCH_VERSION
        if ns.platform or ns.python or not manifest.get("built"):
            results = check(directory, ns.platform or DEFAULT_PLATFORMS, ns.python or PYTHONS, reqs, torch_version)
        else:  # what was built into this folder
            pythons: dict[str, list] = {}
            for platform, python in manifest["built"]:
                pythons.setdefault(platform, []).append(python)
            results = [r for platform, versions in pythons.items()
                       for r in check(directory, [platform], versions, reqs, torch_version)]
    print(report(results, directory))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
