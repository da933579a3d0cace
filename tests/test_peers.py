"""The table-building code of ``benchmarks/peers/peers.py`` on fake measurements (no model, no second venv)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE = {
    "langvae": {
        "step_ms": 19508.7,
        "tokens_per_s": 7.76,
        "peak_mib": 2488.3,
        "nmi": {"A": 0.0015, "B": 1.0},
        "nll": 12.07,
    },
    "peft": {"step_ms": 1337.6, "tokens_per_s": 124.5, "peak_mib": 2279.9, "nmi": None, "nll": 3.2777},
    "ours-discrete": {
        "step_ms": 1200.0,
        "tokens_per_s": 130.0,
        "peak_mib": 2100.0,
        "nmi": {"A": 0.9, "B": 0.1},
        "nll": 1.5,
    },
    "ours-continuous": {"unavailable": "exit 1: RuntimeError: boom | here"},
}


def test_markdown_table_has_a_row_per_system_with_the_measurements(peers):
    table = peers.markdown_table(FAKE).splitlines()
    assert table[0] == "| system | step ms (median) | tokens/s | peak RSS MiB | NMI A | NMI B | NLL nats/token |"
    assert table[1] == "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    assert table[2] == "| langvae | 19,509 | 8 | 2,488 | 0.002 | 1.000 | 12.070 |"
    assert table[3] == "| peft | 1,338 | 124 | 2,280 | no latent | no latent | 3.278 |"
    assert table[4] == "| ours-discrete | 1,200 | 130 | 2,100 | 0.900 | 0.100 | 1.500 |"
    # an unavailable system: its reason (with the pipe escaped) in one row of the same width
    assert table[5].startswith("| ours-continuous | unavailable: exit 1: RuntimeError: boom \\| here |")
    assert len(re.findall(r"(?<!\\)\|", table[5])) == table[0].count("|")
    assert len(table) == 6


def test_markdown_table_puts_each_systems_own_kmeans_baseline_beside_its_nmi(peers):
    results = {
        "langvae": dict(FAKE["langvae"], baselines_nmi={"A": {"encoder_kmeans": 0.0003}, "B": {"encoder_kmeans": 1.0}}),
        "peft": FAKE["peft"],
        "ours-discrete": dict(
            FAKE["ours-discrete"],
            baselines_nmi={
                "A": {"encoder_kmeans": 1.0, "prior_kmeans": 0.0},
                "B": {"encoder_kmeans": 0.0, "prior_kmeans": 0.0},
            },
        ),
        "ours-continuous": dict(FAKE["peft"], nmi={"A": 0.5, "B": 0.25}),  # no baseline recorded
    }
    table = peers.markdown_table(results).splitlines()
    assert table[0] == (
        "| system | step ms (median) | tokens/s | peak RSS MiB | NMI A | A: k-means of its features | NMI B"
        " | B: k-means of its features | NLL nats/token |"
    )
    assert table[2] == "| langvae | 19,509 | 8 | 2,488 | 0.002 | 0.000 | 1.000 | 1.000 | 12.070 |"
    assert table[3] == "| peft | 1,338 | 124 | 2,280 | no latent | – | no latent | – | 3.278 |"
    assert table[4] == "| ours-discrete | 1,200 | 130 | 2,100 | 0.900 | 1.000 | 0.100 | 0.000 | 1.500 |"
    assert table[5] == "| ours-continuous | 1,338 | 124 | 2,280 | 0.500 | – | 0.250 | – | 3.278 |"


def test_final_json_is_keyed_by_measurement_then_system(peers):
    line = peers.final_json(FAKE, {"wall_s": 12.0})
    assert "\n" not in line
    out = json.loads(line)
    for key in ("step_ms", "peak_mib", "nmi", "nll", "tokens_per_s"):
        assert set(out[key]) == set(FAKE), key
    assert out["step_ms"]["peft"] == 1337.6
    assert out["nmi"]["ours-discrete"] == {"A": 0.9, "B": 0.1}
    assert out["nmi"]["peft"] is None
    assert out["nll"]["langvae"] == 12.07
    assert out["step_ms"]["ours-continuous"] is None and out["nmi"]["ours-continuous"] is None
    assert out["unavailable"] == {"ours-continuous": "exit 1: RuntimeError: boom | here"}
    assert out["wall_s"] == 12.0


def test_goals_compare_our_step_with_peft_and_our_nmi_with_langvae(peers):
    goals = peers.goals(FAKE)
    assert goals["ours-discrete_step_over_peft"] == pytest.approx(1200.0 / 1337.6, abs=1e-3)
    assert goals["ours-discrete_step_no_slower_than_peft"] is True
    assert goals["ours-discrete_nmi_at_least_langvae"] == {"A": True, "B": False, "best": False}
    assert not any(key.startswith("ours-continuous") for key in goals)  # unavailable: no verdict


def test_step_clock_skips_the_warmup_and_counts_tokens(peers, monkeypatch):
    instants = iter([0.0, 1.0, 3.0, 4.0, 6.0, 7.0])
    monkeypatch.setattr(peers.time, "perf_counter", lambda: next(instants))
    monkeypatch.setattr(peers, "reset_peak_rss", lambda: None)
    monkeypatch.setattr(peers, "peak_rss_mib", lambda: 42.0)
    clock = peers.StepClock(warmup=2)
    clock.start()
    for tokens in (10, 20, 30, 40, 50):
        clock.step_done(tokens)
    clock.finish()
    summary = clock.summary()  # steps 3..5 took 1, 2, 1 s with 30, 40, 50 tokens
    assert summary["step_ms"] == 1000.0
    assert summary["tokens_per_s"] == pytest.approx(120 / 4)
    assert summary["timed_steps"] == 3 and summary["peak_mib"] == 42.0


def test_step_clock_without_a_start_times_from_the_second_step(peers, monkeypatch):
    instants = iter([10.0, 12.0, 13.0, 16.0])
    monkeypatch.setattr(peers.time, "perf_counter", lambda: next(instants))
    monkeypatch.setattr(peers, "reset_peak_rss", lambda: None)
    clock = peers.StepClock(warmup=1)
    for tokens in (5, 6, 7, 8):
        clock.step_done(tokens)
    summary = clock.summary()  # intervals end steps 2, 3, 4: all after the warm-up
    assert summary["timed_steps"] == 3
    assert summary["step_ms"] == 2000.0
    assert summary["tokens_per_s"] == pytest.approx((6 + 7 + 8) / 6)


SETTINGS = {"rows": 400, "steps": 120, "batch_size": 8, "warmup": 3, "seed": 0, "threads": 1}


def test_reuse_takes_a_result_measured_with_the_same_settings(peers, tmp_path):
    path = tmp_path / "result-peft.json"
    path.write_text(json.dumps(dict(FAKE["peft"], settings=SETTINGS)))
    result = peers.reused_result(path, dict(SETTINGS))
    assert result["reused"] is True
    assert result["step_ms"] == FAKE["peft"]["step_ms"]


def test_a_result_file_as_run_all_writes_it_is_reusable(peers, tmp_path):
    path = tmp_path / "result-peft.json"
    peers.record_settings(path, FAKE["peft"], SETTINGS)
    assert peers.reused_result(path, SETTINGS)["nll"] == FAKE["peft"]["nll"]


def test_reuse_refuses_a_result_of_other_settings_naming_the_file_and_field(peers, tmp_path):
    path = tmp_path / "result-peft.json"
    path.write_text(json.dumps(dict(FAKE["peft"], settings=dict(SETTINGS, steps=20))))
    with pytest.raises(SystemExit, match=r"result-peft\.json.*differs in steps"):
        peers.reused_result(path, SETTINGS)
    path.write_text(json.dumps(FAKE["peft"]))  # written before results recorded their settings
    with pytest.raises(SystemExit, match="records none"):
        peers.reused_result(path, SETTINGS)


def test_seeds_table_lists_each_systems_latent_seed_by_seed(peers):
    def run(seed, a, kmeans_a, nll):
        ours = dict(FAKE["ours-discrete"], nmi={"A": a, "B": 0.0}, nll=nll)
        ours["baselines_nmi"] = {"A": {"encoder_kmeans": kmeans_a}, "B": {"encoder_kmeans": 0.0}}
        return {"settings": dict(SETTINGS, seed=seed), "details": {"ours-discrete": ours, "peft": FAKE["peft"]}}

    second = run(1, 0.5, 1.0, 2.25)
    second["details"]["langvae"] = FAKE["langvae"]  # run in the second call only, without a baseline
    table = peers.seeds_table([run(0, 1.0, 1.0, 0.9), second]).splitlines()
    assert table[0] == "seeds 0 / 1"
    assert table[2] == (
        "| system | NMI A | A: k-means of its features | NMI B | B: k-means of its features | NLL nats/token |"
    )
    assert table[4] == (
        "| ours-discrete | 1.000 / 0.500 | 1.000 / 1.000 | 0.000 / 0.000 | 0.000 / 0.000 | 0.900 / 2.250 |"
    )
    assert table[5] == "| langvae | – / 0.002 | – / – | – / 1.000 | – / – | – / 12.070 |"
    assert len(table) == 6  # peft has no latent: no row


def test_seeds_names_a_folder_without_results(peers, tmp_path, capsys):
    with pytest.raises(SystemExit):
        peers.main(["seeds", str(tmp_path)])
    assert str(tmp_path / "results.json") in capsys.readouterr().err


def test_seeds_table_refuses_runs_that_differ_in_more_than_the_seed(peers):
    runs = [{"settings": dict(SETTINGS, seed=seed, steps=steps), "details": {}} for seed, steps in ((0, 120), (1, 20))]
    with pytest.raises(ValueError, match="differ in steps"):
        peers.seeds_table(runs)


def test_folders_are_refused_where_they_would_be_ignored(peers, tmp_path, capsys):
    with pytest.raises(SystemExit):
        peers.main(["all", str(tmp_path)])
    assert "takes no folders" in capsys.readouterr().err
