"""Real text, offline: the standard library as a corpus, a byte-level BPE tokenizer trained here, and training on it
through `train(text=...)`: the held-out loss falls and a greedy sample changes; bad text is refused up front."""
import pytest
import torch

from helpers.models.hf import HFModel, hf_config, save_hf_model
from helpers.models.layered import Stage
from helpers.models.text import (greedy_sample, load_rows, prepare_text, read_text, stdlib_path, text_files,
                                 text_loss, train_tokenizer)
from helpers.training import train


def test_stdlib_corpus_and_tokenizer_are_deterministic(tmp_path):
    files = text_files(stdlib_path())
    assert files == sorted(files) and not any("site-packages" in f.parts for f in files)
    text = read_text(stdlib_path(), 30_000)
    assert text == read_text(stdlib_path(), 30_000) and len(text) == 30_000
    a, b = train_tokenizer(text, 300, tmp_path / "tok"), train_tokenizer(text, 300)
    sample = "def f(x):\n    return x + 1  # ünïcode\n"
    assert a(sample)["input_ids"] == b(sample)["input_ids"]
    assert a.decode(a(sample)["input_ids"]) == sample  # byte-level: nothing is unknown
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "tok")(sample)["input_ids"] == a(sample)["input_ids"]
    data = prepare_text(seq_len=16, vocab_size=300, max_chars=30_000)
    assert data.train.shape[1] == data.held_out.shape[1] == 17 and len(data.held_out) > 0


@pytest.mark.full
def test_training_on_text_lowers_held_out_loss_and_changes_the_sample(tmp_path):
    """A tiny Llama, 30 Adam steps on standard-library text (in-process engine): the held-out windows' loss falls
    and the greedy continuation of a prompt changes; the tokenizer is saved beside the trained model."""
    from transformers import AutoTokenizer

    model = save_hf_model(hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, seq_len=32),
                          tmp_path / "base")
    out = train(model, strategy="naive", engine="threads", steps=30, batch=8, seq_len=32, lr=1e-2,
                text=stdlib_path(), save_to=tmp_path / "trained", workdir=tmp_path / "text")
    held = load_rows(out.held_out_path)[:16]

    def measure(path):
        hf = HFModel(str(path))
        layers = hf.meta_layers()
        hf.materialize(layers, range(len(layers)), torch.device("cpu"))
        stage = Stage(layers).eval()
        return text_loss(stage, held), greedy_sample(stage, out.tokenizer, "def ", 20, 32)

    (before, sample_before), (after, sample_after) = measure(model.path), measure(tmp_path / "trained")
    assert after < before - 0.5
    assert sample_after != sample_before
    assert len(AutoTokenizer.from_pretrained(tmp_path / "trained")) == len(out.tokenizer)


def test_bad_text_is_refused_before_training(tmp_path):
    model = save_hf_model(hf_config("llama", n_layers=1, hidden=32, heads=4, vocab=300, seq_len=16),
                          tmp_path / "base")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print('hello')\n")
    with pytest.raises(ValueError, match="smaller than one batch"):
        train(model, strategy="naive", engine="threads", steps=3, batch=8, seq_len=16, text=tiny,
              workdir=tmp_path / "t")
    with pytest.raises(ValueError, match="beyond the model's context of 16"):
        train(model, strategy="naive", engine="threads", steps=3, batch=2, seq_len=32, text=stdlib_path() / "json",
              workdir=tmp_path / "t2")
    with pytest.raises(ValueError, match="no text"):
        text_files(tmp_path / "missing")
