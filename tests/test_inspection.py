"""``disentangle inspect``: the token report of one example and the run's plots, on checkpoints trained
on the synthetic hidden-factor data (``conftest.py``)."""

from __future__ import annotations

import json
import math

import pytest

from conftest import model_and_tokenizer
from disentanglement import cli
from disentanglement.commands import run_inspect
from disentanglement.inspection import QUANTITIES
from disentanglement.report import read_metrics_jsonl
from disentanglement.runs import load_examples
from helpers import capture_figures, check_html, line_series, tick_labels, visible_axes

PNG = b"\x89PNG\r\n\x1a\n"


def visible(token: str) -> str:
    """A token as the page shows it (line breaks drawn as a return arrow)."""
    return token.replace("\r", "\u240d").replace("\n", "\u21b5")


@pytest.fixture(scope="module")
def discrete_inspection(discrete_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    with capture_figures() as figures:
        paths = run_inspect(
            discrete_run.checkpoint, index=3, output_dir=out, progress=False, model_and_tokenizer=model_and_tokenizer()
        )
    return paths, out, figures


def test_html_is_well_formed_and_agrees_with_its_sidecar(discrete_run, discrete_inspection):
    paths, out, _ = discrete_inspection
    assert paths["html"] == out / "inspect_3.html" and paths["json"] == out / "inspect_3.json"
    sidecar = json.loads(paths["json"].read_text())
    text = paths["html"].read_text()
    assert text.startswith("<!DOCTYPE html>") and "http://" not in text and "https://" not in text
    page = check_html(text)

    _, tok, config, _ = discrete_run.load()
    example = load_examples("validation", config, tok)[0][3]
    tokens = sidecar["tokens"]
    # every response token exactly once, in order
    assert len(tokens) == len(page.token_spans) == len(example.response_ids)
    assert [int(s["data-i"]) for s in page.token_spans] == list(range(len(tokens)))
    assert "".join(tokens) == tok.decode(example.response_ids, skip_special_tokens=False)
    assert page.token_texts == [visible(t) for t in tokens]
    assert [s["data-token"] for s in page.token_spans] == tokens
    # the page's numbers are the sidecar's
    assert set(sidecar["values"]) == set(QUANTITIES)
    for key, values in sidecar["values"].items():
        assert len(values) == len(tokens)
        assert [s[f"data-{key}"] for s in page.token_spans] == [f"{v:.4g}" for v in values]
    values = sidecar["values"]
    for i in range(len(tokens)):
        assert values["gain"][i] == pytest.approx(values["zfree_surprisal"][i] - values["conditioned_nll"][i])
        assert values["latent_gain"][i] == pytest.approx(values["prior_nll"][i] - values["conditioned_nll"][i])
    assert sum(values["token_weight"]) == pytest.approx(1.0)
    assert sum(values["inverse_token_weight"]) == pytest.approx(1.0)
    meta = sidecar["meta"]
    assert meta["index"] == 3 and meta["label"] == example.label and meta["token_weight_alpha"] == 1.0
    assert meta["latent"]["codes"][0] in range(config.latent.codebook_size)
    assert meta["gain_per_token"] == pytest.approx(sum(values["gain"]) / len(tokens))
    # the weights follow surprisal at alpha = 1: pi_t proportional to b_t
    b, pi = values["zfree_surprisal"], values["token_weight"]
    assert pi == pytest.approx([v / sum(b) for v in b], rel=1e-4)


def test_plots_are_written_and_non_empty(discrete_inspection):
    paths, out, _ = discrete_inspection
    names = {p.name for p in paths["plots"]}
    assert {"training_curves.png", "kl.png", "schedules.png", "code_usage.png", "code_label_heatmap.png"} <= names
    for path in paths["plots"]:
        data = path.read_bytes()
        assert path.parent == out and data.startswith(PNG) and len(data) > 1000


def test_plots_draw_the_metrics_log_and_the_codes_of_the_data(discrete_run, discrete_inspection):
    paths, _, figures = discrete_inspection
    assert set(figures) == {p.name for p in paths["plots"]}
    # the training curves (issue 23: grouped panels, not one per key): the loss first in the objective's panel,
    # its logged values by step
    log = read_metrics_jsonl(discrete_run.run_dir / "metrics.jsonl")
    numeric = {
        k: v
        for r in log
        for k, v in r.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }
    panels = {ax.get_title(): ax for ax in visible_axes(figures["training_curves.png"]) if ax.get_title()}
    assert list(panels)[0] == "objective (nats)" and len(figures["training_curves.png"].axes) <= 8
    assert all(ax.get_xlabel() == "step" for ax in panels.values())
    logged = [r for r in log if math.isfinite(r.get("loss", math.nan))]
    assert line_series(panels["objective (nats)"])[0] == (
        [float(r["step"]) for r in logged],
        [float(r["loss"]) for r in logged],
    )
    (kl,) = visible_axes(figures["kl.png"])  # one slot: fewer units than the heat map needs
    assert kl.get_title() == "KL terms" and {line.get_label() for line in kl.get_lines()} == {
        k for k in numeric if "kl" in k.lower() and not k.startswith("val_") and "objective_unit" not in k
    }
    assert {ax.get_title() for ax in visible_axes(figures["schedules.png"])} <= {"beta", "temperature", "lr"}
    # code usage: one bar chart per slot, a bar per code, the bars counting every example of the data
    _, tok, config, _ = discrete_run.load()
    examples = load_examples("validation", config, tok)[0]
    slots = visible_axes(figures["code_usage.png"])
    assert len(slots) == config.latent.num_slots
    for m, ax in enumerate(slots):
        assert len(ax.patches) == config.latent.codebook_size and ax.get_title().startswith(f"slot {m}: perplexity")
        assert sum(p.get_height() for p in ax.patches) == len(examples)
    # the code x label heat map: the data's labels across, the codes used down, every example counted once
    ax, colorbar = visible_axes(figures["code_label_heatmap.png"])
    (image,) = ax.get_images()
    assert (ax.get_xlabel(), ax.get_ylabel(), colorbar.get_ylabel()) == ("label", "code", "count")
    assert ax.get_title() == "code x label"
    assert set(tick_labels(ax, "x")) == {str(e.label) for e in examples}
    assert set(tick_labels(ax, "y")) <= {str(k) for k in range(config.latent.codebook_size)}
    assert image.get_array().sum() == len(examples)


def test_markup_in_token_text_is_escaped(discrete_run, tmp_path):
    response = '<script>alert("x")</script> & <b>bold</b>'
    data = tmp_path / "markup.jsonl"
    data.write_text(json.dumps({"prompt": "red <i>cat</i> 5", "response": response, "label": "0"}) + "\n")
    paths = run_inspect(
        discrete_run.checkpoint,
        data=str(data),
        index=0,
        output_dir=tmp_path / "out",
        plots=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    assert paths["plots"] == []
    text = paths["html"].read_text()
    page = check_html(text)
    assert page.tags.count("script") == 2  # the page's own data and code, nothing from the tokens
    assert "b" not in page.tags and "i" not in page.tags
    assert "<script>alert" not in text and "&lt;" in text and "&amp;" in text
    sidecar = json.loads(paths["json"].read_text())
    assert "".join(page.token_texts) == "".join(sidecar["tokens"]) == response + "<|im_end|>"
    assert sidecar["meta"]["prompt"] == "red <i>cat</i> 5\n"


def test_alpha_override_gives_uniform_weights(discrete_run, tmp_path):
    paths = run_inspect(
        discrete_run.checkpoint,
        index=0,
        alpha=0.0,
        plots=False,
        output_dir=tmp_path,
        model_and_tokenizer=model_and_tokenizer(),
    )
    sidecar = json.loads(paths["json"].read_text())
    n = len(sidecar["tokens"])
    assert sidecar["meta"]["token_weight_alpha"] == 0.0
    assert sidecar["values"]["token_weight"] == pytest.approx([1 / n] * n)


def test_continuous_inspection(continuous_run, tmp_path):
    paths = run_inspect(
        continuous_run.run_dir,
        index=0,
        prior_samples=4,
        output_dir=tmp_path,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    sidecar = json.loads(paths["json"].read_text())
    assert len(sidecar["meta"]["latent"]["posterior_mean"]) == continuous_run.config.latent.latent_dim
    assert all(v is not None and math.isfinite(v) for vals in sidecar["values"].values() for v in vals)
    names = {p.name for p in paths["plots"]}
    assert "code_label_heatmap.png" in names and "code_usage.png" not in names and "training_curves.png" in names


def test_cli_inspect(discrete_run, tmp_path, injected_loader, capsys):
    argv = ["inspect", str(discrete_run.checkpoint), "--index", "1", "--no-plots", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "inspect_1.html" in capsys.readouterr().out
    assert (tmp_path / "inspect_1.html").is_file() and (tmp_path / "inspect_1.json").is_file()
    assert cli.main(["inspect", str(discrete_run.checkpoint), "--index", "4000", "--no-plots"]) == 2
    assert "--index 4000" in capsys.readouterr().err


def test_default_output_dir_is_next_to_the_checkpoints(discrete_run, injected_loader):
    assert cli.main(["inspect", str(discrete_run.run_dir), "--index", "0", "--no-plots", "--no-progress"]) == 0
    assert (discrete_run.run_dir / "inspect" / "inspect_0.html").is_file()


def test_factor_labels_get_one_heat_map_each(discrete_run, tmp_path):
    rows = [json.loads(line) for line in discrete_run.data_path.read_text().splitlines()][:24]
    data = tmp_path / "factors.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": r["prompt"], "response": r["response"], "label": {"factor": r["label"], "half": str(i % 2)}}
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    with capture_figures() as figures:
        paths = run_inspect(
            discrete_run.checkpoint,
            data=str(data),
            index=0,
            output_dir=tmp_path / "out",
            progress=False,
            model_and_tokenizer=model_and_tokenizer(),
        )
    names = {p.name for p in paths["plots"]}
    assert {"code_factor_heatmap.png", "code_half_heatmap.png"} <= names and "code_label_heatmap.png" not in names
    # each heat map has its own factor's values across, and counts all 24 examples
    for file, values in (
        ("code_factor_heatmap.png", {r["label"] for r in rows}),
        ("code_half_heatmap.png", {"0", "1"}),
    ):
        ax, _ = visible_axes(figures[file])
        assert set(tick_labels(ax, "x")) == {str(v) for v in values}
        assert ax.get_images()[0].get_array().sum() == len(rows)
