"""What crosses the link between the two devices, and what it costs.

- `Wire`: the dtype activations and gradients travel in. fp16/bf16 halve the bytes; values are cast back to the
  compute dtype on arrival, in both directions, so backward sees correctly typed gradients.
- `link_benchmark`: bandwidth and latency over a size sweep. On GPUs: CUDA copies host->device (pinned vs pageable)
  and device->device; on CPU: gloo send/recv between two ranks (run through the launcher).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SENDABLE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = {v: k for k, v in SENDABLE.items()}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """fp32/fp16/bf16 (or the torch dtypes); anything else cannot carry activations and gradients."""
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in SENDABLE:
        raise ValueError(f"cannot send activations as {dtype}: boundary transfers take fp32, fp16 or bf16 "
                         "(integer or 8-bit types would need scaling that gradients do not survive)")
    return resolved


@dataclass(frozen=True)
class Wire:
    """How tensors travel between stages: cast to `dtype` before sending, back to `compute` after receiving."""

    dtype: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32

    @classmethod
    def of(cls, dtype: torch.dtype | str = torch.float32) -> "Wire":
        return cls(resolve_dtype(dtype))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.compute) if t.is_floating_point() else t

    def bytes(self, t: torch.Tensor) -> int:
        """Bytes this tensor occupies on the wire."""
        size = torch.tensor([], dtype=self.dtype).element_size() if t.is_floating_point() else t.element_size()
        return t.numel() * size

    @property
    def name(self) -> str:
        return SENDABLE[self.dtype]


@dataclass(frozen=True)
class LinkSample:
    path: str
    bytes: int
    seconds: float  # one-way time, median

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def row(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "time (us)": self.seconds * 1e6, "GB/s": self.gb_per_s}


def default_sizes(max_bytes: int = 64 * 2**20) -> list[int]:
    sizes, n = [], 4 * 1024
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


def _round_trip(buf: torch.Tensor, rank: int) -> None:
    """Rank 0 sends `buf` to rank 1, which sends it back."""
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def gloo_pingpong(sizes: list[int], repeats: int = 5) -> list[LinkSample]:
    """Rank worker: one-way time of n bytes = round trip / 2, median of repeats, per size."""
    rank = dist.get_rank()
    for _ in range(3):  # the first messages pay for connection setup
        _round_trip(torch.zeros(1), rank)
    samples = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)
        times = []
        for r in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            _round_trip(buf, rank)
            if r:
                times.append((time.perf_counter() - t0) / 2)
        samples.append(LinkSample("gloo send/recv (CPU ranks)", n, statistics.median(times)))
    return samples


def _time_copy(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_copy_benchmark(sizes: list[int], repeats: int = 5) -> list[LinkSample]:
    """Host->device from pinned and from pageable memory, and device->device (cuda:0 -> cuda:1, or within
    cuda:0 on a one-GPU machine). Only call where CUDA is available."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_copy_benchmark needs CUDA; on CPU use the gloo benchmark")
    dst_index = 1 if torch.cuda.device_count() > 1 else 0
    samples = []
    for n in sizes:
        numel = n // 4
        pageable = torch.empty(numel)
        pinned = torch.empty(numel, pin_memory=True)
        dev0 = torch.empty(numel, device="cuda:0")
        dev1 = torch.empty(numel, device=f"cuda:{dst_index}")
        samples.append(LinkSample("host->cuda:0 pinned", n, _time_copy(pinned, dev0, repeats)))
        samples.append(LinkSample("host->cuda:0 pageable", n, _time_copy(pageable, dev0, repeats)))
        samples.append(LinkSample(f"cuda:0->cuda:{dst_index}", n, _time_copy(dev0, dev1, repeats)))
    return samples


def link_benchmark(rig, sizes: list[int] | None = None, repeats: int = 5) -> list[LinkSample]:
    """The link between this rig's two devices, measured: CUDA copies on GPUs, gloo send/recv on CPU."""
    from helpers.runtime.launch import run

    sizes = sizes or default_sizes()
    bad = [n for n in sizes if n < 4 or n % 4]
    if bad:
        raise ValueError(f"message sizes must be positive multiples of 4 bytes (fp32 elements), got {bad}")
    if rig.is_cuda:
        return cuda_copy_benchmark(sizes, repeats)
    return run(gloo_pingpong, sizes, repeats, rig=rig)[0]


class CopyStreams:
    """Side streams for copies between GPUs, as torchgpipe uses them: per device one stream for what leaves it and
    one for what arrives, so neither device's compute stream waits for a copy, and the two directions of a link
    run at once."""

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str], object] = {}

    def get(self, device: torch.device, role: str):
        key = (device, role)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]


class Transfer:
    """A tensor on its way to another device (or stream). `get` makes the receiver's current stream wait for the
    copy, and tells the allocator the tensor is now used there (`record_stream`), so its memory is not reused while
    the receiver still reads it."""

    def __init__(self, tensor: torch.Tensor, event=None):
        self.tensor, self.event = tensor, event

    def get(self) -> torch.Tensor:
        if self.event is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            stream.wait_event(self.event)
            self.tensor.record_stream(stream)
        return self.tensor


def send_to(t: torch.Tensor, device: torch.device, streams: CopyStreams | None = None) -> Transfer:
    """Start moving `t` to `device`.

    Between GPUs (with `streams`): the copy runs on the sender's outgoing and the receiver's incoming copy stream,
    after the kernels that produced `t`; the sender's compute stream goes on at once. On one GPU shared by two
    stages (each on its own compute stream) nothing is copied: the receiver waits for the producer's event.
    Anything else (CPU virtual devices): a plain `.to()`.
    """
    if t.device.type != "cuda" or device.type != "cuda" or streams is None:
        return Transfer(t.to(device))
    producer = torch.cuda.current_stream(t.device)
    event = torch.cuda.Event()
    if t.device == device:
        event.record(producer)
        return Transfer(t, event)
    outgoing, incoming = streams.get(t.device, "out"), streams.get(device, "in")
    outgoing.wait_stream(producer)  # the data must exist before it is copied
    with torch.cuda.stream(outgoing), torch.cuda.stream(incoming):  # a cross-GPU copy syncs both current streams
        out = t.to(device, non_blocking=True)
        event.record(incoming)
    t.record_stream(outgoing)
    return Transfer(out, event)
