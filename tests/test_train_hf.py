"""Real Hugging Face models through every engine and strategy, against one device: tied embeddings, masks and
padding, grouped-query attention, sliding windows, mixed precision, dropout, several optimizer steps, and
save_pretrained / reload. (The layer view itself is checked against HF's own forward in test_hf.py.)

Tolerances: fp32 gradients within 1e-5 of one device's (absolute); after four Adam steps weights within 1e-5 (Adam
divides by sqrt(v), which amplifies round-off of tiny gradients); bf16 autocast within 5e-2 of each tensor's
largest gradient (8 mantissa bits), fp16 within 1e-2 (11 bits).
"""
from dataclasses import dataclass

import pytest
import torch

from helpers.check import max_grad_diff
from helpers.models import SyntheticTokens, lm_loss
from helpers.models.hf import HFModel, hf_config, save_hf_model
from helpers.models.layered import Stage, microbatch_seed, with_seed
from helpers.pipeline.stages import split_model
from helpers.pipeline.threaded import ThreadedPipeline
from helpers.precision import Precision, max_relative_diff
from helpers.runtime.rig import cpu_rig
from helpers.training import train
from helpers.training.job import TrainJob
from helpers.training.loop import run_training

SEQ, BATCH, VOCAB = 16, 8, 64
FULL = pytest.mark.full  # the full tier (pytest --full)
CONFIGS = {
    "gpt2-tied": dict(family="gpt2", tie_embeddings=True),
    "llama-gqa": dict(family="llama", kv_heads=2),
    "mistral-window": dict(family="mistral", kv_heads=2, sliding_window=6),
    "qwen2": dict(family="qwen2", kv_heads=2),
    "gemma-tied": dict(family="gemma", kv_heads=1, tie_embeddings=True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family built from a config with random weights and saved locally, as a user saves a checkpoint."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, kw in CONFIGS.items():
        kw = dict(kw)
        cfg = hf_config(kw.pop("family"), n_layers=2, hidden=32, heads=4, vocab=VOCAB, seq_len=SEQ, **kw)
        out[name] = save_hf_model(cfg, root / name)
    return out


def _data(padding: str):
    return SyntheticTokens(BATCH, SEQ, VOCAB, padding=padding).masked_batch(0, BATCH)


def reference(model: HFModel, padding: str = "none", precision: Precision = Precision(), seed: int | None = None):
    """One device: the whole layer list (a tied weight shared, as in the original model), one batch."""
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), torch.device("cpu"))
    stage = Stage([layer.to(precision.weights) for layer in layers])
    x, y, mask = _data(padding)
    ctx = model.context(x, mask)
    if seed is not None:
        ctx = with_seed(ctx, seed)
    with precision.context(torch.device("cpu")):
        loss = lm_loss(stage(x, ctx), y)
    loss.backward()
    return loss.item(), [p.grad.float().clone() for layer in layers for p in layer.parameters()]


def _check(ref, loss, grads, precision=Precision()):
    ref_loss, ref_grads = ref
    assert len(grads) == len(ref_grads)
    if precision.compute == "fp32":
        assert abs(loss - ref_loss) < 1e-5 and max_grad_diff(ref_grads, grads) <= 1e-5
    else:
        assert abs(loss - ref_loss) < 1e-3 * ref_loss
        assert max_relative_diff(ref_grads, grads) <= precision.tolerance


@pytest.mark.parametrize("attention", [pytest.param("eager", marks=FULL), "sdpa"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_threads_engine_equals_one_device(saved, name, padding, attention):
    model = HFModel(saved[name].path, attention)
    ref = reference(model, padding)
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), torch.device("cpu"))
    split = split_model(layers, [2], [torch.device("cpu")] * 2)
    if model.tied:
        assert len(split.tied) == 1, "the embedding and the head became one copy per stage"
    x, y, mask = _data(padding)
    loss = ThreadedPipeline(split, "1f1b", 4, context=model.context).step(x, y, mask)
    _check(ref, loss.item(), [p.grad for stage in split.stages for layer in stage for p in layer.parameters()])


@pytest.mark.parametrize("name, schedule, padding",
                         [("llama-gqa", "zbh1", "left"), ("gpt2-tied", "dualpipev", "right")])
def test_split_backward_schedules_on_hf_models_equal_one_device(saved, name, schedule, padding):
    """A split backward runs its micro-batch's forward layer by layer, each layer's input cut from the graph
    (helpers.pipeline.split_backward.forward_cut): with the micro-batch's masks and positions handed to every layer,
    padding, grouped-query attention, and a tied embedding whose two copies sit on one device (the V shape's first
    and last stage), the gradients are one device's."""
    model = HFModel(saved[name].path)
    ref = reference(model, padding)
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), torch.device("cpu"))
    stages = 4 if schedule == "dualpipev" else 2
    split = split_model(layers, list(range(1, stages)), [torch.device("cpu")] * stages)
    x, y, mask = _data(padding)
    loss = ThreadedPipeline(split, schedule, 4, context=model.context).step(x, y, mask)
    _check(ref, loss.item(), [p.grad for stage in split.stages for layer in stage for p in layer.parameters()])


PROCESS_RUNS = [  # (model, job fields, in the fast tier)
    ("gpt2-tied", dict(pp=2, schedule="1f1b", microbatches=4, padding="right"), True),
    ("gpt2-tied", dict(pp=2, microbatches=4, engine="torch", padding="left"), False),
    ("gpt2-tied", dict(dp=2, padding="right"), False),
    ("gpt2-tied", dict(dp=2, data_parallel="fsdp2", padding="left"), True),
    ("gpt2-tied", dict(dp=2, pp=2, schedule="1f1b", microbatches=2, padding="right"), False),
    ("llama-gqa", dict(pp=2, schedule="1f1b", microbatches=4, padding="left"), False),
    ("llama-gqa", dict(dp=2, data_parallel="zero2", padding="right"), False),
    ("mistral-window", dict(pp=2, microbatches=2, padding="right"), False),
    ("gemma-tied", dict(pp=2, schedule="1f1b", microbatches=4, engine="torch"), True),
]


@pytest.mark.parametrize("name, kw", [pytest.param(n, kw, marks=() if fast else FULL,
                                                   id=f"{n}-{'-'.join(map(str, kw.values()))}")
                                      for n, kw, fast in PROCESS_RUNS])
def test_processes_equal_one_device(saved, name, kw):
    job = TrainJob(saved[name], batch=BATCH, seq_len=SEQ, timed_steps=1, return_grads=True, **kw)
    res = run_training(job, cpu_rig(), oversubscribe=True)
    _check(reference(saved[name], job.padding), res.loss, res.grads)


@FULL
@pytest.mark.parametrize("name, kw", [("gpt2-tied", dict(pp=2, schedule="1f1b", microbatches=4, autocast="bf16")),
                                      ("llama-gqa", dict(dp=2, autocast="fp16", optimizer="adam"))],
                         ids=["gpt2-1f1b-bf16-autocast", "llama-ddp-fp16-autocast-scaler"])
def test_mixed_precision_on_hf_models(saved, name, kw):
    job = TrainJob(saved[name], batch=BATCH, seq_len=SEQ, timed_steps=1, return_grads=True, **kw)
    res = run_training(job, cpu_rig())
    _check(reference(saved[name], precision=job.precision), res.loss, res.grads, job.precision)


@pytest.mark.parametrize("strategy, engine", [("1f1b", "threads"), pytest.param("1f1b", "processes", marks=FULL),
                                              pytest.param("fsdp2", "processes", marks=FULL)])
def test_tied_model_trains_like_one_device_and_saves(saved, tmp_path, strategy, engine):
    """Four Adam steps: the embedding and head copies stay identical, the weights equal one device's, and the saved
    checkpoint reloads with exactly the trained weights (the head equal to the embedding, never random)."""
    trains_like_one_device_and_saves(saved, tmp_path, strategy, engine)


def trains_like_one_device_and_saves(saved, tmp_path, strategy: str, engine: str) -> None:
    """The tied GPT-2 trained by train() and saved: see test_tied_model_trains_like_one_device_and_saves (DeepSpeed's
    strategies run it in tests/test_deepspeed.py)."""
    model = saved["gpt2-tied"]
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), torch.device("cpu"))
    stage = Stage(layers)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    x, y, mask = _data("none")
    for _ in range(4):
        opt.zero_grad()
        lm_loss(stage(x, model.context(x, mask)), y).backward()
        opt.step()
    out = train(model, strategy, engine, steps=4, batch=BATCH, seq_len=SEQ, microbatches=4, rig=cpu_rig(),
                save_to=tmp_path / "trained")
    head = len(layers) - 1
    assert torch.equal(out.state[0]["tok.weight"], out.state[head]["weight"])
    reloaded = HFModel(str(out.saved))
    again = reloaded.meta_layers()
    reloaded.materialize(again, range(len(again)), torch.device("cpu"))
    for mine, ref, trained in zip(again, layers, (out.state[i] for i in range(len(layers)))):
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            assert torch.equal(p, trained[name]), "the checkpoint holds exactly the trained weights"
            assert (p - q).abs().max() <= 1e-5
    assert out.losses[-1] < out.losses[0]


@FULL
def test_dropout_is_seeded_and_one_microbatch_equals_one_device(tmp_path):
    """Each micro-batch's dropout draws from its own seed: the same run twice gives the same result, and with one
    micro-batch the pipeline draws exactly one device's masks. With m > 1 the masks are drawn per micro-batch, so
    they differ from one device's (as any pipeline's do)."""
    cfg = hf_config("gpt2", n_layers=2, hidden=32, heads=4, vocab=VOCAB, seq_len=SEQ, dropout=0.1)
    model = save_hf_model(cfg, tmp_path / "gpt2-dropout")
    job = TrainJob(model, pp=2, microbatches=1, batch=BATCH, seq_len=SEQ, timed_steps=1, return_grads=True)
    first, second = (run_training(job, cpu_rig()) for _ in range(2))
    assert first.loss == second.loss and max_grad_diff(first.grads, second.grads) == 0
    _check(reference(model, seed=microbatch_seed(0, 0, 0)), first.loss, first.grads)
    no_seed = reference(model)
    assert abs(no_seed[0] - first.loss) > 1e-6, "dropout really is on"


@dataclass(frozen=True)
class _DriftingHead(HFModel):
    """A model whose head copy is loaded wrong: what the tied-weight check exists to catch."""

    def materialize(self, layers, indices, device):
        super().materialize(layers, indices, device)
        if self.n_layers - 1 in set(indices) and 0 not in set(indices):
            with torch.no_grad():
                layers[-1].weight.add_(1e-3)


@FULL
def test_tied_copies_out_of_sync_are_refused(saved):
    drifting = _DriftingHead(saved["gpt2-tied"].path)
    with pytest.raises(Exception, match="tied weights out of sync"):
        run_training(TrainJob(drifting, pp=2, microbatches=2, batch=BATCH, seq_len=SEQ, timed_steps=1), cpu_rig())


def test_train_refuses_bad_input_before_starting(saved):
    with pytest.raises(ValueError, match="unknown strategy"):
        train(saved["llama-gqa"], "zero9")
    with pytest.raises(ValueError, match="fsdp2 runs with engine processes, not 'threads'"):
        train(saved["llama-gqa"], "fsdp2", "threads")
    with pytest.raises(ValueError, match="steps must be at least 3"):
        train(saved["llama-gqa"], steps=2)
    with pytest.raises(ValueError, match="activation checkpointing here runs with the data-parallel strategies"):
        train(saved["llama-gqa"], "naive", "threads", seq_len=SEQ, activation_checkpointing=True)
    model = saved["llama-gqa"]
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB}"):
        model.context(torch.tensor([[1, VOCAB]]), None)


def test_split_layered_loads_each_stage_and_keeps_ties(saved):
    """Building stage by stage (each reads only its own tensors) registers the tie across stages, so the threads
    engine sums the two copies' gradients exactly as when the whole model is loaded first."""
    from helpers.pipeline.stages import split_layered

    model = saved["gemma-tied"]
    ref = reference(model, "right")
    split = split_layered(model, [2], [torch.device("cpu")] * 2)
    assert len(split.tied) == 1
    x, y, mask = _data("right")
    loss = ThreadedPipeline(split, "1f1b", 4, context=model.context).step(x, y, mask)
    _check(ref, loss.item(), [p.grad for stage in split.stages for layer in stage for p in layer.parameters()])


@FULL
def test_fp16_weights_train_on_threads_as_on_processes(saved):
    """fp16 weights need loss scaling, and their gradients are fp16: the threads engine used a plain GradScaler, which
    refuses to unscale fp16 gradients ("Attempting to unscale FP16 gradients"), so `train(..., engine="threads",
    dtype="fp16")` failed at its first step. Both engines now run the same steps with the same losses. Adam on fp16
    weights is refused before anything starts: its eps rounds to 0 in fp16, and it turned the weights to NaN."""
    kw = dict(steps=3, batch=BATCH, seq_len=SEQ, microbatches=2, dtype="fp16", rig=cpu_rig(), optimizer="sgd")
    threads = train(saved["llama-gqa"], "1f1b", "threads", **kw)
    processes = train(saved["llama-gqa"], "1f1b", "processes", **kw)
    assert all(torch.isfinite(torch.tensor(threads.losses))) and threads.losses[-1] < threads.losses[0]
    assert max(abs(a - b) for a, b in zip(threads.losses, processes.losses)) <= 1e-2 * threads.losses[0]
    with pytest.raises(ValueError, match="autocast='fp16'"):
        train(saved["llama-gqa"], "1f1b", "threads", **{**kw, "optimizer": "adam"})
