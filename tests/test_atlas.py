"""The atlas (helpers.simulate.atlas, data/atlas.csv): regenerated here and compared with the checked-in file byte
for byte; its headline rows asserted."""
import csv
import io
from pathlib import Path

from helpers.simulate.atlas import COLUMNS, MODELS, PATH, atlas_csv, atlas_rows, headline

REPO = Path(__file__).resolve().parent.parent


def test_atlas_csv_is_what_the_command_writes():
    assert PATH == REPO / "data" / "atlas.csv"
    fresh = atlas_csv()
    assert fresh == PATH.read_text(), "data/atlas.csv is stale: run python -m helpers.simulate.atlas"


def test_atlas_covers_models_methods_rigs_and_headlines():
    rows = list(csv.DictReader(io.StringIO(PATH.read_text())))
    assert tuple(rows[0]) == COLUMNS and len(rows) >= 200
    assert {r["model"] for r in rows} == set(MODELS)
    assert {r["method"] for r in rows} == {"inference", "full", "lora", "qlora"}
    assert {r["techniques"] for r in rows if r["method"] == "inference"} == {"bf16", "int8", "nf4"}
    assert {r["gpus"] for r in rows} == {"2 x RTX 3090", "1 x RTX 3090", "RTX 3090 + RTX 4090"}
    assert {int(r["context"]) for r in rows} == {2048, 8192, 32768}
    for r in rows:
        assert r["fits"] in ("yes", "no") and (r["limit"] == "nothing") == (r["fits"] == "yes")
        assert r["command"].startswith("python -m helpers.plan ")
        assert bool(r["tokens_per_s"]) == (r["fits"] == "yes")  # every row that fits is priced
    eight_b = [r for r in rows if (r["model"], r["method"], r["context"], r["batch"], r["gpus"]) ==
               ("llama-3-8b", "full", "2048", "1", "2 x RTX 3090") and r["fits"] == "yes"]
    chosen = next(r for r in eight_b if r["techniques"] == "adamw-4bit, pure bf16, optimizer-in-backward, "
                                                             "chunked-loss")
    assert float(chosen["gpu_peak_gib"]) <= 22.5 and float(chosen["host_ram_gib"]) <= 32
    assert "--optimizer adamw-4bit --precision pure --technique optimizer-in-backward,chunked-loss" in \
        chosen["command"]
    fp32_master = [r for r in rows if (r["model"], r["method"], r["context"], r["batch"], r["gpus"]) ==
                   ("llama-3-8b", "full", "2048", "1", "2 x RTX 3090") and "fp32 master" in r["techniques"]
                   and "cpu offload" not in r["techniques"]]
    assert fp32_master and all(r["fits"] == "no" for r in fp32_master)
    best = headline(rows)
    assert best["full"]["model"] == "llama-3-8b" and best["inference nf4"]["model"] == "llama-3-70b"


def test_a_row_is_its_command():
    import shlex

    from helpers.plan import main

    row = next(r for r in atlas_rows() if r["model"] == "llama-3.2-1b" and r["method"] == "full")
    argv = shlex.split(row["command"])[3:]
    main(argv + ["--json"])  # exits 1 when it does not fit: this one fits
