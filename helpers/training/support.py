"""Which strategy runs on which rig with which engine, and why not where it does not: checked before any process
starts, printed by the doctor, and shown as a table in README.

Which strategies and engines there are is the catalog's (helpers.catalog); what each rig allows is decided here.
Engines: `threads` (one thread per device in the notebook's process), `processes` (our interpreter, one rank per
device), `torch` (torch.distributed.pipelining, one rank per device). Data-parallel strategies run on processes
with PyTorch's own wrappers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from helpers.catalog import TRAINED, strategy as catalog_entry
from helpers.runtime.rig import Rig

GLOO_CUDA = ("gloo cannot carry CUDA tensors for {what} ({source}), and NCCL refuses two ranks on one GPU")
# The collectives gloo runs on CUDA tensors (the backend table of PyTorch's distributed docs: broadcast and
# all_reduce only): what two ranks sharing one GPU can use.
GLOO_CUDA_COLLECTIVES = ("allreduce", "broadcast")


def carries(backend: str, device_type: str, collective: str) -> bool:
    """Whether `backend` runs `collective` ('allreduce', 'allgather', 'reducescatter', 'broadcast') on tensors of
    `device_type`: NCCL and gloo on CPU tensors run them all; gloo on CUDA tensors only GLOO_CUDA_COLLECTIVES."""
    return not (backend == "gloo" and device_type == "cuda" and collective not in GLOO_CUDA_COLLECTIVES)


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""

    def require(self, what: str) -> None:
        if not self.ok:
            raise ValueError(f"{what} cannot run here: {self.reason}")


def engines_for(strategy: str, engine: str | None = None) -> tuple[str, ...]:
    """The engines a strategy can run with (helpers.catalog); `engine`, if given, refused unless it is one."""
    found = catalog_entry(strategy)
    if not found.trained:
        raise ValueError(f"{strategy!r} is the one-device reference, not a strategy; choose one of {TRAINED}")
    if engine is not None and engine not in found.engines:
        raise ValueError(f"{strategy} runs with engine {' or '.join(found.engines)}, not {engine!r}")
    return found.engines


def support(rig: Rig, strategy: str, engine: str, ranks: int = 2) -> Support:
    """Whether `strategy` with `engine` on `ranks` devices works on `rig`, and if not, why."""
    if engine not in engines_for(strategy):
        return Support(False, f"{strategy} runs with {' or '.join(engines_for(strategy))}, not {engine!r}")
    if strategy == "dp_x_pp":
        ranks = max(ranks, 4)
    if engine != "threads" and ranks > rig.max_ranks:
        if rig.is_cpu:
            return Support(True, f"{ranks} ranks share {rig.max_ranks} virtual devices' cores (oversubscribe=True): "
                                 "exact results, timings mean little")
        return Support(False, f"{ranks} ranks need {ranks} GPUs, this rig has {rig.max_ranks}")
    if rig.kind == "one_gpu":
        if engine == "torch":
            return Support(False, GLOO_CUDA.format(what="send/recv", source="pytorch#45995") +
                           ": torch.distributed.pipelining sends CUDA tensors; use engine='processes', which stages "
                           "them through host memory")
        entry = catalog_entry(strategy)
        if entry.fully_sharded or entry.library == "deepspeed":
            return Support(False, GLOO_CUDA.format(what="reduce-scatter and all-gather",
                                                   source="the backend table of PyTorch's distributed docs") +
                           ": FSDP2 and DeepSpeed's ZeRO need both")
    return Support(True)


def reference_rigs() -> dict[str, Rig]:
    """The three rigs of the course, described without touching CUDA (what `detect_rig` returns on each)."""
    import torch

    from helpers.runtime.rig import cpu_rig

    gpu = "NVIDIA GeForce RTX 3090"
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    cpu = cpu_rig(threads=1)
    return {
        "CPU (2 cores)": Rig("cpu", cpu.devices, cpu.names, cpu.capacity_bytes, "gloo", 2),
        "one GPU": Rig("one_gpu", (cuda0, cuda0), (gpu, gpu), (12 * 2**30,) * 2, "gloo", 2),
        "two GPUs": Rig("two_gpus", (cuda0, cuda1), (gpu, gpu), (24 * 2**30,) * 2, "nccl", 2, peer_access=False),
    }


def _matrix(rigs: dict[str, Rig]) -> Iterator[tuple[str, str, dict[str, Support]]]:
    """Each strategy and engine with its support on each named rig: what both tables format."""
    for strategy in TRAINED:
        for engine in engines_for(strategy):
            yield strategy, engine, {name: support(rig, strategy, engine) for name, rig in rigs.items()}


def support_markdown() -> str:
    """The matrix as a Markdown table, with each refusal's reason below it (README shows exactly this)."""
    rigs = reference_rigs()
    reasons: dict[str, int] = {}
    lines = ["| strategy | engine | " + " | ".join(rigs) + " |", "|---|---|" + "---|" * len(rigs)]
    for strategy, engine, found in _matrix(rigs):
        notes = [f" ({reasons.setdefault(s.reason, len(reasons) + 1)})" if s.reason else "" for s in found.values()]
        cells = [("yes" if s.ok else "no") + note for s, note in zip(found.values(), notes)]
        lines.append(f"| {strategy} | {engine} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"({n}) {reason}." for reason, n in reasons.items()]
    return "\n".join(lines)


def support_rows(rigs: dict[str, Rig]) -> list[dict]:
    """The whole matrix: one row per strategy and engine, one column per named rig ('yes', 'yes*' with a note,
    or 'no: reason')."""
    return [{"strategy": strategy, "engine": engine,
             **{name: ("yes" if not s.reason else "yes*") if s.ok else f"no: {s.reason}" for name, s in found.items()}}
            for strategy, engine, found in _matrix(rigs)]


if __name__ == "__main__":
    print(support_markdown())
