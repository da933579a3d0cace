"""``disentangle sweep`` on the tiny model: cells and grids, resumability, parallel jobs, the summaries."""

from __future__ import annotations

import csv
import json
import math

import pytest

from conftest import hidden_factor_prompts, model_and_tokenizer
from disentanglement import cli, sweep
from disentanglement.config import ConfigError
from disentanglement.testing import make_hidden_factor_pairs
from helpers import capture_figures, tick_labels, visible_axes

BASE = dict(
    preset="raw",  # the recipe these sweeps were written against (the defaults before issue 23)
    max_steps=4,
    batch_size=4,
    save_every=2,
    eval_every=0,
    eval_batches=1,
    chat_template=False,
    validation_fraction=0.25,
    decoder_training="full",
)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep-data") / "pairs.jsonl"
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(32), kind="clean", seed=0)
    path.write_text(
        "".join(json.dumps({"prompt": p.prompt, "response": p.response, "label": p.label}) + "\n" for p in pairs)
    )
    return path


def spec_for(data_file, seeds=(0, 1), **settings):
    cells = ["raw reconstruction_weight=1", "term3 reconstruction_weight=0 token_weighted_weight=1"]
    return sweep.build_spec(dict(BASE, data=str(data_file)), cells, settings.get("sets", ()), seeds)


def test_values_fields_and_cells_are_parsed_and_checked():
    assert [sweep.parse_value(v) for v in ("1", "0.5", "1e-3", "true", "none", "js")] == [
        1,
        0.5,
        1e-3,
        True,
        None,
        "js",
    ]
    assert sweep.parse_grid(["kl.beta=0.1,0.2", "token_weight_alpha=1,2"]) == {
        "beta": [0.1, 0.2],
        "token_weight_alpha": [1, 2],
    }
    assert sweep.parse_cell("t3 reconstruction_weight=0 token_weighted_weight=1") == (
        "t3",
        {"reconstruction_weight": 0, "token_weighted_weight": 1},
    )
    for bad, message in (
        (lambda: sweep.parse_grid(["betta=1"]), "unknown config field 'betta'"),
        (lambda: sweep.parse_grid(["latent.beta=1"]), "is in section 'kl', not 'latent'"),
        (lambda: sweep.parse_grid(["seed=1,2"]), "set by the sweep itself"),
        (lambda: sweep.parse_grid(["beta"]), "expected FIELD=V1,V2"),
        (lambda: sweep.parse_cell("t3 beta"), "is not FIELD=VALUE"),
        (lambda: sweep.build_spec({}, ["a beta=-1"]), "cell 'a': KLConfig.beta must be >= 0"),
        (lambda: sweep.build_spec({}, ["a beta=x"]), "cell 'a': KLConfig.beta must be a number"),
        (lambda: sweep.build_spec({}, ["a beta=1", "a beta=2"]), "same name"),
    ):
        with pytest.raises(ConfigError, match=message):
            bad()


def test_cells_are_named_cells_crossed_with_the_grid():
    spec = sweep.build_spec({}, ["a beta=0.1", "b beta=0.2"], ["token_weight_alpha=1,2"], [0, 3])
    assert list(spec.cells) == [
        "a,token_weight_alpha=1",
        "a,token_weight_alpha=2",
        "b,token_weight_alpha=1",
        "b,token_weight_alpha=2",
    ]
    assert spec.cells["b,token_weight_alpha=2"] == {"beta": 0.2, "token_weight_alpha": 2}
    assert len(spec.runs()) == 8 and sweep.build_spec({}, seeds=[1]).cells == {"base": {}}


def test_mean_and_interval_is_the_student_t_interval():
    mean, half, n = sweep.mean_and_interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert n == 3 and mean == pytest.approx(7 / 3) and half == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    assert math.isnan(sweep.mean_and_interval([5.0])[1]) and sweep.mean_and_interval([5.0])[0] == 5.0


def test_flatten_report_keeps_finite_numbers_only():
    flat = sweep.flatten_report({"a": 1, "b": {"c": 2.5, "d": [1, 2], "e": float("nan")}, "f": "x", "g": True})
    assert flat == {"a": 1.0, "b.c": 2.5, "g": 1.0}


def test_plot_summary_draws_each_cells_mean_and_interval(tmp_path):
    summary = {
        "a": {"label_nmi": (0.5, 0.1, 3), "kl": (2.0, 0.5, 3)},
        "b": {"label_nmi": (0.25, float("nan"), 1), "kl": (1.0, 0.0, 1)},
    }
    with capture_figures() as figures:
        path = sweep.plot_summary(summary, tmp_path / "sweep.png")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    panels = visible_axes(figures["sweep.png"])
    assert [ax.get_title() for ax in panels] == ["label_nmi", "kl"]
    for ax, key in zip(panels, ("label_nmi", "kl"), strict=True):
        assert tick_labels(ax, "y") == ["a", "b"] and ax.yaxis_inverted()  # the first cell on top
        points, _, (bars,) = ax.containers[0]
        assert list(points.get_xdata()) == [summary["a"][key][0], summary["b"][key][0]]
        assert list(points.get_ydata()) == [0, 1]
        half = [summary[c][key][1] for c in ("a", "b")]
        half = [0.0 if math.isnan(h) else h for h in half]  # one seed: no interval drawn
        ends = [x for seg in bars.get_segments() for x in (seg[0][0], seg[1][0])]
        means = list(points.get_xdata())
        assert ends == pytest.approx([x for m, h in zip(means, half, strict=True) for x in (m - h, m + h)])


def test_the_seed_to_keep_is_the_highest_latent_gain_and_needs_no_labels():
    gain, nmi = sweep.KEEP_BY, "factors.style.latent.nmi"
    rows = [
        {"cell": "a", "seed": 0, gain: 0.010, nmi: 0.30, "label_nmi": 0.2},
        {"cell": "a", "seed": 1, gain: 0.050, nmi: 0.70, "label_nmi": 0.6},
        {"cell": "a", "seed": 2, gain: 0.030, nmi: 0.90, "label_nmi": 0.1},
        {"cell": "a", "seed": 4, nmi: 0.99},  # no gain (a run whose report has none): neither kept nor the best
        {"cell": "b", "seed": 3, gain: 0.020},  # a tie: the lower seed; no labels: no NMI
        {"cell": "b", "seed": 1, gain: 0.020},
        {"cell": "c", "seed": 0, gain: math.nan, nmi: 0.5},  # no finite gain: no seed to keep
    ]
    kept = sweep.kept_seeds(rows, ["a", "b", "c"])
    assert kept == {  # label_nmi is factors.label.latent.nmi's twin: the named factors' NMI is kept
        "a": {"seed": 1, "run_dir": "runs/a/seed-1", gain: 0.05, "seeds": 3, nmi: 0.70},
        "b": {"seed": 1, "run_dir": "runs/b/seed-1", gain: 0.02, "seeds": 2},
    }
    md = sweep.kept_markdown(kept, rows)
    assert "## The seed to keep" in md and "4 of 10" in md
    assert "| cell | seed to keep | latent gain | NMI with style (the best seed's) |" in md
    assert "| a | 1 of 3 | 0.0500 | 0.700 (0.900, seed 2) |" in md
    assert "| b | 1 of 2 | 0.0200 | - |" in md and "| c |" not in md
    assert sweep.kept_markdown({}, rows) == ""
    # no labels at all (the case this is for): no NMI column; a string label: one column, label_nmi
    unlabelled = [{"cell": "b", "seed": s, gain: g} for s, g in ((0, 0.01), (1, 0.03))]
    md = sweep.kept_markdown(sweep.kept_seeds(unlabelled, ["b"]), unlabelled)
    assert "| cell | seed to keep | latent gain |\n| --- | ---: | ---: |\n| b | 1 of 2 | 0.0300 |\n" in md
    labelled = [dict(r, label_nmi=0.4 + r["seed"] / 10) for r in unlabelled]
    md = sweep.kept_markdown(sweep.kept_seeds(labelled, ["b"]), labelled)
    assert "| NMI with the label (the best seed's) |" in md and "| b | 1 of 2 | 0.0300 | 0.500 (0.500, seed 1) |" in md


def test_sweep_runs_every_cell_and_seed_resumes_and_skips_what_is_done(tmp_path, data_file, monkeypatch):
    spec = spec_for(data_file)
    with capture_figures() as figures:
        rows = sweep.run_sweep(spec, tmp_path, model_factory=model_and_tokenizer)
    assert [(r["cell"], r["seed"]) for r in rows] == spec.runs()
    with (tmp_path / "sweep.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 4 and {"cell", "seed", "reconstruction_weight", "label_nmi"} <= set(table[0])
    md = (tmp_path / "sweep.md").read_text()
    assert "| raw | reconstruction_weight=1 |" in md and "±" in md and (tmp_path / "sweep.png").stat().st_size > 1000
    # sweep.png: one panel per headline metric (a factor's NMI with its baselines in one panel, issue 23),
    # each cell's mean over its seeds (the panel's first error bar: the latent's), cells named down the side
    keys = sweep.headline_keys(rows)
    panels = visible_axes(figures["sweep.png"])
    layout = sweep.summary_panels(keys)
    assert "label_nmi" in keys and [ax.get_title() for ax in panels] == [title for title, _ in layout]
    assert "factor label: NMI" in [title for title, _ in layout]
    for ax, (_, (key, *_)) in zip(panels, layout, strict=True):
        assert tick_labels(ax, "y") == ["raw", "term3"]
        (points, _, _) = ax.containers[0]
        means = [sum(r[key] for r in rows if r["cell"] == c) / 2 for c in ("raw", "term3")]
        assert list(points.get_xdata()) == pytest.approx(means) and list(points.get_ydata()) == [0, 1]
    report = json.loads((tmp_path / "runs" / "raw" / "seed-1" / "eval" / "sweep_eval.json").read_text())
    assert rows[1]["label_nmi"] == report["label_nmi"]
    # the seed to keep per cell: the run of the highest latent gain, its directory, its NMI; sweep.md says so
    kept = json.loads((tmp_path / "kept.json").read_text())
    for cell in ("raw", "term3"):
        runs = [r for r in rows if r["cell"] == cell]
        best = max(runs, key=lambda r: (r[sweep.KEEP_BY], -r["seed"]))
        assert kept[cell]["seed"] == best["seed"] and kept[cell]["factors.label.latent.nmi"] == best["label_nmi"]
        assert (tmp_path / kept[cell]["run_dir"] / "eval" / "sweep_eval.json").is_file()
        assert f"| {cell} | {best['seed']} of 2 | {best[sweep.KEEP_BY]:.4f} |" in md
    # front.png: one point per run (4), NMI against the posterior NLL of each run's report
    (front_panel,) = visible_axes(figures["front.png"])
    drawn = sorted(tuple(p) for c in front_panel.collections for p in c.get_offsets().tolist())
    expected = sorted((r["posterior_nll_nats_per_token"], r["label_nmi"]) for r in rows)
    assert [x for p in drawn for x in p] == pytest.approx([x for p in expected for x in p])
    # Every cell and seed shares the user's frozen-pass cache (feature_store): none in the sweep's folder.
    assert not (tmp_path / "feature_cache").exists()

    import disentanglement.trainer as trainer

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run is not trained again")

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "train", no_training)
        again = sweep.run_sweep(spec, tmp_path, model_factory=model_and_tokenizer)
    assert again == rows
    # An interrupted run (its last checkpoint and report gone) resumes from the checkpoint before.
    run_dir = tmp_path / "runs" / "term3" / "seed-0"
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step-000004")
    (run_dir / "eval" / "sweep_eval.json").unlink()
    resumed = sweep.run_sweep(spec, tmp_path, model_factory=model_and_tokenizer)
    assert resumed == rows, "a resumed run is bit-identical, so its evaluation is too"
    with pytest.raises(ConfigError, match="another base config"):
        sweep.run_sweep(sweep.build_spec(dict(BASE, data=str(data_file), beta=0.5)), tmp_path)


def test_parallel_jobs_give_the_same_results(tmp_path, data_file, monkeypatch):
    # A store of this test's own: the serial runs fill it and the parallel ones read it. (The session's store
    # may hold these examples' features from another test's batches, equal only to float rounding.)
    monkeypatch.setenv("DISENTANGLEMENT_FEATURE_CACHE", str(tmp_path / "store"))
    spec = spec_for(data_file, seeds=(0,))
    serial = sweep.run_sweep(spec, tmp_path / "serial", model_factory=model_and_tokenizer)
    parallel = sweep.run_sweep(spec, tmp_path / "parallel", jobs=2, model_factory=model_and_tokenizer)
    assert parallel == serial


def test_sweep_command_line(tmp_path, data_file, monkeypatch, capsys):
    import yaml

    import disentanglement.lm as lm

    monkeypatch.setattr(lm, "load_model_and_tokenizer", lambda cfg, device="cpu", dtype=None: model_and_tokenizer())
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(dict(BASE, data=str(data_file))))
    out = tmp_path / "out"
    code = cli.main(
        ["sweep", "--config", str(base), "--output-dir", str(out), "--seeds", "0", "--set", "kl.beta=0.01,0.02"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "2 cells x 1 seeds = 2 runs" in printed and "| base,beta=0.01 |" in printed
    assert "## The seed to keep" in printed and f"seed to keep per cell: {out / 'kept.json'}" in printed
    assert cli.main(["sweep", "--output-dir", str(out), "--set", "betta=1"]) == 2
    assert "unknown config field 'betta'" in capsys.readouterr().err
    # issue 23: a base config that sets seed or output_dir (configs/default.yaml does) is accepted, and the sweep
    # says it overrides them (it was refused: "sets 'seed'"); the same sweep, so both runs are read back
    seeded = tmp_path / "seeded.yaml"
    seeded.write_text(yaml.safe_dump(dict(BASE, data=str(data_file), seed=3, output_dir="runs/elsewhere")))
    argv = ["sweep", "--config", str(seeded), "--output-dir", str(out), "--seeds", "0", "--set", "kl.beta=0.01,0.02"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"sweep: the base config {seeded} sets output_dir='runs/elsewhere', seed=3" in printed  # as in the file
    assert "overriding them" in printed
    assert "sweep: run 1 of 2: base,beta=0.01 seed 0 (done before" in printed
    assert "sweep: run 2 of 2: base,beta=0.02 seed 0 (done before" in printed
    # a flag's name works as a field name in --set and --cell
    spec = sweep.build_spec({}, ["t token-weighted-reconstruction-weight=1"], ["token_weighted_reconstruction_alpha=2"])
    assert spec.cells == {"t": {"token_weighted_weight": 1}} and spec.base == {"token_weight_alpha": 2}


def test_a_single_valued_set_is_a_setting_of_every_cell():
    spec = sweep.build_spec({"beta": 0.1}, ["a latent_tokens=2"], ["data=x.jsonl", "token_weight_alpha=1,2"])
    assert list(spec.cells) == ["a,token_weight_alpha=1", "a,token_weight_alpha=2"]
    assert spec.base == {"beta": 0.1, "data": "x.jsonl"}
