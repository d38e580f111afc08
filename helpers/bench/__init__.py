"""Measure strategies side by side in one run: medians of interleaved repeats, ratios within the run.

What notebooks import is here (`blocks`); the command line `python -m helpers.bench` is apart:
- `blocks`: a one-device step, pipelines ready to time, interleaved timing, table rows, the machine's load;
- `jobs`: what a bench run measures (its size by mode, its jobs derived from the catalog and the support matrix);
- `rows`: how it measures them (threads in interleaved rounds, processes in interleaved launches);
- `predict`: each row's simulated step, calibrated in the same run, and the errors;
- `extras`: notebook 02's splits, notebook 03's checkpointing sweep, the split backward's cost;
- `report`: the printed table, bench.json, the comparison with a previous run;
- `cli`: `main`, the command line.
"""
from helpers.bench.blocks import (MachineLoad, PipelineRun, bench_cut, make_pipeline_run, one_device_step, run_rows,
                                  stage_costs_per_microbatch, time_pipeline_runs, training_curve)

__all__ = ["MachineLoad", "PipelineRun", "bench_cut", "make_pipeline_run", "one_device_step", "run_rows",
           "stage_costs_per_microbatch", "time_pipeline_runs", "training_curve"]
