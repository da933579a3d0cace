import json
import math
import re

import pytest

from disentanglement import metrics as M
from disentanglement import report as R
from helpers import capture_figures, check_html, line_series, tick_labels, visible_axes

TOKENS = ["Hello", " world", "<b>&", "\n", ' "quoted"', "</script>", "  two spaces", "x\ny"]
VALUES = {
    "zfree_surprisal": [1.0, 2.5, 0.0, 0.25, 3.0, 4.0, 0.5, 1.5],
    "token_weight": [0.1, 0.2, 0.0, 0.05, 0.25, 0.3, 0.05, 0.05],
    "gain": [-1.0, 0.5, 0.0, 0.2, -0.3, 2.0, float("nan"), 0.1],
}


def test_html_well_formed_one_span_per_token_and_escaped():
    page = R.render_token_html(TOKENS, VALUES, "Example <report>", meta={"model": "tiny & <odd>", "step": 3})
    assert page.startswith("<!DOCTYPE html>")
    p = check_html(page)
    assert len(p.token_spans) == len(TOKENS)
    # raw markup never appears: "<b>" is only a token's text, never a tag; no stray tags
    assert "b" not in p.tags and "odd" not in p.tags and "report" not in p.tags
    assert "<b>&" not in page and "&lt;b&gt;&amp;" in page
    assert "<odd>" not in page and "<report>" not in page
    for i, (attrs, tok) in enumerate(zip(p.token_spans, TOKENS, strict=True)):
        assert attrs["data-i"] == str(i)
        assert attrs["data-token"] == tok  # attribute round-trips through escaping
        assert "zfree_surprisal" in attrs["title"]
        assert attrs["data-zfree_surprisal"] == f"{VALUES['zfree_surprisal'][i]:.4g}"
        assert "background-color" in attrs["style"]
    # visible whitespace: newline drawn as a return arrow followed by a line break; spaces kept
    assert p.token_texts[3] == "\u21b5"
    assert p.token_texts[7] == "x\u21b5y"
    assert page.count("\u21b5<br>") == 2
    assert p.token_texts[6] == "  two spaces"
    assert p.token_spans[6]["data-gain"] == "n/a"
    # a select listing every quantity; the default is selected
    for key in VALUES:
        assert f'<option value="{key}"' in page
    assert '<option value="zfree_surprisal" selected>' in page


def test_html_embedded_json_matches_inputs_and_no_network():
    page = R.render_token_html(TOKENS, VALUES, "t", default="gain")
    p = check_html(page)
    raw = p.scripts["token-data"]
    assert "</" not in raw
    data = json.loads(raw)
    assert data["tokens"] == TOKENS
    assert data["default"] == "gain"
    for key, vals in VALUES.items():
        expected = [None if math.isnan(v) else v for v in vals]
        assert data["values"][key] == expected
    assert data["scales"]["gain"]["signed"] is True
    assert data["scales"]["zfree_surprisal"]["signed"] is False
    assert data["scales"]["zfree_surprisal"]["max"] == 4.0
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page and "src=" not in page
    assert '<option value="gain" selected>' in page


def test_html_colour_scales():
    page = R.render_token_html(["a", "b", "c"], {"gain": [-2.0, 0.0, 1.0], "nll": [0.0, 1.0, 2.0]}, "t", default="nll")
    spans = check_html(page).token_spans
    assert [s["style"] for s in spans] == [
        "background-color:rgb(255,255,255)",
        "background-color:rgb(255,128,128)",
        "background-color:rgb(255,0,0)",
    ]
    page = R.render_token_html(["a", "b", "c"], {"gain": [-2.0, 0.0, 1.0]}, "t")
    spans = check_html(page).token_spans
    assert [s["style"] for s in spans] == [
        "background-color:rgb(0,0,255)",
        "background-color:rgb(255,255,255)",
        "background-color:rgb(255,128,128)",
    ]
    # the legend's ends are the values drawn in its end colours: -max|v| (blue) and +max|v| (red), not min and max
    assert 'id="legend-min">-2<' in page and 'id="legend-max">2<' in page


def test_html_rejects_bad_input():
    with pytest.raises(ValueError, match="one per token"):
        R.render_token_html(["a", "b"], {"x": [1.0]}, "t")
    with pytest.raises(ValueError, match="default"):
        R.render_token_html(["a"], {"x": [1.0]}, "t", default="y")


def test_write_token_report_sidecar_agrees(tmp_path):
    html_path, json_path = R.write_token_report(tmp_path / "sub" / "ex0.html", TOKENS, VALUES, "title", {"k": 1})
    assert html_path.exists() and json_path == tmp_path / "sub" / "ex0.json"
    side = json.loads(json_path.read_text())
    assert set(side) == {"title", "meta", "tokens", "values"}
    assert side["tokens"] == TOKENS and side["meta"] == {"k": 1} and side["title"] == "title"
    p = check_html(html_path.read_text(encoding="utf-8"))
    embedded = json.loads(p.scripts["token-data"])
    assert embedded["values"] == side["values"]
    assert side["values"]["token_weight"] == VALUES["token_weight"]
    assert side["values"]["gain"][6] is None


def test_read_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5}\n')
    assert R.read_metrics_jsonl(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text('{"step": 1}\n{"step": 2, oops}\n')
    with pytest.raises(ValueError, match=r"line 2\b"):
        R.read_metrics_jsonl(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2"):
        R.read_metrics_jsonl(path)


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1024


def synthetic_metrics():
    out = []
    for step in range(1, 41):
        out.append(
            {
                "step": step,
                "loss": 3.0 / step,
                "kl": 0.1 * step,
                "kl_per_slot_mean": 0.05 * step,
                "beta": min(1.0, step / 20),
                "temperature": 1.0 - 0.01 * step,
                "lr": 1e-3,
                "grad_norm": float("nan"),  # never finite: skipped
                "phase": "train",  # not numeric: skipped
                "flag": True,  # bool: skipped
            }
        )
    return out


def test_plot_training_curves(tmp_path):
    metrics = synthetic_metrics()
    with capture_figures() as figures:
        paths = R.plot_training_curves(metrics, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["kl.png", "schedules.png", "training_curves.png"]
    for p in paths:
        assert_png(p)
    assert sorted(figures) == names
    steps = [float(r["step"]) for r in metrics]

    def drawn(key):
        return steps, [float(r[key]) for r in metrics]

    # the panels (issue 23): grouped in a fixed order, not one per key; beta and temperature on KL's right axis
    grid = figures["training_curves.png"]
    panels = [ax for ax in grid.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        "objective (nats)",
        "KL (nats) and beta",
        "learning rates and gradient norm",
    ]
    assert len(grid.axes) == 4  # and beta's right axis
    objective, kl_panel, rates = panels
    (right,) = [ax for ax in grid.axes if not ax.get_title()]
    assert line_series(objective) == [drawn("loss")] and objective.get_xlabel() == "step"
    assert line_series(kl_panel) == [drawn("kl"), drawn("kl_per_slot_mean")]
    assert line_series(right) == [drawn("beta"), drawn("temperature")] and right.get_ylabel() == "beta"
    assert line_series(rates) == [drawn("lr")] and rates.get_yscale() == "log"
    # the KL plot: the keys containing "kl" on one axes, with a legend naming them
    (kl,) = visible_axes(figures["kl.png"])
    assert (kl.get_title(), kl.get_xlabel(), kl.get_ylabel()) == ("KL terms", "step", "nats")
    assert line_series(kl) == [drawn("kl"), drawn("kl_per_slot_mean")]
    assert [line.get_label() for line in kl.get_lines()] == ["kl", "kl_per_slot_mean"]
    assert [t.get_text() for t in kl.get_legend().get_texts()] == ["kl", "kl_per_slot_mean"]
    # the schedules: beta, temperature and lr, one panel each
    schedules = visible_axes(figures["schedules.png"])
    assert [ax.get_title() for ax in schedules] == ["beta", "temperature", "lr"]
    for ax, key in zip(schedules, ["beta", "temperature", "lr"], strict=True):
        assert line_series(ax) == [drawn(key)]

    # without KL or schedule keys only the grid is written; nothing numeric -> nothing written
    with capture_figures() as figures:
        only = R.plot_training_curves([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], tmp_path / "b")
    assert [p.name for p in only] == ["training_curves.png"]
    (ax,) = visible_axes(figures["training_curves.png"])
    assert ax.get_title() == "objective (nats)" and line_series(ax) == [([1.0, 2.0], [1.0, 0.5])]
    assert ax.get_lines()[0].get_marker() == "."  # few points: each one marked
    # a record without a step is drawn at its index; keys of no known panel share the panel "other"
    with capture_figures() as figures:
        R.plot_training_curves([{"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}, {"a": 0.5}], tmp_path / "d")
    (other,) = figures["training_curves.png"].axes
    assert other.get_title() == "other" and [line.get_label() for line in other.get_lines()] == ["a", "b", "c", "d"]
    assert line_series(other)[0] == ([0.0, 1.0], [1.0, 0.5])
    with capture_figures() as figures:
        assert R.plot_training_curves([{"step": 1, "note": "x"}], tmp_path / "c") == []
    assert figures == {}


def test_plot_code_usage_and_contingency(tmp_path):
    usage = M.code_usage_per_slot([[0, 1], [1, 1], [2, 1], [2, 3]], 4)
    with capture_figures() as figures:
        assert_png(R.plot_code_usage(usage, tmp_path / "usage.png"))
    # one bar chart per slot: the bars are the code counts, the title its perplexity and codes used
    slots = visible_axes(figures["usage.png"])
    assert len(slots) == 2
    for m, (ax, expected) in enumerate(zip(slots, ([1, 1, 2, 0], [0, 3, 0, 1]), strict=True)):
        assert [p.get_height() for p in ax.patches] == expected == list(usage[m]["histogram"])
        assert [p.get_x() + p.get_width() / 2 for p in ax.patches] == pytest.approx([0, 1, 2, 3])
        used = sum(c > 0 for c in expected)
        assert ax.get_title() == f"slot {m}: perplexity {usage[m]['perplexity']:.2f}, used {used}/4"
        assert ax.get_ylabel() == "count"
    assert slots[-1].get_xlabel() == "code"

    agreement = M.label_agreement([0, 0, 1, 2, 2], ["a", "a", "b", "c", "b"])
    contingency = agreement["contingency"]
    with capture_figures() as figures:
        assert_png(R.plot_contingency_heatmap(contingency, tmp_path / "heat.png"))
    ax, colorbar = visible_axes(figures["heat.png"])
    (image,) = ax.get_images()
    assert image.get_array().tolist() == [[2, 0, 0], [0, 1, 0], [0, 1, 1]] == contingency["counts"]
    assert (ax.get_xlabel(), ax.get_ylabel(), colorbar.get_ylabel()) == ("label", "code", "count")
    assert tick_labels(ax, "x") == ["a", "b", "c"] and tick_labels(ax, "y") == ["0", "1", "2"]
    # every cell annotated with its count, row by row
    assert [t.get_text() for t in ax.texts] == ["2", "0", "0", "0", "1", "0", "0", "1", "1"]


def test_write_markdown_summary(tmp_path):
    agreement = M.label_agreement([0, 0, 1, 2, 2], ["a", "a", "b", "c", "b"])
    report = {
        "title": "Eval run",
        "num_examples": 5,
        "mutual_information": 0.693147,
        "checkpoint": "ckpt|1",
        "latent": {"active_units": 3, "kl": {"mean": 1.25, "per_dim": [0.5, 0.75]}},
        "labels": agreement,
        "code_usage": M.code_usage_per_slot([[0], [1], [1]], 3),
    }
    path = R.write_markdown_summary(report, tmp_path / "summary.md")
    text = path.read_text()
    assert text.startswith("# Eval run\n")
    assert "| key | value |" in text
    assert "| num_examples | 5 |" in text
    assert "| mutual_information | 0.693147 |" in text
    assert "ckpt\\|1" in text  # pipes escaped inside cells
    assert "active_units" in text and "per_dim" in text
    assert re.search(r"^#+ latent$", text, re.M) and re.search(r"^#+ kl$", text, re.M)
    # contingency as a code x label table
    assert "| code \\ label | a | b | c |" in text
    assert "| 0 | 2 | 0 | 0 |" in text
    assert "| 2 | 0 | 1 | 1 |" in text
    # per-slot list of dicts as one table
    assert re.search(r"^\| # \|.*perplexity", text, re.M)


def test_markdown_summary_has_one_table_per_factor(tmp_path):
    style = ["polite", "polite", "rude", "rude", "rude", "polite"]
    topic = ["billing", "login", "billing", "login", "billing", "login"]
    latent = [0, 0, 1, 1, 1, 0]
    features = {"encoder_kmeans": [[0.0], [0.1], [5.0], [5.1], [5.2], [0.2]], "prior_kmeans": [[1.0], [2.0]] * 3}
    factors = {
        name: M.factor_agreement(latent, v, features, permutations=3)
        for name, v in (("style", style), ("topic", topic))
    }
    factors["style"]["latent_per_slot"] = [M.agreement_scores(latent, style), M.agreement_scores([0] * 6, style)]
    path = R.write_markdown_summary({"title": "Eval", "examples": 6, "factors": factors}, tmp_path / "summary.md")
    text = path.read_text()
    assert re.search(r"^## factors$", text, re.M)
    header = "| assignment | NMI | ARI | homogeneity | completeness |"
    for name, entry in factors.items():
        assert re.search(rf"^### factor {name}$", text, re.M)
        section = text.split(f"### factor {name}\n", 1)[1].split("### factor", 1)[0]
        assert header in section
        rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(header)]
        names = [row.split(" | ")[0][2:] for row in rows]
        assert names[:4] == ["latent", "encoder k-means", "prior k-means", "random"]
        for row, key in zip(rows, ("latent", "encoder_kmeans", "prior_kmeans", "random"), strict=False):
            cells = [c.strip() for c in row.strip("|").split("|")][1:]
            assert cells == [f"{entry[key][m]:.6g}" for m in M.AGREEMENT_METRICS]
        assert f"latent NMI above every baseline's: {'yes' if entry['latent_beats_baselines'] else 'no'}" in section
        assert f"| latent \\ {name} |" in section  # the latent x value table
    assert "| slot 1 code | 0 |" in text
    assert "#### latent" not in text and "encoder_kmeans" not in text  # not the generic nested rendering


def test_read_metrics_jsonl_leaves_out_a_partial_last_line(tmp_path):
    from disentanglement.report import read_metrics_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics_jsonl(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        read_metrics_jsonl(path)


@pytest.mark.parametrize(
    "body, message",
    [
        ("<div><span></div></span>", "unbalanced"),
        ("<div><p>open", "unbalanced </body> with open ['body', 'div', 'p']"),
        ("<div/>", "self-closing"),
        ('<img src="x.png">', "src="),
        ('<link rel="stylesheet" href="s.css">', "<link>"),
        ('<a href="https://example.org">x</a>', "https://"),
        ("<style>@import 'x.css';</style>", "@import"),
    ],
)
def test_the_html_checker_catches_broken_and_non_self_contained_pages(body, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_html(f"<!DOCTYPE html>\n<html><body>{body}</body></html>\n")
    with pytest.raises(AssertionError, match="unclosed tags"):
        check_html("<!DOCTYPE html>\n<html><body><div>")
    page = check_html(
        '<!DOCTYPE html>\n<html><body><a href="#x">in</a><br><p class="a b" id="x">t<b>u</b></p></body></html>'
    )
    assert page.by_id("x").text == "tu" and page.find("p", "b").classes == ["a", "b"] and page.tags.count("br") == 1
