import os

import pytest
import torch

from helpers.runtime.rig import GiB, cpu_rig, detect_rig, is_geforce, p2p_advice


def test_forced_cpu_rig_has_two_virtual_devices():
    rig = detect_rig(force_cpu=True, cpu_budget_gib=1.5)
    assert rig.is_cpu and rig.kind == "cpu"
    assert rig.devices == (torch.device("cpu"), torch.device("cpu"))
    assert rig.backend == "gloo"
    assert rig.capacity_bytes == (int(1.5 * GiB),) * 2
    assert "CPU rig" in rig.describe() and "1.5 GiB" in rig.describe()


def test_env_forces_cpu(monkeypatch):
    monkeypatch.setenv("LAB_FORCE_CPU", "1")
    monkeypatch.setenv("LAB_CPU_BUDGET_GIB", "0.5")
    rig = detect_rig()
    assert rig.is_cpu and rig.capacity_bytes[0] == GiB // 2


@pytest.mark.parametrize("budget", [0, -1.0, float("nan")])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match="positive"):
        cpu_rig(2, budget)


def test_device_index_out_of_range_is_explained():
    with pytest.raises(ValueError, match="devices 0..1"):
        cpu_rig().device(2)


def test_detect_never_touches_cuda_without_it(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")

    def boom(*a, **k):
        raise AssertionError("torch.cuda touched on a CPU machine")

    for name in ("device_count", "get_device_name", "get_device_properties", "can_device_access_peer"):
        monkeypatch.setattr(torch.cuda, name, boom)
    assert detect_rig().is_cpu


def test_geforce_advice_names_nccl_p2p_disable():
    assert is_geforce("NVIDIA GeForce RTX 3090")
    assert not is_geforce("NVIDIA H200")
    (advice,) = p2p_advice(("NVIDIA GeForce RTX 3090",) * 2, peer_access=False)
    assert "NCCL_P2P_DISABLE=1" in advice and "host memory" in advice
    assert p2p_advice(("NVIDIA A100-SXM4-80GB",) * 2, peer_access=True) == ()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_rig():
    rig = detect_rig()
    assert rig.kind == "two_gpus" and rig.backend == "nccl" and rig.devices == (torch.device("cuda:0"),
                                                                               torch.device("cuda:1"))
    assert rig.peer_access is torch.cuda.can_device_access_peer(0, 1)  # the driver's answer, not a guess by name
    assert rig.advice == p2p_advice(rig.names, rig.peer_access)  # GeForce without P2P: NCCL_P2P_DISABLE advised


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one CUDA device")
def test_one_gpu_rig_puts_both_stages_on_cuda0():
    rig = detect_rig()
    assert rig.kind == "one_gpu" and rig.devices == (torch.device("cuda:0"),) * 2


FAULTS_AFTER_WARMUP = """
import resource, sys, torch
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.runtime.rig import claim_cpu_device, cpu_rig
claim_cpu_device(cpu_rig())
model = build_stack(StackConfig(hidden=256, n_blocks=4, seq_len=32))
x, y = SyntheticTokens(16, 32, 256).batch(0, 16)
faults = []
for _ in range(6):  # whole batch, then 4 micro-batches: blocks of several sizes come and go, as in the bench
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    lm_loss(model(x), y).backward()
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        lm_loss(model(xb), yb).backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


@pytest.mark.full
def test_a_cpu_device_keeps_freed_memory_as_a_gpu_allocator_does():
    """After warm-up, a CPU virtual device's steps take no new pages from the operating system: each fresh page
    costs a page fault, which made the bench's forward passes up to a quarter slower in the steps that took them."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    from helpers.runtime.rig import keep_freed_memory

    if not keep_freed_memory():
        pytest.skip("no glibc mallopt on this platform: the allocator is left as it is")
    out = subprocess.run([sys.executable, "-c", FAULTS_AFTER_WARMUP], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    faults = ast.literal_eval(out.strip().splitlines()[-1])
    assert max(faults[-3:]) < faults[0] / 10, faults  # counts, not times: seen 20-100x apart; 10x is the margin


def _openmp_max_threads():
    """libgomp's omp_get_max_threads (torch's bundled OpenMP), or skip where there is none or one core."""
    import ctypes
    import os
    from pathlib import Path

    gomp = next(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*"), None)
    if gomp is None or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch's bundled OpenMP and two cores")
    return ctypes.CDLL(str(gomp)).omp_get_max_threads


def test_a_device_thread_runs_with_the_process_intra_op_threads():
    """A new thread's OpenMP starts with as many threads as cores: two virtual devices on threads would each
    compute on every core (the calibration's busy rates measured four threads on two cores)."""
    import threading

    from helpers.runtime.rig import device_thread

    omp_max, before, seen = _openmp_max_threads(), torch.get_num_threads(), {}
    torch.set_num_threads(1)
    try:
        for name, fn in (("plain", omp_max), ("device", device_thread(omp_max))):
            t = threading.Thread(target=lambda name=name, fn=fn: seen.update({name: fn()}))
            t.start()
            t.join()
    finally:
        torch.set_num_threads(before)
    assert seen["device"] == 1 and seen["plain"] > 1  # a plain thread would compute on every core


def test_every_thread_that_computes_as_a_device_has_one_intra_op_thread():
    """The threaded training engine's stages and the calibration's runs together: each a virtual device of one
    intra-op thread by construction (`device_thread`). In a plain thread a GELU over 4 M values used 1.9 CPU-s per
    second; the bench model's training step used 1.0 either way (its ops set their thread count as they start), so
    the threaded rows measured before this change stand."""
    from torch import nn

    from helpers.bench.blocks import bench_cut, make_pipeline_run
    from helpers.models import SyntheticTokens, StackConfig, build_stack
    from helpers.runtime.rig import run_together

    omp_max, before, seen = _openmp_max_threads(), torch.get_num_threads(), []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(omp_max())
            return x

    torch.set_num_threads(1)
    try:
        rig = cpu_rig()
        cfg = StackConfig(hidden=32, n_blocks=2, seq_len=8)
        model = build_stack(cfg)
        model.insert(0, Probe())  # first in its stage thread: before any op could set the thread count
        run = make_pipeline_run("probe", model, bench_cut("1f1b", len(model)), rig.devices, rig.labels, "1f1b", 2)
        run.step(*SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4))
        run_together([lambda: seen.append(omp_max())] * 2)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


needs_two_pinnable_cores = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux and two usable cores")


@needs_two_pinnable_cores
def test_each_rank_computes_on_cores_of_its_own(monkeypatch):
    """A CPU rank is a device of its own: its main thread (where it computes) on device r's cores, none shared with
    the other rank; the threads the process group started (gloo's) stay free to run wherever a core is idle, as a
    GPU's communication does not take its compute; LAB_PIN_CORES=0 leaves the ranks to the scheduler."""
    from helpers.runtime.launch import run
    from tests import workers

    monkeypatch.delenv("LAB_PIN_CORES", raising=False)
    rig, usable = cpu_rig(), sorted(os.sched_getaffinity(0))
    ranks = run(workers.cores_of_threads, rig=rig)
    assert all(len(r["main"]) == rig.threads_per_device for r in ranks)
    assert not set(ranks[0]["main"]) & set(ranks[1]["main"])
    assert all(any(cores == usable for cores in r["others"]) for r in ranks)  # gloo's threads left free
    monkeypatch.setenv("LAB_PIN_CORES", "0")
    assert all(r["main"] == usable for r in run(workers.cores_of_threads, rig=rig))


@needs_two_pinnable_cores
def test_a_cpu_device_thread_runs_on_its_devices_cores(monkeypatch):
    """Device threads of CPU devices pinned to their device's cores, the caller's thread left as it was; a thread
    for a CUDA device (a GPU's host thread), a lone device and devices that do not fit the cores never pinned."""
    import threading

    from helpers.runtime.rig import device_thread

    monkeypatch.delenv("LAB_PIN_CORES", raising=False)
    before, usable = torch.get_num_threads(), sorted(os.sched_getaffinity(0))

    def cores(device: torch.device, index: int, world: int) -> set[int]:
        seen = {}
        t = threading.Thread(target=device_thread(lambda: seen.update(cores=os.sched_getaffinity(0)), device, index,
                                                  world))
        t.start()
        t.join()
        return seen["cores"]

    torch.set_num_threads(1)
    try:
        cpu = torch.device("cpu")
        assert [cores(cpu, i, 2) for i in range(2)] == [{usable[0]}, {usable[1]}]
        assert cores(torch.device("cuda", 0), 0, 2) == cores(cpu, 0, 1) == set(usable)
        assert cores(cpu, 0, len(usable) + 1) == set(usable)  # more devices than cores: the scheduler shares them
    finally:
        torch.set_num_threads(before)
    assert os.sched_getaffinity(0) == set(usable)
