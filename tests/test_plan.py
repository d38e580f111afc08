import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from helpers.inference.compare import CASES, accelerate_dtypes, compare_with_accelerate, comparison_table
from helpers.inference.plan import DoesNotFit, evaluate, logits_workspace_bytes, plan, plan_shape
from helpers.sizing.activations import activation_workspace_bytes
from helpers.sizing.gpus import Gpu, parse_gpus
from helpers.sizing.shape import inference_data, known_models, meta_model, model_shape, weight_format
from helpers.inference.widget import FitForm
from helpers.units import MiB
from helpers.plan import main as plan_main

REPO = Path(__file__).resolve().parent.parent


def tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=128, intermediate=64, tie=False) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=tie)


# --- bytes: formats, parameters, KV cache -----------------------------------------------------------------------

def test_bytes_per_weight_follow_their_sources():
    assert weight_format("fp16").bytes_per_weight() == weight_format("bfloat16").bytes_per_weight() == 2
    assert weight_format("4bit").name == "nf4"
    assert weight_format("nf4").bytes_per_weight() == (4 + 32 / 64) / 8  # QLoRA: 0.5 bit per parameter for scales
    assert weight_format("nf4-dq").bytes_per_weight() == pytest.approx((4 + 0.127) / 8, rel=1e-3)  # QLoRA: 0.127 bit
    assert weight_format("int8").tensor_bytes((3, 5), quantize=True) == 3 * 5 + 3 * 4  # int8 + one fp32 per row
    assert weight_format("int8").tensor_bytes((3, 5), quantize=False) == 3 * 5 * 2  # left alone: fp16


@pytest.mark.parametrize("name", known_models())
def test_parameters_counted_exactly_on_the_meta_device(name):
    shape = model_shape(name, "fp16")
    model = meta_model(shape.config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.weight_bytes == sum(p.numel() * 2 for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    stated = inference_data()["models"][name].get("stated_params_billion")
    if stated is not None:  # the figure its makers state, to 0.1 B (data/inference.json says where)
        assert abs(shape.params / 1e9 - stated) < 0.1


def test_weight_bytes_agree_with_accelerates_own_count():
    from accelerate.utils import compute_module_sizes

    for name, dtype in (("llama-3-8b", "bf16"), ("llama-2-70b", "nf4")):
        shape = model_shape(name, dtype)
        sizes = compute_module_sizes(meta_model(shape.config), special_dtypes=accelerate_dtypes(shape))
        for layer in shape.layers:
            ours = layer.weight_bytes
            if shape.format.quantized and layer.kind == "decoder":  # accelerate prices 4-bit at 0.5 B, no scales
                ours -= sum(math.ceil(p.numel() / 64) * 4 for n, p in meta_model(shape.config).named_parameters()
                            if n.startswith(layer.name + ".") and n.endswith("proj.weight"))
            assert ours == sizes[layer.name], layer.name


@pytest.mark.parametrize("config, expected_tokens", [
    (tiny_llama(layers=3), 7),  # every layer caches the whole 7-token prompt
    (MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, sliding_window=4), 3),  # window - 1 kept
])
def test_kv_formula_matches_a_real_dynamic_cache(config, expected_tokens):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    batch, prompt = 2, 7
    with torch.no_grad():
        cache = model(torch.randint(0, 64, (batch, prompt)), use_cache=True).cache
    real = [layer.keys.nbytes + layer.values.nbytes for layer in cache.layers]
    shape = model_shape(config, "fp32")
    per_token = [layer.kv_bytes_per_token for layer in shape.decoder_layers]
    assert per_token == [2 * 2 * 8 * 4] * 3  # K and V x 2 KV heads x head_dim 8 x fp32
    assert real == [batch * expected_tokens * t for t in per_token]
    # the planner counts a sliding layer's peak: the window - 1 kept tokens plus the one being decoded
    assert [layer.kv_bytes(prompt, batch) for layer in shape.decoder_layers] == \
        [batch * min(prompt, getattr(config, "sliding_window", None) or prompt) * t for t in per_token]


# --- the planner against brute force ------------------------------------------------------------------------------

def brute_force(shape, gpus, context, batch):
    """Best slowest-GPU read over every contiguous split of the modules in forward order (rotary embedding, and a
    tied head, with the embedding), each accounted by `evaluate`; None when no split fits."""
    moving = [layer.name for layer in shape.layers
              if layer.kind not in ("buffers", "embedding") and not (shape.tied and layer.kind == "head")]
    units = [next(layer.name for layer in shape.layers if layer.kind == "embedding"), *moving]
    best = None
    for cuts in itertools.combinations(range(1, len(units)), len(gpus) - 1):
        edges = [0, *cuts, len(units)]
        device_map = {name: j for j, (a, b) in enumerate(zip(edges, edges[1:])) for name in units[a:b]}
        for layer in shape.layers:
            device_map.setdefault(layer.name, 0)
        placement = evaluate(shape, device_map, gpus, context, batch)
        if placement.fits and (best is None or placement.slowest.read_bytes < best):
            best = placement.slowest.read_bytes
    return best


@pytest.mark.parametrize("seed", range(24))
def test_planner_matches_brute_force_over_all_splits(seed):
    rng = random.Random(seed)
    config = tiny_llama(layers=rng.randint(3, 6), hidden=rng.choice([16, 32, 48]), heads=rng.choice([2, 4]),
                        kv_heads=rng.choice([1, 2]), vocab=rng.choice([64, 256, 1024]),
                        intermediate=rng.choice([32, 96, 160]), tie=rng.random() < 0.3)
    shape = model_shape(config, rng.choice(["fp32", "fp16"]))
    context, batch, k = rng.choice([8, 64, 200]), rng.randint(1, 3), rng.choice([2, 3])
    # GPUs around an even share of everything, so memory caps bind in some cases and nothing fits in others
    even = (shape.weight_bytes + shape.kv_bytes(context, batch) + logits_workspace_bytes(shape, context, batch)) / k \
        + activation_workspace_bytes(shape, context, batch)
    gpus = [Gpu(f"g{j}", int(even * rng.uniform(0.8, 1.6)), rng.choice([0, 1024])) for j in range(k)]
    expected = brute_force(shape, gpus, context, batch)
    if expected is None:
        with pytest.raises(DoesNotFit):
            plan_shape(shape, gpus, context, batch)
    else:
        placement = plan_shape(shape, gpus, context, batch)
        assert placement.fits
        assert placement.slowest.read_bytes == expected


def test_default_rig_llama_2_13b_fits_with_everything_counted():
    placement = plan("llama-2-13b", "fp16", 4096, 1)
    assert placement.fits and [d.gpu.name for d in placement.devices] == ["RTX 3090", "RTX 3090"]
    assert sum(d.weights_bytes for d in placement.devices) == placement.shape.weight_bytes
    assert sum(d.kv_cache_bytes for d in placement.devices) == 40 * 2 * 40 * 128 * 2 * 4096  # layers x K,V x heads
    head = placement.devices[placement.device_map["lm_head"]]
    assert head.workspace_bytes > placement.devices[1 - placement.device_map["lm_head"]].workspace_bytes  # logits
    assert set(placement.device_map.values()) == {0, 1}


@pytest.mark.parametrize("tie", [False, True])
def test_device_map_is_accepted_by_from_pretrained_and_generates_the_same(tmp_path, tie):
    from accelerate.utils import check_device_map

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_llama(tie=tie)).eval()
    reference.save_pretrained(tmp_path / "model")
    placement = plan(tmp_path / "model", "fp32", 16, 1, [Gpu("small", 2 * MiB, 0)] * 2)
    check_device_map(reference, placement.device_map)
    assert placement.device_map["lm_head"] == (0 if tie else 1)  # a tied head stays with its embedding
    # no GPUs here: GPU 0 becomes the CPU, GPU 1 the disk (accelerate's offload hooks), a real two-place split
    where = {0: "cpu", 1: "disk"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                  device_map={k: where[v] for k, v in placement.device_map.items()},
                                                  offload_folder=str(tmp_path / "offload"))
    ids = torch.randint(0, 128, (1, 5))
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False), expected)


# --- when nothing fits ----------------------------------------------------------------------------------------------

def test_does_not_fit_says_by_how_much_and_computes_what_fits():
    with pytest.raises(DoesNotFit) as info:
        plan("llama-2-13b", "fp16", 8192, 4)
    err, alt = info.value, info.value.alternatives
    assert err.short_bytes > 0 and min(d.free_bytes for d in err.closest.devices) == -err.short_bytes
    assert "shorter context: at most" in str(err) and "smaller batch: at most" in str(err)
    assert plan("llama-2-13b", "fp16", alt.context, 4).fits  # the longest context fits...
    with pytest.raises(DoesNotFit):
        plan("llama-2-13b", "fp16", alt.context + 1, 4)  # ...and one more token does not
    assert plan("llama-2-13b", "fp16", 8192, alt.batch).fits
    with pytest.raises(DoesNotFit):
        plan("llama-2-13b", "fp16", 8192, alt.batch + 1)


def test_70b_in_fp16_points_to_4_bit_and_cpu_offload():
    with pytest.raises(DoesNotFit) as info:
        plan("llama-2-70b", "fp16", 4096, 1)
    alt = info.value.alternatives
    assert alt.context == 0 and alt.four_bit is not None and alt.four_bit.fits
    # a decoder layer's fp16 weights, from Hugging Face's own Llama-2-70B built on the meta device (855,654,400 each)
    with torch.device("meta"):
        config = LlamaConfig(**{**inference_data()["models"]["llama-2-70b"]["config"], "num_hidden_layers": 1})
        hf = AutoModelForCausalLM.from_config(config)
    layer = 2 * sum(p.numel() for p in hf.model.layers[0].parameters())
    assert 0 < alt.offload_layers < 80 and alt.offload_bytes == alt.offload_layers * layer
    assert "4-bit weights (nf4): fits" in str(info.value) and "CPU RAM" in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "gpt-7"}, "known models are llama-2-13b"),
    ({"context": 0}, "context must be a whole number of at least 1"),
    ({"batch": -2}, "batch must be a whole number of at least 1"),
    ({"dtype": "int3"}, "no byte size known for weight format 'int3'"),
    ({"gpus": "RTX 9999"}, "no memory size known for GPU 'RTX 9999'"),
    ({"gpus": " , "}, "no GPUs in"),
    ({"gpus": "RTX 3090=1GiB"}, "no more than the runtime reserve"),
])
def test_bad_input_is_refused_in_the_users_terms(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_gpu_lists_read_like_a_person_writes_them():
    gpus = parse_gpus("2 x RTX 3090, lab card=32GiB")
    assert [g.name for g in gpus] == ["RTX 3090", "RTX 3090", "lab card"]
    assert gpus[0].capacity_bytes == 24268 * MiB and gpus[2].capacity_bytes == 32 * 2**30
    assert gpus[2].bandwidth_gb_s is None


# --- accelerate, side by side -----------------------------------------------------------------------------------

def test_comparison_with_accelerate_computed_by_accelerate():
    rows = compare_with_accelerate()
    assert len(rows) == 4 * len(CASES)
    ours = {r["model"]: r for r in rows if r["map"] == "planner"}
    assert all(r["fits"] for r in ours.values())
    for r in rows:
        shape = r["placement"].shape
        assert sum(r["weights"]) + r["offloaded"] == shape.weight_bytes  # every byte placed somewhere
        if r["map"] != "planner" and r["fits"]:  # ours is the fastest split that fits (rotary buffers aside)
            assert ours[r["model"]]["slowest_read"] <= r["slowest_read"] + 1024
    # what accelerate leaves out matters: maps it thought fine (nothing offloaded) overflow once KV cache, workspace
    # and reserve are on the cards
    assert any(not r["fits"] and r["offloaded"] == 0 for r in rows if r["map"].startswith("accelerate"))
    text = comparison_table(rows)
    assert "accelerate balanced_low_0" in text and "room for KV" in text


# --- command line and widget -------------------------------------------------------------------------------------

def test_cli_json_is_one_object_with_the_map():
    out = subprocess.run([sys.executable, "-m", "helpers.plan", "--model", "llama-2-13b", "--dtype", "fp16",
                          "--context", "4096", "--batch", "1", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=True).stdout
    result = json.loads(out)
    assert result["fits"] is True and result["device_map"]["lm_head"] == 1
    wanted = {"name", "weights_bytes", "kv_cache_bytes", "workspace_bytes", "reserve_bytes", "free_bytes"}
    assert len(result["devices"]) == 2 and all(wanted <= set(device) for device in result["devices"])


def test_cli_table_names_every_part(capsys):
    plan_main(["--model", "mistral-7b", "--dtype", "bf16", "--context", "8192"])
    out = capsys.readouterr().out
    for word in ("weights", "KV cache", "workspace", "reserve", "free", "device_map", "cuda:1 RTX 3090"):
        assert word in out


def test_cli_prices_generation_with_the_last_positions_logits(capsys):
    """Planning inference is planning generate(): the logits of the last position by default, and the output says so.
    Qwen2.5-14B in bf16 at 32k tokens fits two 3090s that way; with the whole prompt's logits (a loss over it) it
    does not, by the 28 GiB those logits take (152k-token vocabulary x 32k positions, bf16 plus an fp32 copy: the
    figure README quotes)."""
    shape = model_shape("qwen2.5-14b", "bf16")
    extra = logits_workspace_bytes(shape, 32768, 1, "prompt") - logits_workspace_bytes(shape, 32768, 1, "last")
    assert round(extra / 2**30) == 28 and "152k-token vocabulary, 28 GiB more" in " ".join((REPO / "README.md").read_text().split())
    argv = ["--model", "qwen2.5-14b", "--dtype", "bf16", "--context", "32768"]
    plan_main(argv)
    out = capsys.readouterr().out
    assert "logits for the last position" in out and "fits on 2 x RTX 3090" in out
    with pytest.raises(SystemExit):
        plan_main([*argv, "--logits", "prompt"])
    assert "does not fit" in capsys.readouterr().err


def test_cli_compare_prints_accelerates_maps_beside_ours(capsys):
    plan_main(["--compare", "--logits", "last"])
    out = capsys.readouterr().out
    assert "logits for the last position" in out
    for name in ("planner", "accelerate balanced", "accelerate balanced_low_0", "accelerate sequential"):
        assert out.count(name) >= len(CASES)


@pytest.mark.parametrize("argv, code, message", [
    (["--model", "gpt-7"], 2, "known models are"),
    (["--context", "0"], 2, "context must be"),
    (["--batch", "0"], 2, "batch must be"),
    (["--dtype", "int3"], 2, "no byte size known"),
    (["--gpus", "RTX 9999"], 2, "no memory size known"),
    (["--model", "llama-2-70b", "--dtype", "fp16"], 1, "does not fit on 2 x RTX 3090"),
])
def test_cli_bad_input_exits_nonzero_without_a_map(capsys, argv, code, message):
    with pytest.raises(SystemExit) as info:
        plan_main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert info.value.code == code and message in err and "device_map" not in out
    if code == 1:
        assert json.loads(out)["fits"] is False


def test_fit_form_draws_once_without_a_frontend_and_replans_on_change(capsys):
    form = FitForm().show()
    assert "fits on 2 x RTX 3090 (planner)" in capsys.readouterr().out
    ax = form.figure.axes[0]
    assert len(ax.patches) == 5 * 2  # weights, KV cache, workspace, reserve, free for each GPU
    form.inputs["model"].value = "llama-2-70b"  # fp16: does not fit; the form shows why and the closest split
    assert isinstance(form.result, DoesNotFit) and form.placement is form.result.closest
    form.inputs["dtype"].value = "nf4"
    assert form.result.fits
    form.inputs["gpus"].value = "RTX 9999"
    assert isinstance(form.result, ValueError) and form.placement is None and "NAME=SIZE" in form.text
