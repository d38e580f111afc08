"""DeepSpeed's ZeRO stages (helpers.training.deepspeed_zero) on the same jobs as PyTorch's engines: one device's
losses and gradients, the ZeRO formulas' memory, refusals before any rank starts.

DeepSpeed is optional (requirements-deepspeed.txt): without it these tests skip with the install command, except
where LAB_REQUIRE_DEEPSPEED=1 (CI, which installs it: a skip would hide it), where they fail.
"""
import os
import sys

import pytest

from helpers.catalog import DEEPSPEED
from helpers.check import max_grad_diff, one_device_grads
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.runtime.rig import cpu_rig
from helpers.sizing.state import zero_formula
from helpers.training.deepspeed_zero import INSTALL, check_config, ds_config, host_adam_step_s, missing
from helpers.training.job import TrainJob, check_job
from tests.test_scripts import model_dir  # noqa: F401 (a fixture: the scripts' tiny tied GPT-2)
from tests.test_train_hf import saved as hf_models  # noqa: F401 (a fixture: Hugging Face models saved locally)

REQUIRE_ENV = "LAB_REQUIRE_DEEPSPEED"
CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
BATCH = 8
STEPS = 3  # timed steps: with the warm-up and recorded steps, five optimizer steps compared


@pytest.fixture(scope="module")
def deepspeed():
    reason = missing()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}, and {REQUIRE_ENV}=1")
        pytest.skip(reason)


def _one_device(optimizer: str):
    from helpers.training.loop import run_training

    return run_training(TrainJob(CFG, batch=BATCH, timed_steps=STEPS, optimizer=optimizer), cpu_rig())


def test_each_deepspeed_job_gets_processes_of_its_own():
    """`run_trainings` launches PyTorch's jobs together and each DeepSpeed job alone (`launches`): DeepSpeed keeps
    process-wide state from one engine to the next."""
    from helpers.training.loop import launches

    names = ("ddp", "ds_zero2", "fsdp2", "ds_zero3")
    assert launches([TrainJob(CFG, name, batch=BATCH) for name in names]) == [[0, 2], [1], [3]]
    assert launches([TrainJob(CFG, "ds_zero1", batch=BATCH)]) == [[0]]


@pytest.mark.full
def test_every_deepspeed_stage_trains_like_one_device_and_pytorchs_engines(deepspeed):
    """Five AdamW steps with two micro-batches of accumulation: every DeepSpeed stage, PyTorch's DDP and FSDP2 and
    one device give the same losses (1e-5), and the first step's gradients (1e-5)."""
    from helpers.training.loop import run_trainings

    loss, grads = one_device_grads(build_stack(CFG), *SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH),
                                   lm_loss)
    one = _one_device("adamw")
    names = ("ddp", "fsdp2", *DEEPSPEED)
    jobs = [TrainJob(CFG, name, batch=BATCH, microbatches=2, timed_steps=STEPS, optimizer="adamw",
                     return_grads=True) for name in names]
    for job, res in zip(jobs, run_trainings(jobs, cpu_rig())):
        assert abs(res.loss - loss) < 1e-5, job.strategy
        assert max_grad_diff(grads, res.grads) <= 1e-5, job.strategy
        assert max(abs(a - b) for a, b in zip(res.losses, one.losses)) < 1e-5, (job.strategy, res.losses, one.losses)


@pytest.mark.full
def test_deepspeed_memory_is_the_zero_formulas_plus_its_fp32_partition(deepspeed):
    """Per rank at rest after an Adam step: the weights the stage keeps (ZeRO-3: half), no gradients (DeepSpeed
    frees them after the step, where PyTorch's engines keep their buffers), and the ZeRO paper's optimizer state
    (Adam's two fp32 moments of the rank's half) plus an fp32 copy of the rank's half of the weights, which
    DeepSpeed's optimizer steps even when the weights are fp32 already; with offload all of it on the host."""
    from helpers.training.loop import run_trainings

    n = sum(p.numel() for p in build_stack(CFG).parameters())
    jobs = [TrainJob(CFG, name, batch=BATCH, timed_steps=1, optimizer="adam") for name in DEEPSPEED]
    jobs.append(TrainJob(CFG, "ds_zero3", batch=BATCH, timed_steps=1, optimizer="adam", offload="cpu"))
    for job, res in zip(jobs, run_trainings(jobs, cpu_rig())):
        formula = zero_formula(job.strategy, n, 2)
        # moments, the fp32 partition, and torch's Adam's step count (a tensor; DeepSpeed's CPU Adam keeps an int)
        state = formula.optimizer + n * 4 // 2 + (0 if job.offload else 4)
        for memory, host in zip(res.memory, res.host_state):
            assert memory.params == formula.params and memory.grads == 0, job
            assert (memory.optimizer, host) == ((0, state) if job.offload else (state, 0)), job
        print(f"{job.strategy} offload={job.offload}: {res.memory[0]}, host {res.host_state[0]} B; "
              f"ZeRO formula {formula}")


@pytest.mark.full
def test_zero_offload_steps_deepspeeds_cpu_adam_like_torchs_adamw(deepspeed):
    """ZeRO-3 with the optimizer on the host (DeepSpeed's C++ CPU Adam, built on first use) trains to one device's
    losses with torch's AdamW over five steps, within 1e-5."""
    from helpers.training.loop import run_training

    one = _one_device("adamw")
    res = run_training(TrainJob(CFG, "ds_zero3", batch=BATCH, timed_steps=STEPS, optimizer="adamw", offload="cpu"),
                       cpu_rig())
    assert max(abs(a - b) for a, b in zip(res.losses, one.losses)) < 1e-5, (res.losses, one.losses)


def test_the_config_is_written_from_the_job(deepspeed):
    """Batch sizes multiply out, DDP's bucket size becomes ZeRO's buckets, clipping is off unless asked (DeepSpeed's
    default clips at 1.0), and offload names DeepSpeed's CPU AdamW."""
    job = TrainJob(CFG, "ds_zero3", batch=BATCH, microbatches=2, optimizer="adamw", offload="cpu", bucket_mb=1.0)
    config = ds_config(job)
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2 == BATCH
    assert config["zero_optimization"]["stage"] == 3 and config["zero_optimization"]["reduce_bucket_size"] == 2**18
    assert config["gradient_clipping"] == 0.0
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["optimizer"]["type"] == "AdamW"
    assert ds_config(TrainJob(CFG, "ds_zero1", batch=BATCH, max_grad_norm=0.5))["gradient_clipping"] == 0.5


@pytest.mark.parametrize("fields, message", [
    ({"strategy": "ds_zero2", "dtype": "fp16"}, "CPU accelerator has no fp16"),
    ({"strategy": "ds_zero2", "autocast": "bf16"}, "give dtype='bf16'"),
    ({"strategy": "ds_zero3", "offload": "cpu", "optimizer": "sgd"}, "optimizer='adam' or 'adamw'"),
    ({"strategy": "ds_zero1", "offload": "cpu", "optimizer": "adam"}, "stage 2 or 3"),
    ({"strategy": "ds_zero3", "loss_chunks": 2}, "not wired to DeepSpeed"),
    ({"strategy": "ds_zero2", "shares": (3, 5)}, "same micro-batch"),
])
def test_what_deepspeed_cannot_run_is_refused_before_ranks_start(deepspeed, fields, message):
    with pytest.raises(ValueError, match=message):
        check_job(TrainJob(CFG, batch=BATCH, **fields), cpu_rig())


def test_a_users_config_that_does_not_match_the_job_is_refused_naming_the_field(deepspeed):
    job = TrainJob(CFG, "ds_zero2", batch=BATCH)
    check_config(ds_config(job), job)
    with pytest.raises(ValueError, match="train_batch_size 8 != train_micro_batch_size_per_gpu 2 x "
                                         "gradient_accumulation_steps 1 x 2 ranks"):
        check_config({**ds_config(job), "train_micro_batch_size_per_gpu": 2}, job)
    with pytest.raises(ValueError, match="fp16.enabled"):
        check_config({**ds_config(job), "fp16": {"enabled": True}}, job)


def test_without_deepspeed_a_job_says_how_to_install_it(monkeypatch):
    """Where DeepSpeed is missing, a ds_* job is refused before any rank starts with the install command."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ValueError, match=f"ds_zero2 runs DeepSpeed. DeepSpeed is not installed: {INSTALL}"):
        check_job(TrainJob(CFG, "ds_zero2", batch=BATCH), cpu_rig())


# --- the take-home script: scripts/train_deepspeed.py under torchrun -------------------------------------------------

@pytest.mark.full
@pytest.mark.parametrize("stage, extra", [(2, []), (3, ["--offload", "cpu"])])
def test_the_script_trains_like_one_device_resumes_and_exports(deepspeed, model_dir, tmp_path, stage, extra):
    """Two ranks: one device's first loss, a falling loss; a second run resumes from the checkpoint; the DeepSpeed
    checkpoint consolidated on the host (no ranks) loads with from_pretrained and computes the logits of the model
    the script saved; a resume on another stage is refused before any rank starts, naming both."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.runtime.launch import run_command
    from helpers.training.deepspeed_zero import checkpoint_layout, export_checkpoint
    from tests.test_scripts import REPO, SCRIPTS, _one_device_first_loss, _run

    ckpt = tmp_path / "ckpt"
    flags = ["--stage", str(stage), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", *extra]
    losses = _run("train_deepspeed.py", 2, model_dir, tmp_path / "out", *flags)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert abs(losses[0] - _one_device_first_loss(model_dir)) < 1e-4
    assert checkpoint_layout(str(ckpt)) == (stage, 2, "step4")
    export_checkpoint(str(ckpt), str(model_dir), str(tmp_path / "exported"))
    saved, exported = (AutoModelForCausalLM.from_pretrained(tmp_path / d) for d in ("out", "exported"))
    x = torch.randint(64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(saved(input_ids=x).logits, exported(input_ids=x).logits, atol=1e-5)
    resumed = _run("train_deepspeed.py", 2, model_dir, tmp_path / "out2", *flags, "--steps", "6")
    assert len(resumed) == 2  # steps 4 and 5
    other = "2" if stage == 3 else "3"
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        str(SCRIPTS / "train_deepspeed.py"), "--model", str(model_dir), "--stage", other,
                        "--seq-len", "16", "--checkpoint-dir", str(ckpt)], timeout_s=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1", TMPDIR=str(tmp_path)))
    assert proc.returncode != 0 and f"saved by ZeRO-{stage} on 2 ranks; this run is ZeRO-{other} on 2" in proc.stderr


@pytest.mark.full
@pytest.mark.parametrize("strategy", DEEPSPEED)
def test_a_hugging_face_model_trained_by_train_saves_one_devices_weights(deepspeed, hf_models, tmp_path, strategy):
    """train() on a tied Hugging Face GPT-2 with each DeepSpeed stage: four Adam steps to one device's weights, the
    tied copies identical, and a save_pretrained folder of exactly the trained weights (ZeRO-3's partitions gathered
    layer by layer)."""
    from tests.test_train_hf import trains_like_one_device_and_saves

    trains_like_one_device_and_saves(hf_models, tmp_path, strategy, "processes")


@pytest.mark.full
def test_deepspeeds_cpu_adam_computes_torchs_adamw_update(deepspeed):
    """ZeRO-Offload's optimizer step timed against torch's AdamW on the host (notebook 07 prints the ratio beside
    DeepSpeed's 5-7x claim); the same update after eight steps, to fp32 rounding."""
    out = host_adam_step_s(numel=2**16, repeats=7)
    assert out["deepspeed"] > 0 and out["torch"] > 0 and out["max_weight_diff"] < 1e-5
