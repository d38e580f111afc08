"""`python -m helpers.doctor`'s command line: every section run (`report`), printed, written with `--json`; or
`--gpu-suite` instead of the checks."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from helpers.doctor.engines import parity_checks
from helpers.doctor.checks import Check, guarded, print_report
from helpers.doctor.long_runs import long_run_checks
from helpers.doctor.speeds import SPEEDS, speed_check
from helpers.doctor.scripts import (BENCH_LAUNCH, bench_launch_check, calibration_check, notebook_plan_checks,
                                    script_checks)
from helpers.doctor.system import links, system_checks, topology
from helpers.runtime.rig import Rig, claim_cpu_device, detect_rig
from helpers.runtime.strict import STRICT_ENV

DESCRIPTION = ("The first command on a new machine: every engine and strategy this rig supports, run once against "
               "one device, and the links the engines really use, measured.")


def report(rig: Rig, sizes: list[int], repeats: int, progress: bool = True, only: tuple[str, ...] = ()) -> dict:
    """Every section, each guarded: a failure is a FAIL row and the rest still runs. `only`: just the checks whose
    name contains one of these words (to recheck one thing after a fix)."""
    import tempfile

    from helpers.training.support import support_rows

    def say(what: str) -> None:
        if progress:
            print(what, flush=True)

    def wanted(name: str) -> bool:
        return not only or any(word.lower() in name.lower() for word in only)

    def into(name: str, key: str, fn) -> list[Check]:  # a section the report keeps: no row unless it fails
        return guarded(name, lambda: result.__setitem__(key, fn()) or [])

    say(rig.describe())
    result: dict = {"topology": {"rig": rig.describe(), "advice": list(rig.advice)}, "links": [], "checks": []}
    checks = into("topology", "topology", lambda: topology(rig))
    say("system ...")
    checks += system_checks(rig)
    if wanted("links: point-to-point and all-reduce"):
        say("links ...")
        checks += into("links: point-to-point and all-reduce", "links", lambda: links(rig, sizes, repeats))
    if wanted(SPEEDS):
        say("unequal cards: each device's forward + backward, timed ...")
        checks += guarded(SPEEDS, lambda: speed_check(rig, say=say))
    with tempfile.TemporaryDirectory(prefix="lab-doctor-") as workdir:
        say("parity checks (one training step against one device):")
        checks += parity_checks(rig, workdir, progress, wanted)
        say("take-home scripts (two steps each) and the bench's calibration ...")
        checks += script_checks(rig, workdir, wanted)
        say("long runs (offload, checkpoints, a restart, an export) ...")
        checks += guarded("long run: its models", lambda: long_run_checks(rig, workdir, wanted))
    for name, check in (("bench: calibration in its ranks", calibration_check), (BENCH_LAUNCH, bench_launch_check)):
        if wanted(name):
            checks += guarded(name, lambda check=check: check(rig))
    say("notebooks' GPU sizes ...")
    checks += guarded("notebooks: GPU sizes", lambda: notebook_plan_checks(rig, wanted))
    result["checks"] = [asdict(c) for c in checks if wanted(c.name) or c.status == "FAIL"]
    result["support"] = support_rows({"this rig": rig})
    return result


def gpu_suite_report(rig: Rig, json_path: str | None) -> int:
    """`--gpu-suite`: every notebook's training step at its GPU sizes on one GPU, measured peak beside plan."""
    from helpers.gpu_sizes.suite import gpu_suite
    from helpers.report import table

    rows = gpu_suite(rig.devices[0])
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def parser() -> argparse.ArgumentParser:
    """The doctor's flags."""
    out = argparse.ArgumentParser(prog="python -m helpers.doctor", description=DESCRIPTION)
    out.add_argument("--json", metavar="PATH", help="also write the whole report as JSON")
    out.add_argument("--cpu", action="store_true", help="check the CPU rig even on a GPU machine")
    out.add_argument("--repeats", type=int, default=5, help="repeats per message size in the link sweep")
    out.add_argument("--gpu-suite", action="store_true",
                     help="instead of the checks: every notebook's training step at its GPU sizes on one GPU, "
                          "measured peak beside plan (about 10 minutes; on the CPU rig at small sizes)")
    out.add_argument("--only", default="", help="comma-separated words: run only the checks whose names contain "
                                                "one of them, e.g. --only script,fsdp2 after fixing something")
    return out


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 if anything FAILed."""
    ns = parser().parse_args(argv)
    rig = detect_rig(force_cpu=ns.cpu or None)
    if rig.is_cpu:
        claim_cpu_device(rig)
        os.environ.setdefault(STRICT_ENV, "1")  # ranks and scripts fail here where they would under NCCL
    if ns.gpu_suite:
        return gpu_suite_report(rig, ns.json)
    sizes = [2**k for k in range(12, 25, 2)] if rig.is_cpu else [2**k for k in range(12, 29, 2)]
    result = report(rig, sizes, ns.repeats, only=tuple(w.strip() for w in ns.only.split(",") if w.strip()))
    print_report(result)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {ns.json}")
    counts = {s: sum(c["status"] == s for c in result["checks"]) for s in ("PASS", "WARN", "FAIL", "REFUSED")}
    print(f"\ndoctor: {counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL, {counts['REFUSED']} "
          "REFUSED (reasons above)")
    return 1 if counts["FAIL"] else 0
