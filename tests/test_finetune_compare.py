"""The planner beside a run (helpers.finetune.compare): its figures for a LoRA / QLoRA / full fine-tuning run of the
course, in the ledger's parts, against the ledger on one device; and what notebook 12 draws and tabulates.

On one device the run is the course's layers (`full_layers`, checkpointed as the training loop checkpoints them: every
layer between the embedding and the head) with one Adam step; the planner is asked for one GPU. The counting
differences `planned_parts` documents are checked to the byte: Adam's 4-byte step counter per trainable tensor, and the
final norm, which the loop checkpoints (keeping its input) where the planner keeps what the norm saves."""
import pytest
import torch

from helpers.activation_checkpointing import checkpoint_in_place
from helpers.finetune.compare import planned_parts, plot_plans, published_comparison, run_format, summary_row
from helpers.finetune.lora import LoraModel, LoraSpec, full_layers, small_llama
from helpers.finetune.memory_plan import plan_training
from helpers.sizing.state import training_data
from helpers.sizing.ledger import MemoryLedger
from helpers.models.data import SyntheticTokens, lm_loss
from helpers.models.layered import Stage

SEQ, BATCH, HIDDEN = 16, 2, 64


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return small_llama(tmp_path_factory.mktemp("compare") / "llama", vocab=128, seq_len=32, n_layers=2, hidden=HIDDEN)


def _one_device_ledger(model: LoraModel):
    """One checkpointed Adam step of `model` on one device, as helpers.sizing.ledger's ledger counts it."""
    layers = full_layers(model)
    for layer in layers[1:-1]:
        checkpoint_in_place(layer)
    stage = Stage(layers)
    ledger = MemoryLedger(["device"])
    ledger.assign("device", stage)
    ledger.optimizer = torch.optim.Adam([p for p in stage.parameters() if p.requires_grad], lr=1e-3)
    x, y = SyntheticTokens(BATCH, SEQ, model.vocab_size).batch(0, BATCH)
    with ledger.track_activations("device"):
        loss = lm_loss(stage(x), y)
    loss.backward()
    ledger.optimizer.step()
    return ledger.device("device")


def test_planned_parts_equal_the_ledger_on_one_device_but_for_the_documented_counting(base):
    model = LoraModel(base, LoraSpec("lora", rank=4, alpha=8))
    plan, planned = planned_parts(model, BATCH, SEQ, ranks=1)
    measured = _one_device_ledger(model)
    tensors = sum(len(u.trainable) for u in plan.shape.units)
    assert measured.params == planned.params and measured.grads == planned.grads
    assert measured.optimizer == planned.optimizer + 4 * tensors  # Adam's step counters
    # the final norm: the loop keeps its input (4 bytes x hidden per token, fp32), the planner what it saves (its fp32
    # input, and an fp32 rsqrt per token)
    assert planned.activations - measured.activations == 4 * BATCH * SEQ
    assert plan.shape.trainable_params == sum(p.numel() for l in full_layers(model) for p in l.parameters()
                                              if p.requires_grad)


def test_run_format_prices_torchao_nf4_in_the_runs_compute_dtype():
    nf4 = run_format("qlora", "fp32")
    assert nf4.quantized and nf4.activation_bytes == 4 and nf4.scales == run_format("qlora", "bf16").scales
    assert run_format("qlora", "bf16").name == "nf4-torchao" and run_format("lora", "bf16").name == "bf16"
    assert not run_format("full", "fp32").quantized


def test_the_planner_takes_a_config_as_well_as_its_directory(base):
    by_dir = plan_training(base.path, "qlora", context=SEQ, batch=BATCH, lora_rank=4, dtype=run_format("qlora", "fp32"))
    by_config = plan_training(base.config, "qlora", context=SEQ, batch=BATCH, lora_rank=4,
                              dtype=run_format("qlora", "fp32"))
    assert [d.peak_bytes for d in by_dir.devices] == [d.peak_bytes for d in by_config.devices]


def test_tables_and_the_plot_of_real_plans():
    import matplotlib

    matplotlib.use("Agg")
    plans = {"7B full": plan_training("llama-2-7b", "full"), "7B QLoRA": plan_training("llama-2-7b", "qlora")}
    rows = [summary_row(name, plan) for name, plan in plans.items()]
    assert [r["fits"] for r in rows] == [False, True]
    ax = plot_plans(plans)
    assert len(ax.patches) == 7 * len(plans)  # one segment per part per plan
    published = published_comparison()
    assert len(published) == len(training_data()["published_runs"]["runs"])
    assert all(0.85 <= r["planner / published"] <= 1.15 for r in published)


def test_planned_parts_takes_activation_checkpointing_and_its_old_name_warns():
    """The job's word (`activation_checkpointing`); `checkpointing=` still plans the same, with a warning."""
    from helpers.finetune.lora import LoraModel, LoraSpec
    from helpers.models.hf import HFModel, hf_config, save_hf_model
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        save_hf_model(hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=32), folder)
        model = LoraModel(HFModel(folder), LoraSpec("lora", 4, 8))
        _, new = planned_parts(model, 2, 16, activation_checkpointing=False)
        with pytest.warns(DeprecationWarning, match="checkpointing= is now activation_checkpointing="):
            _, old = planned_parts(model, 2, 16, checkpointing=False)
        assert new == old != planned_parts(model, 2, 16)[1]
