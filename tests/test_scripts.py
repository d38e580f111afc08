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


def _one_device_first_loss(model_dir: Path, model=None, autocast: torch.dtype | None = None) -> float:
    """The first batch the scripts draw, on one device with the original weights in fp32 (or `model`), under
    `autocast` if given."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from transformers import AutoModelForCausalLM

        from _common import batches, token_loss_sum
    finally:
        sys.path.remove(str(SCRIPTS))

    class Flags:
        data, text, batch, seq_len, seed = None, None, 8, 16, 0

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    x, y = batches(Flags, model.config.vocab_size, 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
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
    # one device: the fp16 checkpoint's values as fp32 weights, computing under fp16 autocast (fp16 rounds every
    # product: within 1e-3 of the loss, as the parity tests allow 16-bit runs)
    reference = _one_device_first_loss(half, autocast=torch.float16)
    assert abs(losses[0] - reference) < 1e-3 * reference, (losses[0], reference)
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


# --- the planner's memory flags: a full fine-tune of Llama-3-8B on two RTX 3090s, at the CPU rig's size ------------

EIGHT_B_FLAGS = ["--dtype", "bf16", "--optimizer", "adamw-4bit", "--technique", "optimizer-in-backward,chunked-loss"]
EIGHT_B_PLAN = dict(method="full", strategy="fsdp2", optimizer="adamw-4bit", precision="pure",
                    techniques=("optimizer-in-backward", "chunked-loss"))  # helpers.plan --train's same flags


@pytest.fixture(scope="module")
def llama_4bit_dir(tmp_path_factory):
    """Big enough that torchao's 4-bit AdamW quantizes nearly every shard (>= 4096 numbers, whole 128-blocks)."""
    path = tmp_path_factory.mktemp("scripts") / "llama-4bit"
    save_hf_model(hf_config("llama", n_layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=256,
                            seq_len=64), path)
    return path


def _run_lines(script: str, nproc: int, model_dir: Path, out: Path, *extra: str) -> list[dict]:
    """`_run`, returning every JSON record the ranks print (losses, and --memory-report's per-rank bytes; two
    ranks' lines may share a line of torchrun's output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(SCRIPTS / script),
           "--model", str(model_dir), "--save-to", str(out), *FLAGS, *extra]
    proc = run_command(cmd, timeout_s=400, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1",
                                                              TMPDIR=str(out.parent)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import re

    return [json.loads(m) for m in re.findall(r'\{"step": [^}]*\}|\{"rank": \d+, "memory": \{[^}]*\}\}', proc.stdout)]


def _one_layer_saved_bytes(model_dir: Path, batch: int, seq_len: int) -> int:
    """What backward's recomputation of one checkpointed decoder layer saves, measured: layer 0 of the bf16 model run
    without checkpointing on one rank's micro-batch, its saved tensors counted by the course's ledger (the
    recomputation itself saves inside torch.utils.checkpoint's own hooks, where no ledger can see it)."""
    from transformers import AutoModelForCausalLM

    from helpers.sizing.ledger import MemoryLedger

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ledger = MemoryLedger(["layer"])
    tracking = ledger.track_activations("layer")
    layer = model.model.layers[0]

    def enter(*_):
        tracking.__enter__()

    def leave(*_):  # a forward hook's return value would replace the layer's output
        tracking.__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    model(input_ids=torch.randint(model.config.vocab_size, (batch, seq_len)))
    return ledger.device("layer").activations


@pytest.mark.full
def test_train_fsdp2_with_the_8b_flags_measures_within_the_plan(llama_4bit_dir, tmp_path):
    """The 8B full fine-tune's flags (bf16 weights, torchao 4-bit AdamW with stochastic rounding, the step in
    backward, the chunked loss) over 2 FSDP2 ranks: the first loss is one device's in bf16, the loss falls, and each
    rank's bytes, measured by the course's ledger, are within 10% of plan_training for the same small job, part by
    part: weights (+ buffers), the gradients held at once (one unit's shard), the 4-bit optimizer state, and the
    activations (what autograd holds at the end of forward, from the script; plus one layer's recomputation, measured
    here on one process). Not compared: the planner's workspace (gathered layers, the reduce-scatter buffer, one
    chunk's logits, a layer's transients: estimates of transients the ledger does not hold), the optimizer step's
    temporaries (none with the step in backward is kept), and the reserve (CUDA context, allocator rounding): on the
    CPU rig every rank is one process heap of some hundred MiB of Python and torch, beside these few hundred KiB."""
    from transformers import AutoModelForCausalLM

    from helpers.finetune.memory_plan import plan_training
    from helpers.sizing.training import saved_activation_bytes

    batch, seq_len = 8, 16  # FLAGS: the global batch, 4 sequences a rank
    lines = _run_lines("train_fsdp2.py", 2, llama_4bit_dir, tmp_path / "out", *EIGHT_B_FLAGS, "--memory-report")
    losses = [line["loss"] for line in lines if "loss" in line]
    measured = {line["rank"]: line["memory"] for line in lines if "memory" in line}
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    bf16 = AutoModelForCausalLM.from_pretrained(llama_4bit_dir, dtype=torch.bfloat16)
    reference = _one_device_first_loss(llama_4bit_dir, bf16)
    assert abs(losses[0] - reference) < 1e-3 * reference, (losses[0], reference)

    plan = plan_training(str(llama_4bit_dir), context=seq_len, batch=batch // 2, gpus="2x cpu=24GiB", suggest=False,
                         **EIGHT_B_PLAN)
    acts = saved_activation_bytes(plan.shape, seq_len, batch // 2, activation_checkpointing=True, chunked_loss=True)
    recompute = _one_layer_saved_bytes(llama_4bit_dir, batch // 2, seq_len)
    assert sorted(measured) == [0, 1]
    for rank, got in measured.items():
        d = plan.devices[rank]
        assert d.activation_bytes == acts.peak  # the planner's activations: held at the end of forward + recompute
        parts = {"weights": (got["params"] + got["buffers"], d.trainable_bytes + d.frozen_bytes),
                 "gradients": (got["grads"], d.gradient_bytes),
                 "optimizer": (got["optimizer"], d.optimizer_bytes),
                 "activations held": (got["activations"], acts.saved),
                 "one layer recomputed": (recompute, acts.recompute)}
        parts["compared total"] = tuple(map(sum, zip(*parts.values())))
        said = f"rank {rank}: " + ", ".join(f"{k} {m} measured / {p} planned ({(m - p) / p:+.1%})"
                                            for k, (m, p) in parts.items())
        print(said)
        assert got["host_activations"] == 0, said
        for name, (m, p) in parts.items():
            assert abs(m - p) <= 0.1 * p, said


@pytest.mark.parametrize("extra, why", [
    (["--technique", "optimizer-in-backward", "--microbatches", "2"], "accumulation needs the gradients kept"),
    (["--technique", "optimizer-in-backward", "--autocast", "fp16"], "loss scaling checks every gradient"),
    (["--technique", "optimizer-in-backward", "--checkpoint-dir", "x"], "the checkpointer does not save"),
    (["--technique", "chunked-loss,offload"], "unknown --technique offload"),
    (["--optimizer", "adamw-2bit"], "invalid choice: 'adamw-2bit'"),
])
def test_train_fsdp2_refuses_what_the_library_refuses_before_the_process_group(model_dir, monkeypatch, capsys,
                                                                                extra, why):
    """train_fsdp2.py parses its flags before init() joins the process group: the combinations train() refuses
    (helpers.training.job.check_job) stop there, with the reason."""
    common = _scripts_module("_common")
    monkeypatch.setattr(sys, "argv", ["train_fsdp2.py", "--model", str(model_dir), "--seq-len", "16", *extra])
    with pytest.raises(SystemExit):
        common.parse("FSDP2", memory=True)
    assert why in capsys.readouterr().err


def test_train_fsdp2_takes_techniques_comma_separated_or_repeated(model_dir, monkeypatch):
    common = _scripts_module("_common")
    monkeypatch.setattr(sys, "argv", ["train_fsdp2.py", "--model", str(model_dir), "--seq-len", "16",
                                      "--technique", "chunked-loss, optimizer-in-backward",
                                      "--technique", "activation-offload", "--optimizer", "adamw-8bit"])
    ns = common.parse("FSDP2", memory=True)
    assert ns.technique == ["chunked-loss", "optimizer-in-backward", "activation-offload"]
    assert ns.optimizer == "adamw-8bit" and ns.optimizer in common.OPTIMIZERS
