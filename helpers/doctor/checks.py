"""The doctor's rows and its printed report: a `Check` per thing checked (PASS, WARN, FAIL, REFUSED), every section
`guarded` so that a failure is a row and the table still prints."""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable

from helpers.training.support import Support


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN (works, but change something) | FAIL | REFUSED (this rig cannot run it)
    detail: str = ""
    seconds: float = 0.0


def guarded(name: str, fn: Callable[[], "Check | list[Check] | str"]) -> list[Check]:
    """Run one section or check; whatever it raises becomes a FAIL row with the reason, so the table still prints.
    `fn` returns its rows, or a PASS detail."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - a failing check is a result, not a crash
        return [Check(name, "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
                      time.perf_counter() - t0)]
    if isinstance(out, str):
        return [Check(name, "PASS", out, time.perf_counter() - t0)]
    return out if isinstance(out, list) else [out]


def run_check(name: str, verdict: Support, fn: Callable[[], str]) -> Check:
    """REFUSED with the support matrix's reason where this rig cannot run it, else `fn` run `guarded`."""
    if not verdict.ok:
        return Check(name, "REFUSED", verdict.reason)
    (check,) = guarded(name, fn)
    return check


def print_report(result: dict) -> None:
    """The rig and its topology, the fitted links, the checks' table, then every FAIL and WARN in full."""
    from helpers.report import table

    topo = result["topology"]
    print(f"\n{topo['rig']}\ntorch {topo['torch']}, Python {topo['python']}, {topo['platform']}")
    for key in ("cuda", "nccl", "driver", "peer_access", "environment"):
        if topo.get(key):
            print(f"{key}: {topo[key]}")
    for key in ("topo", "nvlink"):
        if topo.get(key):
            print(f"{key}:\n{topo[key]}")
    for line in topo["advice"]:
        print("advice:", line)
    if result["links"]:
        print("\nlinks (fitted: time = latency + bytes / bandwidth):")
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in result["links"]]))
    print("\nchecks:")
    print(table([{"check": c["name"], "status": c["status"], "seconds": c["seconds"],
                  "detail": c["detail"].splitlines()[0][:110] if c["detail"] else ""} for c in result["checks"]]))
    for c in result["checks"]:
        if c["status"] in ("FAIL", "WARN"):
            print(f"\n{c['status']} {c['name']}:\n{c['detail']}")

