"""The verdict after every run (``verdict.judge``): each branch on constructed metric dicts, then end to end
on the tiny trained checkpoints of ``conftest.py``, through ``eval``, the end of ``train`` and an untrained
(collapsed) model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import NUM_FACTORS, hidden_factor_prompts, model_and_tokenizer
from disentanglement import cli
from disentanglement.commands import eval_summary_lines
from disentanglement.config import build_config
from disentanglement.data import tokenize_pairs
from disentanglement.features import build_feature_cache
from disentanglement.models import build_cvae
from disentanglement.runs import load_examples
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.verdict import (
    BEATS,
    BELOW,
    COLLAPSED,
    GAIN_EPSILON,
    MATCHES,
    NMI_MARGIN,
    UNLABELLED,
    VERDICTS,
    judge,
    validation_verdict,
    verdict_lines,
)


def factor(latent, encoder, prior=0.01, random=0.02):
    return {
        "latent": {"nmi": latent},
        "encoder_kmeans": {"nmi": encoder},
        "prior_kmeans": {"nmi": prior},
        "random": {"nmi": random},
    }


def discrete(used=(4,), gain=0.2, weighted=None, factors=None):
    report = {
        "latent": "discrete",
        "code_usage": [{"used_codes": u, "codebook_size": 4, "perplexity": float(u)} for u in used],
        "latent_gain_nats_per_token": gain,
    }
    if weighted is not None:
        report["token_weighted_latent_gain_nats_per_token"] = weighted
    if factors is not None:
        report["factors"] = factors
    return report


def continuous(active=3, gain=0.2, factors=None):
    report = {
        "latent": "continuous",
        "active_units": active,
        "posterior_mean_variance": [0.5] * active + [0.0] * (4 - active),
        "latent_gain_nats_per_token": gain,
    }
    if factors is not None:
        report["factors"] = factors
    return report


# --------------------------------------------------------------------------- each branch, by hand


def test_collapsed_one_code_zero_units_or_no_gain():
    # the case: NMI near 1 beside 0 active units and a latent gain of 0.003 is collapsed, not learned
    one_code = judge(discrete(used=(1,), factors={"label": factor(0.97, 0.97)}))
    assert one_code["verdict"] == COLLAPSED and "one code used in every slot" in one_code["reason"]
    assert "k-means of its own features 0.97" in one_code["reason"]
    no_units = judge(continuous(active=0, gain=0.003, factors={"label": factor(0.93, 0.95)}))
    assert no_units["verdict"] == COLLAPSED and no_units["reason"].startswith("0 active units")
    assert no_units["usage"] == {"kind": "units", "active": 0, "of": 4}
    flat = judge(discrete(gain=GAIN_EPSILON, factors={"label": factor(1.0, 0.1)}))
    assert flat["verdict"] == COLLAPSED and "latent gain +0.0010 <= 0.001" in flat["reason"]
    negative = judge(continuous(gain=-0.05))
    assert negative["verdict"] == COLLAPSED
    # one slot of two still uses several codes: not collapsed
    assert judge(discrete(used=(1, 3)))["verdict"] == UNLABELLED


def test_token_weighted_gain_counts():
    # flat on average over every token, but the tokens the objective weights gain: the latent is used
    result = judge(discrete(gain=0.0004, weighted=0.17))
    assert result["verdict"] == UNLABELLED and result["latent_gain"] == pytest.approx(0.17)
    assert judge(discrete(gain=0.0004, weighted=0.0002))["verdict"] == COLLAPSED


def test_beats_matches_and_below_by_the_margin():
    beats = judge(continuous(factors={"a": factor(0.9, 0.9 - NMI_MARGIN), "b": factor(0.1, 0.0)}))
    assert beats["verdict"] == BEATS and beats["factors"]["a"]["beats"] and beats["factors"]["b"]["beats"]
    assert beats["reason"].startswith("factor a: NMI 0.90")  # the factor the latent took
    # a trace of a second factor above its baselines does not beat clustering when the factor the latent took
    # is below k-means of its own features (two-factor, seed 1: A 0.57 against 1.00, B 0.09 against 0.00)
    trace = judge(discrete(factors={"A": factor(0.57, 1.0), "B": factor(0.09, 0.001)}))
    assert trace["verdict"] == BELOW and trace["factors"]["B"]["beats"]
    assert trace["reason"].startswith("factor A: NMI 0.57, not above k-means of its own features 1.00")
    # within the margin of k-means of its own features, on the factor with the highest NMI
    matches = judge(discrete(factors={"a": factor(0.97, 1.0), "b": factor(0.2, 0.3)}))
    assert matches["verdict"] == MATCHES and "factor a: NMI 0.97, k-means of its own features 1.00" in matches["reason"]
    just_short = judge(discrete(factors={"a": factor(0.5 + NMI_MARGIN - 0.001, 0.5)}))
    assert just_short["verdict"] == MATCHES
    # below its own features' clustering
    below = judge(discrete(factors={"a": factor(0.5, 0.9)}))
    assert below["verdict"] == BELOW and "not above k-means of its own features 0.90" in below["reason"]
    # above its own features but not above the prompt's
    prompt = judge(discrete(factors={"a": factor(0.6, 0.2, prior=0.62)}))
    assert prompt["verdict"] == BELOW and prompt["factors"]["a"]["best_baseline"] == "prior_kmeans"
    assert "k-means of the prompt's features 0.62" in prompt["reason"]


def test_verdict_lines():
    report = discrete(used=(4, 2), gain=0.21, weighted=0.3, factors={"label": factor(1.0, 0.43, prior=0.5)})
    lines = verdict_lines(report)
    assert lines == [
        "code usage:  slot 0 4/4, slot 1 2/4 codes used",
        "latent gain: +0.2100 nats/token (posterior against prior latents; token-weighted +0.3000)",
        "factor label: NMI 1.00 beside best baseline k-means of the prompt's features 0.50; "
        "k-means of its own features 0.43",
        "verdict: beats every baseline (factor label: NMI 1.00 against its best baseline, k-means of the "
        "prompt's features 0.50 (margin 0.05))",
    ]
    assert verdict_lines(continuous(active=2))[0] == "active units: 2/4 dimensions"


# --------------------------------------------------------------------------- end to end on the tiny models


def fixture_verdict(run):
    model, tok, config, _ = run.load()
    examples, _ = load_examples("validation", config, tok)
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    return validation_verdict(model, examples, cache, tok.pad_token_id)


def test_trained_discrete_fixture_beats_every_baseline(discrete_run):
    report, result = fixture_verdict(discrete_run)
    entry = report["factors"]["label"]
    baselines = max(entry[name]["nmi"] for name in ("encoder_kmeans", "prior_kmeans", "random"))
    assert entry["latent"]["nmi"] >= baselines + NMI_MARGIN  # recovered exactly, k-means of its features 0.75
    assert result["verdict"] == BEATS and result["usage"]["used"] == [NUM_FACTORS]
    assert verdict_lines(report, result)[-1].startswith("verdict: beats every baseline (factor label: NMI 1.00")


def test_trained_continuous_fixture_is_judged_on_its_numbers(continuous_run):
    report, result = fixture_verdict(continuous_run)
    assert report["active_units"] > 0 and report["latent_gain_nats_per_token"] > GAIN_EPSILON
    entry = report["factors"]["label"]
    nmi, own = entry["latent"]["nmi"], entry["encoder_kmeans"]["nmi"]
    best = max(entry[name]["nmi"] for name in ("encoder_kmeans", "prior_kmeans", "random"))
    expected = BEATS if nmi >= best + NMI_MARGIN else MATCHES if abs(nmi - own) <= NMI_MARGIN else BELOW
    assert result["verdict"] == expected
    assert verdict_lines(report, result)[0] == f"active units: {report['active_units']}/4 dimensions"


def test_an_encoder_that_ignores_its_input_is_collapsed():
    config = build_config(dict(chat_template=False, latent="continuous", latent_dim=3, encoder_hidden=16))
    decoder, tok = model_and_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, decoder).eval()
    model.zfree_reference_scale = 2.0
    with torch.no_grad():
        model.encoder[-1].weight.zero_()  # the posterior mean is its bias, whatever the example
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(16), num_factors=2, kind="clean", seed=1)
    examples, _ = tokenize_pairs(pairs, tok, config.data)
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    report, result = validation_verdict(model, examples, cache, tok.pad_token_id)
    assert report["active_units"] == 0 and result["verdict"] == COLLAPSED
    assert result["reason"].startswith("0 active units")
    lines = eval_summary_lines(dict(report, data="16 examples"))
    assert "active units: 0/3 dimensions" in lines and lines[-1].startswith("verdict: collapsed (0 active units")


def test_train_ends_with_the_verdict_on_its_validation_split(tmp_path, monkeypatch, capsys, injected_loader):
    import disentanglement.lm as lm

    monkeypatch.setattr(lm, "load_model_and_tokenizer", lambda cfg, device="cpu", dtype=None: model_and_tokenizer())
    data = tmp_path / "hidden.jsonl"
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(60), num_factors=NUM_FACTORS, kind="clean", seed=0)
    data.write_text(
        "".join(json.dumps({"prompt": p.prompt, "response": p.response, "label": p.label}) + "\n" for p in pairs)
    )
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--no-chat-template", "--no-progress", "--output-dir", str(run)]
    argv += ["--latent", "discrete", "--codebook-size", str(NUM_FACTORS), "--code-dim", "16", "--latent-tokens", "4"]
    argv += ["--encoder-hidden", "64", "--batch-size", "8", "--max-steps", "6", "--save-every", "6"]
    argv += ["--warmup-steps", "0", "--validation-fraction", "0.25", "--device", "cpu", "--decoder-training", "full"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    start = printed.index("on the validation split (15 examples):")
    block = printed[start + 1 :]
    # the numbers `disentangle eval RUN` gives afterwards (the validation split, eval's defaults)
    from disentanglement.commands import run_eval

    report, _, _ = run_eval(run, output=str(tmp_path / "eval.json"), progress=False, device="cpu")
    assert block[-1] == f"verdict report: {run / 'verdict.json'} (the numbers 'disentangle eval {run}' gives)"
    block = block[:-1]
    assert block == verdict_lines(report)
    assert report["verdict"]["verdict"] == block[-1].split(" (")[0].removeprefix("verdict: ")
    assert block[0].startswith("code usage:  slot 0 ") and block[2].startswith("factor label: NMI ")
    # the run keeps it: eval's report on the same split, its verdict and step
    saved = json.loads((run / "verdict.json").read_text())
    assert saved["verdict"] == report["verdict"] and saved["step"] == report["step"] == 6
    same = {k for k in report if k not in ("title", "data")}
    assert {k: saved[k] for k in same} == {k: report[k] for k in same} and same <= set(saved)
    assert saved["data"] == "the run's validation split (15 examples)"
    assert block[-1].startswith("verdict: ") and report["verdict"]["verdict"] in VERDICTS


def test_no_verdict_ends_without_scoring_the_validation_split(tmp_path, monkeypatch, capsys):
    import disentanglement.lm as lm
    import disentanglement.verdict as verdict

    monkeypatch.setattr(lm, "load_model_and_tokenizer", lambda cfg, device="cpu", dtype=None: model_and_tokenizer())

    def judged(*args, **kwargs):
        raise AssertionError("--no-verdict scored the validation split")

    monkeypatch.setattr(verdict, "train_verdict", judged)
    data = tmp_path / "hidden.jsonl"
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(40), num_factors=NUM_FACTORS, kind="clean", seed=0)
    data.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.response}) + "\n" for p in pairs))
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--no-chat-template", "--no-progress", "--output-dir", str(run)]
    argv += ["--codebook-size", str(NUM_FACTORS), "--code-dim", "16", "--encoder-hidden", "64", "--batch-size", "8"]
    argv += ["--max-steps", "2", "--validation-fraction", "0.25", "--device", "cpu", "--no-verdict"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"verdict: not judged (--no-verdict; 'disentangle eval {run}' judges the run)"
    assert not any(line.startswith("on the validation split") for line in printed)
    assert (run / "checkpoints" / "step-000002" / "model.safetensors").is_file()  # the run itself is whole


# --------------------------------------------------------------------------- the explorer page


def page_with_verdict():
    from disentanglement.explorer import label_distribution
    from test_explorer import _page

    page = _page(label="a")
    report = discrete(factors={"label": factor(1.0, 0.43)})
    result = judge(report)
    page["verdict"] = {"verdict": result["verdict"], "reason": result["reason"], "lines": verdict_lines(report, result)}
    page["labels"] = label_distribution(["a", "b", "b", "a"])  # base rates 0.5 / 0.5
    return page, report


def test_explorer_shows_the_verdict_at_its_top_and_base_rates_beside_shares():
    from disentanglement.explorer import render_explorer_html
    from helpers import check_html

    page, report = page_with_verdict()
    text = render_explorer_html(page)
    check_html(text)
    top = text.split("<h1>")[1]
    assert top.index('id="verdict"') < top.index('class="meta"') < top.index('class="overview"')
    block = top.split('id="verdict"')[1].split("</div>")[0]
    assert 'data-verdict="beats every baseline"' in text and "<b>verdict: beats every baseline</b>" in block
    for line in verdict_lines(report)[:-1]:
        assert f"<li>{line}</li>" in block.replace("&#x27;", "'")
    # the overview's most common label with the share it would have by chance
    assert "label=a 1.00 (base rate 0.50)" in text
    assert '<td class="base-rate">0.500</td>' in text and "<th>base rate (all data)</th>" in text
    # a page without them (as built before) still renders, without the block or the rates
    bare = render_explorer_html({k: v for k, v in page.items() if k not in ("verdict", "labels")})
    assert 'id="verdict"' not in bare and "base rate" not in bare and "label=a 1.00" in bare


def test_explorer_of_a_trained_run_has_eval_s_verdict(discrete_run, tmp_path):
    from disentanglement.explorer import run_explore

    path = run_explore(
        discrete_run.checkpoint,
        output=tmp_path / "page.html",
        examples_per_group=1,
        num_prompts=0,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    text = path.read_text()
    report, result = fixture_verdict(discrete_run)  # the validation split, as the page's default data
    assert result["verdict"] == BEATS and f'data-verdict="{BEATS}"' in text
    assert f"<li>{verdict_lines(report, result)[0]}</li>" in text
    # every group's labels beside the split's base rates (4 hidden factors, about a quarter each)
    rates = [float(c.split("<")[0]) for c in text.split('<td class="base-rate">')[1:]]
    assert rates and all(0.1 < r < 0.4 for r in rates)
    assert "(base rate 0." in text.split('class="overview"')[1]


def test_nothing_to_judge_without_a_validation_split():
    from types import SimpleNamespace

    from disentanglement.verdict import train_verdict

    empty = SimpleNamespace(data=SimpleNamespace(train=[1], validation=[]), pad_token_id=0, cache=None, model=None)
    assert train_verdict(empty, config=None) is None
    assert train_verdict(SimpleNamespace(output_dir="x"), config=None) is None  # a stand-in result
