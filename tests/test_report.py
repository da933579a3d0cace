import json
import math
import re
from html.parser import HTMLParser

import pytest

from disentanglement import metrics as M
from disentanglement import report as R

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class BalanceChecker(HTMLParser):
    """Checks that every non-void tag is closed in order; collects token spans and script data."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.token_spans: list[dict[str, str]] = []
        self.token_text: list[str] = []
        self.tags: list[str] = []
        self.scripts: dict[str, str] = {}
        self._script_id: str | None = None
        self._in_tok = 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag in VOID:
            return
        self.stack.append(tag)
        if tag == "span" and "tok" in (attrs.get("class") or "").split():
            self.token_spans.append(attrs)
            self.token_text.append("")
            self._in_tok = len(self.stack)
        if tag == "script":
            self._script_id = attrs.get("id", "")
            self.scripts[self._script_id] = ""

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in VOID:
            self.errors.append(f"self-closing non-void <{tag}/>")

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}> with open {self.stack[-3:]}")
            return
        if self._in_tok == len(self.stack):
            self._in_tok = 0
        self.stack.pop()
        if tag == "script":
            self._script_id = None

    def handle_data(self, data):
        if self._script_id is not None:
            self.scripts[self._script_id] += data
        elif self._in_tok:
            self.token_text[-1] += data


def parse(page: str) -> BalanceChecker:
    p = BalanceChecker()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors
    assert not p.stack, f"unclosed tags {p.stack}"
    return p


TOKENS = ["Hello", " world", "<b>&", "\n", ' "quoted"', "</script>", "  two spaces", "x\ny"]
VALUES = {
    "zfree_surprisal": [1.0, 2.5, 0.0, 0.25, 3.0, 4.0, 0.5, 1.5],
    "token_weight": [0.1, 0.2, 0.0, 0.05, 0.25, 0.3, 0.05, 0.05],
    "gain": [-1.0, 0.5, 0.0, 0.2, -0.3, 2.0, float("nan"), 0.1],
}


def test_html_well_formed_one_span_per_token_and_escaped():
    page = R.render_token_html(TOKENS, VALUES, "Example <report>", meta={"model": "tiny & <odd>", "step": 3})
    assert page.startswith("<!DOCTYPE html>")
    p = parse(page)
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
    assert p.token_text[3] == "\u21b5"
    assert p.token_text[7] == "x\u21b5y"
    assert page.count("\u21b5<br>") == 2
    assert p.token_text[6] == "  two spaces"
    assert p.token_spans[6]["data-gain"] == "n/a"
    # a select listing every quantity; the default is selected
    for key in VALUES:
        assert f'<option value="{key}"' in page
    assert '<option value="zfree_surprisal" selected>' in page


def test_html_embedded_json_matches_inputs_and_no_network():
    page = R.render_token_html(TOKENS, VALUES, "t", default="gain")
    p = parse(page)
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
    spans = parse(page).token_spans
    assert [s["style"] for s in spans] == [
        "background-color:rgb(255,255,255)",
        "background-color:rgb(255,128,128)",
        "background-color:rgb(255,0,0)",
    ]
    page = R.render_token_html(["a", "b", "c"], {"gain": [-2.0, 0.0, 1.0]}, "t")
    spans = parse(page).token_spans
    assert [s["style"] for s in spans] == [
        "background-color:rgb(0,0,255)",
        "background-color:rgb(255,255,255)",
        "background-color:rgb(255,128,128)",
    ]
    assert 'id="legend-min">-2<' in page and 'id="legend-max">1<' in page


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
    p = parse(html_path.read_text(encoding="utf-8"))
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
    paths = R.plot_training_curves(synthetic_metrics(), tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["kl.png", "schedules.png", "training_curves.png"]
    for p in paths:
        assert_png(p)
    # without KL or schedule keys only the grid is written; nothing numeric -> nothing written
    only = R.plot_training_curves([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], tmp_path / "b")
    assert [p.name for p in only] == ["training_curves.png"]
    assert R.plot_training_curves([{"step": 1, "note": "x"}], tmp_path / "c") == []


def test_plot_code_usage_and_contingency(tmp_path):
    usage = M.code_usage_per_slot([[0, 1], [1, 1], [2, 1], [2, 3]], 4)
    assert_png(R.plot_code_usage(usage, tmp_path / "usage.png"))
    agreement = M.label_agreement([0, 0, 1, 2, 2], ["a", "a", "b", "c", "b"])
    assert_png(R.plot_contingency_heatmap(agreement["contingency"], tmp_path / "heat.png"))


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
