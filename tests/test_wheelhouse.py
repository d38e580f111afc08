"""The offline-install tool on a tiny fake wheelhouse made here: nothing is downloaded, pip never reaches a network
(--no-index, its configuration switched off), and each check is one pip process of about a second."""
import zipfile

import pytest

from tools import wheelhouse
from tools.wheelhouse import check, course_requirements, main


def make_wheel(folder, name, version, requires=()):
    """A minimal pure-Python wheel whose metadata declares `requires`."""
    dist = f"{name}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def house(tmp_path):
    """alpha needs beta only on macOS and gamma only before Python 3.11: markers of the *target*, not this machine."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    make_wheel(folder, "alpha", "1.0", ["beta>=2; sys_platform == 'darwin'", "gamma; python_version < '3.11'"])
    make_wheel(folder, "beta", "2.1")
    return folder


def test_markers_are_evaluated_for_the_target_platform_and_nothing_is_written(house):
    before = sorted(p.name for p in house.iterdir())
    linux, mac = check(house, ["linux-x86_64", "macos-arm64"], ["3.11"], ["alpha"], torch_version=None)
    assert linux.ok and [f.name for f in linux.files] == ["alpha-1.0-py3-none-any.whl"]
    assert mac.ok and [f.name for f in mac.files] == ["alpha-1.0-py3-none-any.whl", "beta-2.1-py3-none-any.whl"]
    assert sorted(p.name for p in house.iterdir()) == before


def test_a_gap_is_named_in_plain_words_whatever_this_machine_s_pip_config(house, tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"  # a machine's own find-links must not hide the gap
    mirror.mkdir()
    make_wheel(mirror, "gamma", "1.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(mirror))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    [result] = check(house, ["linux-x86_64"], ["3.10"], ["alpha"], torch_version=None)
    assert not result.ok and not result.files
    assert "linux-x86_64, Python 3.10" in result.problem and "`gamma`" in result.problem
    assert "missing" in result.problem and "needed by alpha 1.0" in result.problem


def test_check_command_checks_what_was_built_and_wants_the_cpu_torch_on_linux(house, tmp_path, capsys):
    make_wheel(house, "torch", "2.13.0")  # stands for PyPI's wheel: the CPU/MPS build on macOS, CUDA on Linux
    (house / wheelhouse.MANIFEST).write_text('{"torch": "2.13.0", "built": [["linux-x86_64", "3.11"], '
                                             '["macos-arm64", "3.10"], ["macos-arm64", "3.11"]]}')
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# the course\nalpha  # needs beta on macOS\n")
    assert main(["check", str(house), "--requirements", str(requirements)]) == 1
    out = capsys.readouterr().out
    assert "macos-arm64    3.11" in out and "complete" in out
    assert "linux-x86_64, Python 3.11: the CPU build of torch (torch==2.13.0+cpu) is missing" in out
    assert "macos-arm64, Python 3.10: `gamma` (needed by alpha 1.0) is missing" in out


def test_course_requirements_include_the_editable_install_s_build_backend():
    reqs = course_requirements()
    assert "setuptools>=68" in reqs and "wheel" in reqs and "torch>=2.6" in reqs
    assert not any(r.startswith("-") or "#" in r for r in reqs)


def test_toml_reading_without_tomllib_matches_tomllib():
    text = (wheelhouse.REPO / "pyproject.toml").read_text()
    for table, key in (("build-system", "requires"), ("project", "dependencies"), ("project", "absent")):
        assert wheelhouse._toml_list_without_tomllib(text, table, key) == wheelhouse._toml_list(text, table, key)
    assert wheelhouse._toml_list(text, "build-system", "requires") == ["setuptools>=68"]


def test_intel_macs_are_refused_with_the_reason(house, capsys):
    assert main(["check", str(house), "--platform", "macos-x86_64"]) == 1
    out = capsys.readouterr().out
    assert "no macOS x86_64 (Intel) wheels after torch 2.2.2" in out and "linux-x86_64 wheelhouse" in out


def test_unknown_platform_and_bad_python_are_usage_errors(house):
    with pytest.raises(SystemExit) as exc:
        main(["check", str(house), "--platform", "windows"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["check", str(house), "--python", "311"])
    assert exc.value.code == 2


def make_sdist(folder, name: str, version: str):
    """A minimal pure-Python source distribution built by setuptools (already installed: no build isolation)."""
    import io
    import tarfile

    root = f"{name}-{version}"
    files = {f"{root}/pyproject.toml": "[build-system]\nrequires = ['setuptools']\nbuild-backend = "
                                       f"'setuptools.build_meta'\n[project]\nname = '{name}'\nversion = '{version}'\n",
             f"{root}/{name}/__init__.py": "",
             f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for member, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_requirement_published_only_as_an_sdist_is_built_into_a_wheel_for_every_platform(house, tmp_path):
    """DeepSpeed ships no wheel, and `pip download --platform` takes wheels only: the build makes one here (pure
    Python: py3-none-any, which every platform takes); a requirement with a wheel is left to the download."""
    sources = tmp_path / "index"
    sources.mkdir()
    make_sdist(sources, "onlysource", "1.0")
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--no-index", "--find-links", str(sources), "--find-links", str(house), "--no-build-isolation"]
    built = wheelhouse.build_sdist_wheels(out, ["onlysource==1.0", "alpha"], extra)
    assert [w.name for w in built] == ["onlysource-1.0-py3-none-any.whl"]
    assert sorted(p.name for p in out.iterdir()) == ["onlysource-1.0-py3-none-any.whl"]
