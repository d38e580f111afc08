"""The checks themselves: a comparison of nothing is refused, so a strategy that returns no gradients (or fewer than
one device has) fails every parity test instead of comparing as "no difference"."""
from types import SimpleNamespace

import pytest
import torch

from helpers.check import assert_same_grads, max_grad_diff
from helpers.doctor.engines import _compare as doctor_compare
from helpers.inference.generate import same_tokens
from helpers.precision import Precision, max_relative_diff

REFERENCE = [torch.ones(3, 2), torch.ones(2)]
COMPARISONS = {"max_grad_diff": max_grad_diff, "max_relative_diff": max_relative_diff,
               "assert_same_grads": assert_same_grads}


@pytest.mark.parametrize("compare", COMPARISONS.values(), ids=COMPARISONS.keys())
@pytest.mark.parametrize("other, message", [
    ([], "2 reference tensors but 0"),                                 # a strategy that returned no gradients
    (REFERENCE[:1], "2 reference tensors but 1"),                      # one parameter lost on the way
    (REFERENCE + [torch.ones(1)], "2 reference tensors but 3"),
    ([torch.ones(3, 2), torch.ones(())], r"tensor 1: shape \(\), the reference's is \(2,\)"),  # broadcasts silently
], ids=["none", "fewer", "more", "shape"])
def test_comparisons_refuse_what_they_cannot_compare(compare, other, message):
    assert compare(REFERENCE, REFERENCE) == 0
    with pytest.raises(ValueError, match=message):
        compare(REFERENCE, other)
    with pytest.raises(ValueError, match="the reference holds no tensors"):
        compare([], [])


def test_two_generations_of_nothing_are_not_the_same_tokens():
    tokens = [torch.tensor([[1, 2, 3]])]
    assert same_tokens(tokens, tokens) and not same_tokens(tokens, []) and not same_tokens(tokens, [tokens[0][:, :2]])
    with pytest.raises(ValueError, match="neither run generated any tokens"):
        same_tokens([], [])


def _without_gradients(monkeypatch, module, loss: float, keep: int):
    """Make `module.run_training` a strategy that computes one device's loss and returns only the first `keep` of
    one device's gradients (no processes start: the test is about the check, not the engine)."""
    def run_training(job, rig, **kw):
        _, grads = module._reference_with(job.precision)
        return SimpleNamespace(loss=loss, losses=[loss + 1, loss], grads=grads[:keep])
    monkeypatch.setattr(module, "run_training", run_training)


@pytest.mark.parametrize("keep", [0, -1], ids=["no gradients", "one missing"])
def test_a_strategy_without_its_gradients_fails_the_parity_tests(monkeypatch, keep):
    """The parity tests themselves, run against a strategy whose loss is right and whose gradients are missing:
    each fails on the count, where `zip` used to stop at the shorter list and report no difference."""
    import tests.test_train_hf as hf
    import tests.test_training as training

    loss, grads = training._reference_with(Precision())
    reference = (loss, grads, None)
    _without_gradients(monkeypatch, training, loss, keep)
    with pytest.raises(ValueError, match="reference tensors but"):
        training.test_pipelines_equal_one_device(dict(schedule="1f1b", microbatches=4), reference)
    for kw in training.PRECISIONS:
        precision = Precision(**{k: kw[k] for k in ("dtype", "autocast") if k in kw})
        loss16, _ = training._reference_with(precision)
        _without_gradients(monkeypatch, training, loss16, keep)
        with pytest.raises(ValueError, match="reference tensors but"):
            training.test_mixed_precision_in_every_strategy_stays_close_to_one_device(kw)
    for precision in (Precision(), Precision(autocast="bf16")):  # the Hugging Face tests' check and the doctor's
        with pytest.raises(AssertionError):
            hf._check((loss, grads), loss, grads[:keep], precision)
        with pytest.raises(ValueError, match="reference tensors but"):
            doctor_compare((loss, grads), loss, grads[:keep], precision)
