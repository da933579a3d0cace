"""``benchmarks/cvae-adds/`` (docs/what-the-cvae-adds.md's runs): every recipe is a valid training config, the
table reads eval reports with and without a text detector, marker_share.py splits a response's tokens,
first_tokens.py computes each code's first-token distribution as training lays the sequence out, and
what_codes_hold.py counts each code's label values."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from disentanglement.cli import _train_config, build_parser

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmarks" / "cvae-adds"
THESIS_BASE = ROOT / "benchmarks" / "thesis" / "base.yaml"  # the synthetic sets' base config in run.py
#: the trainable encoder of section 26: the attention pool over one transformer layer on the per-token states
TBLOCK = {"encoder_view": "token_weighted_attention", "encoder_block": "transformer"}


def train_config(config: Path, *flags: str):
    """The training config ``disentangle train --config CONFIG FLAGS...`` builds (every field validated)."""
    return _train_config(build_parser().parse_args(["train", "--config", str(config), *flags]))


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"cvae_adds_{name}", BENCHMARK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "tokens, parts",
    [
        (["What", " time", " is", " it", "?", "<|im_end|>", "\n"], "FRRRQEE"),
        (["OK", ".", " Is", " it", " far", "?", "?", "<|im_end|>"], "FRRRRQQE"),
        (["?", " Yes", "<|im_end|>"], "QRE"),  # a question mark first: the first word is taken
        (["\n", "Sure", " thing", "<|im_end|>"], "EFRE"),  # whitespace alone is no word
    ],
)
def test_act_weights_splits_first_word_question_marks_end_and_rest(tokens, parts):
    act_weights = load("act_weights")
    names = {"F": "first word", "Q": "question mark", "E": "end", "R": "rest"}
    assert act_weights.token_parts(tokens, {"<|im_end|>"}) == [names[p] for p in parts]


@pytest.fixture(scope="module")
def run():
    return load("run")


@pytest.fixture(scope="module")
def table():
    return load("table")


@pytest.fixture(scope="module")
def marker_share():
    return load("marker_share")


def test_configs_steer_yaml_trains_the_recipe_of_section_20(run):
    """configs/steer.yaml is exactly what run.py trained as ``centered-full-between-random-dpost-hard-late`` on
    the thesis base (docs/what-the-cvae-adds.md, section 20), every field, the data and output aside."""
    own = ["--data", "mine.jsonl", "--output-dir", "runs/x", "--dtype", "float32", "--seed", "1"]
    steer = train_config(ROOT / "configs" / "steer.yaml", *own)
    measured = train_config(THESIS_BASE, *run.RECIPES["centered-full-between-random-dpost-hard-late"], *own)
    assert steer.to_dict() == measured.to_dict()
    latent = steer.latent
    assert (latent.latent_placement, latent.codebook_init, latent.decoder_posterior_start) == ("between", "random", 180)
    assert steer.model.decoder_training == "full" and steer.train.max_steps == 240


def test_every_planned_recipe_is_a_valid_training_config(run):
    assert {recipe for _, recipe, _ in run.PLAN} <= set(run.RECIPES)
    configs = {"dailydialog": BENCHMARK / "dailydialog.yaml"}
    built = {}
    for name, recipe, _ in run.PLAN:  # each with the config its set trains with; building checks every field
        built[recipe] = train_config(configs.get(name, THESIS_BASE), *run.RECIPES[recipe])
    for recipe in ("centered", "centered-attention", "centered-norefresh", "centered-lora", "centered-lora-vk"):
        assert built[recipe].latent.centered_straight_through, recipe
    assert built["centered-attention"].latent.encoder_view == "token_weighted_attention"
    assert built["centered-norefresh"].latent.codebook_refresh_every == 0
    assert built["centered-lora-vk"].latent.codebook_init == "view_kmeans"
    assert built["centered-lora-vk"].model.decoder_training == "lora"
    dynamic = built["centered-lora-dynamic"]
    assert dynamic.model.decoder_training == "lora" and dynamic.train.max_steps == 240
    assert dynamic.reconstruction.token_weight_source == "dynamic"
    control = built["centered-lora-240"]  # the dynamic probe's control: the same but the weights' source
    assert control.train.max_steps == 240 and control.reconstruction.token_weight_source == "surprisal"
    assert control.model.decoder_training == "lora" and control.latent.centered_straight_through
    # the tables' "default" rows stay the frozen recipe over the bases (which pin it), and centered-lora-240 is the
    # default recipe since section 34 but for the centring's spelling (true, where the default's null centres too)
    from disentanglement.config import build_config
    from helpers import recipe as recipe_of

    frozen = dict(recipe_of(build_config({"preset": "frozen"})), max_steps=built["default"].train.max_steps)
    assert recipe_of(built["default"]) == frozen  # the steps are its base's: 120 (thesis), 200 (DailyDialog)
    assert recipe_of(control) == dict(recipe_of(build_config({})), centered_straight_through=True)
    for recipe in ("centered-full", "centered-full-400", "centered-full-dynamic"):
        full = built[recipe]  # section 12: the whole decoder at 5e-5, the centred gradient
        assert full.model.decoder_training == "full" and full.train.decoder_lr == 5e-5, recipe
        assert full.latent.centered_straight_through, recipe
    assert built["centered-full"].train.max_steps == 240 and built["centered-full-400"].train.max_steps == 400
    assert built["centered-full-dynamic"].reconstruction.token_weight_source == "dynamic"
    for recipe in ("centered-full-between", "centered-full-between-random", "centered-full-between-random-attention"):
        between = built[recipe]  # sections 14-16: the whole decoder, the code between prompt and response
        assert between.model.decoder_training == "full" and between.latent.centered_straight_through, recipe
        assert between.latent.latent_placement == "between" and between.train.max_steps == 240, recipe
    assert built["centered-full-between"].latent.codebook_init != "random"
    assert built["centered-full-between-random"].latent.codebook_init == "random"
    attention = built["centered-full-between-random-attention"]  # section 16: that, with the attention pool
    assert attention.latent.codebook_init == "random" and attention.latent.encoder_view == "token_weighted_attention"
    assert built["centered-full-between-random"].latent.encoder_view == "token_weighted"
    longer = built["centered-full-between-random-400"]  # section 17: the same, 400 steps
    assert longer.train.max_steps == 400 and longer.latent.latent_placement == "between"
    assert longer.latent.codebook_init == "random" and longer.model.decoder_training == "full"
    assert longer.latent.centered_straight_through and longer.latent.encoder_view == "token_weighted"
    raw = built["raw-full-between-random"]  # section 17: raw reconstruction with the same decoder and placement
    assert (raw.reconstruction.reconstruction_weight, raw.reconstruction.token_weighted_weight) == (1.0, 0.0)
    assert raw.latent.encoder_view == "mean_last" and not raw.latent.centered_straight_through
    assert raw.model.decoder_training == "full" and raw.train.decoder_lr == 5e-5 and raw.train.max_steps == 240
    assert raw.latent.latent_placement == "between" and raw.latent.codebook_init == "random"
    for recipe, target, weight, start in (
        ("centered-full-between-random-dpost", "soft", 1.0, 120),
        ("centered-full-between-random-dpost-hard", "hard", 1.0, 120),
        ("centered-full-between-random-dpost-hard-w3", "hard", 3.0, 120),  # section 19
        ("centered-full-between-random-dpost-hard-late", "hard", 1.0, 180),
    ):
        dpost = built[recipe]  # section 18: section 16's recipe, the decoder's posterior teaching the encoder
        assert (dpost.latent.decoder_posterior_weight, dpost.latent.decoder_posterior_start) == (weight, start), recipe
        assert dpost.latent.decoder_posterior_target == target and dpost.latent.latent_placement == "between"
        assert dpost.latent.codebook_init == "random" and dpost.model.decoder_training == "full"
    k4, k5 = (  # section 21: the same with five codes, nothing else
        train_config(THESIS_BASE, *run.RECIPES[recipe])
        for recipe in (
            "centered-full-between-random-dpost-hard-late",
            "centered-full-between-random-dpost-hard-late-k5",
        )
    )
    assert (k4.latent.codebook_size, k5.latent.codebook_size) == (4, 5)
    assert k5 == replace(k4, latent=replace(k4.latent, codebook_size=5))
    bow, wd = (  # section 23: the same with a remedy for an unused latent each, nothing else
        train_config(THESIS_BASE, *run.RECIPES[f"centered-full-between-random-dpost-hard-late-{name}"])
        for name in ("bow", "wd")
    )
    assert bow == replace(k4, latent=replace(k4.latent, bow_weight=1.0))
    assert wd == replace(k4, latent=replace(k4.latent, word_dropout=0.3))
    for name, change in (  # sections 24-25: the bag-of-words recipe with one change each
        ("bow-k16", {"codebook_size": 16}),
        ("bow3", {"bow_weight": 3.0}),
        ("bow-wd", {"word_dropout": 0.3}),
        ("bow-wd5", {"word_dropout": 0.5}),
        ("bow-wd-dpost3", {"word_dropout": 0.3, "decoder_posterior_weight": 3.0}),
        ("bow-wd-early", {"word_dropout": 0.3, "decoder_posterior_start": 120}),  # section 26
        ("bow-wd-tblock", {"word_dropout": 0.3, **TBLOCK}),
        ("bow-wd-tblock-early", {"word_dropout": 0.3, **TBLOCK, "decoder_posterior_start": 120}),
    ):
        variant = train_config(THESIS_BASE, *run.RECIPES[f"centered-full-between-random-dpost-hard-late-{name}"])
        assert variant == replace(bow, latent=replace(bow.latent, **change)), name
    for steps, start in (
        (480, 420),
        (960, 900),
    ):  # sections 26-27: longer, the teaching term over the last 60 as before
        longer = train_config(THESIS_BASE, *run.RECIPES[f"centered-full-between-random-dpost-hard-late-bow-wd-{steps}"])
        assert longer == replace(
            bow,
            latent=replace(bow.latent, word_dropout=0.3, decoder_posterior_start=start),
            train=replace(bow.train, max_steps=steps),
        ), steps


def report(tmp_path: Path, controllability: dict | None) -> Path:
    checkpoint = tmp_path / "runs" / "set-recipe" / "seed-0" / "checkpoints" / "step-000120"
    body = {
        "checkpoint": str(checkpoint),
        "step": 120,
        "factors": {
            "act": {n: {"nmi": v} for n, v in (("latent", 0.1), ("encoder_kmeans", 0.04), ("prior_kmeans", 0.02))}
        },
        "posterior_nll_nats_per_token": 2.5,
        "zfree_nll_nats_per_token": 3.0,
        "latent_gain_nats_per_token": 0.012,
        "controllability": controllability,
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(body))
    return path


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_table_reads_the_text_detector_or_else_the_classifier(table, tmp_path):
    fluency = {"zfree_nll_per_token": 1.8, "real_zfree_nll_per_token": 2.0}
    detected = {
        "factors": {"style": {"accuracy": 0.96875, "chance": 0.25, "none_share": 0.0, "generations_scored": 32}}
    }
    row = cells(table.row(report(tmp_path, {"factor_accuracy": detected, "labels": {}, **fluency})))
    assert row[0] == "set-recipe/seed-0 @120"
    assert row[1] == "act 0.100 (view 0.040, prior 0.020)"
    assert row[2:4] == ["2.500 / 3.000", "+0.0120"]
    assert row[4] == "style 0.969 (chance 0.25, none 0.00, n 32)"
    assert row[5] == "0.90"
    path = report(tmp_path, {"factor_accuracy": detected, "labels": {}, **fluency})
    body = json.loads(path.read_text())
    body["decoder_posterior"] = {"agreement": 0.9, "factors": {"act": {"encoder": 0.1, "decoder": 0.25}}}
    path.write_text(json.dumps(body))
    assert cells(table.row(path))[1] == "act 0.100 (view 0.040, prior 0.020, decoder 0.250)"
    assert cells(table.row(path))[3] == "+0.0120"  # a report written before eval measured the decoder's gain
    body["decoder_posterior"].update(latent_gain_nats_per_token=0.0461, best_latent_gain_nats_per_token=0.0502)
    path.write_text(json.dumps(body))
    assert cells(table.row(path))[3] == "+0.0120 (decoder's codes +0.0461, best +0.0502)"
    decoders = {**detected["factors"]["style"], "accuracy": 1.0, "majority_share": 0.5, "generations_scored": 24}
    by_decoder = {**detected, "decoder_codes": {"style": decoders}}
    row = cells(table.row(report(tmp_path, {"factor_accuracy": by_decoder, "labels": {}, **fluency})))
    assert row[4] == "style 0.969 (chance 0.25, none 0.00, n 32; by the decoder's codes 1.000, majority 0.50, n 24)"
    unscored = {**detected, "decoder_codes": {"style": {**decoders, "accuracy": None}}}
    row = cells(table.row(report(tmp_path, {"factor_accuracy": unscored, "labels": {}, **fluency})))
    assert row[4] == "style 0.969 (chance 0.25, none 0.00, n 32)"
    use = {"factors": {"style": {**detected["factors"]["style"], "weighted_accuracy": 0.99}}}
    use["decoder_codes"] = {"style": {**decoders, "weighted_accuracy": 0.875}}
    row = cells(table.row(report(tmp_path, {"factor_accuracy": use, "labels": {}, **fluency})))
    assert row[4] == (
        "style 0.969 weighted 0.990 (chance 0.25, none 0.00, n 32; by the decoder's codes 1.000 weighted 0.875, "
        "majority 0.50, n 24)"
    )
    spread = {"factors": {"style": {**detected["factors"]["style"], "accuracy_interval_by_prompt": [0.875, 1.0]}}}
    row = cells(table.row(report(tmp_path, {"factor_accuracy": spread, "labels": {}, **fluency})))
    assert row[4] == "style 0.969 [0.88, 1.00] (chance 0.25, none 0.00, n 32)"
    labels = {
        "act": {
            "accuracy": 0.5,
            "chance": 0.25,
            "majority_share": 0.625,
            "real_accuracy": 0.6,
            "generations_scored": 64,
        },
        "emotion": {"accuracy": 0.25, "chance": 0.14, "real_accuracy": None, "generations_scored": 64},
    }
    row = cells(table.row(report(tmp_path, {"labels": labels, **fluency})))  # no detector: no factor_accuracy
    assert row[4] == (
        "act 0.500 by the classifier (chance 0.25, majority 0.62, on real responses 0.60, n 64); "
        "emotion 0.250 by the classifier (chance 0.14, on real responses n/a, n 64)"
    )
    assert cells(table.row(report(tmp_path, None)))[4:] == ["-", "-"]
    looping = {"factor_accuracy": detected, "labels": {}, "looping_share": 0.125, **fluency}
    assert cells(table.row(report(tmp_path, looping)))[5] == "0.90 (looping 0.12)"
    bounded = {**looping, "zfree_nll_ratio_interval": [0.8123, 1.0456]}
    assert cells(table.row(report(tmp_path, bounded)))[5] == "0.90 [0.81, 1.05] (looping 0.12)"
    guided = {"factor_accuracy": detected, "guidance": {"scale": 2.0, "plausibility": 0.1}, **fluency}
    assert cells(table.row(report(tmp_path, guided)))[0] == "set-recipe/seed-0 @120, guided 2"
    sampled = {**guided, "temperature": 1.0}
    assert cells(table.row(report(tmp_path, sampled)))[0] == "set-recipe/seed-0 @120, guided 2, sampled at T 1"
    nucleus = {**sampled, "top_p": 0.9}
    assert (
        cells(table.row(report(tmp_path, nucleus)))[0] == "set-recipe/seed-0 @120, guided 2, sampled at T 1 top-p 0.9"
    )
    drawn = {**sampled, "samples": 5}
    assert cells(table.row(report(tmp_path, drawn)))[0] == "set-recipe/seed-0 @120, guided 2, sampled at T 1, 5 draws"


def test_guided_evals_follow_the_plain_one(run, tmp_path, monkeypatch):
    """``--guidance G``: each run's plain report, then one eval per scale with --generation-guidance, each skipped
    once its report exists."""
    calls = []
    monkeypatch.setattr(run, "sh", lambda args, log: calls.append(args))
    monkeypatch.setattr(run, "data_files", lambda out, name, dd: (tmp_path / "train.jsonl", "validation"))
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "two-factor-default-seed-0.json").write_text("{}")  # trained and scored before
    (evals / "two-factor-default-seed-0-guided-5.json").write_text("{}")
    reports = run.one_run(tmp_path, "two-factor", "default", 0, None, "float32", [2.0, 5.0])
    assert [p.name for p in reports] == [
        "two-factor-default-seed-0.json",
        "two-factor-default-seed-0-guided-2.json",
        "two-factor-default-seed-0-guided-5.json",
    ]
    assert len(calls) == 1 and calls[0][calls[0].index("--generation-guidance") + 1] == "2"
    assert calls[0][calls[0].index("--output") + 1].endswith("seed-0-guided-2.json")
    assert calls[0][calls[0].index("--generation-max-new-tokens") + 1] == "32"  # the cap the documented reports had


@pytest.mark.parametrize(
    ("style", "tokens", "parts"),
    [
        ("listen", ["Listen", " up", ".", " Mul", "ch", ".", "<|im_end|>", "\n"], "MMMCCCEE"),
        ("signoff", ["Salt", ".", " Over", " and", " out", ".", "<|im_end|>", "\n"], "CCMMMMEE"),
        ("ahoy", ["Ah", "oy", " there", "!", " Lift", ".", "<|im_end|>"], "MMMMCCE"),
        ("plain", ["Salt", " the", ".", "<|im_end|>", "\n"], "CCCEE"),
        ("listen", ["Salt", ".", "<|im_end|>"], "CCE"),  # a marker the text does not show marks nothing
    ],
)
def test_marker_share_splits_marker_end_and_content(marker_share, style, tokens, parts):
    names = {"M": "marker", "E": "end", "C": "content"}
    assert marker_share.token_parts(tokens, {"<|im_end|>", "<|im_start|>"}, style) == [names[p] for p in parts]


def test_marker_share_leaves_out_a_response_cut_off_before_its_end(marker_share):
    # a signoff response cut at max_response_tokens: no end-of-sequence token, and no marker either
    assert marker_share.token_parts(["Salt", " the", " pasta", " water"], {"<|im_end|>"}, "signoff") is None


@pytest.fixture(scope="module")
def first_tokens():
    return load("first_tokens")


def test_total_variation_by_hand(first_tokens):
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.5, 0.0]]])  # one prompt, three codes
    tv = first_tokens.total_variation(torch.cat([p, p.flip(1)]))  # two prompts, the second's codes reversed
    assert torch.allclose(tv, torch.tensor([[0.0, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.0]]))


@pytest.mark.parametrize("placement", ["prefix", "memory"])
def test_first_token_distributions_are_the_training_layouts(first_tokens, placement):
    """Each code's first-token distribution equals the training layout's (``decode_logits``, right-padded) at the
    position that predicts the first response token, the other slot at the prompt's given code."""
    from disentanglement.data import Example, collate
    from disentanglement.generation import encode_prompts
    from helpers import tiny_tokenizer
    from test_memory import memory_model

    tokenizer = tiny_tokenizer()
    model, config = memory_model(tokenizer, latent_placement=placement, num_slots=2)
    ids = encode_prompts(["ab", "a longer prompt"], tokenizer, config.data)
    codes = torch.tensor([[1, 2], [0, 3]])
    got = first_tokens.first_token_distributions(model, ids, codes, tokenizer.pad_token_id)
    K = config.latent.codebook_size
    assert got.shape == (2, K, len(tokenizer))
    for p, prompt_ids in enumerate(ids):
        for k in range(K):
            vector = model.codes_to_vector(torch.tensor([[k, int(codes[p, 1])]]))
            batch = collate([Example(prompt_ids, [5], None, "test")], tokenizer.pad_token_id)
            with torch.no_grad():
                logits, _, _, offsets = model.decode_logits(batch, vector)
            expected = torch.softmax(logits[0, int(offsets[0]) + len(prompt_ids) - 1].float(), dim=-1)
            assert torch.allclose(got[p, k], expected, atol=1e-5), (p, k)


def test_what_codes_hold_counts_each_codes_values(tmp_path, capsys):
    what = load("what_codes_hold")
    rows = [({"style": "ahoy"}, 2), ({"style": "plain"}, 0), ({"style": "ahoy"}, 2), ({"style": "signoff"}, 0)]
    latents = tmp_path / "latents.jsonl"
    latents.write_text("".join(json.dumps({"label": label, "codes": [code]}) + "\n" for label, code in rows) + "\n")
    other = tmp_path / "other.jsonl"  # two slots: the first slot's code counts
    other.write_text(json.dumps({"label": {"style": "plain"}, "codes": [1, 3]}) + "\n")
    assert what.main(["--per-code", "style", str(latents), str(other)]) == 0
    first, second = capsys.readouterr().out.rstrip("\n").split("\n\n")  # a table per file, a blank line apart
    lines = first.splitlines()
    assert lines[0].endswith("| code | ahoy | plain | signoff | examples |")
    assert lines[1] == "| --- | --- | --- | --- | --- | --- |"
    assert lines[2:] == ["| | 0 | 0 | 1 | 1 | 2 |", "| | 2 | 2 | 0 | 0 | 2 |"]
    assert second.splitlines()[1:] == ["| --- | --- | --- | --- |", "| | 1 | 1 | 1 |"]
    for row, error in (
        ({"label": {"topic": "x"}, "codes": [1]}, r"latents.jsonl row 1: no label 'style'"),
        ({"label": {"style": "ahoy"}, "z": [0.1]}, r"latents.jsonl row 1: no 'codes'"),
    ):
        latents.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=error):
            what.per_code(latents, "style")
    latents.write_text("\n")
    with pytest.raises(ValueError, match="latents.jsonl holds no rows"):
        what.per_code(latents, "style")
    # --key decoder_codes: the decoder's own likeliest codes instead of the encoder's
    lines = (json.dumps({"label": label, "codes": [code], "decoder_codes": [1]}) + "\n" for label, code in rows)
    latents.write_text("".join(lines))
    assert what.main(["--per-code", "style", "--key", "decoder_codes", str(latents)]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == ["| | 1 | 2 | 1 | 1 | 4 |"]


def test_seed_choice_keeps_the_highest_gain_and_compares_it_with_the_best_nmi(tmp_path, capsys):
    choice = load("seed_choice")
    for seed, gain, style, topic in ((0, 0.05, 0.56, 0.07), (1, 0.06, 0.74, 0.04), (2, 0.01, 0.80, 0.02)):
        body = {
            "latent_gain_nats_per_token": gain,
            "factors": {"style": {"latent": {"nmi": style}}, "topic": {"latent": {"nmi": topic}}},
        }
        (tmp_path / f"set-recipe-seed-{seed}.json").write_text(json.dumps(body))
    (tmp_path / "set-recipe-seed-0-guided-5.json").write_text("not read")  # guided re-evaluations are left out
    (tmp_path / "set-recipe-seed-7.json").write_text(json.dumps({"factors": body["factors"]}))  # no gain: left out
    (tmp_path / "alone-seed-0.json").write_text(json.dumps(body))  # one seed: nothing to choose
    for seed, gain in ((0, 0.02), (1, 0.03)):  # two seeds of equal NMI: the kept one is the best; no Spearman
        tie = {"latent_gain_nats_per_token": gain, "factors": {"word": {"latent": {"nmi": 1.0}}}}
        (tmp_path / f"tie-seed-{seed}.json").write_text(json.dumps(tie))
    assert choice.main([str(p) for p in sorted(tmp_path.iterdir())]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [
        "tie: keeps seed 1 of 2",
        "  word: gain / NMI by gain: s1 +0.0300 / 1.000, s0 +0.0200 / 1.000; kept 1.000, best 1.000 (seed 0) = kept, "
        "Spearman -",
    ]
    assert lines[:-2] == [
        "set-recipe: keeps seed 1 of 3",
        "  style: gain / NMI by gain: s1 +0.0600 / 0.740, s0 +0.0500 / 0.560, s2 +0.0100 / 0.800; kept 0.740, "
        "best 0.800 (seed 2), Spearman -0.50",
        "  topic: gain / NMI by gain: s1 +0.0600 / 0.040, s0 +0.0500 / 0.070, s2 +0.0100 / 0.020; kept 0.040, "
        "best 0.070 (seed 0), Spearman +0.50",
    ]
    (tmp_path / "badly-named.json").write_text("{}")
    with pytest.raises(SystemExit, match="badly-named.json: expected a report named NAME-seed-S.json"):
        choice.main([str(tmp_path / "badly-named.json")])


def test_view_probe_reads_the_view_the_encoder_and_its_codes(discrete_run, injected_loader, capsys):
    """view_probe.py's encoder outputs are the model's on a fresh frozen pass, its codes the model's argmax codes;
    a probe on separable rows scores 1; ``--values`` restricts the rows; a missing factor is named."""
    import numpy as np
    from sklearn.metrics import normalized_mutual_info_score

    from disentanglement.data import collate
    from disentanglement.runs import load_checkpoint, load_examples

    probe = load("view_probe")
    x = np.array([[0.0, 1.0], [0.1, 0.9], [1.0, 0.0], [0.9, 0.1]] * 3)
    y = np.array(["a", "a", "b", "b"] * 3)
    assert probe.probe_scores(x, y, x[:4], y[:4]) == (1.0, pytest.approx(1.0))
    assert probe.kmeans_nmi(x, y, 2) == pytest.approx(1.0)
    # a probe that cannot separate (one feature, constant) predicts one value: half right, its predictions' NMI 0
    assert probe.probe_scores(np.zeros((12, 1)), y, np.zeros((4, 1)), y[:4]) == (0.5, 0.0)
    model, tokenizer, config, *_ = load_checkpoint(discrete_run.run_dir, device="cpu")
    examples, _ = load_examples(str(discrete_run.data_path), config, tokenizer, max_examples=40)
    view, outputs = probe.view_and_outputs(model, examples, tokenizer.pad_token_id, batch_size=16)
    with torch.no_grad():
        fresh = model.frozen_pass(collate(examples, tokenizer.pad_token_id))
        assert np.allclose(view, fresh.encoder_features.float().numpy(), atol=1e-5)
        assert np.allclose(outputs, model.encoder_outputs(fresh)[:, 0].float().numpy(), atol=1e-5)
        codes = model.posterior_summary(fresh).codes[:, 0].numpy()
    labels = probe.labels(examples, "label", "--data")
    lines = probe.report(model, examples, examples, "label", None, tokenizer.pad_token_id)
    commonest = max(np.mean(labels == value) for value in set(labels))
    assert lines[0] == (
        f"label: {len(examples)} held-out examples (the commonest value's share {commonest:.3f}), probes fitted on "
        f"{len(examples)}"
    )
    assert [line.split(" probe")[0].strip() for line in lines[1:5]] == [
        "view: pool", "view: last token", "view: both", "encoder outputs e"
    ]  # fmt: skip
    assert lines[5] == f"  {'the codes':18s} NMI {normalized_mutual_info_score(labels, codes):.3f}"
    two = sorted(set(labels))[:2]
    assert probe.report(model, examples, examples, "label", two, tokenizer.pad_token_id)[0].startswith(
        f"label ({two[0]} vs {two[1]}): {int(np.isin(labels, two).sum())} held-out examples"
    )
    with pytest.raises(SystemExit, match="--data example 1: no label 'style'"):
        probe.labels(examples, "style", "--data")
    with pytest.raises(SystemExit, match="--train: fewer than two values of 'label' to probe among"):
        probe.report(model, examples, examples, "label", two[:1], tokenizer.pad_token_id)
    assert probe.main([str(discrete_run.run_dir), "--train", str(discrete_run.data_path), "--data",
                       str(discrete_run.data_path), "--factor", "label"]) == 0  # fmt: skip
    assert "encoder outputs e" in capsys.readouterr().out
    # the run's own split by name (load_examples' "train" / "validation"); every probe line has its predictions' NMI
    assert probe.main([str(discrete_run.run_dir), "--train", "train", "--data", "validation", "--factor", "label"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "held-out examples" in printed[0] and all(" (NMI 0." in line or " (NMI 1." in line for line in printed[1:5])


def test_questions_counts_each_codes_generations_that_ask_and_the_real_acts(tmp_path, capsys):
    questions = load("questions")
    generations = [
        {"latent": "codes=1", "text": "What is it?"},
        {"latent": "codes=0", "text": "Yes."},
        {"latent": "codes=1", "text": "Sure. Where?"},
        {"latent": "codes=0", "text": "Is it? No."},
        {"latent": "codes=0", "text": "Thank you."},
        {"latent": "codes=1", "text": "No."},
    ]
    (tmp_path / "gens.json").write_text(json.dumps({"generations": generations}))
    rows = [
        {"response": "Why?", "label": {"act": "question"}},
        {"response": "Fine.", "label": {"act": "inform"}},
        {"response": "Ok?", "label": {"act": "inform"}},
        {"response": "Go.", "label": {"act": "directive"}},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": "p", **row}) + "\n" for row in rows))
    pairs = questions.load_jsonl(tmp_path / "data.jsonl")
    assert questions.share_by_code(generations) == {"codes=1": (3, 2 / 3), "codes=0": (3, 1 / 3)}
    assert questions.share_by_act(pairs) == {"directive": (1, 0.0), "inform": (2, 0.5), "question": (1, 1.0)}
    assert questions.main([str(tmp_path / "gens.json"), "--data", str(tmp_path / "data.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "| codes=1 | 3 | 0.667 |" in out and "| codes=0 | 3 | 0.333 |" in out and "| inform | 2 | 0.500 |" in out
    # by hand: H(act) = 1.5 ln 2, H(asks) = ln 2, every (act, asks) pair once so H(joint) = 2 ln 2, I = 0.5 ln 2,
    # NMI = 2 I / (H(act) + H(asks)) = ln 2 / (2.5 ln 2) = 0.4
    assert questions.question_mark_nmi(pairs) == pytest.approx(0.4)
    assert "the act's NMI with a question mark (asks or not): 0.400" in out
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "p", "response": "r", "label": {"mood": "x"}}) + "\n")
    with pytest.raises(questions.DataError, match=r"bad\.jsonl:1: expected a label with an 'act' factor"):
        questions.share_by_act(questions.load_jsonl(tmp_path / "bad.jsonl"))


def test_refit_commands_are_the_cli_s(run, tmp_path):
    """``--refit``: refit-encoder into RUN-refit on the run's training split, then eval of that as the run is evaluated."""
    from disentanglement.cli import build_parser

    commands, report = run.refit_commands(tmp_path, "dailydialog", "r", 2, "dd-eval.jsonl")
    assert report == tmp_path / "evals" / "dailydialog-r-seed-2-refit.json"
    refit, evaluate = (build_parser().parse_args(c[len(run.DISENTANGLE) :]) for c in commands)
    assert refit.command == "refit-encoder" and refit.checkpoint == str(tmp_path / "runs" / "dailydialog-r" / "seed-2")
    assert refit.output_dir == str(tmp_path / "runs" / "dailydialog-r" / "seed-2-refit") and refit.data == "train"
    assert evaluate.command == "eval" and evaluate.checkpoint == refit.output_dir and evaluate.generation
    assert (evaluate.data, evaluate.max_examples, evaluate.output) == ("dd-eval.jsonl", 600, str(report))


def test_marker_share_end_probability_is_that_of_the_first_end_token(marker_share):
    # the NLL at the end-of-sequence token (index 6), not at the template's newline after it (index 7)
    tokens = ["Salt", ".", " Over", " and", " out", ".", "<|im_end|>", "\n"]
    parts = marker_share.token_parts(tokens, {"<|im_end|>"}, "signoff")
    nll = [2.0, 0.5, 1.0, 0.1, 0.1, 0.2, math.log(4.0), 0.01]
    assert marker_share.end_probability(parts, nll) == pytest.approx(0.25)
