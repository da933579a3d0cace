"""``benchmarks/thesis/table.py`` (the thesis tables of docs/results.md) on fake sweep run directories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "thesis" / "table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("thesis_table", TABLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(root: Path, sweep: str, data_set: str, cell: str, seed: int, nmi_a: float, dtype: str = "float32"):
    run = root / sweep / "runs" / cell / f"seed-{seed}"
    (run / "eval").mkdir(parents=True)
    config = {"data": {"data": f"runs/thesis/data/{data_set}-train.jsonl"}, "model": {"dtype": dtype}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))

    def sources(nmi):
        return {
            "latent": {"nmi": nmi},
            "encoder_kmeans": {"nmi": 1.0},
            "prior_kmeans": {"nmi": 0.001},
            "random": {"nmi": 0.02},
        }

    report = {
        "factors": {"A": sources(nmi_a), "B": sources(1 - nmi_a)},
        "latent_gain_nats_per_token": 0.01 * seed,
        "posterior_nll_nats_per_token": 1.0 + seed,
        "zfree_nll_nats_per_token": 3.0,
    }
    (run / "eval" / "sweep_eval.json").write_text(json.dumps(report))
    return run


def test_rows_gather_seeds_across_sweep_directories(table, tmp_path):
    fake_run(tmp_path, "first", "two-factor", "term3", 0, 0.8)
    fake_run(tmp_path, "second", "two-factor", "term3", 1, 0.9)
    fake_run(tmp_path, "second", "two-factor", "term3", 2, 1.0)
    fake_run(tmp_path, "copy", "two-factor", "term3", 2, 1.0)  # the same run found twice counts once
    fake_run(tmp_path, "second", "style-in-echo", "raw", 0, 0.5, dtype="bfloat16")
    (tmp_path / "second" / "runs" / "term3" / "seed-3").mkdir()  # unfinished: no report, not counted
    found = table.find_runs([tmp_path])
    assert sorted(found) == [("style-in-echo", "raw"), ("two-factor", "term3")]
    assert sorted(found["two-factor", "term3"]) == [0, 1, 2]
    text = table.table("two-factor", {"term3": found["two-factor", "term3"]})
    row = next(line for line in text.splitlines() if line.startswith("| term3 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["term3", "0,1,2", "float32"]
    # mean 0.9, sd 0.1, t(0.975, 2) = 4.303: half-width 4.303 * 0.1 / sqrt(3) = 0.248
    assert cells[3] == "0.900 ± 0.248 (0.80, 0.90, 1.00)"
    assert cells[4].startswith("0.100 ± 0.248")
    assert cells[5] == "0.010 ± 0.025"  # latent gain 0, 0.01, 0.02
    assert cells[6] == "1.00, 2.00, 3.00 (3.00)"  # posterior NLL per seed (z-free)
    assert cells[7:] == ["1.000 / 1.000", "0.001 / 0.001", "0.020"]
    one = table.table("style-in-echo", {"raw": found["style-in-echo", "raw"]})
    assert "| raw | 0 | bfloat16 | 0.500 | 0.500 | 0.000 | 1.00 (3.00) |" in one


def test_the_same_run_with_different_results_is_refused(table, tmp_path):
    fake_run(tmp_path, "first", "two-factor", "term3", 0, 0.8)
    fake_run(tmp_path, "second", "two-factor", "term3", 0, 0.7)
    with pytest.raises(SystemExit, match="the same run with different results"):
        table.find_runs([tmp_path])
