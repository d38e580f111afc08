"""Memory, measured and planned, in one place: the model every planner of the course builds on.

- `ledger`: what a run holds per device, measured (parameters, gradients, optimizer state, the activations autograd
  saves), on any device including meta;
- `state`: the one table of bytes per parameter (weights, gradients, optimizer state, per recipe and optimizer) and
  ZeRO's sharding of it (`zero_formula`);
- `activations`: saved activations of a transformer by formula (Korthikanti et al. 2022);
- `shape`: a Hugging Face decoder's placement units priced in a weight format (`ModelShape`, `model_shape`);
- `gpus`: the one GPU description (`Gpu`, `gpu("RTX 3090")`: capacity, bandwidth, sustained matmul rates) of the
  planners and the simulator, and the one runtime reserve (CUDA context + margin);
- `training`: what fine-tuning saves and trains per decoder layer (`TrainShape`, `saved_activation_bytes`).
The planners built on it: `helpers.inference.plan` (device maps), `helpers.finetune.memory_plan` (training),
`helpers.gpu_sizes` (each notebook's GPU sizes). Units (`MiB`, `fmt_bytes`) are `helpers.units`.
"""
