"""A deterministic synthetic token dataset and the language-model loss: same seed, same data, on every rig."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


IGNORE_INDEX = -100  # a target that takes no part in the loss (padding), as in PyTorch and Hugging Face


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the kept tokens (targets != IGNORE_INDEX): their mean, the one-device reference
    (or their sum: `lm_loss_sum`)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same cross entropy summed over the kept tokens. Engines divide it by the kept tokens of the *global*
    batch, so that micro-batches and data-parallel shards with different amounts of padding still add up to
    exactly `lm_loss` of the whole batch (a mean of per-micro-batch means would not)."""
    return lm_loss(logits, targets, "sum")


def kept_tokens(targets: torch.Tensor) -> int:
    """How many targets count in the loss."""
    return int((targets != IGNORE_INDEX).sum())


HOST = torch.device("cpu")  # where data is made before a rank moves it to its device
PADDING = ("none", "right", "left")
PAD_ID = 0


def pad_sequences(x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, side: str,
                  pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padding as a tokenizer makes it, for sequences of `lengths` real tokens: on the right (training) or the left
    (generation). A pad position gets `pad_id` as input, IGNORE_INDEX as target and 0 in the attention mask."""
    if side not in ("right", "left"):
        raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
    b, s = x.shape
    positions = torch.arange(s, device=x.device).expand(b, s)
    real = positions < lengths[:, None] if side == "right" else positions >= (s - lengths)[:, None]
    if side == "left":  # move each sequence's first `length` tokens to the end
        shift = (s - lengths)[:, None]
        source = (positions - shift).clamp(min=0)
        x, y = x.gather(1, source), y.gather(1, source)
    mask = real.long()
    return x.masked_fill(~real, pad_id), y.masked_fill(~real, IGNORE_INDEX), mask


@dataclass(frozen=True)
class SyntheticTokens:
    """Deterministic token sequences with learnable structure: each token follows from the previous one by a fixed
    random permutation, with a fraction of noise tokens. Same seed, same data, on every rig.

    With `padding` "right" or "left", each sample keeps a seeded number of real tokens (from a quarter of the
    sequence to all of it) and the rest is padding: `masked_batch` returns the attention mask too."""

    n_samples: int
    seq_len: int = 32
    vocab: int = 256
    noise: float = 0.1
    seed: int = 0
    padding: str = "none"
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.padding not in PADDING:
            raise ValueError(f"unknown padding {self.padding!r}; choose one of {PADDING}")

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both [n_samples, seq_len] int64; targets are inputs shifted by one."""
        if "data" not in self._cache:
            with torch.device(HOST):  # generated on the host, as a data loader does; ranks move it to their device
                self._cache["data"] = self._generate()
        return self._cache["data"]

    def _generate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole data set, on the default device (`tensors` makes it the host)."""
        g = torch.Generator().manual_seed(self.seed)
        perm = torch.randperm(self.vocab, generator=g)
        seq = torch.empty(self.n_samples, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (self.n_samples,), generator=g)
        for t in range(1, self.seq_len + 1):
            noisy = torch.rand(self.n_samples, generator=g) < self.noise
            seq[:, t] = torch.where(noisy, torch.randint(self.vocab, (self.n_samples,), generator=g),
                                    perm[seq[:, t - 1]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` (wrapping around) of `batch_size` samples."""
        x, y = self.tensors()
        if not 0 < batch_size <= self.n_samples:
            raise ValueError(f"batch size {batch_size} must be between 1 and the {self.n_samples} samples")
        start = (index * batch_size) % (self.n_samples - batch_size + 1)
        return x[start:start + batch_size], y[start:start + batch_size]

    def masked_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, attention mask) of batch `index`; the mask is None without padding."""
        x, y = self.batch(index, batch_size)
        if self.padding == "none":
            return x, y, None
        g = torch.Generator().manual_seed(self.seed + 1)
        lengths = torch.randint(max(1, self.seq_len // 4), self.seq_len + 1, (self.n_samples,), generator=g,
                                device=HOST)
        start = (index * batch_size) % (self.n_samples - batch_size + 1)
        return pad_sequences(x, y, lengths[start:start + batch_size], self.padding)
