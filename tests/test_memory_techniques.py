"""The memory techniques a 24 GB card needs (helpers.training.memory_techniques), through the training loop at the
CPU rig's small sizes: each one computes what the plain run computes, and saves the bytes its formula and the
training planner (helpers.finetune.memory_plan) say, as the course's ledger measures them per rank."""
import pytest
import torch

from helpers.check import max_grad_diff
from helpers.models import StackConfig, StackModel
from helpers.models.data import IGNORE_INDEX, lm_loss_sum
from helpers.runtime.rig import cpu_rig
from helpers.training.job import TrainJob, check_job
from helpers.training.loop import run_trainings
from helpers.training.memory_techniques import chunked_lm_loss_sum, low_bit_state_bytes

CFG = StackConfig(hidden=64, n_blocks=2, heads=2, seq_len=8, vocab=128)
BATCH = 8
TOKENS = BATCH * CFG.seq_len


def _numels(dp: int, by_layer: bool = False) -> list:
    """Every parameter's numbers on one rank: whole, or FSDP2's dim-0 shard (rank 0's: a full chunk); `by_layer`:
    one list per layer (an FSDP2 unit)."""
    layers = [[-(-p.shape[0] // dp) * p[0].numel() for p in layer.parameters()]
              for layer in StackModel(CFG).meta_layers()]
    return layers if by_layer else [n for layer in layers for n in layer]


# --- chunked loss ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunked_loss_is_exact(chunks):
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 100))
    h = torch.randn(4, 10, 32, requires_grad=True)
    y = torch.randint(0, 100, (4, 10))
    y[0, :3] = IGNORE_INDEX  # padding takes no part
    ref = lm_loss_sum(head(h), y)
    ref_grads = torch.autograd.grad(ref, [h, *head.parameters()])
    got = chunked_lm_loss_sum(head, h, y, chunks)
    got_grads = torch.autograd.grad(got, [h, *head.parameters()])
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert max_grad_diff(ref_grads, got_grads) <= 1e-5


def _job(strategy: str, **fields) -> TrainJob:
    fields = {"batch": BATCH, "timed_steps": 1, **fields}
    return TrainJob(CFG, dp=1, **fields) if strategy == "single" else TrainJob(CFG, strategy, **fields)


def _plain_and(strategy: str, common: dict | None = None, **technique) -> tuple:
    """The plain job and the same with the technique, both with `common`."""
    return _job(strategy, **(common or {})), _job(strategy, **(common or {}), **technique)


def _run(jobs) -> list:
    return run_trainings(list(jobs), cpu_rig(), oversubscribe=True)


def head_saved_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """What the plain loss saves for backward beyond the head's input, per rank (fp32): the log-probabilities
    (tokens x vocab), the final norm's output and its mean and 1/std; the chunked loss keeps only the head's input."""
    return tokens * (vocab * 4 + hidden * 4 + 2 * 4)


@pytest.mark.parametrize("strategy", ["single", "fsdp2", "ddp"])
def test_chunked_loss_in_training(strategy):
    plain, chunked = _run(_plain_and(strategy, dict(return_grads=True), loss_chunks=3))
    assert abs(chunked.loss - plain.loss) <= 1e-5
    assert max_grad_diff(plain.grads, chunked.grads) <= 1e-5
    dp = 1 if strategy == "single" else 2
    saved = [p.activations - c.activations for p, c in zip(plain.memory, chunked.memory)]
    formula = head_saved_bytes(TOKENS // dp, CFG.hidden, CFG.vocab)
    assert all(abs(s - formula) <= 0.01 * formula for s in saved), (saved, formula)
    print(f"chunked loss ({strategy}): activations {plain.memory[0].activations} -> {chunked.memory[0].activations}, "
          f"saved {saved[0]} measured, {formula} formula")


# --- optimizer step in backward ------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["single", "fsdp2"])
def test_optimizer_in_backward_same_weights(strategy):
    base = dict(optimizer="adam", timed_steps=3, return_state=True)
    plain, in_bwd = _run(_plain_and(strategy, base, optimizer_in_backward=True))
    diffs = [(a - b).abs().max().item() for i, layer in plain.state.items()
             for a, b in zip(layer.values(), in_bwd.state[i].values())]
    assert max(diffs) <= 1e-5
    assert plain.losses == pytest.approx(in_bwd.losses, abs=1e-5)
    dp = 1 if strategy == "single" else 2
    # the peak of gradients held: every gradient at once, or (each freed as it steps) the largest one alone on one
    # device, the largest unit's reduce-scattered shard under FSDP2 (its gradients are views of it): the training
    # planner's formula (helpers.finetune.gpu_memory.gpu_training: one unit's gradient shard), exactly
    assert all(m.grads == 4 * sum(_numels(dp)) for m in plain.memory)
    held = max(_numels(1)) if dp == 1 else max(sum(layer) for layer in _numels(dp, by_layer=True))
    assert all(m.grads == 4 * held for m in in_bwd.memory), ([m.grads for m in in_bwd.memory], 4 * held)
    print(f"optimizer in backward ({strategy}): peak gradient bytes {plain.memory[0].grads} -> "
          f"{in_bwd.memory[0].grads}")
    assert all(m.optimizer == p.optimizer for m, p in zip(in_bwd.memory, plain.memory))


@pytest.mark.parametrize("fields, why", [
    (dict(strategy="ddp"), "DDP averages gradients in buckets"),
    (dict(strategy="zero1"), "DDP averages gradients in buckets"),
    (dict(dp=1, microbatches=2), "needs the gradients kept"),
    (dict(dp=1, autocast="fp16"), "loss scaling"),
    (dict(dp=1, return_grads=True), "nothing to return"),
    (dict(strategy="1f1b", microbatches=2), "pipeline stages are not wired"),
    (dict(dp=1, optimizer="none"), "give optimizer="),
    (dict(dp=1, max_grad_norm=1.0), "clipping scales every gradient by the norm of all of them"),
])
def test_optimizer_in_backward_refusals(fields, why):
    job = TrainJob(CFG, optimizer_in_backward=True, batch=BATCH, **{"optimizer": "adam", **fields})
    with pytest.raises(ValueError, match=why):
        check_job(job, cpu_rig(), oversubscribe=True)


# --- low-bit AdamW -------------------------------------------------------------------------------------------------

LOW_BIT_FULL = pytest.mark.full  # torch.compile of torchao's step, once per tensor shape: 25-40 s a run here


@LOW_BIT_FULL
@pytest.mark.parametrize("name", ["adamw-8bit", "adamw-4bit"])
def test_low_bit_state_bytes_on_fsdp2_shards(name):
    """Each rank's optimizer state as the ledger counts it, against the formula over its shards: 8-bit keeps 2 bytes
    per number (two moments), 4-bit 1, where fp32 AdamW keeps 8."""
    plain, low = _run([_job("fsdp2", optimizer="adamw"), _job("fsdp2", optimizer=name)])
    numels = _numels(2)
    assert plain.memory[0].optimizer == sum(8 * n + 4 for n in numels)
    formula = sum(low_bit_state_bytes(n, name) for n in numels)
    assert low.memory[0].optimizer == formula, (low.memory[0].optimizer, formula)
    from helpers.finetune.gpu_memory import optimizer_state_bytes  # the training planner's accounting

    planned = optimizer_state_bytes(numels, 4, name)  # no step counts: 4 bytes a tensor less
    assert abs(planned - low.memory[0].optimizer) <= 0.1 * low.memory[0].optimizer, (planned, low.memory[0])
    print(f"{name} on fsdp2, rank 0: optimizer state {plain.memory[0].optimizer} (fp32 AdamW) -> "
          f"{low.memory[0].optimizer} measured, {formula} formula, {planned} planner")
    # at this size every tensor pays its code table (1 KiB 8-bit, 64 B 4-bit per moment) and those under 4096
    # numbers (norms, biases, the attention projection's 2048-number shard) stay fp32: 2.8x (8-bit) and 4.7x (4-bit)
    # less than fp32 AdamW here, towards 4x and 8x on a real model's large tensors
    assert low.memory[0].optimizer * (2.5 if name == "adamw-8bit" else 4) < plain.memory[0].optimizer


LOW_BIT_STEPS = 40
# 40 AdamW steps at lr 3e-3 on the standard library's text (a new batch each step) take a 2-block model from 5.9 to
# 3.9 nats. The quantized moments add noise to each update, not a bias: the mean of the last 5 losses of 8-bit and
# 4-bit stays within 3% of fp32 AdamW's (measured here: 8-bit 0.03% below, 4-bit 1.8% above), where the untrained
# model sits 50% above it.
LOW_BIT_BAND = 0.03
TEXT_CFG = StackConfig(hidden=64, n_blocks=2, heads=2, seq_len=16, vocab=320)  # byte-level BPE: 256 bytes + merges


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    from helpers.models.text import prepare_text

    data = prepare_text(seq_len=TEXT_CFG.seq_len, vocab_size=TEXT_CFG.vocab, max_chars=60_000)
    path = tmp_path_factory.mktemp("text") / "windows.pt"
    torch.save(data.train, path)
    return str(path)


@LOW_BIT_FULL
def test_low_bit_adamw_trains_like_fp32(windows):
    jobs = [TrainJob(TEXT_CFG, dp=1, optimizer=name, lr=3e-3, batch=16, data=windows, timed_steps=LOW_BIT_STEPS - 2)
            for name in ("adamw", "adamw-8bit", "adamw-4bit", "adam")]
    fp32, bit8, bit4, _ = _run(jobs)
    last = {name: sum(r.losses[-5:]) / 5 for name, r in (("fp32", fp32), ("8bit", bit8), ("4bit", bit4))}
    print(f"mean loss of the last 5 of {LOW_BIT_STEPS} steps (first {fp32.losses[0]:.3f}): {last}")
    assert last["fp32"] < 0.7 * fp32.losses[0], last  # it learned something
    for name in ("8bit", "4bit"):
        assert abs(last[name] - last["fp32"]) <= LOW_BIT_BAND * last["fp32"], last


@LOW_BIT_FULL
def test_low_bit_adamw_with_bf16_weights_and_in_backward():
    """bf16 weights: stochastic rounding into bf16 (no fp32 master copy); and the step taken in backward."""
    base = dict(batch=BATCH, timed_steps=2, optimizer="adamw-4bit")
    jobs = [TrainJob(CFG, "fsdp2", dtype="bf16", **base), TrainJob(CFG, "fsdp2", optimizer_in_backward=True, **base)]
    bf16, in_bwd = _run(jobs)
    for res in (bf16, in_bwd):
        assert res.losses[-1] < res.losses[0]
    assert bf16.memory[0].params == 2 * sum(_numels(2))
    assert in_bwd.memory[0].optimizer == sum(low_bit_state_bytes(n, "adamw-4bit") for n in _numels(2))


@pytest.mark.parametrize("fields, why", [
    (dict(strategy="zero1"), "ZeroRedundancyOptimizer"),
    (dict(strategy="fsdp2", offload="cpu"), "CPUOffloadOptimizer"),
    (dict(strategy="1f1b", microbatches=2), "pipeline stages are not wired"),
    (dict(dp=1, dtype="fp16"), "fp16"),
])
def test_low_bit_refusals(fields, why):
    with pytest.raises(ValueError, match=why):
        check_job(TrainJob(CFG, optimizer="adamw-8bit", batch=BATCH, **fields), cpu_rig(), oversubscribe=True)


# --- activation offload --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_activation_offload_moves_saved_tensors_to_host(strategy):
    plain, offloaded = _run(_plain_and(strategy, dict(return_grads=True), activation_offload=True))
    assert offloaded.loss == plain.loss
    assert max_grad_diff(plain.grads, offloaded.grads) == 0
    assert plain.host_activations == [0] * len(plain.memory)
    for p, o, host in zip(plain.memory, offloaded.memory, offloaded.host_activations):
        assert o.activations == 0  # every saved activation left the device's ledger
        # ...for the host's: each saved tensor its own copy (save_on_cpu's way), so a tensor two operations save is
        # there twice, where the device counts its storage once
        assert p.activations <= host <= 1.25 * p.activations, (p.activations, host)
    print(f"activation offload ({strategy}): device activations {plain.memory[0].activations} -> "
          f"{offloaded.memory[0].activations}, host {offloaded.host_activations[0]}")


def test_techniques_refused_on_pipelines():
    for fields in (dict(loss_chunks=2), dict(activation_offload=True)):
        with pytest.raises(ValueError, match="pipeline stages are not wired"):
            check_job(TrainJob(CFG, "1f1b", microbatches=2, batch=BATCH, **fields), cpu_rig(), oversubscribe=True)
    with pytest.raises(ValueError, match="loss_chunks must be a whole number"):
        check_job(TrainJob(CFG, dp=1, loss_chunks=0, batch=BATCH), cpu_rig())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_gradient_clipping_equals_one_device(strategy):
    """max_grad_norm, the option the step in backward refuses: the global norm over replicas and shards alike."""
    base = dict(optimizer="sgd", lr=0.5, max_grad_norm=0.05, timed_steps=1, return_state=True)
    one, many, unclipped = _run([_job("single", **base)]) + _run([_job(strategy, **base),
                                                                 _job(strategy, **{**base, "max_grad_norm": None})])
    diffs = [(a - b).abs().max().item() for i, layer in one.state.items()
             for a, b in zip(layer.values(), many.state[i].values())]
    assert max(diffs) <= 1e-5
    assert many.losses[-1] != pytest.approx(unclipped.losses[-1], abs=1e-4)  # clipping changed the run


# --- each technique against the training planner, and beside plain fp32 AdamW -----------------------------------------

# A Llama-style decoder (the planner's activation model) small enough for the CPU rig; vocab 256 keeps a decoder layer
# (43,136 numbers) the largest FSDP2 unit whether the embedding and head are units of their own (the training loop) or
# the root's together (32,832: scripts/train_fsdp2.py, which the planner follows)
PLANNED = dict(n_layers=3, hidden=64, heads=4, kv_heads=2, intermediate=160, vocab=256, seq_len=64)
PLANNED_BATCH = 16  # 8 sequences, 512 tokens, a rank: two of the planner's 256-token loss chunks
ADAMW_STEPS = 6
EXACT_LOSS_BAND = 1e-5  # absolute, per step: the techniques reorder fp32 sums (chunks) or move bytes, nothing more


def _planned_loss_chunks() -> int:
    """The chunks the planner prices: its chunk of tokens (data/training_memory.json) over a rank's tokens."""
    from helpers.sizing.training import chunked_loss_tokens

    tokens = PLANNED_BATCH // 2 * PLANNED["seq_len"]
    return -(-tokens // chunked_loss_tokens(tokens))


def _technique_fields() -> dict:
    """Each technique as TrainJob fields, by the planner's name; "plain" none."""
    return {"plain": {}, "chunked-loss": dict(loss_chunks=_planned_loss_chunks()),
            "activation-offload": dict(activation_offload=True),
            "optimizer-in-backward": dict(optimizer_in_backward=True)}


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory) -> dict:
    """Each technique's run and the plain one, fp32 AdamW by FSDP2 on two ranks, the same synthetic batch each step,
    in one launch of the ranks (activation checkpointing off: the training loop also checkpoints the final norm,
    which transformers' checkpointing, and so the planner, does not)."""
    from helpers.models.hf import hf_config, save_hf_model
    from helpers.training.job import job_for

    model = save_hf_model(hf_config("llama", **PLANNED), tmp_path_factory.mktemp("llama") / "planned")
    base = dict(batch=PLANNED_BATCH, seq_len=PLANNED["seq_len"], optimizer="adamw", microbatches=1,
                timed_steps=ADAMW_STEPS - 2)
    techniques = _technique_fields()
    return dict(zip(techniques, _run(job_for(model, "fsdp2", **base, **f) for f in techniques.values())))


def _planned_rank(technique: str):
    """The planner's rank 0 for the same job: full fine-tuning in fp32 (weights, gradients and AdamW's moments)."""
    from helpers.finetune.memory_plan import plan_training
    from helpers.models.hf import hf_config

    return plan_training(hf_config("llama", **PLANNED), "full", context=PLANNED["seq_len"], batch=PLANNED_BATCH // 2,
                         gpus="2x cpu=24GiB", strategy="fsdp2", dtype="fp32", precision="pure",
                         activation_checkpointing=False, techniques=() if technique == "plain" else (technique,),
                         suggest=False).devices[0]


@pytest.mark.parametrize("technique", ["chunked-loss", "activation-offload", "optimizer-in-backward"])
def test_each_technique_saves_what_the_planner_says(llama_runs, technique):
    """Per rank, what the ledger counts on the device (weights, gradients, optimizer state, saved activations) less
    with the technique than without, against the planner's same parts (state and activations) for the same job,
    within 10%. On the CPU rig host and device are one memory: activation offload's saving is what leaves the
    device's ledger for its host's. Not compared: the planner's workspace (one loss chunk's logits, what backward
    brings back from the host: transients no ledger holds) and the optimizer step's temporaries."""
    plain, run = llama_runs["plain"], llama_runs[technique]
    before, after = _planned_rank("plain"), _planned_rank(technique)
    planned = (before.state_bytes + before.activation_bytes) - (after.state_bytes + after.activation_bytes)
    for rank, (p, m) in enumerate(zip(plain.memory, run.memory)):
        saved = p.total - m.total
        print(f"{technique}, rank {rank}: saves {saved} bytes measured, {planned} planned "
              f"({(saved - planned) / planned:+.2%}); device {p.as_dict()} -> {m.as_dict()}")
        assert abs(saved - planned) <= 0.1 * planned, (saved, planned)
    if technique == "activation-offload":
        host = after.host["activations (offloaded)"]
        print(f"host copies {run.host_activations} measured, {host} planned (a lower bound without checkpointing)")
        # save_on_cpu copies a tensor once per operation that saves it: the planner counts that outside the decoder
        # layers and for checkpointed ones; here (no checkpointing) q, k and v's shared input and the like are more
        assert all(m.activations == 0 and h >= host for m, h in zip(run.memory, run.host_activations))


@pytest.mark.parametrize("technique", ["chunked-loss", "activation-offload", "optimizer-in-backward"])
def test_each_technique_trains_like_plain_fp32_adamw(llama_runs, technique):
    """Six fp32 AdamW steps with the technique take the same losses as plain fp32 AdamW on the same data, within
    EXACT_LOSS_BAND each step (the low-bit optimizers, which do change the numbers, have their own band:
    test_low_bit_adamw_trains_like_fp32)."""
    plain, run = llama_runs["plain"].losses, llama_runs[technique].losses
    assert len(plain) == ADAMW_STEPS and plain[-1] < plain[0] - 0.3, plain  # it trains
    print(f"{technique}: losses {run}, plain fp32 AdamW {plain}")
    assert run == pytest.approx(plain, abs=EXACT_LOSS_BAND, rel=0), (run, plain)


@pytest.mark.parametrize("family, strategy", [("gpt2", "fsdp2"), ("llama", "zero2")])
def test_train_with_every_technique_equals_plain(tmp_path, family, strategy):
    """train() on a Hugging Face model (gpt2's tied head: FSDP2 keeps it in the root's unit) with the chunked loss,
    the step in backward and activation offload together computes what the plain run computes."""
    from helpers.models.hf import hf_config, save_hf_model
    from helpers.training import train

    cfg = hf_config(family, n_layers=2, hidden=32, heads=4, vocab=64, seq_len=16, tie_embeddings=family == "gpt2")
    model = save_hf_model(cfg, tmp_path / family)
    kw = dict(steps=3, batch=8, seq_len=16, microbatches=1, rig=cpu_rig(), optimizer="adamw")
    plain = train(model, strategy, **kw)
    techniques = train(model, strategy, **kw, loss_chunks=3, optimizer_in_backward=True, activation_offload=True)
    assert techniques.losses == pytest.approx(plain.losses, abs=1e-5)
    assert techniques.memory[0].activations == 0 and techniques.memory[0].grads < plain.memory[0].grads
