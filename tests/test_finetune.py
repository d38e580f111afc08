"""LoRA and QLoRA (helpers.finetune) against one device and against peft itself.

Tolerances: an fp32 base or an NF4 base computing in fp32: loss within 1e-5 and adapter gradients within 1e-5
(absolute) of one device's: both hold the very same bytes (NF4 quantized once on the host, the same layout for any
number of ranks up to 8) and FSDP2 only moves them. A bf16 base: adapter gradients within 1e-2 of each tensor's
largest: the base's matmuls round to bf16's 8 mantissa bits (2^-8 = 0.4% per rounding) and a rank multiplies half the
rows, which kernels may block differently (on this CPU the two agree far closer, as measured, but GPUs pick
algorithms by shape). Adapters are always fp32.
"""
import hashlib

import pytest
import torch

from helpers.check import max_grad_diff
from helpers.finetune.lora import (LoraModel, LoraSpec, base_for_merge, full_layers, load_adapters, merged_model,
                                   save_adapters)
from helpers.finetune.quant import dequantization_peak, is_nf4, nf4_layout
from helpers.sizing.ledger import tensor_bytes
from helpers.models.data import SyntheticTokens, lm_loss
from helpers.models.hf import hf_config, save_hf_model
from helpers.models.layered import Stage
from helpers.precision import max_relative_diff
from helpers.runtime.rig import cpu_rig
from helpers.training.job import TrainJob, check_job
from helpers.training.loop import run_training

SEQ, BATCH, VOCAB = 16, 8, 128


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seq_len=32)
    return save_hf_model(cfg, tmp_path_factory.mktemp("lora") / "llama")


def _batch():
    x, y, _ = SyntheticTokens(BATCH, SEQ, VOCAB).masked_batch(0, BATCH)
    return x, y


def _reference(model: LoraModel):
    """One device: every layer, the same batch, loss and the adapters' gradients."""
    layers = full_layers(model)
    x, y = _batch()
    loss = lm_loss(Stage(layers)(x), y)
    loss.backward()
    return loss.item(), [p.grad.float() for layer in layers for p in layer.parameters() if p.requires_grad]


def _frozen_hash(layers) -> str:
    """A digest of every frozen tensor's bytes (an NF4 weight's codes, scales and table included)."""
    h = hashlib.sha256()
    for layer in layers:
        for name, p in layer.named_parameters():
            if p.requires_grad:
                continue
            parts = [getattr(p, n) for n in p.__tensor_flatten__()[0]] if is_nf4(p) else [p]
            for t in parts:
                h.update(name.encode())
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _adam_steps(model: LoraModel, layers, steps: int = 3) -> None:
    x, y = _batch()
    opt = torch.optim.Adam([p for layer in layers for p in layer.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(Stage(layers)(x), y).backward()
        opt.step()


# --- quick: one process --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=pytest.mark.full)])
def test_training_changes_only_the_adapters(base, method):
    """Frozen base bytes unchanged after Adam steps; the adapters move; only they have gradients."""
    model = LoraModel(base, LoraSpec(method=method, rank=4, alpha=8, init="random"))
    layers = full_layers(model)
    before, adapters = _frozen_hash(layers), [p.detach().clone() for l in layers for p in l.parameters()
                                              if p.requires_grad]
    _adam_steps(model, layers)
    assert _frozen_hash(layers) == before
    after = [p for l in layers for p in l.parameters() if p.requires_grad]
    assert len(after) == len(adapters) > 0 and all(not torch.equal(a, b) for a, b in zip(adapters, after))
    assert all(p.grad is None for l in layers for p in l.parameters() if not p.requires_grad)


def test_peft_init_starts_at_the_base_and_nf4_holds_4_bits(base):
    """With peft's init (B = 0) the adapted model computes the base exactly; QLoRA's block linears are NF4 and the
    ledger counts their real bytes (4-bit codes + scales: about 0.53 bytes per value, not 4)."""
    from transformers import AutoModelForCausalLM

    x, _ = _batch()
    hf = AutoModelForCausalLM.from_pretrained(base.path).eval()
    with torch.no_grad():
        torch.testing.assert_close(Stage(full_layers(LoraModel(base))).eval()(x), hf(input_ids=x).logits,
                                   rtol=0, atol=1e-5)
    q = full_layers(LoraModel(base, LoraSpec(method="qlora")))
    weight = q[1].block.mlp.up_proj.base_layer.weight
    assert is_nf4(weight) and tensor_bytes(weight) < weight.numel() * 0.6


@pytest.mark.full
def test_adapters_save_reload_and_merge_like_peft(base, tmp_path):
    """Trained adapters written with peft's save_pretrained reload (ours and peft's PeftModel.from_pretrained) and
    merge (merge_and_unload) into models that compute the same logits as base + adapters."""
    from peft import PeftModel

    for method in ("lora", "qlora"):
        model = LoraModel(base, LoraSpec(method=method, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")))
        layers = full_layers(model)
        _adam_steps(model, layers)
        x, _ = _batch()
        with torch.no_grad():
            ours = Stage(layers).eval()(x)
        trained = {i: {n: p.detach().clone() for n, p in l.named_parameters() if p.requires_grad}
                   for i, l in enumerate(layers) if any(p.requires_grad for p in l.parameters())}
        directory = save_adapters(model, trained, tmp_path / method)
        assert (directory / "adapter_config.json").is_file()
        reloaded = load_adapters(model, directory)
        assert all(torch.equal(reloaded[i][n], t) for i in trained for n, t in trained[i].items())
        with torch.no_grad():
            peft_model = PeftModel.from_pretrained(base_for_merge(model), str(directory)).eval()
            torch.testing.assert_close(peft_model(input_ids=x).logits, ours, rtol=0, atol=1e-5)
            torch.testing.assert_close(merged_model(model, directory)(input_ids=x).logits, ours, rtol=0, atol=1e-4)


def test_bad_lora_input_is_refused_before_anything_starts(base, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="rank must be a whole number >= 1"):
        LoraModel(base, LoraSpec(rank=0))
    with pytest.raises(ValueError, match="not nn.Linear layers"):
        LoraModel(base, LoraSpec(targets=("c_attn",)))
    gpt2 = save_hf_model(hf_config("gpt2", n_layers=1, hidden=32, heads=4, vocab=64, seq_len=16), tmp_path / "gpt2")
    with pytest.raises(ValueError, match="no nn.Linear layers"):
        LoraModel(gpt2, LoraSpec())
    model = LoraModel(base)
    with pytest.raises(ValueError, match="beyond the model's context of 32"):
        check_job(TrainJob(model, dp=2, data_parallel="fsdp2", batch=8, seq_len=64), cpu_rig(), oversubscribe=True)
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        check_job(TrainJob(model, dp=2, data_parallel="ddp", batch=8, seq_len=16, offload="cpu"), cpu_rig())
    with pytest.raises(ValueError, match="keeps its own dtypes"):
        check_job(TrainJob(model, dp=2, data_parallel="fsdp2", batch=8, seq_len=16, dtype="bf16"), cpu_rig())
    small = tmp_path / "small.pt"
    torch.save(torch.zeros(3, SEQ + 1, dtype=torch.long), small)
    with pytest.raises(ValueError, match="smaller than one batch"):
        check_job(TrainJob(model, dp=2, data_parallel="fsdp2", batch=8, seq_len=SEQ, data=str(small)), cpu_rig())
    assert isinstance(nf4_layout((60, 64)), str)  # rows that 8 ranks cannot share equally
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError, match="QLoRA needs torchao"):
        LoraModel(base, LoraSpec(method="qlora"))


# --- two ranks: FSDP2 against one device -----------------------------------------------------------------------------

@pytest.mark.full
@pytest.mark.parametrize("method, base_dtype, checkpointing, offload", [
    ("lora", "fp32", False, None),
    ("qlora", "fp32", True, "cpu"),
    ("lora", "bf16", True, None),
    ("qlora", "bf16", False, "cpu"),
])
def test_fsdp2_lora_step_equals_one_device(base, method, base_dtype, checkpointing, offload):
    """A 2-rank FSDP2 step (activation checkpointing, CPUOffloadPolicy: on the CPU rig it runs with
    pin_memory=False and moves nothing) computes one device's loss and adapter gradients; the frozen base gets
    no gradient and no optimizer state."""
    model = LoraModel(base, LoraSpec(method=method, rank=4, alpha=8, base_dtype=base_dtype, init="random"))
    ref_loss, ref_grads = _reference(model)
    job = TrainJob(model, dp=2, data_parallel="fsdp2", batch=BATCH, seq_len=SEQ, timed_steps=1, optimizer="adam",
                   return_grads=True, return_state=True, activation_checkpointing=checkpointing, offload=offload)
    res = run_training(job, cpu_rig(), oversubscribe=True)
    assert len(res.grads) == len(ref_grads)
    assert abs(res.loss - ref_loss) < 1e-5
    if base_dtype == "fp32":
        assert max_grad_diff(ref_grads, res.grads) <= 1e-5
    else:
        assert max_relative_diff(ref_grads, res.grads) <= 1e-2
    adapter_bytes = sum(g.numel() * 4 for g in ref_grads)
    assert sum(m.grads for m in res.memory) == adapter_bytes
    steps = 2 * 4 * len(ref_grads)  # Adam's fp32 step counter, one per adapter tensor on each rank
    assert sum(m.optimizer for m in res.memory) == 2 * adapter_bytes + steps  # two moments, sharded
    assert res.state and all("lora_" in name for layer in res.state.values() for name in layer)


def test_finetune_each_refuses_bad_input_before_anything_starts(base):
    from helpers.finetune.lora import finetune_each

    with pytest.raises(ValueError, match="no fine-tuning method given"):
        finetune_each(base.path, ())
    with pytest.raises(ValueError, match="unknown method 'dora'"):
        finetune_each(base.path, ("lora", "dora"))
    with pytest.raises(ValueError, match="steps must be at least 3"):
        finetune_each(base.path, steps=2)


@pytest.mark.full
def test_finetune_each_runs_every_method_in_one_launch(tmp_path, monkeypatch):
    """LoRA and QLoRA of one base on the standard library's text in one launch: each trains only its adapters, saves
    them in its own folder, and starts from the base (peft's init: the held-out loss before is the base's, for QLoRA
    up to 4-bit rounding)."""
    import helpers.training.loop as loop
    from helpers.finetune.lora import finetune_each, small_llama

    launches = []
    real_run = loop.run
    monkeypatch.setattr(loop, "run", lambda *a, **k: launches.append(1) or real_run(*a, **k))
    llama = small_llama(tmp_path / "llama", vocab=320, seq_len=32, n_layers=2, hidden=64)
    out = finetune_each(llama.path, ("lora", "qlora"), steps=3, batch=BATCH, seq_len=SEQ, rank=4,
                        save_to=tmp_path / "adapters", workdir=tmp_path / "work", held_out_windows=4,
                        max_chars=20_000, rig=cpu_rig())
    assert list(out) == ["lora", "qlora"] and len(launches) == 1
    for method, result in out.items():
        assert result.model.spec.method == method and len(result.losses) == 3
        assert result.saved == tmp_path / "adapters" / method and (result.saved / "adapter_config.json").is_file()
        assert result.state and all("lora_" in name for layer in result.state.values() for name in layer)
        assert result.held_out_path.is_file() and len(result.held_out_loss) == len(result.samples) == 2
    assert abs(out["lora"].held_out_loss[0] - out["qlora"].held_out_loss[0]) < 0.1


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_nf4_dequantization_peak_is_measured_as_the_planner_prices_it(dtype, name):
    """torchao's get_original_weight holds int64 indices and intermediate halves: far more than the dequantized
    weight's own bytes (what the planner counted before). The planner's figure is this measurement."""
    from helpers.sizing.state import training_data

    measured = dequantization_peak(dtype)
    assert measured == dequantization_peak(dtype, (512, 2048)), "bytes per element, whatever the shape"
    assert measured == training_data()["nf4_dequantization"]["peak_bytes_per_element"][name]
    assert measured > 3 * dtype.itemsize
