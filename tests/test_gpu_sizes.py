"""GPU sizes planned, not guessed: every notebook that uses a GPU declares its plan after its parameters and calls
`check_plan` (found by walking notebooks/*.ipynb, no list), and its GPU constants fit two RTX 3090s and one with 15%
headroom, by the course's memory model run on the meta device (helpers.gpu_sizes)."""
import ast
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.gpu_sizes import (NotebookPlan, check_plan, recorded_plans, rtx3090_rigs, shortfalls, stage_bytes,
                               training_step, training_step_peak)
from helpers.gpu_sizes.footprint import HFSpec
from helpers.units import GiB
from helpers.sizing.ledger import MemoryLedger, measure_step_memory
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.runtime.rig import cpu_rig
from tests.notebook_plans import NOTEBOOKS, declared, declared_plan, notebook_id, plan_cells, records, uses_a_gpu

REPO = Path(__file__).resolve().parent.parent
GPU_NOTEBOOKS = [p for p in NOTEBOOKS if uses_a_gpu(p)]


def _over(plan: NotebookPlan) -> str:
    return ", ".join(f"{d} {plan.peak(d) / GiB:.1f} GiB ({plan.heaviest(d).name})" for d in plan.devices)


def _path(notebook: str) -> Path:
    return next(p for p in NOTEBOOKS if notebook_id(p) == notebook)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_every_notebook_that_uses_a_gpu_is_planned_and_fits_two_3090s_and_one(path):
    """The rule holds by construction: a new notebook that takes the course's rig is walked here too, and fails
    until it declares a plan (a `check_plan` call after its parameters) that fits with 15% headroom."""
    if not uses_a_gpu(path):
        pytest.skip(f"{path.name} never touches a GPU")
    for kind in rtx3090_rigs():
        plan = declared_plan(path, kind)
        assert plan.notebook == notebook_id(path), f"{path.name} checks the plan of notebook {plan.notebook}"
        assert plan.fits, (f"notebook {plan.notebook} on {kind}: {_over(plan)}; budget {plan.budget / GiB:.1f} GiB "
                           f"per card: lower {plan.knob_text()}")


def test_a_notebook_that_uses_a_gpu_without_a_plan_fails_the_walk(tmp_path):
    """What let 06b escape: it used the GPU and was on nobody's list. Walked, it has no check_plan call and fails;
    and a check_plan call without a declared plan is refused where the notebook runs."""
    cells = [{"cell_type": "code", "source": [s], "metadata": {}, "outputs": []} for s in
             ("from helpers.course import setup\nrig = setup(seed=0)", "HIDDEN = 256 if rig.is_cpu else 4096",
              "x = torch.zeros(HIDDEN, HIDDEN, device=rig.devices[0])")]
    path = tmp_path / "99_unplanned.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert uses_a_gpu(path)
    with pytest.raises(LookupError, match="no cell calls check_plan"):
        plan_cells(path)
    with pytest.raises(TypeError, match="declare its plan"):
        check_plan("99", cpu_rig(), {}, None, ())


def test_the_recorded_plans_are_the_notebooks_own():
    """data/gpu_plans.json (what the doctor and the CPU rig's check print) is what the notebooks declare today."""
    recorded = {nb: {k: r.as_dict() for k, r in per_rig.items()} for nb, per_rig in recorded_plans().items()}
    computed = {nb: {k: r.as_dict() for k, r in per_rig.items()} for nb, per_rig in records().items()}
    assert recorded == computed, "data/gpu_plans.json is stale: rewrite it with `python -m tests.notebook_plans`"


def test_the_library_never_reads_a_notebook():
    """No notebook names, notebook JSON or exec in helpers/, and no import cycle in helpers.gpu_sizes: the pieces
    (parts) build on the plans, never the other way."""
    reads = re.compile(r"""\.ipynb['"]|\[\s*['"]cells['"]\s*\]|\bexec\(""")  # a notebook path, its cells, exec
    for module in (REPO / "helpers").rglob("*.py"):
        assert not reads.search(module.read_text()), module
    plans = ast.parse((REPO / "helpers/gpu_sizes/plans.py").read_text())
    imported = {n.module for n in ast.walk(plans) if isinstance(n, ast.ImportFrom)}
    assert "helpers.gpu_sizes.parts" not in imported


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
    assert declared(_path("05"), rigs["two_gpus"])["constants"]["HIDDEN"] == 1024
    assert declared(_path("05"), cpu_rig())["constants"]["HIDDEN"] == 256
    budgets = [declared(_path("03"), rigs[k])["constants"]["BUDGET"] for k in ("two_gpus", "one_gpu")]
    assert budgets[0] == 2 * budgets[1], "03 reads rig.capacity_bytes: the one-GPU rig gives each stage half"
    declared(_path("11"), rigs["two_gpus"])  # its parameters cell makes a temporary directory
    assert set(Path(tempfile.gettempdir()).iterdir()) == before


def test_the_old_sizes_ran_out_of_memory():
    """What the notebooks had before (05-07: hidden 2048, batch 128 x 512 tokens; 06b until it was planned: the same)
    does not fit a 3090 by far: 06b's reference step alone plans over 70 GiB."""
    for notebook in ("05", "06", "07"):
        plan = declared_plan(_path(notebook), "two_gpus", HIDDEN=2048, BATCH=128)
        assert min(plan.peaks().values()) > plan.capacity, _over(plan)
    old = declared_plan(_path("06b"), "two_gpus", HIDDEN=2048, BATCH=128)
    reference = next(phase for phase in old.phases if phase.name == "section 4: the reference")
    assert old.phase_bytes(reference, "cuda:0") > 70 * GiB, _over(old)


def test_not_enough_free_memory_says_what_to_lower():
    plan = declared_plan(_path("05"), "two_gpus")
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
    check_plan("08", cpu_rig(), {"BATCH": 8}, lambda rig: [], knobs=("BATCH",))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("GPU sizes planned for RTX 3090s") and "one GPU: cuda:0" in out[0]


def test_layers_are_measured_once_per_sequence():
    """Activations grow linearly with the batch: the plan measures one sequence on the meta device and scales. The
    reference is a real step's ledger at each batch size (the plan counts the loss's inputs with the last layer, a
    few hundred bytes a sequence more than the step keeps: within 3%, never below)."""
    cfg = StackConfig(hidden=32, n_blocks=2, seq_len=8)
    measured = {}
    for batch in (1, 6):
        model = build_stack(cfg)
        x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
        measured[batch] = measure_step_memory(model, x, y, lm_loss, torch.optim.SGD(model.parameters())).activations
        assert measured[batch] <= stage_bytes(cfg, batch).activations <= 1.03 * measured[batch], batch
    assert measured[6] > 5.9 * measured[1]  # what the step itself keeps grows with the batch, as the plan assumes


def test_the_doctor_checks_every_notebook_that_uses_a_gpu():
    """The doctor's table is the walk's (data/gpu_plans.json), so it cannot skip a notebook, as it skipped 06b."""
    from helpers.doctor import notebook_plan_checks

    checks = notebook_plan_checks(cpu_rig())
    assert {c.name for c in checks} == {f"notebook {notebook_id(p)}: GPU sizes" for p in GPU_NOTEBOOKS}
    assert all(c.status == "PASS" for c in checks), [c for c in checks if c.status != "PASS"]


def test_the_gpu_suite_replays_every_recorded_step_on_the_cpu_rig():
    """`python -m helpers.doctor --gpu-suite` on a GPU sets each notebook's step at its GPU sizes beside its plan; in
    CI (no GPU) the same path runs every recorded step at small sizes."""
    from helpers.gpu_sizes.suite import gpu_suite

    rows = gpu_suite(torch.device("cpu"))
    recorded = {(nb, what) for nb, per_rig in recorded_plans().items() for what, _ in per_rig["one_gpu"].steps}
    assert {(r["notebook"], r["step"]) for r in rows} == recorded and len(recorded) >= 12
    assert all(r["planned GiB"] > 0 and r["measured GiB"] is None and r["reserved GiB"] is None for r in rows)


def test_a_cards_memory_is_read_in_one_place():
    """What CUDA reports for a card comes from the one GPU description (helpers.sizing.gpus.gpu): no other module,
    script or notebook reads data/inference.json's figure itself."""
    from helpers.gpu_sizes.plans import CARD, card_bytes
    from helpers.sizing.gpus import gpu

    assert card_bytes() == gpu(CARD).capacity_bytes and gpu(CARD).capacity_source
    readers = [str(f.relative_to(REPO)) for folder in ("helpers", "scripts", "notebooks", "tools")
               for f in sorted((REPO / folder).rglob("*")) if f.suffix in (".py", ".ipynb")
               and "cuda_total_mib" in f.read_text()]
    assert readers == ["helpers/sizing/gpus.py"]
