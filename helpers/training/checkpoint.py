"""Checkpoints of a training run with torch.distributed.checkpoint (DCP): save every N steps, resume from the latest
complete one, keep the last K, save in the background.

What a checkpoint holds (torchtitan's set): the model (a LoRA model: the adapters alone, `ignore_frozen_params`),
the optimizer, the LR scheduler, the step (the data position follows from it: step k trains on windows
k*batch..), every rank's RNG states (CPU, and CUDA on GPUs) and the gradient scaler. Model and optimizer go through
DCP's own `get_state_dict` / `set_state_dict`, so DDP replicas, ZeRO-1's optimizer shards, FSDP2's DTensor shards
and pipeline stages are saved the way PyTorch intends: one key per tensor of the whole model (named by global layer
index, so every stage's keys are distinct), each rank writing only what it owns, replicas written once. That is
what lets a checkpoint of two ranks load into one process, and a pipeline's into an unsplit model (DCP reshards on
load).

On disk: FOLDER/step-00000010/ holds DCP's files (`__0_0.distcp`, ... and `.metadata`), and, written last by rank 0
once every rank's files are complete, `complete.json`: the step, the world, the optimizer and every file's size and
CRC-32. `resume` takes the newest folder with that mark; a folder without it (a save killed half-way, Ctrl-C, disk
full) is never chosen, and the previous checkpoint is untouched because a save never writes into it. Before loading,
each file is checked against the mark (missing, truncated, corrupted) and the checkpoint's tensors against the
model and optimizer being resumed, and refused with the file and what differs.

Exact on GPUs too: a run that checkpoints on CUDA sets `torch.use_deterministic_algorithms` (`exact_on`), since fp32
attention runs the memory-efficient SDPA kernel there, whose backward is not deterministic otherwise. A checkpoint
moves between CPU and CUDA processes: DCP loads into the template's devices, and a generator the writer did not have
(a CPU rig's checkpoint has no CUDA RNG) is left at its seed, with a warning that says so.

`async_save`: `dcp.async_save` stages the state into host memory (pinned on GPUs) and writes it from a thread over
a gloo group of its own, so the training step is blocked only while it copies; `Checkpointer.blocked` lists the
seconds each save blocked the step, sync or async.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

MARK = "complete.json"
KILL_ENV = "LAB_KILL_AT"  # "RANK:STEP": that rank SIGKILLs itself after step STEP, once
_STEP_FOLDER = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: the message names the file and what differs."""


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often a run checkpoints. `every`: save after every `every` optimizer steps (and after the
    last); `keep`: how many complete checkpoints stay (older ones are deleted); `resume`: start from the newest
    complete checkpoint in `folder`, if there is one; `async_save`: write in the background (dcp.async_save)."""

    folder: str
    every: int = 10
    keep: int = 2
    resume: bool = True
    async_save: bool = False


def as_checkpoint_spec(checkpoint: str | os.PathLike | CheckpointSpec | None) -> CheckpointSpec | None:
    """A folder stands for a CheckpointSpec with the defaults."""
    if checkpoint is None or isinstance(checkpoint, CheckpointSpec):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        return CheckpointSpec(str(checkpoint))
    raise TypeError(f"checkpoint must be a folder or a CheckpointSpec, got {type(checkpoint).__name__}")


def check_spec(spec: CheckpointSpec) -> None:
    """Refuse a spec that cannot work, before any process starts."""
    for name in ("every", "keep"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"checkpoint {name} must be a whole number >= 1, got {value!r}")
    folder = Path(spec.folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} is a file")


def step_folder(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


def _step_folders(folder: str | Path) -> dict[int, Path]:
    """Every step's folder in `folder`, complete or not, by its step."""
    folder = Path(folder)
    found = ((_STEP_FOLDER.match(child.name), child) for child in folder.iterdir()) if folder.is_dir() else ()
    return {int(match.group(1)): child for match, child in found if match}


def complete_steps(folder: str | Path) -> list[int]:
    """The steps of the complete checkpoints in `folder` (those whose mark was written), oldest first."""
    return sorted(step for step, path in _step_folders(folder).items() if (path / MARK).is_file())


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in `folder`, or None: a half-written one is never chosen."""
    steps = complete_steps(folder)
    return step_folder(folder, steps[-1]) if steps else None


def _intact_before(folder: str | Path, damaged: Path) -> str:
    """What to do when the newest checkpoint is refused: the newest older one whose files all check, and how to
    resume from it (the run resumes from the newest complete folder, so the refused one is moved aside)."""
    for step in reversed(complete_steps(folder)):
        path = step_folder(folder, step)
        if path == damaged:
            continue
        try:
            verify_files(path)
        except CheckpointError:
            continue
        return (f"The newest intact checkpoint is step {step} ({path}): to resume from it, move the refused one "
                f"aside (mv {damaged} {damaged}.refused) and start the run again")
    return "No older checkpoint in the folder is intact: move the refused one aside to start the run from step 0"


def read_mark(path: str | Path) -> dict:
    """A checkpoint's `complete.json`, or a CheckpointError saying it is not a complete checkpoint."""
    mark = Path(path) / MARK
    if not mark.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {MARK} is missing (a save that did not finish)")
    try:
        return json.loads(mark.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{mark} cannot be read: {exc}") from None


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _file_table(path: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, _crc32(p)] for p in sorted(path.iterdir()) if p.is_file() and p.name != MARK}


def verify_files(path: str | Path) -> dict:
    """Check every file a complete checkpoint lists: present, of its size, of its CRC-32; return the mark."""
    path = Path(path)
    mark = read_mark(path)
    for name, (size, crc) in mark["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint of step {mark['step']} lists it (a shard "
                                  "file of one rank; copy the whole folder)")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file} is truncated or overwritten: {actual} bytes, {size} when saved")
        if _crc32(file) != crc:
            raise CheckpointError(f"{file} is corrupted: its CRC-32 differs from the one recorded when saved")
    return mark


def layer_view(layers: Sequence[nn.Module], owned: Sequence[int]) -> nn.ModuleDict:
    """The layers a rank holds under their global indices ("7.block.attn...", whatever the stage or strategy): the
    names a checkpoint's tensors get, the same on one device, on any pipeline stage and under FSDP2."""
    return nn.ModuleDict({str(i): layer for i, layer in zip(owned, layers)})


def _host_default():
    """DCP's bookkeeping (plans, shard offsets: small tensors made without device=) on the host, as on a GPU rank,
    whose default device is the host. A device-strict CPU rank (helpers.runtime.strict) defaults to meta instead,
    where PyTorch's DTensor offsets (`torch.tensor(offsets)`, then `int()`) would fail: a difference of the stand-in,
    not a fault a GPU would meet."""
    return torch.device("cpu")


def exact_on(device: torch.device) -> bool:
    """Make this process's kernels deterministic where exact resume needs it: on CUDA (cuBLAS's workspace config,
    read when it creates a handle, and `use_deterministic_algorithms`; warn_only, so an operator without a
    deterministic kernel names itself in a warning instead of stopping a long run). Returns whether it did; the CPU
    kernels the course runs are deterministic already."""
    if device.type != "cuda":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return True


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().to("cpu")
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _flat_tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state by DCP's flattened names ("optim.state.3.w.exp_avg")."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    out = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            out.update(_flat_tensors(value, name + "."))
    return out


def kill_if_asked(rank: int, step: int, folder: str | Path) -> None:
    """Fault injection for the resume tests and notebook 13: with LAB_KILL_AT="RANK:STEP", that rank dies by SIGKILL
    after step STEP, once: it leaves a note in the checkpoint folder first, so the restarted run (whichever node its
    ranks land on) goes on."""
    target = os.environ.get(KILL_ENV)
    note = Path(folder) / f"killed-at-{step}"
    if target == f"{rank}:{step}" and not note.exists():
        note.touch()
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Checkpointer:
    """One rank's checkpoints of one run. `model`: the rank's layers under global names (`layer_view`, or any
    module); `optimizers`: the local optimizers (ZeroRedundancyOptimizer's `.optim`); `group`: the process group of
    the run (None: a single process without torch.distributed, as when a run is continued on one device)."""

    spec: CheckpointSpec
    model: nn.Module
    optimizers: Sequence[torch.optim.Optimizer] = ()
    scheduler: Any = None
    scaler: Any = None
    description: dict = field(default_factory=dict)  # written into the mark (the strategy, the model), for people
    blocked: list[float] = field(default_factory=list)  # seconds each save blocked the training step
    saved: list[int] = field(default_factory=list)

    def __post_init__(self):
        check_spec(self.spec)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._pending = None
        self._async_error: Exception | None = None
        self._async_group = self._stager = None
        if self.spec.async_save and self.distributed:  # a group of its own: the background write's collectives
            self._async_group = dist.new_group(backend="gloo")  # never queue behind the training's
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        exact_on(self.device)
        if self.rank == 0:
            Path(self.spec.folder).mkdir(parents=True, exist_ok=True)

    # --- what a checkpoint holds ---
    def _options(self, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # strict=False on load: a LoRA model's frozen base is not in its checkpoint (`_check_tensors` has already
        # checked that every tensor that is saved, and every trainable one, is there). Flattened: every optimizer
        # entry named by its parameter ("state.3.w.exp_avg", "param_groups.3.w.lr"), so ranks holding different
        # parameters (pipeline stages, ZeRO-1 shards) never write one key with two values
        return StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=strict)

    def state(self, step: int) -> dict[str, Any]:
        """The state to save at `step` (also the template a load fills in place)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, list(self.optimizers), options=self._options())
        out: dict[str, Any] = {"model": model, "progress": {"step": step}, "rng": {f"rank{self.rank}": _rng_state()}}
        if self.optimizers:
            out["optim"] = optim
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def _mark(self) -> dict:
        return {"world": self.world, "device": self.device.type,
                "optimizers": [type(o).__name__ for o in self.optimizers],
                "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
                "scaler": self.scaler is not None, **self.description}

    # --- saving ---
    def due(self, step: int, last: int) -> bool:
        """Whether to save after `step` (steps counted from 1): every `every` steps and at the end."""
        return step % self.spec.every == 0 or step == last

    def save(self, step: int) -> float:
        """Save the state after `step` optimizer steps; return (and record) the seconds the caller was blocked."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time: the previous one finishes (and is marked) first
        path = step_folder(self.spec.folder, step)
        with _host_default():
            if self.rank == 0 and path.exists():  # a half-written save of this step, from a killed attempt
                shutil.rmtree(path)
            if self.distributed:
                dist.barrier()
            state = self.state(step)
            if not self.spec.async_save:
                dcp.save(state, checkpoint_id=str(path), no_dist=not self.distributed)
                self._finish(path, step)
            else:
                future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._async_group,
                                        async_stager=self._staging(), no_dist=not self.distributed)
                # the mark is written as soon as the write ends, not at the next save: a crash keeps it
                marked = threading.Event()
                future.add_done_callback(lambda f: self._finish_async(f, path, step, marked))
                self._pending = (future, marked)
        seconds = time.perf_counter() - t0
        self.blocked.append(seconds)
        return seconds

    def wait(self) -> None:
        """Wait for the save in flight (async) to be written and marked; its error, if it failed, is raised here."""
        if self._pending is None:
            return
        future, marked = self._pending
        self._pending = None
        future.result()
        marked.wait()
        if self._async_error is not None:
            error, self._async_error = self._async_error, None
            raise error

    def _staging(self):
        """The run's one stager: its host copy of the state (pinned on GPUs) is made at the first async save and
        refilled by every later one (DCP's stager keeps it by source storage), not allocated anew each save."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def _finish_async(self, future, path: Path, step: int, marked: threading.Event) -> None:
        """The end of a background write (in the writer's thread): mark it complete, unless it failed."""
        try:
            if future.exception() is None:
                self._finish(path, step)
        except Exception as exc:  # noqa: BLE001 - raised to the training loop by `wait`
            self._async_error = exc
        finally:
            marked.set()

    def _finish(self, path: Path, step: int) -> None:
        """Rank 0 marks the checkpoint complete (every rank's files are written once DCP's save returned on the
        coordinator: it writes `.metadata` after gathering them all), then deletes all but the last `keep`."""
        if self.rank == 0:
            mark = {"step": step, **self._mark(), "files": _file_table(path)}
            tmp = path / (MARK + ".tmp")
            tmp.write_text(json.dumps(mark, indent=1))
            os.replace(tmp, path / MARK)  # atomic: a mark is there whole or not at all
            self._prune(step)
        self.saved.append(step)

    def _prune(self, newest: int) -> None:
        keep = set(complete_steps(self.spec.folder)[-self.spec.keep:])
        for step, path in _step_folders(self.spec.folder).items():
            if step not in keep and step <= newest:
                shutil.rmtree(path, ignore_errors=True)

    # --- resuming ---
    def resume(self) -> int:
        """Load the newest complete checkpoint, if `spec.resume` and there is one; return the step to start from."""
        if not self.spec.resume:
            return 0
        path = latest_checkpoint(self.spec.folder)
        if path is None:
            return 0
        try:
            return self.load(path)
        except CheckpointError as damaged:
            raise CheckpointError(f"{damaged}. {_intact_before(self.spec.folder, path)}") from None

    def load(self, path: str | Path) -> int:
        """Load the checkpoint at `path` into the model, optimizers, scheduler, scaler and RNG; return its step.
        Refused, naming the file and what differs, when it is incomplete, damaged, or another run's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        with _host_default():
            mark = verify_files(path)
            self._check_mark(path, mark)
            state = self.state(0)
            try:
                saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            except Exception as exc:  # noqa: BLE001 - DCP's own error for an unreadable .metadata
                raise CheckpointError(f"{path / '.metadata'} cannot be read: {exc}") from None
            rng_key = f"rank{self.rank}"
            if f"rng.{rng_key}.cpu" not in saved:  # saved by another number of ranks: not this rank's RNG
                del state["rng"]
            else:
                self._skip_generators_not_saved(path, state["rng"][rng_key], saved, mark)
            self._check_tensors(path, state, saved)
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.distributed)
            set_state_dict(self.model, list(self.optimizers), model_state_dict=state["model"],
                           optim_state_dict=state.get("optim", {}), options=self._options(strict=False))
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None:
                self.scaler.load_state_dict(state["scaler"])
            if "rng" in state:
                _set_rng_state(state["rng"][rng_key])
            return int(state["progress"]["step"])

    def _skip_generators_not_saved(self, path: Path, generators: dict, saved: dict, mark: dict) -> None:
        """A generator this process has and the writer had not (a CPU rig's checkpoint loaded on a GPU: no CUDA
        RNG) keeps its seed: weights, optimizer state and the CPU generator still load exactly."""
        for name in [g for g in generators if f"rng.rank{self.rank}.{g}" not in saved]:
            del generators[name]
            warnings.warn(f"{path} was saved on {mark.get('device', 'another device')}, without a {name} generator: "
                          f"the {name} generator keeps its seed (random draws there, e.g. dropout, differ from an "
                          "uninterrupted run)", stacklevel=3)

    def _check_mark(self, path: Path, mark: dict) -> None:
        mine = self._mark()
        moved = f" (saved on {mark['device']}, loading on {mine['device']})" \
            if mark.get("device", mine["device"]) != mine["device"] else ""
        for key in ("optimizers", "scheduler", "scaler"):
            if key in mark and mark[key] != mine[key]:
                raise CheckpointError(f"{path / MARK}: saved with {key} {mark[key]!r}, this run has "
                                      f"{mine[key]!r}{moved}")

    def _check_tensors(self, path: Path, state: dict, saved: dict) -> None:
        """Every tensor this rank would load exists in the checkpoint with its shape and dtype."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for name, value in _flat_tensors(state).items():
            if name not in saved:
                kind = "optimizer state" if name.startswith("optim.") else "tensor"
                raise CheckpointError(f"{path / '.metadata'}: no {kind} {name!r}: saved for another model, "
                                      f"optimizer or LoRA targets ({len(saved)} entries saved)")
            meta = saved[name]
            if isinstance(meta, TensorStorageMetadata):
                if tuple(meta.size) != tuple(value.shape):
                    raise CheckpointError(f"{path / '.metadata'}: {name!r} has shape {tuple(meta.size)} there, "
                                          f"{tuple(value.shape)} in this model: another model's checkpoint")
                if meta.properties.dtype != value.dtype:
                    raise CheckpointError(f"{path / '.metadata'}: {name!r} is {meta.properties.dtype} there, "
                                          f"{value.dtype} here")

    def after_step(self, step: int, last: int) -> None:
        """Called after every optimizer step (counted from 1): save when due; the fault injection of the tests."""
        if self.due(step, last):
            self.save(step)
        kill_if_asked(self.rank, step, self.spec.folder)

    def close(self) -> None:
        """Finish the save in flight (the run's end); release the staging copy and the background write's group."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None


def rank_checkpointer(job, module: nn.Module, owned: Sequence[int], optimizer, scaler) -> Checkpointer | None:
    """The checkpointer of one rank of a TrainJob (None without `job.checkpoint`): its layers by global index, its
    local optimizer (ZeroRedundancyOptimizer's shard: `.optim`), its gradient scaler."""
    if job.checkpoint is None:
        return None
    optimizers = [getattr(optimizer, "optim", optimizer)] if optimizer is not None else []
    return Checkpointer(job.checkpoint, layer_view(list(module.layers), owned), optimizers, scaler=scaler,
                        description={"strategy": job.strategy, "layers": job.n_layers, "world": job.world})
