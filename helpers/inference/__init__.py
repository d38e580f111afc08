"""Big-model inference across a few GPUs.

`plan` answers "will it fit, and where does each layer go?" for a Hugging Face decoder: exact weight bytes counted on
the meta device, the KV cache, the prefill workspace and logits, a runtime reserve per GPU, and the contiguous split
that decodes fastest, as a `device_map` for `from_pretrained`. `compare` sets that plan beside accelerate's own
`balanced` / `balanced_low_0` / `sequential` maps, and `hf_maps` the map transformers itself computes for
`from_pretrained(device_map="auto")`; `widget` is the "will it fit?" form. The command line is `python -m helpers.plan`.
`generate` runs generation across devices (one device, the layer split) with greedy tokens equal to `generate` on
one device, `pipelined` the layer split with several requests in flight, `tensor_parallel` splits each layer over a
DeviceMesh with `parallelize_module`; `throughput` measures them against each other.

Import the modules you need (`from helpers.inference.plan import plan`): they load transformers, so this package
itself imports nothing.
"""
