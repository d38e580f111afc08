import copy

import pytest
import torch
from torch import nn

from helpers.models import StackConfig, SyntheticTokens, build_hf_model, build_stack, count_params, lm_loss
from helpers.pipeline.stages import make_executors, naive_train_step, split_model
from helpers.timeline import Recorder


def test_synthetic_tokens_are_deterministic_and_shifted():
    a, b = SyntheticTokens(16, 8, 32, seed=1), SyntheticTokens(16, 8, 32, seed=1)
    xa, ya = a.tensors()
    xb, yb = b.tensors()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert int(xa.max()) < 32
    with pytest.raises(ValueError, match="batch size 17"):
        a.batch(0, 17)


def test_stack_has_embedding_blocks_head():
    cfg = StackConfig(hidden=32, n_blocks=3, heads=2, ffn_widths=(16, 64, 32))
    model = build_stack(cfg)
    assert len(model) == 5
    logits = model(SyntheticTokens(2, cfg.seq_len, cfg.vocab).tensors()[0])
    assert logits.shape == (2, cfg.seq_len, cfg.vocab)
    with pytest.raises(ValueError, match="ffn_widths has 2 entries"):
        StackConfig(n_blocks=3, ffn_widths=(1, 2))


def test_naive_split_equals_one_device():
    cfg = StackConfig(hidden=32, n_blocks=4, heads=2)
    ref = build_stack(cfg)
    model = copy.deepcopy(ref)
    x, y = SyntheticTokens(8, cfg.seq_len, cfg.vocab).batch(0, 8)
    loss_ref = lm_loss(ref(x), y)
    loss_ref.backward()
    split = split_model(model, 3, [torch.device("cpu")] * 2)
    recs = [Recorder(0), Recorder(1)]
    loss = naive_train_step(make_executors(split, recs), x, y)
    assert torch.allclose(loss, loss_ref, atol=1e-6)
    for p_ref, p in zip(ref.parameters(), split.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-5)
    events = recs[0].events() + recs[1].events()
    order = [(e.device, e.kind) for e in sorted(events, key=lambda e: e.start)]
    assert order == [(0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")]
    assert torch.allclose(split(x), ref(x), atol=1e-6)


@pytest.mark.parametrize("bounds, msg", [(0, "split point 0 is outside"), (6, "split point 6 is outside"),
                                         ([3, 2], "strictly increasing")])
def test_bad_split_points(bounds, msg):
    with pytest.raises(ValueError, match=msg):
        split_model(build_stack(StackConfig(hidden=16, n_blocks=4, heads=2)), bounds, [torch.device("cpu")] * 3)


def test_more_stages_than_devices_is_refused():
    with pytest.raises(ValueError, match="3 stages but only 2 devices"):
        split_model(build_stack(StackConfig(hidden=16, n_blocks=4, heads=2)), [2, 4], [torch.device("cpu")] * 2)


def test_non_sequential_model_is_explained():
    with pytest.raises(TypeError, match="expected an nn.Sequential"):
        split_model(nn.Linear(2, 2), 1, [torch.device("cpu")] * 2)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_models_build_offline(family):
    model = build_hf_model(family, n_layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
    assert count_params(model) > 0
    out = model(torch.randint(64, (2, 16)))
    assert out.logits.shape == (2, 16, 64)


def test_grad_comparison_sees_differences():
    from helpers.check import grads_of, max_grad_diff

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    for m, scale in ((a, 1.0), (b, 2.0)):
        (m(torch.ones(1, 2)).sum() * scale).backward()
    assert max_grad_diff(a, b) > 0
    assert max_grad_diff(grads_of(a.parameters()), grads_of(b.parameters())) == max_grad_diff(a, b)
    assert max_grad_diff(grads_of(a.parameters()), a) == 0
