"""The Hugging Face layer view: each supported family reproduced exactly (logits and gradients) under eager and sdpa
attention with and without padding; only a device's own tensors loaded; tied embeddings loaded as the checkpoint
stores them; seeded dropout; incremental decoding by stages equal to `generate`; half precision; bad input."""
import dataclasses
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, OPTConfig, OPTForCausalLM

from helpers.check import max_grad_diff
from helpers.models import (IGNORE_INDEX, HFModel, LayeredModel, Stage, hf_config, hf_layers, lm_loss,
                            save_hf_model)
from helpers.models.hf import FAMILIES
from helpers.models.layered import boundary_shapes, is_meta, owned_layers

CPU = torch.device("cpu")
VOCAB, SEQ, BATCH, HIDDEN = 96, 16, 3, 32
SHAPES = dict(n_layers=3, hidden=HIDDEN, heads=4, vocab=VOCAB, seq_len=SEQ, intermediate=64)
# Grouped-query attention where the family has it; sliding windows of 8 on 16 tokens (Qwen2: upper layers only).
OPTIONS = {"gpt2": {}, "llama": {"kv_heads": 2}, "mistral": {"kv_heads": 2, "sliding_window": 8},
           "qwen2": {"kv_heads": 2, "sliding_window": 8}, "gemma": {"kv_heads": 1}}
FP32_TOLERANCE = 1e-5  # float32 round-off; in practice the view runs the same operations and matches exactly


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The directory of a saved model per (family, tied), written once for the module."""
    paths = {}

    def path(family: str, tied: bool) -> str:
        if (family, tied) not in paths:
            directory = tmp_path_factory.mktemp(f"{family}-{'tied' if tied else 'untied'}")
            config = hf_config(family, tie_embeddings=tied, **SHAPES, **OPTIONS[family])
            paths[family, tied] = save_hf_model(config, directory, seed=1).path
        return paths[family, tied]

    return path


def reference(path: str, attn: str = "sdpa", dtype: torch.dtype | None = None):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)


def all_layers(model: HFModel) -> Stage:
    return Stage(owned_layers(model, range(model.n_layers), CPU))


def batch(padding: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(ids, attention mask or None, targets with padding ignored)."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padding == "right":
        mask[0, 10:], mask[1, 13:] = 0, 0
    elif padding == "left":
        mask[0, :6], mask[2, :3] = 0, 0
    targets = ids.roll(-1, dims=1).masked_fill(mask == 0, IGNORE_INDEX)
    return ids, None if padding == "none" else mask, targets


def assert_same_parameter_shapes(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layers_equal_the_hf_model(saved, family, tied, attn, padding):
    model = HFModel(saved(family, tied), attn)
    ref, layers = reference(model.path, attn), all_layers(model)
    ids, mask, targets = batch(padding)
    logits = layers(ids, model.context(ids, mask))
    expected = ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=FP32_TOLERANCE)
    lm_loss(logits, targets).backward()
    lm_loss(expected, targets).backward()
    assert_same_parameter_shapes(ref, layers)  # tied: one shared Parameter on both sides
    assert max_grad_diff(ref, layers) <= FP32_TOLERANCE


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_layers_view_shares_the_model_and_is_causal(saved, family, attn):
    ref = reference(saved(family, True), attn)
    view = hf_layers(ref)
    assert view[0].tok.weight is ref.get_input_embeddings().weight is view[-1].weight
    ids, mask, _ = batch("left")
    torch.testing.assert_close(view(ids, view.context(ids, mask)), ref(ids, attention_mask=mask).logits,
                               rtol=0, atol=FP32_TOLERANCE)
    plain = view(ids)  # no context: the whole sequence, causal (the old eager view let future tokens in)
    torch.testing.assert_close(plain, ref(ids).logits, rtol=0, atol=FP32_TOLERANCE)
    future = ids.clone()
    future[:, -1] = (future[:, -1] + 1) % VOCAB
    torch.testing.assert_close(view(future)[:, :-1], plain[:, :-1], rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral_sliding_window_is_applied(tmp_path, attn):
    ids, mask, _ = batch("left")
    windowed = save_hf_model(hf_config("mistral", sliding_window=8, **SHAPES), tmp_path / "w", 1, attn)
    unwindowed = save_hf_model(hf_config("mistral", **SHAPES), tmp_path / "full", 1, attn)  # same weights
    logits = all_layers(windowed)(ids, windowed.context(ids, mask))
    torch.testing.assert_close(logits, reference(windowed.path, attn)(ids, attention_mask=mask).logits,
                               rtol=0, atol=FP32_TOLERANCE)
    without = all_layers(unwindowed)(ids, unwindowed.context(ids, mask))
    assert (logits - without).abs().max() > 1e-2  # a window of 8 on 16 tokens changes the result


def test_hf_model_is_a_small_picklable_layered_model(saved):
    model = HFModel(saved("mistral", False), "eager", torch.bfloat16)
    assert isinstance(model, LayeredModel)
    assert pickle.loads(pickle.dumps(model)) == model and len(pickle.dumps(model)) < 10_000
    layers = model.meta_layers()
    assert len(layers) == model.n_layers == SHAPES["n_layers"] + 3 and all(is_meta(layer) for layer in layers)
    assert boundary_shapes(model, [1, 3, 5], 2, SEQ) == [((2, SEQ, HIDDEN), torch.bfloat16)] * 3


def test_materialize_reads_only_the_owned_layers(saved, tmp_path):
    model = HFModel(saved("llama", False))
    full = all_layers(model)
    # A copy of the checkpoint without block 0 (layer 1) and the head: the other layers still load from it.
    tensors = load_file(f"{model.path}/model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.0.") and k != "lm_head.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(f"{model.path}/config.json", tmp_path)
    partial = HFModel(str(tmp_path))
    layers = partial.meta_layers()
    partial.materialize(layers, [2, 3], CPU)
    assert [is_meta(layer) for layer in layers] == [True, True, False, False, True, True]
    for i in (2, 3):
        for (name, mine), theirs in zip(layers[i].state_dict().items(), full[i].state_dict().values()):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="has no tensor 'model.layers.0."):
        partial.materialize(layers, [1], CPU)


def test_sharded_checkpoint_opens_only_the_owned_shards(saved, tmp_path):
    model = HFModel(saved("llama", False))
    reference(model.path).save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    owned = {f for name, f in weight_map.items() if name.startswith("model.layers.2.")}
    for shard in set(weight_map.values()) - owned:
        (tmp_path / shard).unlink()  # every shard without block 2's tensors is gone
    layers = HFModel(str(tmp_path)).meta_layers()
    HFModel(str(tmp_path)).materialize(layers, [3], CPU)
    expected = owned_layers(model, [3], CPU)[3]
    for mine, theirs in zip(layers[3].state_dict().values(), expected.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "gemma"])
def test_tied_checkpoint_loads_the_head_equal_to_the_embedding(saved, family):
    model = HFModel(saved(family, True))
    head = model.n_layers - 1
    assert not any(k.startswith("lm_head") for k in load_file(f"{model.path}/model.safetensors"))  # one tensor
    assert model.tied_parameters() == [((0, "tok.weight"), (head, "weight"))]
    assert HFModel(saved(family, False)).tied_parameters() == []
    apart = model.meta_layers()  # as two devices would: separate calls, two copies of the one tensor
    model.materialize(apart, range(head), CPU)
    model.materialize(apart, [head], CPU)
    assert apart[head].weight is not apart[0].tok.weight
    torch.testing.assert_close(apart[head].weight, apart[0].tok.weight, rtol=0, atol=0)
    together = all_layers(model)  # one call, one device: one shared Parameter
    assert together[head].weight is together[0].tok.weight
    ids, mask, targets = batch("right")
    for layers in (Stage(apart), together):
        lm_loss(layers(ids, model.context(ids, mask)), targets).backward()
    # The two copies' gradients add up to the tied weight's: what the engines sum.
    torch.testing.assert_close(apart[0].tok.weight.grad + apart[head].weight.grad, together[0].tok.weight.grad,
                               rtol=0, atol=FP32_TOLERANCE)
    rest = [p.grad for p in together.parameters()][1:]  # every other parameter: the same gradient
    assert max_grad_diff(rest, [p.grad for p in Stage(apart[:head]).parameters()][1:]) <= FP32_TOLERANCE


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_dropout_is_seeded_per_layer(tmp_path, family):
    model = save_hf_model(hf_config(family, dropout=0.3, **SHAPES), tmp_path, seed=1)
    layers = all_layers(model).train()
    ids, mask, targets = batch("right")
    ctx = dataclasses.replace(model.context(ids, mask), seed=7)
    torch.manual_seed(3)
    untouched = torch.rand(4)
    torch.manual_seed(3)
    first = layers(ids, ctx)
    assert torch.equal(torch.rand(4), untouched)  # the caller's generator is left alone
    lm_loss(first, targets).backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    again = layers(ids, ctx)
    lm_loss(again, targets).backward()
    assert torch.equal(first, again) and max_grad_diff(grads, layers) == 0
    assert not torch.equal(first, layers(ids, dataclasses.replace(ctx, seed=8)))
    assert not torch.equal(first, layers.eval()(ids, ctx))  # dropout is really on in training
    # Two devices' layers built apart, run as two stages with the same seed: the same numbers.
    cut = 3
    stages = [Stage(owned_layers(model, range(a, b), CPU)[a:b]).train() for a, b in ((0, cut), (cut, model.n_layers))]
    assert torch.equal(stages[1](stages[0](ids, ctx), ctx), first)


def greedy_by_stages(model: HFModel, stages: list[Stage], ids, mask, positions, steps: int):
    """Prefill then one-token steps, each stage with its own KV cache."""
    caches = [model.new_cache() for _ in stages]
    tokens, logits, step = [], [], ids
    for _ in range(steps):
        h = step
        for stage, cache in zip(stages, caches):
            h = stage(h, model.context(step, mask, cache=cache, position_ids=positions))
        logits.append(h[:, -1])
        step = h[:, -1].argmax(-1, keepdim=True)
        tokens.append(step)
        mask = torch.cat([mask, torch.ones_like(step)], dim=1) if mask is not None else None
        positions = positions[:, -1:] + 1 if positions is not None else None
    return torch.cat(tokens, dim=1), logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family, cuts, padding", [
    ("llama", [3], "none"),
    ("gpt2", [1, 3], "ones"),  # a first stage of the embedding alone: no cache, the mask's length gives positions
    ("mistral", [2], "left"),  # window 4 over 8 + 6 tokens: the sliding cache drops old tokens
])
def test_greedy_decoding_by_stages_equals_generate(tmp_path, family, cuts, padding, attn):
    options = {"sliding_window": 4} if family == "mistral" else {"kv_heads": 2} if family == "llama" else {}
    config = hf_config(family, 4, HIDDEN, 4, VOCAB, 32, 64, family == "gpt2", **options)
    model = save_hf_model(config, tmp_path, seed=2, attn_implementation=attn)
    layers = owned_layers(model, range(model.n_layers), CPU)
    edges = [0, *cuts, model.n_layers]
    stages = [Stage(layers[a:b]) for a, b in zip(edges, edges[1:])]
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = None if padding == "none" else torch.ones_like(ids)
    positions = None
    if padding == "left":
        mask[0, :3] = 0
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate computes them
    out = reference(model.path, attn).generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy_by_stages(model, stages, ids, mask, positions, 6)
    assert torch.equal(tokens, out.sequences[:, ids.shape[1]:])
    for mine, theirs in zip(logits, out.logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=FP32_TOLERANCE)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("family", ["gpt2", "gemma"])  # Gemma: sqrt(hidden) rounded to the weights' dtype, as HF
def test_half_precision_weights(saved, family, dtype, tolerance):
    """Same operations in the same dtype as HF's own model: identical. Against fp32, within the dtype's rounding:
    bf16 keeps 8 significant bits, fp16 11 (measured here: 5e-3 and 6e-4 of the largest logit)."""
    model = HFModel(saved(family, True), "sdpa", dtype)
    layers = all_layers(model)
    assert {p.dtype for p in layers.parameters()} == {dtype}
    ids, mask, targets = batch("left")
    logits = layers(ids, model.context(ids, mask))
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, reference(model.path, "sdpa", dtype)(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)
    fp32 = reference(model.path)(ids, attention_mask=mask).logits
    assert (logits.float() - fp32).abs().max() <= tolerance * fp32.abs().max()
    lm_loss(logits, targets).backward()
    assert all(p.grad.dtype == dtype and p.grad.isfinite().all() for p in layers.parameters())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_autocast_equals_hf_under_autocast(saved, attn):
    model = HFModel(saved("llama", True), attn)
    layers, ref = all_layers(model), reference(model.path, attn)
    ids, mask, targets = batch("left")
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = layers(ids, model.context(ids, mask))
        expected = ref(ids, attention_mask=mask).logits
    assert logits.dtype == expected.dtype == torch.bfloat16  # autocast's head output, as in HF's forward
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    lm_loss(logits, targets).backward()
    lm_loss(expected, targets).backward()
    assert max_grad_diff(ref, layers) <= FP32_TOLERANCE


def test_bad_input_is_refused_clearly(saved, tmp_path):
    model = HFModel(saved("llama", False))
    too_big = torch.full((1, 4), VOCAB)
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the model's vocabulary of {VOCAB} tokens"):
        model.context(too_big, None)
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB} tokens"):
        hf_layers(reference(model.path))(too_big)
    with pytest.raises(ValueError, match="not a model saved with save_pretrained"):
        HFModel(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="'bert' is not supported.*gpt2, llama, mistral, qwen2, gemma"):
        HFModel(str(tmp_path))
    shutil.copy(f"{model.path}/config.json", tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors"):
        HFModel(str(tmp_path))
    with pytest.raises(ValueError, match="'flash_attention_2' is not supported"):
        HFModel(model.path, "flash_attention_2")
    with pytest.raises(ValueError, match=f"{SEQ + 1} tokens are more than the model's {SEQ} learned positions"):
        HFModel(saved("gpt2", False)).context(torch.zeros(1, SEQ + 1, dtype=torch.long), None)
    with torch.device("meta"):
        opt = OPTForCausalLM(OPTConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                       num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=16))
    with pytest.raises(ValueError, match="'opt' is not supported"):
        hf_layers(opt)
    with pytest.raises(ValueError, match="unknown model family 'bert'"):
        hf_config("bert")
    with pytest.raises(ValueError, match="GPT-2 has no grouped-query attention"):
        hf_config("gpt2", kv_heads=2)
    with pytest.raises(ValueError, match="llama has no sliding window"):
        hf_config("llama", sliding_window=4)


def test_stage_threads_sharing_a_generator_take_turns_in_dropout_layers():
    """The CPU rig's virtual devices, and both stages of the one-GPU rig on cuda:0, draw dropout masks from one default
    generator: a layer seeds it and draws under its lock, so the other stage's thread cannot reseed it in between
    (before, both seeded and restored it at once, and masks depended on thread timing)."""
    import threading
    from types import SimpleNamespace

    from helpers.models.hf import _dropout_generator

    ctx, cpu = SimpleNamespace(seed=7), torch.device("cpu")
    trying, inside = threading.Event(), threading.Event()

    def other_stage():
        trying.set()
        with _dropout_generator(ctx, 1, True, cpu):
            inside.set()

    with _dropout_generator(ctx, 0, True, cpu):
        first = torch.rand(4)
        thread = threading.Thread(target=other_stage)
        thread.start()
        trying.wait()
        assert not inside.wait(0.3), "the other stage entered a dropout layer while this one held the generator"
    thread.join()
    assert inside.is_set()
    with _dropout_generator(ctx, 0, True, cpu):
        assert torch.equal(torch.rand(4), first), "the layer's masks come from its own seed"


def test_blocks_get_their_cache_under_the_name_they_take():
    """transformers 5.17 names a block's KV cache `past_key_values`, 5.25 `cache`: passed under the other name it
    lands in **kwargs unused, and decoding attends to nothing cached (generation differed from `generate` on the GPU
    machine's 5.17)."""
    from helpers.models.hf import cache_keyword

    class Before(torch.nn.Module):
        def forward(self, h, attention_mask=None, past_key_values=None, **kwargs):
            return h

    class After(torch.nn.Module):
        def forward(self, h, attention_mask=None, cache=None, **kwargs):
            return h

    assert cache_keyword(Before()) == "past_key_values" and cache_keyword(After()) == "cache"
