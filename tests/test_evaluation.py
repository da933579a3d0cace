"""``disentangle eval``: the mixture and bound arithmetic by hand, then the report of checkpoints trained
on the synthetic hidden-factor data (``conftest.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import NUM_FACTORS, hidden_factor_prompts, model_and_tokenizer
from disentanglement import cli
from disentanglement.commands import eval_summary_lines, run_eval
from disentanglement.config import Scoring, build_config
from disentanglement.data import DataError, collate, tokenize_pairs
from disentanglement.evaluation import evaluate, label_recovery, mixture_token_nll, posterior_latents, score_batch
from disentanglement.features import build_feature_cache
from disentanglement.metrics import agreement_scores, kmeans_assignments, label_agreement, random_assignment_agreement
from disentanglement.models import build_cvae
from disentanglement.runs import load_examples, resolve_run
from disentanglement.testing import make_hidden_factor_pairs
from references import ALL_TERMS as SIX_TERMS

REQUIRED_KEYS = (
    "zfree_gain_nats_per_token",
    "token_weighted_zfree_gain_nats_per_token",
    "latent_gain_nats_per_token",
    "token_weighted_latent_gain_nats_per_token",
    "reconstruction_terms",
    "kl",
    "mutual_information",
    "iw_nll",
)
LABEL_KEYS = ("label_nmi", "label_ari", "label_homogeneity", "label_completeness")
FOUR = ("nmi", "ari", "homogeneity", "completeness")


def finite_numbers(obj):
    """Every number inside a JSON-able object."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, int | float):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from finite_numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from finite_numbers(v)


# --------------------------------------------------------------------------- arithmetic, no model


def test_mixture_token_nll_by_hand():
    # Two latents, weights 0.25 / 0.75, two response tokens (position 0 is a prompt position).
    p = torch.tensor(
        [[[0.0, 0.5, 0.2]], [[0.0, 0.1, 0.6]]], dtype=torch.float64
    )  # p(y_t | z_s) at supervised positions
    nll = torch.where(p > 0, -p.clamp_min(1e-30).log(), torch.zeros_like(p))  # [S=2, B=1, N=3]
    log_w = torch.tensor([[0.25], [0.75]], dtype=torch.float64).log()
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    out = mixture_token_nll(nll, log_w, mask)
    first = 0.25 * 0.5 + 0.75 * 0.1  # p_mix(y_1)
    both = 0.25 * 0.5 * 0.2 + 0.75 * 0.1 * 0.6  # p_mix(y_1, y_2)
    assert out[0, 0] == 0
    assert out[0, 1].item() == pytest.approx(-math.log(first), rel=1e-12)
    assert out[0, 2].item() == pytest.approx(-math.log(both / first), rel=1e-12)
    # the tokens sum to the sequence NLL of the mixture
    assert out.sum().item() == pytest.approx(-math.log(both), rel=1e-12)


def test_mixture_of_one_latent_is_that_latent():
    nll = torch.rand(1, 3, 5, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.float64)
    nll = nll * mask
    out = mixture_token_nll(nll, torch.zeros(1, 3, dtype=torch.float64), mask)
    torch.testing.assert_close(out, nll[0])


def test_mixture_of_identical_latents_is_that_latent():
    nll = torch.rand(1, 2, 4, dtype=torch.float64).expand(3, -1, -1)
    mask = torch.ones(2, 4, dtype=torch.float64)
    out = mixture_token_nll(nll, torch.full((3, 2), -math.log(3), dtype=torch.float64), mask)
    torch.testing.assert_close(out, nll[0])


# --------------------------------------------------------------------------- trained checkpoints


@pytest.fixture(scope="module")
def discrete_report(discrete_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "report.json"
    report, json_path, md_path = run_eval(
        discrete_run.checkpoint, output=out, progress=False, model_and_tokenizer=model_and_tokenizer()
    )
    return report, json_path, md_path


def test_discrete_report_keys_finite_and_written(discrete_report):
    report, json_path, md_path = discrete_report
    for key in (*REQUIRED_KEYS, *LABEL_KEYS, "code_perplexity", "code_usage", "dead_codes", "label_contingency"):
        assert key in report, key
    assert "active_units" not in report
    assert set(report["reconstruction_terms"]) == set(SIX_TERMS)
    numbers = list(finite_numbers(report))
    assert numbers and all(math.isfinite(v) for v in numbers)
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(report))
    summary = md_path.read_text()
    assert md_path.suffix == ".md" and summary.startswith("# Evaluation of")
    assert "latent_gain_nats_per_token" in summary and "code \\ label" in summary
    for key in ("zfree_gain", "latent_gain", "prior_zfree_gain", "zfree_nll"):
        nats = report[f"{key}_nats_per_token"]
        assert report[f"{key}_bits_per_token"] == pytest.approx(nats / math.log(2))


def test_discrete_latent_is_used_and_recovers_the_factor(discrete_report):
    report, _, _ = discrete_report
    assert report["label_nmi"] >= 0.9
    assert report["latent_gain_nats_per_token"] > 0
    assert report["token_weighted_latent_gain_nats_per_token"] > 0
    # a tuned prompt alone beats z-free too: the z-free gain under prior latents is large as well
    assert report["zfree_gain_nats_per_token"] > report["prior_zfree_gain_nats_per_token"] > 0
    assert report["prior_mixture"] == {"method": "exact", "latents": NUM_FACTORS}
    counts = report["label_contingency"]["counts"]
    assert sum(map(sum, counts)) == report["examples"]
    assert report["code_perplexity"][0] > NUM_FACTORS - 0.5
    assert report["dead_codes"] == [[]]
    # nearest assignment: one-hot posterior, so MI = entropy of the code histogram, log(code perplexity)
    assert report["mutual_information"] == pytest.approx(math.log(report["code_perplexity"][0]))


def test_string_labels_are_one_factor_beside_its_baselines(discrete_report):
    report, _, md_path = discrete_report
    assert set(report["factors"]) == {"label"} and report["factor_random_permutations"] == 20
    entry = report["factors"]["label"]
    assert entry["latent"] == {key: report[f"label_{key}"] for key in FOUR}
    assert entry["contingency"] == report["label_contingency"]
    assert entry["values"] == NUM_FACTORS and entry["clusters"] == len(report["label_contingency"]["rows"])
    for baseline in ("encoder_kmeans", "prior_kmeans", "random"):
        assert set(entry[baseline]) == set(FOUR)
    assert entry["random"]["nmi"] < 0.2 and entry["latent_beats_baselines"] is True
    assert "factor label: NMI " in "\n".join(eval_summary_lines(report))
    summary = md_path.read_text()
    assert "### factor label" in summary and "| encoder k-means |" in summary


def write_two_factor_data(path, seed: int = 0):
    """The fixtures' pairs with object labels: ``factor`` (the hidden factor) and ``noise`` (a seeded coin
    of three values that nothing in the text says)."""
    rng = random.Random(seed)
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(), num_factors=NUM_FACTORS, kind="clean", seed=0)
    lines = [
        json.dumps(
            {"prompt": p.prompt, "response": p.response, "label": {"factor": p.label, "noise": rng.choice("xyz")}}
        )
        for p in pairs
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_factor_report_through_run_eval(discrete_run, tmp_path):
    data = write_two_factor_data(tmp_path / "two_factors.jsonl")
    report, _, md_path = run_eval(
        discrete_run.checkpoint,
        data=str(data),
        output=tmp_path / "two.json",
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    # object labels: the factors, and none of the top-level keys of a plain string label
    assert list(report["factors"]) == ["factor", "noise"]
    assert not any(key in report for key in (*LABEL_KEYS, "label_contingency"))
    for name, values in (("factor", NUM_FACTORS), ("noise", 3)):
        entry = report["factors"][name]
        assert set(entry) >= {"values", "clusters", "latent", "encoder_kmeans", "prior_kmeans", "random"}
        assert entry["values"] == values and isinstance(entry["latent_beats_baselines"], bool)
        for key in ("latent", "encoder_kmeans", "prior_kmeans", "random"):
            assert set(entry[key]) == set(FOUR) and all(math.isfinite(v) for v in entry[key].values())
    # the latent's NMI of the true factor is label_agreement of its assignments, computed here independently
    model, tok, config, _ = discrete_run.load()
    examples, _ = load_examples(str(data), config, tok)
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    codes = posterior_latents(model, examples, cache, tok.pad_token_id)["codes"]
    assert codes.shape == (200, 1)
    factor = [e.label["factor"] for e in examples]
    noise = [e.label["noise"] for e in examples]
    entry = report["factors"]["factor"]
    assert entry["latent"]["nmi"] == label_agreement(codes[:, 0], factor)["nmi"]
    assert entry["latent"] == agreement_scores(codes[:, 0], factor)
    assert entry["latent"]["nmi"] >= 0.9 and entry["latent_beats_baselines"] is True
    assert label_recovery(model, examples, cache, tok.pad_token_id, factor="factor")["nmi"] == entry["latent"]["nmi"]
    with pytest.raises(ValueError, match="several factors"):
        label_recovery(model, examples, cache, tok.pad_token_id)
    # the baselines, independently: k-means of the frozen features with the latent's cluster count, permutations
    clusters = len(set(codes[:, 0].tolist()))
    assert entry["clusters"] == clusters
    for name, features in (("encoder_kmeans", cache.encoder_features), ("prior_kmeans", cache.prior_features)):
        assert entry[name] == pytest.approx(agreement_scores(kmeans_assignments(features, clusters, seed=0), factor))
    assert entry["random"] == pytest.approx(random_assignment_agreement(codes[:, 0], factor, permutations=20, seed=0))
    # the noise factor: nothing beats chance by much
    assert report["factors"]["noise"]["latent"] == agreement_scores(codes[:, 0], noise)
    assert report["factors"]["noise"]["latent"]["nmi"] < 0.1
    lines = eval_summary_lines(report)
    for name in ("factor", "noise"):
        e = report["factors"][name]
        assert (
            f"factor {name}: NMI {e['latent']['nmi']:.2f} (encoder k-means {e['encoder_kmeans']['nmi']:.2f}, "
            f"prior k-means {e['prior_kmeans']['nmi']:.2f}, random {e['random']['nmi']:.2f}, the decoder's "
            f"posterior {report['decoder_posterior']['factors'][name]['decoder']:.2f})"
        ) in lines
    summary = md_path.read_text()
    assert "### factor factor" in summary and "### factor noise" in summary
    assert summary.count("| assignment | NMI | ARI | homogeneity | completeness |") == 2


def test_the_summary_warns_when_the_latent_makes_the_decoder_worse_than_no_latent(discrete_report):
    import copy

    report = copy.deepcopy(discrete_report[0])
    if report["zfree_gain_nats_per_token"] >= 0:  # the fixture's latent helps: no warning
        assert not [line for line in eval_summary_lines(report) if line.startswith("warning:")]
    report["zfree_gain_nats_per_token"] = -1.4835
    report["posterior_nll_nats_per_token"], report["zfree_nll_nats_per_token"] = 2.5704, 1.0869
    (warning,) = [line for line in eval_summary_lines(report) if line.startswith("warning:")]
    assert "worse than the z-free model (2.5704 against 1.0869 nats/token)" in warning
    assert "reconstruction_weight > 0" in warning
    report["zfree_gain_nats_per_token"] = 0.0  # equal: no warning
    assert not [line for line in eval_summary_lines(report) if line.startswith("warning:")]


def test_discrete_bounds_are_consistent(discrete_report):
    report, _, _ = discrete_report
    iw = report["iw_nll"]
    # one-hot posterior: the IW bound is exact and equals the negative ELBO
    assert iw["exact"] is True and iw["samples"] == 1
    assert iw["nats_per_example"] == pytest.approx(-report["elbo"])
    assert iw["perplexity"] == pytest.approx(math.exp(iw["nats_per_token"]))
    # -log p(y|x) <= -log p(y|x,k*) - log p(k*|x): the bound is above the exact prior-mixture NLL
    assert iw["nats_per_token"] >= report["prior_nll_nats_per_token"] - 1e-9
    assert report["kl"]["total"] == pytest.approx(sum(report["kl"]["per_slot"]))
    # -log sum_k p(k|x) p(y|x,k) <= -log p(k*|x) - log p(y|x,k*): the latent gain of an example is at most its KL
    assert 0 < report["latent_gain_nats_per_example"] <= report["kl"]["total"] + 1e-9
    # the reconstruction term is the posterior NLL averaged per example
    terms = report["reconstruction_terms"]
    assert terms["zfree_relative_reconstruction_loss"] == pytest.approx(
        terms["reconstruction_loss"] / report["zfree_reference_scale"]
    )


def test_eval_is_deterministic_given_the_seed(discrete_run, tmp_path):
    kwargs = dict(data=str(discrete_run.data_path), max_examples=24, exact_limit=1, prior_samples=4, progress=False)
    first, _, _ = run_eval(
        discrete_run.checkpoint, output=tmp_path / "a.json", model_and_tokenizer=model_and_tokenizer(), **kwargs
    )
    second, _, _ = run_eval(
        discrete_run.checkpoint, output=tmp_path / "b.json", model_and_tokenizer=model_and_tokenizer(), **kwargs
    )
    assert first == second
    # exact_limit=1 forces prior samples instead of the exact mixture
    assert first["prior_mixture"] == {"method": "samples", "latents": 4}
    assert first["examples"] == 24
    assert first["latent_gain_nats_per_token"] > 0


def test_continuous_report(continuous_run, tmp_path):
    report, _, _ = run_eval(
        continuous_run.checkpoint,
        output=tmp_path / "c.json",
        iw_samples=3,
        prior_samples=4,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    for key in (*REQUIRED_KEYS, *LABEL_KEYS, "active_units", "posterior_mean_variance"):
        assert key in report, key
    assert "code_perplexity" not in report
    assert all(math.isfinite(v) for v in finite_numbers(report))
    assert report["label_assignment"] == "k-means of posterior means"
    label = report["factors"]["label"]  # a string label is the single factor "label", computed the same way
    assert label["latent"] == {key: report[f"label_{key}"] for key in FOUR}
    assert label["clusters"] == label["values"] == NUM_FACTORS
    assert report["iw_nll"]["exact"] is False and report["iw_nll"]["samples"] == 3
    assert report["prior_mixture"] == {"method": "samples", "latents": 4}
    D = continuous_run.config.latent.latent_dim
    assert len(report["kl"]["per_dimension"]) == D
    assert 0 <= report["active_units"] <= D
    assert report["active_units"] == sum(v > 0.01 for v in report["posterior_mean_variance"])
    assert 0 <= report["mutual_information"] <= math.log(report["examples"]) + 1e-9


def test_resolve_run_accepts_run_and_checkpoint_dirs(discrete_run, tmp_path):
    assert resolve_run(discrete_run.run_dir) == (discrete_run.checkpoint, discrete_run.run_dir)
    assert resolve_run(discrete_run.checkpoint) == (discrete_run.checkpoint, discrete_run.run_dir)
    with pytest.raises(FileNotFoundError):
        resolve_run(tmp_path)


def test_load_examples_splits_and_files(discrete_run):
    _, tok, config, _ = discrete_run.load()
    val, description = load_examples(None, config, tok)
    train, _ = load_examples("train", config, tok)
    assert "validation" in description and len(val) == 40 and len(train) == 160
    everything, _ = load_examples(str(discrete_run.data_path), config, tok)
    assert len(everything) == 200
    subset, _ = load_examples(str(discrete_run.data_path), config, tok, max_examples=7)
    assert len(subset) == 7
    with pytest.raises(FileNotFoundError):
        load_examples("missing.jsonl", config, tok)


def test_cli_eval(discrete_run, tmp_path, injected_loader, capsys):
    out = tmp_path / "cli" / "eval.json"
    argv = ["eval", str(discrete_run.run_dir), "--output", str(out), "--no-progress", "--max-examples", "16"]
    assert cli.main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "latent gain" in printed and str(out) in printed
    report = json.loads(out.read_text())
    assert report["examples"] == 16 and out.with_suffix(".md").is_file()


def test_cli_eval_reports_errors(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


# --------------------------------------------------------------------------- untrained models, other options


def untrained(**overrides):
    """An untrained tiny CVAE, labelled examples and their frozen-pass cache (no training: fast)."""
    values = dict(preset="raw", chat_template=False, latent_tokens=2, code_dim=8, latent_dim=3, encoder_hidden=16)
    values.update(overrides)
    config = build_config(values)
    decoder, tok = model_and_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, decoder).eval()
    model.zfree_reference_scale = 2.0
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(12), num_factors=3, kind="clean", seed=1)
    examples, _ = tokenize_pairs(pairs, tok, config.data)
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    return model, tok, examples, cache


def test_exact_prior_mixture_over_several_slots_by_brute_force():
    model, tok, examples, cache = untrained(num_slots=2, codebook_size=3)
    batch = collate(examples[:4], tok.pad_token_id, indices=range(4))
    features = cache.features(batch)
    scores = score_batch(model, batch, features, Scoring(iw_samples=1))
    assert scores.mixture.method == "exact" and scores.mixture.size == 9
    log_p = model.prior_log_probs(features)  # [B, M, K]
    terms = []
    for a in range(3):
        for b in range(3):
            codes = torch.tensor([[a, b]] * 4)
            nll, _ = model.conditioned_token_nll(batch, model.codes_to_vector(codes))
            terms.append(log_p[:, 0, a] + log_p[:, 1, b] - nll.double().sum(-1))
    expected = -torch.logsumexp(torch.stack(terms), 0)
    torch.testing.assert_close(scores.prior_nll.double().sum(-1), expected.double(), rtol=1e-5, atol=1e-5)
    # the exact IW bound of the nearest assignment: -log p(y | x, k*) - log p(k* | x) >= -log p(y | x)
    iw = -scores.iw_log_weights[0]
    assert (iw >= expected - 1e-5).all()


@pytest.mark.parametrize("overrides", [{"assignment": "gumbel"}, {"latent": "continuous", "prior": "fixed"}])
def test_sampled_importance_bound_and_report(overrides):
    model, tok, examples, cache = untrained(**overrides)
    report = evaluate(
        model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=4, prior_samples=3), progress=False
    )
    assert report["iw_nll"]["exact"] is False and report["iw_nll"]["samples"] == 4
    assert all(math.isfinite(v) for v in finite_numbers(report))
    for key in (*REQUIRED_KEYS, *LABEL_KEYS):
        assert key in report
    again = evaluate(
        model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=4, prior_samples=3), progress=False
    )
    assert again == report
    other_seed = evaluate(
        model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=4, prior_samples=3), seed=1, progress=False
    )
    assert other_seed["iw_nll"] != report["iw_nll"]


def test_factors_of_an_untrained_multi_slot_model():
    model, tok, examples, cache = untrained(num_slots=2, codebook_size=3)
    topics = ("billing", "login")
    examples = [
        dataclasses.replace(e, label={"style": e.label, "topic": topics[i % 2]}) for i, e in enumerate(examples)
    ]
    report = evaluate(model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=1), progress=False)
    assert list(report["factors"]) == ["style", "topic"] and "label_nmi" not in report
    codes = posterior_latents(model, examples, cache, tok.pad_token_id)["codes"]  # [E, 2]
    tuples = np.unique(codes, axis=0, return_inverse=True)[1].reshape(-1)
    for name in ("style", "topic"):
        values = [e.label[name] for e in examples]
        entry = report["factors"][name]
        assert entry["latent"] == agreement_scores(tuples, values)  # the code tuple
        assert entry["latent_per_slot"] == [agreement_scores(codes[:, m], values) for m in range(2)]
        clusters = len(np.unique(tuples))
        assert entry["clusters"] == clusters
        expected = agreement_scores(kmeans_assignments(cache.encoder_features, clusters, seed=0), values)
        assert entry["encoder_kmeans"] == pytest.approx(expected)
    # factor names that differ between examples are refused, naming the example
    examples[3] = dataclasses.replace(examples[3], label={"style": "0"})
    with pytest.raises(DataError, match=f"{examples[3].source}: label factors"):
        evaluate(model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=1), progress=False)
    # an unlabelled example: no factors at all, as with string labels
    examples[3] = dataclasses.replace(examples[3], label=None)
    assert "factors" not in evaluate(
        model, examples, cache, tok.pad_token_id, scoring=Scoring(iw_samples=1), progress=False
    )


def test_eval_says_how_many_examples_the_run_trained_on(discrete_run, tmp_path, monkeypatch):
    """eval says how many of its examples the run trained on, from one preparation of the run's data: for ``--data
    validation`` the split it scores and the run's training pairs both come from it; a file needs one too (for the
    training pairs), and ``train`` one."""
    from disentanglement import splits
    from disentanglement.commands import eval_summary_lines

    prepared = []
    real = splits.prepare_data
    monkeypatch.setattr(splits, "prepare_data", lambda *a, **k: prepared.append(1) or real(*a, **k))

    def evaluate(data):
        prepared.clear()
        report, _, _ = run_eval(
            discrete_run.checkpoint,
            data=data,
            output=tmp_path / f"{Path(data).stem}.json",
            exact_limit=1,
            prior_samples=2,
            progress=False,
            model_and_tokenizer=model_and_tokenizer(),
        )
        assert len(prepared) == 1, data
        return report

    whole, validation, train = evaluate(str(discrete_run.data_path)), evaluate("validation"), evaluate("train")
    # the run's data file is its training split and its validation split, which holds no training pair
    assert validation["seen_in_training"]["pairs"] == 0
    assert whole["seen_in_training"]["pairs"] == whole["examples"] - validation["examples"] == train["examples"]
    assert whole["seen_in_training"]["prompts"] >= whole["seen_in_training"]["pairs"]
    assert "seen_in_training" not in train  # all of it, by definition
    warning = f"warning: {train['examples']} of the {whole['examples']} examples are pairs the run trained on"
    assert any(line.startswith(warning) for line in eval_summary_lines(whole))
    assert not any(line.startswith("warning:") for line in eval_summary_lines(validation))
    assert json.loads((tmp_path / "validation.json").read_text())["seen_in_training"] == {
        "pairs": 0,
        "prompts": validation["seen_in_training"]["prompts"],
    }
