"""GPU sizes planned, not guessed: every notebook's GPU constants, read from its own parameters cell, fit two RTX
3090s and one with 15% headroom, by the course's memory model run on the meta device (helpers.gpu_sizes)."""
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.gpu_sizes import (NotebookPlan, check_plan, notebook_constants, plan_notebook, rtx3090_rigs, shortfalls,
                               stage_bytes, training_step, training_step_peak)
from helpers.gpu_sizes.footprint import HFSpec, layer_bytes
from helpers.units import GiB
from helpers.sizing.ledger import MemoryLedger, measure_step_memory
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.runtime.rig import cpu_rig

STACK_NOTEBOOKS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "10"]
HF_NOTEBOOKS = ["09", "11", "12"]  # Hugging Face models: importing transformers takes longer than this tier allows


def _over(plan: NotebookPlan) -> str:
    return ", ".join(f"{d} {plan.peak(d) / GiB:.1f} GiB ({plan.heaviest(d).name})" for d in plan.devices)


def _assert_fits(notebook: str) -> None:
    for kind, rig in rtx3090_rigs().items():
        plan = plan_notebook(notebook, rig)
        assert plan.fits, (f"notebook {notebook} on {kind}: {_over(plan)}; budget {plan.budget / GiB:.1f} GiB per "
                           f"card: lower {plan.knob_text()}")


def test_the_ledger_tells_meta_storages_apart():
    """Every meta storage has data_ptr 0: the ledger must tell them apart by identity, and still count views once."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("meta")
    ledger = MemoryLedger(["meta"])
    ledger.assign("meta", model)
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    with ledger.track_activations("meta"):
        h = model[1](model[0](x))
        out = model[2](h.view(4, 16))  # a view of ReLU's output: saved once more, the same storage
    # Linear saves its input (4x8 fp32), ReLU its output (4x16, which the second Linear saves again)
    assert ledger.live_activations("meta") == 4 * 8 * 4 + 4 * 16 * 4
    assert ledger.largest_saved("meta") == 4 * 16 * 4
    out.sum().backward()
    assert ledger.live_activations("meta") == 0 and x.grad.shape == x.shape


def test_meta_activations_equal_the_cpu_ledger():
    """The meta count is what the ledger measures on CPU, up to fixed-size tensors (the position indices, the loss's
    weight: a few hundred bytes) that measuring one sequence and scaling counts once per sequence; with attention,
    CPU's fused kernel keeps what CUDA's does (q, k, v, output, log-sum-exp) but for the log-sum-exp's padding."""
    for attention, tolerance in ((False, 0.001), (True, 0.05)):
        cfg = StackConfig(hidden=64, n_blocks=2, seq_len=16, attention=attention)
        model = build_stack(cfg)
        x, y = SyntheticTokens(3, cfg.seq_len, cfg.vocab).batch(0, 3)
        cpu = measure_step_memory(model, x, y, lm_loss, torch.optim.SGD(model.parameters(), lr=0.0))
        meta = stage_bytes(cfg, 3)
        assert meta.params == cpu.params
        assert cpu.activations <= meta.activations <= (1 + tolerance) * cpu.activations, (attention, meta, cpu)


# torch.cuda.max_memory_allocated of one training step on an H200 (the second of three, gradients kept), in GiB:
# measured in this branch's GPU session (see helpers.gpu_sizes.footprint)
H200_STACK = {(2048, 8, 16, 512, "sgd"): 11.58, (1024, 8, 32, 512, "sgd"): 9.28, (1024, 8, 32, 512, "adam"): 10.04,
              (1024, 4, 8, 256, "sgd"): 1.01, (1024, 12, 32, 256, "adam"): 8.56}
H200_HF = {"llama": 7.75, "gpt2": 7.58}  # 12 x 768, vocabulary 50257, 8 x 512 tokens, bf16 autocast, AdamW


def test_the_step_plan_covers_what_an_h200_measured():
    """The plan of a step is at least what the GPU's allocator saw, and within 5% of it for the block stack."""
    for (hidden, blocks, batch, seq, optimizer), measured in H200_STACK.items():
        planned = training_step_peak(hidden, blocks, batch, seq, optimizer).total / GiB
        assert measured <= planned <= 1.05 * measured, (hidden, blocks, batch, seq, optimizer, planned)


@pytest.mark.full
def test_the_plan_of_a_hugging_face_step_covers_what_an_h200_measured():
    """Hugging Face models under bf16 autocast (played on meta): at least what the GPU saw, within 15%."""
    for family, measured in H200_HF.items():
        spec = HFSpec(family, 12, 768, 4, 50257, 512, tie_embeddings=family == "gpt2",
                      kv_heads=None if family == "gpt2" else 2)
        planned = training_step(stage_bytes(spec, 8, autocast=True), "adam", autocast=True).total / GiB
        assert measured <= planned <= 1.15 * measured, (family, planned)


def test_constants_come_from_the_notebooks_own_parameters_cell():
    rigs = rtx3090_rigs()
    before = set(Path(tempfile.gettempdir()).iterdir())
    assert notebook_constants("05", rigs["two_gpus"])["HIDDEN"] == 1024
    assert notebook_constants("05", cpu_rig())["HIDDEN"] == 256
    budgets = [notebook_constants("03", rigs[k])["BUDGET"] for k in ("two_gpus", "one_gpu")]
    assert budgets[0] == 2 * budgets[1], "03 reads rig.capacity_bytes: the one-GPU rig gives each stage half"
    notebook_constants("11", rigs["two_gpus"])  # its parameters cell makes a temporary directory
    assert set(Path(tempfile.gettempdir()).iterdir()) == before


@pytest.mark.parametrize("notebook", STACK_NOTEBOOKS)
def test_notebook_fits_two_3090s_and_one(notebook):
    _assert_fits(notebook)


@pytest.mark.full
@pytest.mark.parametrize("notebook", HF_NOTEBOOKS)
def test_hugging_face_notebook_fits_two_3090s_and_one(notebook):
    _assert_fits(notebook)


def test_the_old_sizes_ran_out_of_memory():
    """What the notebooks had before (05-07: hidden 2048, batch 128 x 512 tokens) does not fit a 3090 by far."""
    rig = rtx3090_rigs()["two_gpus"]
    for notebook in ("05", "06", "07"):
        constants = {**notebook_constants(notebook, rig), "HIDDEN": 2048, "BATCH": 128}
        plan = plan_notebook(notebook, rig, constants)
        assert min(plan.peaks().values()) > plan.capacity, _over(plan)


def test_not_enough_free_memory_says_what_to_lower():
    plan = plan_notebook("05", rtx3090_rigs()["two_gpus"])
    roomy = {d: plan.peak(d) for d in plan.devices}
    assert shortfalls(plan, roomy) == []
    tight = {**roomy, "cuda:1": 2 * GiB}
    [message] = shortfalls(plan, tight)
    assert message.startswith("notebook 05 plans ") and "on cuda:1 but 2.0 GiB are free" in message
    assert "lower BATCH (now 32) or SEQ (now 512)" in message


def test_on_the_cpu_rig_the_check_prints_the_3090_plan_without_cuda(capsys, monkeypatch):
    def no_cuda(*_, **__):
        raise AssertionError("CUDA touched on the CPU rig")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    check_plan("08", cpu_rig())
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("GPU sizes planned for RTX 3090s") and "one GPU: cuda:0" in out[0]


def test_layers_are_measured_once_per_sequence():
    """Activations grow linearly with the batch: the plan measures one sequence and scales."""
    cfg = StackConfig(hidden=32, n_blocks=2, seq_len=8)
    assert stage_bytes(cfg, 6).activations == 6 * sum(layer.saved for layer in layer_bytes(cfg)) > 0
