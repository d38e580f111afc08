"""The take-home training scripts, each run with torchrun on the CPU rig with a tiny model: same first loss as one
device on the same batch, a loss that goes down, and a checkpoint that reloads."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers.models.hf import hf_config, save_hf_model
from helpers.runtime.launch import run_command

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
FLAGS = ["--steps", "4", "--batch", "8", "--seq-len", "16", "--lr", "3e-3", "--autocast", "none"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "gpt2-tied"
    save_hf_model(hf_config("gpt2", n_layers=2, hidden=32, heads=4, vocab=64, seq_len=16, tie_embeddings=True), path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "llama"
    save_hf_model(hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16), path)
    return path


def _one_device_first_loss(model_dir: Path, model=None) -> float:
    """The first batch the scripts draw, on one device with the original weights (or `model`)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from transformers import AutoModelForCausalLM

        from _common import batches, token_loss_sum
    finally:
        sys.path.remove(str(SCRIPTS))

    class Flags:
        data, text, batch, seq_len, seed = None, None, 8, 16, 0

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir)
    x, y = batches(Flags, model.config.vocab_size, 0)
    with torch.no_grad():
        return (token_loss_sum(model(input_ids=x).logits, y) / y.numel()).item()


def _run(script: str, nproc: int, model_dir: Path, out: Path, *extra: str) -> list[float]:
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc-per-node", str(nproc)]
    cmd = [*launcher, str(SCRIPTS / script), "--model", str(model_dir), "--save-to", str(out), *FLAGS, *extra]
    proc = run_command(cmd, timeout_s=240, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1",
                                                              TMPDIR=str(out.parent)))  # torchrun's temp folders
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line)["loss"] for line in proc.stdout.splitlines() if line.startswith('{"step"')]


@pytest.mark.full
@pytest.mark.parametrize("script, nproc, extra", [
    ("train_naive_split.py", 0, []),
    ("train_pipeline.py", 2, ["--schedule", "1f1b", "--microbatches", "4"]),
    ("train_pipeline.py", 2, ["--schedule", "interleaved", "--microbatches", "4"]),
    ("train_pipeline.py", 2, ["--schedule", "zbv", "--microbatches", "4"]),
    ("train_pipeline.py", 2, ["--schedule", "dualpipev", "--microbatches", "4"]),
    ("train_ddp.py", 2, ["--microbatches", "2"]),
    ("train_fsdp2.py", 2, []),
    ("train_dp_x_pp.py", 4, ["--pp", "2", "--microbatches", "2"]),
])
def test_script_trains_like_one_device_and_saves(model_dir, tmp_path, script, nproc, extra):
    from transformers import AutoModelForCausalLM

    losses = _run(script, nproc, model_dir, tmp_path / "out", *extra)
    assert len(losses) == 4
    assert abs(losses[0] - _one_device_first_loss(model_dir)) < 1e-4
    assert losses[-1] < losses[0]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # still tied after the round trip


def _scripts_module(name: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def test_more_ranks_than_gpus_stop_before_nccl_with_the_reason():
    """Two ranks on a one-GPU machine: rank 1 died in torch.cuda.set_device with "invalid device ordinal". Now every
    rank stops before the process group starts, with the reason in the user's terms."""
    common = _scripts_module("_common")
    said = common.gpu_shortage(processes=2, gpus=1, visible=None)
    assert "2 processes on this machine, but 1 GPU(s) visible" in said and "--nproc-per-node 1" in said
    assert common.gpu_shortage(processes=2, gpus=2, visible="0,1") is None


def test_the_naive_split_says_where_its_halves_run():
    """One GPU: both halves on cuda:0, said (it trained on the CPU without a word); none: the CPU, and why."""
    naive = _scripts_module("train_naive_split")
    assert naive.split_devices(2, False) == ([0, 1], "naive split: first half on cuda:0, second half on cuda:1")
    devices, said = naive.split_devices(1, False)
    assert devices == [0, 0] and "both halves on cuda:0" in said
    devices, said = naive.split_devices(2, True)
    assert devices == ["cpu", "cpu"] and "LAB_FORCE_CPU=1" in said


@pytest.mark.full
@pytest.mark.parametrize("script, nproc", [("train_naive_split.py", 0), ("train_ddp.py", 2)])
def test_master_weights_are_fp32_whatever_the_checkpoint_dtype(tmp_path, script, nproc):
    """transformers 5 loads a half-precision checkpoint in its own dtype: the scripts trained bf16 master weights and
    Adam state without a word, and an fp16 checkpoint with --autocast fp16 failed ("Attempting to unscale FP16
    gradients"). They now load fp32 master weights (--dtype) and compute in the autocast dtype."""
    from transformers import AutoModelForCausalLM

    half = tmp_path / "fp16-checkpoint"
    model = AutoModelForCausalLM.from_config(hf_config("llama", n_layers=2, hidden=32, heads=4, vocab=64, seq_len=16,
                                                       kv_heads=2))
    model.to(torch.float16).save_pretrained(half)
    losses = _run(script, nproc, half, tmp_path / "out", "--autocast", "fp16")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert {p.dtype for p in saved.parameters()} == {torch.float32}


@pytest.mark.full
@pytest.mark.parametrize("extra", [["--method", "lora"],
                                   ["--method", "qlora", "--checkpointing", "--offload", "cpu"]])
def test_finetune_lora_script_trains_adapters_like_one_device(llama_dir, tmp_path, extra):
    """LoRA / QLoRA over 2 FSDP2 ranks: the first loss is the frozen base's (peft starts the adapters at zero; for
    QLoRA the base's NF4 values), the loss falls, and the saved adapters reload with peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers.finetune.lora import LoraModel, LoraSpec, base_for_merge
    from helpers.models.hf import HFModel

    losses = _run("finetune_lora.py", 2, llama_dir, tmp_path / "adapters", "--lora-rank", "4", *extra)
    base = base_for_merge(LoraModel(HFModel(str(llama_dir)), LoraSpec(method=extra[1])))
    assert len(losses) == 4
    assert abs(losses[0] - _one_device_first_loss(llama_dir, base)) < 1e-4
    assert losses[-1] < losses[0]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir), tmp_path / "adapters")
    trained_b = [p for n, p in reloaded.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)


@pytest.mark.full
def test_qlora_on_one_process_trains_without_fsdp2_and_refuses_offload(llama_dir, tmp_path):
    """torchao's NF4 base fails FSDP2's one-rank gather ("not enough values to unpack", seen on the GPU machine and
    reproduced on CPU): with one process the QLoRA script trains unsharded, and refuses CPU offload with the reason."""
    losses = _run("finetune_lora.py", 1, llama_dir, tmp_path / "adapters", "--method", "qlora", "--lora-rank", "4")
    assert len(losses) == 4 and losses[-1] < losses[0]
    with pytest.raises(AssertionError, match="needs FSDP2 over 2 or more processes"):
        _run("finetune_lora.py", 1, llama_dir, tmp_path / "x", "--method", "qlora", "--offload", "cpu")


@pytest.mark.full
def test_finetune_lora_refuses_fp16_instead_of_training_fp32(llama_dir, tmp_path):
    """--autocast fp16 kept the base in fp32 and computed nothing in fp16, without a word: refused with the reason."""
    with pytest.raises(AssertionError, match="fp16 would need a gradient scaler"):
        _run("finetune_lora.py", 0, llama_dir, tmp_path / "x", "--autocast", "fp16")
