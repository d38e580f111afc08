"""Real text, offline: a corpus every machine already has (the Python standard library's own .py files), a byte-level
BPE tokenizer trained here with `tokenizers` and saved beside the model, and the token windows the engines train on.

Deterministic: files in sorted order, the held-out part is the corpus's last characters (other files than the
training text), the tokenizer is trained on the training part only, windows are cut in order. The windows are
saved with `torch.save` as a LongTensor [N, L+1] (inputs and the next token), the format every script's `--data`
and `TrainJob(data=...)` read: step k trains on windows k*batch.. (wrapping around).
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
SKIPPED_FOLDERS = ("site-packages", "dist-packages", "__pycache__")  # installed packages are not the stdlib's text
END_OF_TEXT = "<|endoftext|>"


def stdlib_path() -> Path:
    """The Python standard library's folder: .py files on every machine that runs the course, nothing to fetch."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(path: str | Path) -> list[Path]:
    """`path` itself if it is a file, else the text files under it (.py .txt .md .rst), sorted, without installed
    packages, caches or hidden folders."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"no text at {path}: give a text file or a folder of them")
    files = []
    for folder, subfolders, names in os.walk(path):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_FOLDERS and not d.startswith(".")]  # not entered
        files += [Path(folder) / n for n in names if Path(n).suffix in TEXT_SUFFIXES and not n.startswith(".")]
    files.sort()
    if not files:
        raise ValueError(f"{path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """The text of `path` (a file, or a folder's files in sorted order, each followed by END_OF_TEXT), at most
    `max_chars` characters. Undecodable bytes are replaced, so any file reads."""
    parts, total = [], 0
    for f in text_files(path):
        chunk = f.read_text(encoding="utf-8", errors="replace") + END_OF_TEXT
        parts.append(chunk)
        total += len(chunk)
        if max_chars is not None and total >= max_chars:
            break
    text = "".join(parts)
    return text[:max_chars] if max_chars is not None else text


def train_tokenizer(text: str, vocab_size: int, directory: str | Path | None = None):
    """A byte-level BPE tokenizer (GPT-2's kind: any byte sequence encodes, nothing is unknown) trained on `text`
    with `tokenizers`, as a transformers `PreTrainedTokenizerFast`; saved with `save_pretrained` to `directory`
    (beside the model, so `AutoTokenizer.from_pretrained(model_dir)` finds it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least 257 (256 bytes and "
                         f"{END_OF_TEXT}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT)
    if directory is not None:
        fast.save_pretrained(str(directory))
    return fast


def encode(tokenizer, text: str) -> torch.Tensor:
    """Token ids of `text`, 1-D int64, on the host."""
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long, device="cpu")


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows of seq_len + 1 tokens: row[:-1] the inputs, row[1:] the targets."""
    n = ids.numel() // (seq_len + 1)
    return ids[:n * (seq_len + 1)].reshape(n, seq_len + 1).clone()


def batch_rows(rows: torch.Tensor, step: int, batch: int) -> torch.Tensor:
    """The `batch` windows step `step` trains on: the next ones in order, wrapping around (what scripts/_common.py's
    `batches` reads from --data too)."""
    start = (step * batch) % max(1, len(rows) - batch + 1)
    return rows[start:start + batch]


def load_rows(path: str | Path) -> torch.Tensor:
    """A window file written by `TextData.save` (or any torch.save'd LongTensor [N, L+1])."""
    rows = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.dtype == torch.long):
        raise ValueError(f"{path} does not hold token windows: expected a LongTensor [N, L+1], got "
                         f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")
    return rows


def check_rows(rows: torch.Tensor, batch: int, seq_len: int, vocab: int, where: str = "the corpus") -> None:
    """Refuse windows too few for one batch, too short for `seq_len`, or with ids outside the vocabulary."""
    if len(rows) < batch:
        raise ValueError(f"{where} is smaller than one batch: {len(rows)} windows of {rows.shape[1]} tokens, and a "
                         f"batch needs {batch}; give more text, a smaller batch or a shorter seq_len")
    if rows.shape[1] < seq_len + 1:
        raise ValueError(f"{where} has windows of {rows.shape[1]} tokens, too short for seq_len {seq_len} (which "
                         f"needs {seq_len + 1}: inputs and the next token)")
    if int(rows.max()) >= vocab:
        raise ValueError(f"{where} holds token id {int(rows.max())}, outside the model's vocabulary of {vocab}: "
                         "was it made with another tokenizer?")


@dataclass
class TextData:
    """A corpus as training and held-out windows, with the tokenizer that made them."""

    train: torch.Tensor  # [N, L+1]
    held_out: torch.Tensor  # [M, L+1]
    tokenizer: object
    source: str

    def save(self, directory: str | Path) -> tuple[Path, Path]:
        """train.pt and held_out.pt in `directory` (what TrainJob(data=...) and --data read)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = directory / "train.pt", directory / "held_out.pt"
        torch.save(self.train, paths[0])
        torch.save(self.held_out, paths[1])
        return paths


def prepare_text(path: str | Path | None = None, seq_len: int = 64, vocab_size: int = 512,
                 max_chars: int = 400_000, held_out: float = 0.1, tokenizer_dir: str | Path | None = None,
                 tokenizer=None) -> TextData:
    """Read `path` (default: the standard library), keep its last `held_out` share of characters apart, train a
    byte-level BPE tokenizer on the rest (or use `tokenizer`, e.g. one saved beside a model) and cut both parts into
    windows of seq_len + 1 tokens."""
    if not 0 < held_out < 1:
        raise ValueError(f"held_out is a share of the text, between 0 and 1, got {held_out}")
    source = Path(path) if path is not None else stdlib_path()
    text = read_text(source, max_chars)
    cut = int(len(text) * (1 - held_out))
    if tokenizer is None:
        tokenizer = train_tokenizer(text[:cut], vocab_size, tokenizer_dir)
    elif tokenizer_dir is not None:
        tokenizer.save_pretrained(str(tokenizer_dir))
    return TextData(windows(encode(tokenizer, text[:cut]), seq_len), windows(encode(tokenizer, text[cut:]), seq_len),
                    tokenizer, str(source))


# --- measuring a model on text --------------------------------------------------------------------------------------

@torch.no_grad()
def text_loss(model, rows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross entropy of `model` (ids [B, L] -> logits [B, L, V], e.g. a Stage of layers) over the
    windows `rows`, in eval mode."""
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, new_tokens: int = 40, context: int | None = None) -> str:
    """`prompt` continued by `new_tokens` greedy (argmax) tokens: the same text every run. `context`: the longest
    input the model takes (its max_position_embeddings); older tokens are dropped."""
    ids = encode(tokenizer, prompt).unsqueeze(0)
    start = ids.shape[1]
    for _ in range(new_tokens):
        window = ids[:, -context:] if context else ids
        nxt = model(window)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return tokenizer.decode(ids[0, start:].tolist())


def tokenizer_for(model_dir: str | Path, text: str, vocab_size: int):
    """The tokenizer saved beside the model in `model_dir` (a real model has one), else a byte-level BPE trained on
    `text` with the model's vocabulary size and saved there, so that the model and its tokenizer travel together."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if len(tokenizer) > vocab_size:
            raise ValueError(f"the tokenizer in {model_dir} has {len(tokenizer)} tokens, more than the model's "
                             f"vocabulary of {vocab_size}")
        return tokenizer
    return train_tokenizer(text, vocab_size, model_dir)


def model_text(model_dir: str | Path, vocab_size: int, text: str | Path | None, seq_len: int, directory: str | Path,
               max_chars: int = 400_000, held_out: float = 0.1) -> tuple[Path, Path, object]:
    """Token windows of `text` (a file or folder; None: the standard library) for the model in `model_dir`, with its
    tokenizer (`tokenizer_for`), saved in `directory`: (train.pt, held_out.pt, tokenizer)."""
    source = Path(text) if text is not None else stdlib_path()
    raw = read_text(source, max_chars)
    tokenizer = tokenizer_for(model_dir, raw[:int(len(raw) * (1 - held_out))], vocab_size)
    data = prepare_text(source, seq_len, max_chars=max_chars, held_out=held_out, tokenizer=tokenizer)
    return (*data.save(directory), tokenizer)
