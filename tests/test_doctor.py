"""The doctor on this rig: every check PASS or REFUSED with a reason, and README's support matrix is the real one."""
import json
import subprocess
import sys
from pathlib import Path

from helpers.training.support import support_markdown

REPO = Path(__file__).resolve().parent.parent


def test_doctor_passes_or_refuses_with_a_reason(tmp_path):
    out = tmp_path / "doctor.json"
    proc = subprocess.run([sys.executable, "-m", "helpers.doctor", "--json", str(out), "--repeats", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert set(statuses.values()) <= {"PASS", "REFUSED"}
    assert all(c["detail"] for c in report["checks"] if c["status"] == "REFUSED"), "a refusal says why"
    for name in ("threads: 1F1B m=4", "processes: 1F1B m=4", "torch: 1F1B m=4", "processes: fsdp2",
                 "processes: DP x PP 2 x 2, 1F1B"):
        assert statuses[name] == "PASS", name
    paths = {link["path"] for link in report["links"]}
    assert any("point-to-point" in p for p in paths) and any("all-reduce" in p for p in paths)
    assert all(link["GB/s"] > 0 and link["latency_us"] >= 0 for link in report["links"])


def test_readme_shows_the_support_matrix_the_code_enforces():
    readme = (REPO / "README.md").read_text()
    assert support_markdown() in readme, "regenerate it: python -m helpers.training.support"
