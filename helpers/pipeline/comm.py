"""What crosses the link between the two devices (`Wire`: in which dtype), what it costs (`link_benchmark`), and
how the threaded engine moves it between GPUs (`send_to`, `CopyStreams`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.dtypes import DTYPES, NAMES
from helpers.measure import median_time, synchronize
from helpers.runtime.strict import plain_backend

SENDABLE = NAMES  # every floating format the course names can carry activations and gradients
AUTO = "auto"  # send in the dtype the stage computed: exact, whatever the model's precision


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A wire dtype: fp64/fp32/fp16/bf16 (or the torch dtypes), or None for "auto"; anything else cannot carry
    activations and gradients."""
    if dtype is None or dtype == AUTO:
        return None
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in SENDABLE:
        raise ValueError(f"cannot send activations as {dtype}: boundary transfers take 'auto' (the model's own "
                         "dtype), fp32, fp16, bf16 or fp64 (integer or 8-bit types would need scaling that "
                         "gradients do not survive)")
    return resolved


@dataclass(frozen=True)
class Wire:
    """How tensors travel between stages: in `dtype` (None: in the dtype they were computed in), cast back to
    `compute` on arrival, in both directions, so backward sees correctly typed gradients. A bf16 model's boundary
    is bf16 on the wire unless you ask for something else; an fp32 model's can travel as bf16 (half the bytes)."""

    dtype: torch.dtype | None = None
    compute: torch.dtype = torch.float32

    @classmethod
    def of(cls, dtype: torch.dtype | str | None = AUTO, compute: torch.dtype = torch.float32) -> "Wire":
        return cls(resolve_dtype(dtype), compute)

    @property
    def carried(self) -> torch.dtype:
        """The dtype on the wire."""
        return self.dtype or self.compute

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.carried) if t.is_floating_point() else t

    def unpack(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Back to the compute dtype (or `dtype`, the one the sender had)."""
        return t.to(dtype or self.compute) if t.is_floating_point() else t

    def bytes(self, t: torch.Tensor) -> int:
        """Bytes this tensor occupies on the wire."""
        size = torch.tensor([], dtype=self.carried).element_size() if t.is_floating_point() else t.element_size()
        return t.numel() * size

    @property
    def name(self) -> str:
        return SENDABLE[self.carried]


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


def _one_way(buf: torch.Tensor, peer: int, sending: bool, device: torch.device) -> None:
    """One message as the process engine sends it: one `batch_isend_irecv` on the rank's device (NCCL), or staged
    through host memory when the backend is gloo (the CPU rig; two ranks sharing one GPU)."""
    wire = buf if plain_backend() == "nccl" else buf.to("cpu")
    op = dist.P2POp(dist.isend if sending else dist.irecv, wire, peer)
    for work in dist.batch_isend_irecv([op]):
        work.wait()
    if not sending and wire is not buf:
        buf.copy_(wire)
    synchronize(device)


def _round_trip(buf: torch.Tensor, rank: int, device: torch.device) -> None:
    """Rank 0 sends `buf` to rank 1, which sends it back (`_one_way` each)."""
    for sender in (0, 1):
        _one_way(buf, 1 - rank, rank == sender, device)


def timed_across_ranks(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats`, after one untimed warm-up, all ranks starting together (a rank
    worker: every rank calls it)."""
    return median_time(fn, repeats, device, before=dist.barrier)


def process_links(sizes: list[int], repeats: int = 5) -> list[LinkSample]:
    """Rank worker: the links the multi-process engines use, on this rig's backend. Point-to-point: one-way time of
    n bytes (round trip / 2, as the pipeline engine sends them); all-reduce: time of one all-reduce of n bytes (as
    DDP averages a gradient bucket)."""
    from helpers.runtime.launch import rank_device

    rank, device, backend = dist.get_rank(), rank_device(), plain_backend()
    staged = "" if backend == "nccl" else ", through host memory" if device.type == "cuda" else ""
    warm = torch.zeros(1, device=device)
    for _ in range(3):  # the first messages pay for connection setup
        _round_trip(warm, rank, device)
        dist.all_reduce(warm)
    samples = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
        samples.append(LinkSample(f"processes: point-to-point ({backend}{staged})", n,
                                  timed_across_ranks(lambda: _round_trip(buf, rank, device), repeats, device) / 2))
        samples.append(LinkSample(f"processes: all-reduce ({backend})", n,
                                  timed_across_ranks(lambda: dist.all_reduce(buf), repeats, device)))
    return samples if rank == 0 else []


def cuda_copy_benchmark(sizes: list[int], repeats: int = 5) -> list[LinkSample]:
    """In one process (the threaded engine's path): device->device (cuda:0 -> cuda:1, or within cuda:0 on a
    one-GPU machine), and host->device from pinned and from pageable memory. Only call where CUDA is available."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_copy_benchmark needs CUDA; on CPU the process links are what there is to measure")
    dst_index = 1 if torch.cuda.device_count() > 1 else 0
    cuda0 = torch.device("cuda:0")  # every copy here runs on cuda:0's stream (between GPUs: the source's)

    def copy_time(src: torch.Tensor, dst: torch.Tensor) -> float:
        return median_time(lambda: dst.copy_(src, non_blocking=True), repeats, cuda0)

    samples = []
    for n in sizes:
        numel = n // 4
        pageable = torch.empty(numel)
        pinned = torch.empty(numel, pin_memory=True)
        dev0 = torch.empty(numel, device="cuda:0")
        dev1 = torch.empty(numel, device=f"cuda:{dst_index}")
        samples.append(LinkSample(f"threads: cuda:0->cuda:{dst_index} copy", n, copy_time(dev0, dev1)))
        samples.append(LinkSample("host->cuda:0 pinned", n, copy_time(pinned, dev0)))
        samples.append(LinkSample("host->cuda:0 pageable", n, copy_time(pageable, dev0)))
    return samples


def link_benchmark(rig, sizes: list[int] | None = None, repeats: int = 5) -> list[LinkSample]:
    """Every link the engines use on this rig, over a sweep of message sizes: the multi-process engines'
    point-to-point and all-reduce (two ranks), and on GPUs the in-process copies of the threaded engine and host
    transfers."""
    from helpers.runtime.launch import run

    sizes = sizes or default_sizes()
    bad = [n for n in sizes if n < 4 or n % 4]
    if bad:
        raise ValueError(f"message sizes must be positive multiples of 4 bytes (fp32 elements), got {bad}")
    if not repeats >= 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    copies = cuda_copy_benchmark(sizes, repeats) if rig.is_cuda else []
    return copies + run(process_links, sizes, repeats, rig=rig)[0]


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
        self.dtype: torch.dtype | None = None  # the sender's dtype, when the wire changed it

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
