"""Checkpoints (helpers.training.checkpoint) in one process: exact resume, keep K, a half-written checkpoint never
chosen, damaged or foreign checkpoints refused naming the file, a failed or interrupted save leaving the previous one
loadable. The multi-process resume matrix (kill a rank, restart, resume) is tests/test_resume.py."""
import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from helpers.models import StackConfig, SyntheticTokens, lm_loss
from helpers.models.layered import Stage
from helpers.models.stack import StackModel
from helpers.training.checkpoint import (MARK, CheckpointError, Checkpointer, CheckpointSpec, complete_steps,
                                        latest_checkpoint, layer_view, read_mark, step_folder)

CFG = StackConfig(hidden=32, n_blocks=2, heads=2, seq_len=8, vocab=64)


class Run:
    """One device's training of the block stack: Adam, a warm-up LR schedule, a gradient scaler, dropout-free."""

    def __init__(self, folder, seed: int = 0, cfg: StackConfig = CFG, optimizer=torch.optim.Adam, every: int = 2,
                 keep: int = 2):
        model = StackModel(cfg, seed)
        self.layers = model.meta_layers()
        model.materialize(self.layers, range(len(self.layers)), torch.device("cpu"))
        self.stage = Stage(self.layers)
        self.optimizer = optimizer(self.stage.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 3))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        self.ckpt = Checkpointer(CheckpointSpec(str(folder), every=every, keep=keep),
                                 layer_view(self.layers, range(len(self.layers))), [self.optimizer],
                                 self.scheduler, self.scaler)
        self.x, self.y = SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4)

    def step(self, i: int) -> float:
        self.optimizer.zero_grad()
        noise = torch.randn(()) * 0  # draws from the CPU generator: its state must come back too
        loss = lm_loss(self.stage(self.x), self.y) + noise
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.item() + torch.rand(()).item()  # the generator's next draw is part of the result

    def train(self, first: int, last: int) -> list[float]:
        losses = []
        for i in range(first, last):
            losses.append(self.step(i))
            self.ckpt.after_step(i + 1, last)
        self.ckpt.close()
        return losses


def test_resume_continues_bit_for_bit_and_keeps_the_last_k(tmp_path):
    torch.manual_seed(0)
    whole = Run(tmp_path / "a").train(0, 6)
    torch.manual_seed(0)
    Run(tmp_path / "b").train(0, 4)  # "killed" after step 4
    torch.manual_seed(123)  # a restarted process: another generator state, another model seed
    again = Run(tmp_path / "b", seed=7)
    first = again.ckpt.resume()
    assert first == 4
    assert again.train(first, 6) == whole[4:]
    assert complete_steps(tmp_path / "b") == [4, 6]  # keep=2
    mark = json.loads((step_folder(tmp_path / "b", 6) / MARK).read_text())
    assert mark["step"] == 6 and mark["optimizers"] == ["Adam"] and mark["files"]


def test_a_half_written_checkpoint_is_never_chosen(tmp_path):
    run = Run(tmp_path)
    run.train(0, 2)
    half = step_folder(tmp_path, 4)
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    assert Run(tmp_path).ckpt.resume() == 2


def _damage(path, how: str):
    shard = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, how):
    Run(tmp_path).train(0, 2)
    shard = _damage(step_folder(tmp_path, 2), how)
    with pytest.raises(CheckpointError, match=f"{shard}.* {how}.*No older checkpoint"):
        Run(tmp_path).ckpt.resume()


def test_a_damaged_latest_checkpoint_names_the_newest_intact_one_and_how_to_resume_from_it(tmp_path):
    """The refusal names the damaged file and the newest older checkpoint whose files all check (a damaged one
    between them is passed over); moving the refused folders aside, as the message says, resumes from it."""
    Run(tmp_path, keep=3).train(0, 6)
    assert complete_steps(tmp_path) == [2, 4, 6]
    _damage(step_folder(tmp_path, 6), "corrupted")
    _damage(step_folder(tmp_path, 4), "truncated")
    with pytest.raises(CheckpointError, match=r"corrupted.*newest intact checkpoint is step 2 .*mv "):
        Run(tmp_path, keep=3).ckpt.resume()
    for step in (6, 4):
        step_folder(tmp_path, step).rename(f"{step_folder(tmp_path, step)}.refused")
    assert Run(tmp_path, keep=3).ckpt.resume() == 2


def test_another_models_or_optimizers_checkpoint_is_refused(tmp_path):
    Run(tmp_path).train(0, 2)
    with pytest.raises(CheckpointError, match=r"\.metadata.*shape \(64, 32\) there, \(64, 48\) in this model"):
        Run(tmp_path, cfg=StackConfig(hidden=48, n_blocks=2, heads=2, seq_len=8, vocab=64)).ckpt.resume()
    with pytest.raises(CheckpointError, match=rf"{MARK}: saved with optimizers \['Adam'\], this run has \['SGD'\]"):
        Run(tmp_path, optimizer=torch.optim.SGD).ckpt.resume()


@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_save_failing_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fault):
    run = Run(tmp_path)
    run.train(0, 2)
    original = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        original(self, plan, planner)  # the shard files are written, the metadata never is
        raise fault

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_fail)
    with pytest.raises((type(fault), CheckpointException)):  # DCP wraps a writer's error in its own
        run.ckpt.save(4)
    monkeypatch.undo()
    assert complete_steps(tmp_path) == [2]
    assert Run(tmp_path).ckpt.resume() == 2


def test_async_save_marks_complete_without_waiting_for_the_next_save(tmp_path):
    run = Run(tmp_path)
    run.ckpt = Checkpointer(CheckpointSpec(str(tmp_path), every=2, async_save=True), run.ckpt.model,
                            [run.optimizer], run.scheduler, run.scaler)
    run.step(0)
    run.step(1)
    run.ckpt.save(2)
    run.ckpt._pending[1].wait(60)  # written and marked by the writer's thread
    assert complete_steps(tmp_path) == [2]
    run.ckpt.close()
    assert len(run.ckpt.blocked) == 1


@pytest.mark.full  # two ranks: the full tier
def test_qlora_shards_under_cpu_offload_hold_only_their_share(tmp_path):
    """With offload="cpu", `_assign_shard` kept each rank's NF4 shard as a view of the whole weight (torchao's chunk
    returns views, its `.to` to the same device is a no-op): every rank held the whole 4-bit base in host memory
    (about 36 GB per rank at 70B). Each rank now keeps its share alone."""
    from helpers.finetune.lora import LoraModel, LoraSpec, small_llama
    from helpers.runtime.launch import run
    from helpers.runtime.rig import cpu_rig
    from tests.shard_workers import nf4_storage_over_share

    base = small_llama(tmp_path / "base", vocab=128, seq_len=16, n_layers=2, hidden=128)
    ratios = run(nf4_storage_over_share, LoraModel(base, LoraSpec(method="qlora")), True, rig=cpu_rig(),
                 oversubscribe=True)
    assert max(ratios) < 1.1, ratios


def test_exact_resume_makes_cuda_kernels_deterministic_and_leaves_the_cpu_alone(monkeypatch):
    """fp32 attention on a GPU runs the memory-efficient SDPA kernel, whose backward is not deterministic unless
    asked: a checkpointing run on CUDA asks (cuBLAS's workspace config too); the CPU's kernels already are."""
    from helpers.training.checkpoint import exact_on

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not exact_on(torch.device("cpu")) and not torch.are_deterministic_algorithms_enabled()
    try:
        assert exact_on(torch.device("cuda", 0))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_checkpoint_says_where_it_was_written(tmp_path):
    """The mark records the device type the run trained on, so a load elsewhere (a CPU rig's checkpoint on a GPU)
    can say what moved; DCP loads into this process's devices."""
    Run(tmp_path).train(0, 2)
    assert read_mark(step_folder(tmp_path, 2))["device"] == "cpu"


def test_async_saves_reuse_one_staging_copy_and_leave_no_group(tmp_path):
    """Every async save of a run stages into the host copy the first one made (pinned on GPUs: allocating it anew
    each save costs the step), and closing the checkpointer releases its background write's process group."""
    from helpers.runtime.launch import run
    from helpers.runtime.rig import cpu_rig
    from tests.host_workers import async_saves_staging_and_groups

    for rank in run(async_saves_staging_and_groups, str(tmp_path), rig=cpu_rig(), oversubscribe=True):
        assert rank == {"same staging copy": True, "groups left": 0}
