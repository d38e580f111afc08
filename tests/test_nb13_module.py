"""Notebook 13's checkpoint module (the `%%writefile ... my_checkpoints.py` cell learners lift into their own script)
loads on more ranks than saved it: a checkpoint written by one process resumes on two, rank 0 with its saved RNG state,
rank 1 (which saved none) seeded from the step and its rank, deterministically, as the notebook says."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "13_runs_that_finish.ipynb"


def module_source() -> str:
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and text.startswith("%%writefile") and "my_checkpoints.py" in text.split("\n")[0]:
            return text.split("\n", 1)[1]
    raise AssertionError("notebook 13 has no %%writefile cell for my_checkpoints.py")


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()   # Adam's moments exist, as in a resumed run's template
    return model, optimizer


def _resume_on(rank: int, world: int, folder: str, store: str, out: str) -> None:
    sys.path.insert(0, folder)
    import my_checkpoints
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model, optimizer = _model_and_optimizer()
        with torch.no_grad():
            model.weight.zero_()   # the loaded weights must come from the checkpoint
        step = my_checkpoints.resume(f"{folder}/run", model, optimizer)
        torch.save({"step": step, "weight": model.weight.detach().clone(), "draw": torch.rand(3)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.full   # two spawned processes: about 10 s
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    (tmp_path / "my_checkpoints.py").write_text(module_source())
    sys.path.insert(0, str(tmp_path))
    try:
        import my_checkpoints
        model, optimizer = _model_and_optimizer()
        torch.manual_seed(123)
        my_checkpoints.save(tmp_path / "run", 5, model, optimizer)   # one process, no process group: rank 0 alone
        expected_draw = torch.rand(3)                               # what rank 0's restored RNG draws next
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_checkpoints", None)
    mp.spawn(_resume_on, args=(2, str(tmp_path), str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["step"] for r in ranks] == [5, 5]
    assert all(torch.equal(r["weight"], model.weight.detach()) for r in ranks), "both ranks load the saved weights"
    assert torch.equal(ranks[0]["draw"], expected_draw), "rank 0 resumes its saved RNG state"
    torch.manual_seed(1000 * 5 + 1)
    assert torch.equal(ranks[1]["draw"], torch.rand(3)), "rank 1, with no saved state, is seeded from step and rank"
