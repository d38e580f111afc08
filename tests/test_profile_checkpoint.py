import copy

import pytest
import torch
from torch import nn

from helpers.activation_checkpointing import checkpoint_layers, every_kth
from helpers.check import assert_same_grads
from helpers.sizing.ledger import measure_step_memory
from helpers.models import StackConfig, SyntheticTokens, build_hf_model, build_stack, hf_layers, lm_loss
from helpers.profile import profile_layers
from helpers.pipeline.stages import as_layers, make_executors, naive_train_step, split_model

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)


def test_profile_counts_bytes():
    model = build_stack(CFG)
    x, y = SyntheticTokens(4, CFG.seq_len, CFG.vocab).batch(0, 4)
    prof = profile_layers(model, x, repeats=2, loss_fn=lm_loss, target=y)
    assert len(prof.layers) == len(model)
    assert [p.params for p in prof.layers] == [sum(q.numel() * 4 for q in l.parameters()) for l in model]
    assert prof.layers[1].output == 4 * CFG.seq_len * CFG.hidden * 4  # fp32 [4, 8, 32]
    assert prof.layers[-1].output == 4  # the head's output is the scalar loss here
    assert all(p.forward_s > 0 and p.backward_s > 0 and p.activations > 0 for p in prof.layers)
    assert prof.costs("count") == [1.0] * len(model)
    with pytest.raises(ValueError, match="unknown cost"):
        prof.costs("speed")
    assert "fwd (ms)" in str(prof)


def test_layers_of_unlistable_model_are_explained():
    with pytest.raises(TypeError, match="expected an nn.Sequential"):
        as_layers(nn.Transformer())
    with pytest.raises(TypeError, match="expected a Hugging Face causal LM"):
        hf_layers(nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_decoder_split_equals_one_device(family):
    model = build_hf_model(family, n_layers=2, hidden=32, heads=2, vocab=64, seq_len=8)
    layers = hf_layers(model)
    ids, targets = SyntheticTokens(4, 8, 64).batch(0, 4)
    torch.testing.assert_close(layers(ids), model(ids).logits)
    split = split_model(copy.deepcopy(layers), [2], [torch.device("cpu")] * 2)
    loss = naive_train_step(make_executors(split), ids, targets)
    ref = lm_loss(layers(ids), targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    assert_same_grads(layers, split)


def test_checkpointing_keeps_gradients_and_cuts_activations():
    base = build_stack(CFG)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    plain = copy.deepcopy(base)
    ckpt = checkpoint_layers(copy.deepcopy(base), every_kth(range(1, 5), 1))
    mem_plain = measure_step_memory(plain, x, y, lm_loss, torch.optim.SGD(plain.parameters(), lr=0.0))
    mem_ckpt = measure_step_memory(ckpt, x, y, lm_loss, torch.optim.SGD(ckpt.parameters(), lr=0.0))
    assert_same_grads(plain, ckpt)
    assert mem_ckpt.activations * 3 <= mem_plain.activations


def test_checkpoint_indices_are_checked():
    with pytest.raises(ValueError, match=r"layer indices \[9\] are outside"):
        checkpoint_layers(build_stack(CFG), [9])
    with pytest.raises(ValueError, match="k must be at least 1"):
        every_kth([1, 2], 0)
