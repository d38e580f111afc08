"""Generation across two devices: every engine's greedy tokens equal Hugging Face's generate(do_sample=False) on one
device, for a Llama with grouped-query attention saved with save_pretrained, on requests of prompts of different
lengths (left padding); end-of-sequence stops as generate stops; refusals before anything runs; the throughput
plumbing (medians, counts, tables, timelines), never timings."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.inference.generate import (Generation, LayerSplit, OneDevice, Request, StageSpec, Stopping, left_pad,
                                        load_hf, make_requests, merge, plan_for_rig, same_tokens, stages_from_cuts,
                                        stages_from_device_map, stopping_for)
from helpers.inference.pipelined import Pipelined
from helpers.inference.throughput import (Throughput, measure, plot_generation_timelines, throughput_rows,
                                          throughput_table)
from helpers.inference.tensor_parallel import check_shardable, run_tensor_parallel, tensor_parallel_support
from helpers.runtime.launch import run
from helpers.models import hf_config, save_hf_model
from helpers.monitor import MemoryMonitor
from helpers.runtime.rig import cpu_rig
from helpers.timeline import Event
from helpers.training.support import reference_rigs

VOCAB, NEW = 96, 6
RIG = cpu_rig(threads=1)
CPU2 = RIG.devices


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama with grouped-query attention (4 query heads, 2 KV heads), random weights, saved locally."""
    config = hf_config("llama", n_layers=4, hidden=32, heads=4, vocab=VOCAB, seq_len=64, intermediate=64, kv_heads=2)
    return save_hf_model(config, tmp_path_factory.mktemp("llama-gqa"), seed=5)


@pytest.fixture(scope="module")
def requests():
    """Two requests of two prompts of different lengths (left-padded), and one of a single prompt."""
    return [*make_requests(2, VOCAB, per_request=2, lengths=(3, 9), seed=1), left_pad([[5, 17, 33, 2, 60]])]


@pytest.fixture(scope="module")
def reference(llama, requests):
    """generate(do_sample=False) of each request, on one device, called directly."""
    hf = AutoModelForCausalLM.from_pretrained(llama.path).eval()
    rule = stopping_for(llama, NEW)
    out = []
    for r in requests:
        assert r.rows == 1 or bool((r.mask[:, 0] == 0).any())  # left padding really present
        tokens = hf.generate(r.ids, attention_mask=r.mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=rule.pad)
        out.append(tokens[:, r.ids.shape[1]:])
    return out


def test_one_device_engine_is_generate_and_counts_tokens(llama, requests, reference):
    g = OneDevice(llama).generate(requests, NEW)
    assert same_tokens(g.tokens, reference)
    assert g.prompt_tokens == sum(int(r.mask.sum()) for r in requests)
    assert g.decode_tokens == sum(r.rows * (t.shape[1] - 1) for r, t in zip(requests, reference))
    assert {e.kind for e in g.events} == {"prefill", "decode"} and {e.device for e in g.events} == {0}
    assert sum(e.kind == "prefill" for e in g.events) == len(requests)


@pytest.mark.parametrize("split", ["planner", "cuts-2", "cuts-5"])
def test_layer_split_and_pipeline_equal_generate(llama, requests, reference, split):
    if split == "planner":
        placement = plan_for_rig(llama, RIG, context=9 + NEW, batch=sum(r.rows for r in requests))
        assert set(placement.device_map.values()) == {0, 1}
        specs = stages_from_device_map(llama, placement.device_map)
    else:
        specs = stages_from_cuts(llama, [int(split[-1])])
    assert [s.device for s in specs] == [0, 1] and specs[0].start == 0 and specs[-1].end == llama.n_layers
    serial = LayerSplit(llama, specs, CPU2)
    pipe = Pipelined(llama, specs, CPU2)
    for engine in (serial, pipe):
        g = engine.generate(requests, NEW)
        assert same_tokens(g.tokens, reference), engine.name
        assert {e.device for e in g.events} == {0, 1}
        # every stage ran every request's prefill and each of its decode steps once
        steps = sum(t.shape[1] for t in reference)
        assert sum(e.kind in ("prefill", "decode") for e in g.events) == 2 * steps
    again = pipe.generate(requests, NEW)  # the engines keep no state between calls
    assert same_tokens(again.tokens, reference)


def test_layer_split_takes_a_device_map_directly(llama, requests, reference):
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    engine = LayerSplit(llama, device_map, CPU2)
    assert engine.specs == [StageSpec(0, 0, 2), StageSpec(1, 2, 7)]
    assert same_tokens(engine.generate(requests, NEW).tokens, reference)


def test_split_memory_counts_each_devices_weights_and_kv_cache(llama, requests, reference):
    """The memory panel's source for generation. Each device holds its stages' weights, and its KV cache grows to
    what the tokens need: rows x positions (prompt with padding, then each fed-back token) x 2 (K and V) x 2 KV heads
    x head dim 8 x 4 bytes, per decoder layer there (cut at layer 3: blocks 0-1 | blocks 2-3). The layer split holds
    one request's cache at a time, the pipeline every request's at once; both are let go once generation ends."""
    split = LayerSplit(llama, stages_from_cuts(llama, [3]), CPU2)
    memory = split.memory(RIG.labels)
    whole = AutoModelForCausalLM.from_pretrained(llama.path)
    assert memory.labels == ["cpu:0", "cpu:1"]
    assert sum(memory.parts(lb)["params"] for lb in memory.labels) == sum(p.numel() * 4 for p in whole.parameters())
    positions = [r.rows * (r.ids.shape[1] + t.shape[1] - 1) for r, t in zip(requests, reference)]
    per_position = 2 * 2 * 8 * 4 * 2  # K and V, KV heads, head dim, fp32, two decoder layers per device
    split.generate(requests, NEW)
    assert [memory.peak_parts(lb)["kv_cache"] for lb in memory.labels] == [max(positions) * per_position] * 2
    Pipelined.from_split(split).generate(requests, NEW)
    assert [memory.peak_parts(lb)["kv_cache"] for lb in memory.labels] == [sum(positions) * per_position] * 2
    assert [memory.parts(lb)["kv_cache"] for lb in memory.labels] == [0, 0]
    rows = MemoryMonitor(RIG, memory).readings()
    assert [r.label for r in rows] == ["cpu:0", "cpu:1"] and all(set(r.parts) == {"params", "kv_cache"} for r in rows)


def test_end_of_sequence_stops_as_generate_does(llama, requests, reference):
    eos = int(reference[0][0, 1])  # a token the first row really generates: that row finishes early
    rule = stopping_for(llama, NEW, eos_token_id=eos, pad_token_id=0)
    hf = AutoModelForCausalLM.from_pretrained(llama.path).eval()
    expected = [hf.generate(r.ids, attention_mask=r.mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=0)[:, r.ids.shape[1]:] for r in requests]
    assert (expected[0][0, 2:] == 0).all()  # generate pads a finished row
    specs = stages_from_cuts(llama, [3])
    for engine in (OneDevice(llama), LayerSplit(llama, specs, CPU2), Pipelined(llama, specs, CPU2)):
        assert same_tokens(engine.generate(requests, NEW, rule).tokens, expected), engine.name
    one_row = [Request(requests[0].ids[:1], requests[0].mask[:1])]  # the row alone: the request stops at eos
    assert Pipelined(llama, specs, CPU2).generate(one_row, NEW, rule).tokens[0].shape[1] == 2


def test_tensor_parallel_equals_generate(llama, requests, reference):
    tp = run_tensor_parallel(llama, requests, NEW, RIG, repeats=1, warmup=0)
    assert same_tokens(tp.tokens, reference) and tp.ranks_agree
    assert tp.per_forward == 2 * llama.config.num_hidden_layers
    kinds = {(e.device, e.kind) for e in tp.last.events}
    assert {(0, "allreduce"), (1, "allreduce"), (0, "decode"), (1, "decode")} <= kinds
    forwards = sum(t.shape[1] for t in reference)  # one forward per generated token
    assert tp.allreduces["prefill"] + tp.allreduces["decode"] == forwards * tp.per_forward
    assert tp.probe["decode"]["bytes"] == 2 * 32 * 4 and tp.probe["decode"]["s"] > 0
    assert 0 <= tp.allreduce_share("decode") <= 1 and "all-reduces (2 per layer)" in tp.describe()
    parts = tp.decode_step_parts()
    assert parts["linears"] == 7 * 4 + 1 and parts["step_ms"] > 0 and tp.decode_forwards == forwards - len(requests)


@pytest.mark.full
def test_tensor_parallel_ranks_never_hold_the_whole_model(llama):
    """Each rank builds the model on the meta device, shards it there and reads only its own half of each sharded
    matrix: before, every rank loaded the whole model onto its GPU first, so a model too big for one card (the case
    tensor parallelism exists for) ran out of memory while loading."""
    from helpers.models.hf import read_tensors
    from tests.workers import tensor_parallel_shards

    ranks = run(tensor_parallel_shards, llama.path, rig=RIG)
    whole = read_tensors(llama.path, ["model.layers.0.self_attn.q_proj.weight"])
    full_bytes = sum(p.numel() * p.element_size() for p in load_hf(llama).parameters())
    assert all(r["bytes"] < 0.8 * full_bytes for r in ranks)
    assert torch.equal(torch.cat([r["q"] for r in ranks]), whole["model.layers.0.self_attn.q_proj.weight"])
    assert ranks[0]["shapes"]["model.layers.0.mlp.down_proj.weight"][1] * 2 == llama.config.intermediate_size


def test_refusals_in_the_users_terms(llama, tmp_path):
    one_gpu = reference_rigs()["one GPU"]
    support = tensor_parallel_support(one_gpu)
    assert not support.ok and "NCCL refuses two ranks on one GPU" in support.reason
    with pytest.raises(ValueError, match="tensor parallelism cannot run here"):
        run_tensor_parallel(llama, [left_pad([[1, 2]])], 2, one_gpu)  # refused before any process starts
    assert tensor_parallel_support(reference_rigs()["two GPUs"]).ok and tensor_parallel_support(RIG).ok
    with pytest.raises(ValueError, match="1 key/value heads do not split evenly over 2 devices"):
        check_shardable(hf_config("llama", heads=4, kv_heads=1))
    with pytest.raises(ValueError, match="GPT-2 fuses q, k and v"):
        check_shardable(hf_config("gpt2"))
    tied = save_hf_model(hf_config("llama", n_layers=2, hidden=32, heads=4, vocab=VOCAB, tie_embeddings=True),
                         tmp_path / "tied")
    placement = plan_for_rig(tied, RIG, 16, 1)
    with pytest.raises(ValueError, match="one contiguous stage per device"):
        Pipelined(tied, placement.device_map, CPU2)  # the tied head sits with the embedding on device 0
    assert [s.device for s in stages_from_device_map(tied, placement.device_map)] == [0, 1, 0]
    with pytest.raises(ValueError, match="cuts \\[3, 3\\] must rise strictly"):
        stages_from_cuts(llama, [3, 3])
    with pytest.raises(ValueError, match="sends model.layers.3 to 'cpu'"):
        stages_from_device_map(llama, {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
                                       "model.layers.2": 1, "model.layers.3": "cpu", "model.norm": 1, "lm_head": 1})
    with pytest.raises(ValueError, match="uses devices \\[2\\]"):
        LayerSplit(llama, [StageSpec(0, 0, 3), StageSpec(2, 3, 7)], CPU2)
    with pytest.raises(ValueError, match="new_tokens must be a whole number of at least 1"):
        Stopping(0, (), 0)
    with pytest.raises(ValueError, match="every prompt at least one token"):
        left_pad([[1, 2], []])
    with pytest.raises(ValueError, match="1 <= shortest <= longest"):
        make_requests(1, VOCAB, lengths=(5, 2))


def _fake(engine: str, prefill_s: float, decode_s: float) -> Generation:
    events = [Event(0, "prefill", 0.0, prefill_s, 0), Event(1, "decode", prefill_s, prefill_s + decode_s, 0)]
    return Generation(engine, [torch.zeros(2, 5, dtype=torch.long)], prefill_s, decode_s, 20, 8, events)


def test_throughput_plumbing_medians_rows_and_timelines():
    times = {"a": iter([(9.0, 9.0), (1.0, 2.0), (3.0, 4.0), (2.0, 8.0)]), "b": iter([(9.0, 9.0), (1.0, 1.0)] * 2)}
    calls = []

    def run(name):
        def fn():
            calls.append(name)
            return _fake(name, *next(times[name]))
        return fn

    results = measure({"a": run("a"), "b": run("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4  # interleaved rounds, the warm-up not timed
    a = results["a"]
    assert (a.prefill_s, a.decode_s, a.repeats) == (2.0, 4.0, 3)  # medians of (1, 3, 2) and (2, 4, 8)
    assert a.prefill_tok_s == 10.0 and a.decode_tok_s == 2.0
    rows = throughput_rows(results, baseline="a")
    assert rows[0]["prefill x"] == 1.0 and rows[1]["decode x"] == pytest.approx(results["b"].decode_tok_s / 2.0)
    assert "decode tok/s" in throughput_table(results)
    fig = plot_generation_timelines(results, device_names={0: "cpu:0", 1: "cpu:1"})
    assert [ax.get_title() for ax in fig.axes[:2]] == ["a", "b"]
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        measure({"a": run("a")}, repeats=0)
    with pytest.raises(ValueError, match="no runs"):
        Throughput.of("x", [])


def test_launches_of_one_engine_pool_as_the_medians_of_their_medians():
    launches = [Throughput.of("tp", [_fake("tp", p, d)]) for p, d in ((1.0, 4.0), (3.0, 2.0), (2.0, 9.0))]
    pooled = Throughput.pooled(launches)
    assert (pooled.prefill_s, pooled.decode_s, pooled.repeats) == (2.0, 4.0, 3)
    assert pooled.last is launches[-1].last and pooled.engine == "tp"
    assert Throughput.pooled(launches[:2]).decode_s == 3.0  # two launches: their mean
    with pytest.raises(ValueError, match="no launches"):
        Throughput.pooled([])


def test_merge_rebatches_every_prompt(requests):
    merged = merge(requests)
    assert merged.rows == sum(r.rows for r in requests)
    assert merged.prompt_tokens == sum(r.prompt_tokens for r in requests)
    assert bool((merged.mask[:, -1] == 1).all())  # left padding: every prompt ends at the last column


def test_a_tied_head_with_the_embedding_runs_as_three_stages(tmp_path):
    """The planner keeps a tied head with its embedding on device 0: the layer split runs device 0, 1, then 0 again."""
    tied = save_hf_model(hf_config("llama", n_layers=2, hidden=32, heads=4, vocab=VOCAB, tie_embeddings=True,
                                   kv_heads=2), tmp_path / "tied", seed=2)
    placement = plan_for_rig(tied, RIG, 16, 2)
    reqs = make_requests(2, VOCAB, per_request=2, lengths=(2, 6), seed=3)
    split = LayerSplit(tied, placement.device_map, CPU2)
    assert [s.device for s in split.specs] == [0, 1, 0]
    assert same_tokens(split.generate(reqs, 4), OneDevice(tied).generate(reqs, 4))


def test_from_pretrained_balances_with_transformers_own_copy():
    from helpers.inference.hf_maps import (balanced_budgets, decoder_layers_per_device, transformers_device_map,
                                           which_code_runs)
    from helpers.sizing.shape import model_shape

    where = which_code_runs()
    assert where["from_pretrained calls"] == "transformers.integrations.accelerate._get_device_map"
    assert where["get_balanced_memory"].startswith("transformers.")
    shape = model_shape("llama-3-8b", "bf16")  # vocabulary 128256: the embedding outweighs a decoder layer
    budgets = balanced_budgets(shape)
    assert budgets["transformers"][0] > budgets["accelerate"][0]  # the largest leaf, not the mean one
    assert budgets["transformers"][1] == budgets["accelerate"][1]  # the last GPU keeps its whole max_memory
    counts = decoder_layers_per_device(shape, transformers_device_map(shape, "auto"))
    assert sum(counts.values()) == 32 and set(counts) == {0, 1}
    with pytest.raises(ValueError, match="nf4 is a bitsandbytes format"):
        transformers_device_map(model_shape("llama-2-70b", "nf4"), "auto")


def test_decode_bounds_follow_the_bandwidth():
    from helpers.facts import load_data
    from helpers.inference.throughput import decode_bounds

    b = decode_bounds("llama-3-8b", "fp16", context=512)
    # the bytes a token reads, from Hugging Face's own model of that config (built on the meta device, 8,030,261,248
    # parameters): every weight but the embedding table (one row of it), and the KV cache of 512 tokens, in fp16
    config = AutoConfig.for_model(**load_data("inference")["models"]["llama-3-8b"]["config"])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    weights = sum(p.numel() for p in hf.parameters()) - hf.get_input_embeddings().weight.numel() + config.hidden_size
    kv_cache = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 512
    read = 2 * (weights + kv_cache)
    assert b["read_bytes_per_token"] == pytest.approx(read, rel=1e-6)
    bandwidth = load_data("hardware")["gpus"]["RTX 3090"]["memory_bandwidth_gb_s"] * 1e9
    assert b["tok_s"]["one GPU"] == pytest.approx(bandwidth / read, rel=1e-6)
    assert b["tok_s"]["layer split"] < b["tok_s"]["one GPU"] < b["tok_s"]["tensor parallel"] < 2 * b["tok_s"]["one GPU"]
    assert b["tok_s"]["pipelined (2 requests, total)"] == pytest.approx(2 * b["tok_s"]["layer split"])
    assert b["allreduces_per_token"] == 64
