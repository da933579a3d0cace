"""``eval --generation``: controllability of the tiny trained checkpoints (``conftest.py``), of collapsed copies
of them (chance by construction), and of the pure parts by hand."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import NUM_FACTORS, model_and_tokenizer
from disentanglement import cli, trainer
from disentanglement.commands import run_eval
from disentanglement.controllability import (
    EXAMPLES_SHOWN,
    choose_prompts,
    controllability,
    diversity,
    factor_accuracy,
    fit_label_classifier,
    generated_examples,
    held_out_accuracy,
    nearest_target,
    nll_ratio_interval,
    real_zfree_nll,
    recovery_accuracy,
    reencode,
    share_interval,
    summary_lines,
    synthetic_detector,
    wilson_interval,
)
from disentanglement.data import collate
from disentanglement.encode import raw_pairs
from disentanglement.evaluation import evaluate_records, posterior_latents
from disentanglement.features import build_feature_cache
from disentanglement.guidance import Guidance
from disentanglement.latent_space import code_labels, code_shares
from disentanglement.metrics import looping_share, loops
from disentanglement.runs import load_examples

OPTIONS = dict(num_prompts=4, max_new_tokens=40, prior_latents=4, seed=0)


def setup(run):
    model, tokenizer, config, _ = run.load()
    model.eval()
    examples, _ = load_examples(None, config, tokenizer)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 16, "cpu", False)
    return model, tokenizer, config, examples, cache, raw_pairs(None, config, examples)


@pytest.fixture(scope="module")
def discrete(discrete_run):
    return setup(discrete_run)


@pytest.fixture(scope="module")
def continuous(continuous_run):
    return setup(continuous_run)


def collapse_encoder(model, output: torch.Tensor):
    """A copy of ``model`` whose encoder gives every input ``output`` (the last layer's weight zeroed)."""
    collapsed = copy.deepcopy(model)
    last = collapsed.encoder[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(output)
    return collapsed


# --------------------------------------------------------------------------- by hand


class _Pair:
    def __init__(self, prompt: str) -> None:
        self.prompt = prompt


def test_real_zfree_nll_pools_tokens_and_keeps_the_chosen_prompts_responses():
    nll = [torch.tensor([1.0, 3.0]), torch.tensor([2.0]), torch.tensor([0.5, 0.5, 2.0])]
    pairs = [_Pair("a"), _Pair("b"), _Pair("a")]
    assert real_zfree_nll(nll) == pytest.approx((1 + 3 + 2 + 0.5 + 0.5 + 2) / 6)
    # pooled over tokens, not a mean of the responses' means (which would be (2 + 1) / 2)
    assert real_zfree_nll(nll, pairs, ["a"]) == pytest.approx((1 + 3 + 0.5 + 0.5 + 2) / 5)
    assert real_zfree_nll(nll, pairs, ["b", "c"]) == pytest.approx(2.0)


def _loop_interval(generated, real, paired, resamples, confidence, seed, chunk=None):
    """nll_ratio_interval written out: the same draws of the same generator (``chunk`` resamples at a time, as the
    package draws them), each row's count times its NLL and tokens added one row at a time."""
    rng = np.random.default_rng(seed)
    prompts, own = max(generated[2]) + 1, max(real[2]) + 1

    def within(rows, draws, count):  # each prompt's rows drawn again, in the package's order of the generator's calls
        nll, tokens = np.zeros(len(draws)), np.zeros(len(draws))
        for p in range(count):
            mine = [(n, t) for n, t, q in zip(*rows, strict=True) if q == p]
            picks = (
                draws[:, p, None]
                if len(mine) == 1
                else rng.multinomial(draws[:, p] * len(mine), [1 / len(mine)] * len(mine))
            )
            for k, (n, t) in enumerate(mine):
                nll += picks[:, k] * n
                tokens += picks[:, k] * t
        return nll, tokens

    ratios = []
    for start in range(0, resamples, chunk or resamples):
        size = min(chunk or resamples, resamples - start)
        draws = rng.multinomial(prompts, [1 / prompts] * prompts, size=size)
        real_draws = draws if paired else rng.multinomial(own, [1 / own] * own, size=size)
        (g, gt), (r, rt) = within(generated, draws, prompts), within(real, real_draws, own)
        ratios += [g[b] / gt[b] / (r[b] / rt[b]) for b in range(size)]
    tail = (1 - confidence) / 2 * 100
    return [float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))]


def _exact_distribution(generated, real, paired):
    """The ratio's two-stage bootstrap distribution by enumeration (every ordered draw of the prompts, and for each
    drawn prompt of ``n`` rows every ordered draw of ``n`` of its rows, all equally likely): its atoms, ascending,
    and the distribution function at each."""
    from itertools import product

    def outcomes(rows, count, draw):
        """(probability, NLL, tokens) of every within-prompt draw of the prompts in ``draw``."""
        mine = [[(n, t) for n, t, q in zip(*rows, strict=True) if q == p] for p in range(count)]
        slots = [mine[p] for p in draw for _ in mine[p]]  # each drawn prompt brings as many slots as its rows
        for pick in product(*[range(len(choices)) for choices in slots]):
            weight = np.prod([1 / len(choices) for choices in slots])
            chosen = [choices[k] for choices, k in zip(slots, pick, strict=True)]
            yield weight, sum(n for n, _ in chosen), sum(t for _, t in chosen)

    prompts, own = max(generated[2]) + 1, max(real[2]) + 1
    atoms = {}
    for draw in product(range(prompts), repeat=prompts):
        real_choices = [draw] if paired else list(product(range(own), repeat=own))
        share = 1 / prompts**prompts / len(real_choices)
        for real_draw in real_choices:
            for wg, g, gt in outcomes(generated, prompts, draw):
                for wr, r, rt in outcomes(real, own, real_draw):
                    atom = round(g / gt / (r / rt), 12)
                    atoms[atom] = atoms.get(atom, 0.0) + share * wg * wr
    values = np.array(sorted(atoms))
    return values, np.cumsum([atoms[v] for v in values])


def _is_quantile(value, q, values, cdf, tolerance):
    """Whether ``value`` is a ``q``-quantile of the distribution (``values``, ``cdf``) within ``tolerance`` of
    probability: at most ``q`` of it lies below ``value`` and at least ``q`` at or below, each give or take."""
    under, upto = np.searchsorted(values, value - 1e-9), np.searchsorted(values, value + 1e-9, side="right")
    below, at_or_below = (cdf[i - 1] if i else 0.0 for i in (under, upto))
    return below <= q + tolerance and at_or_below >= q - tolerance


def test_nll_ratio_interval_by_hand_against_enumeration_and_a_loop():
    # two prompts of ten tokens each, the real responses 4 nats a token on both: a resample draws prompt 0 twice
    # (ratio 0.9, a chance of 1/4), both (1.1) or prompt 1 twice (1.3): the 95 % interval spans 0.9 to 1.3
    generated = ([36.0, 52.0], [10, 10], [0, 1])
    real = ([40.0, 40.0], [10, 10], [0, 1])
    assert nll_ratio_interval(generated, real, paired=True, resamples=4000) == pytest.approx([0.9, 1.3])
    # the middle 40 % holds only the draws of one of each
    middle = nll_ratio_interval(generated, real, paired=True, resamples=4000, confidence=0.4)
    assert middle == pytest.approx([1.1, 1.1])
    # one prompt on each side: every resample is the ratio itself
    assert nll_ratio_interval(([30.0], [10], [0]), ([20.0], [8], [0]), paired=True) == pytest.approx([1.2, 1.2])
    # one prompt of two generations (3 and 1 nats a token, the real response 2): drawn again within it, both the
    # first (1.5, a chance of 1/4), one of each (1.0) or both the second (0.5); resampling prompts alone is a point
    within = (([30.0, 10.0], [10, 10], [0, 0]), ([20.0], [10], [0]))
    assert nll_ratio_interval(*within, paired=True, resamples=4000) == pytest.approx([0.5, 1.5])
    assert nll_ratio_interval(*within, paired=True, resamples=4000, confidence=0.4) == pytest.approx([1.0, 1.0])
    # real responses of equal NLL per token drawn on their own: the generations' spread alone
    spread = nll_ratio_interval(generated, ([40.0, 8.0, 20.0], [10, 2, 5], [0, 1, 1]), paired=False, resamples=4000)
    assert spread == pytest.approx([0.9, 1.3])
    # uneven prompts, a prompt of two generations and one of two real responses: the ends of 20,000 resamples at
    # four confidences are quantiles of the exact two-stage distribution (every draw enumerated) within 0.01 of
    # probability (3.1 standard errors of a resampled share at 0.3, the widest)
    generated = ([30.0, 12.0, 50.0, 9.0], [10, 3, 12, 4], [0, 0, 1, 2])
    for paired, real in (
        (True, ([20.0, 33.0, 8.0, 15.0], [6, 9, 2, 5], [0, 1, 2, 2])),
        (False, ([20.0, 40.0, 5.0], [5, 9, 2], [0, 1, 1])),
    ):
        values, cdf = _exact_distribution(generated, real, paired)
        for confidence in (0.4, 0.6, 0.8, 0.9):
            low, high = nll_ratio_interval(generated, real, paired=paired, resamples=20000, confidence=confidence)
            tail = (1 - confidence) / 2
            assert _is_quantile(low, tail, values, cdf, 0.01) and _is_quantile(high, 1 - tail, values, cdf, 0.01)
        assert cdf[-1] == pytest.approx(1.0)  # the enumeration's probabilities add up
    # many uneven prompts, both ways of drawing the real responses: the vectorised sums against a loop
    rng = np.random.default_rng(3)
    generated = (list(rng.uniform(5, 60, 12)), list(rng.integers(2, 20, 12)), [0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 5, 5])
    for paired, real in (
        (True, (list(rng.uniform(5, 60, 9)), list(rng.integers(2, 20, 9)), [0, 1, 1, 2, 3, 3, 4, 5, 5])),
        (False, (list(rng.uniform(5, 60, 30)), list(rng.integers(2, 20, 30)), [*range(11), *rng.integers(0, 11, 19)])),
    ):
        got = nll_ratio_interval(generated, real, paired=paired, resamples=300, confidence=0.9, seed=7)
        assert got == pytest.approx(_loop_interval(generated, real, paired, 300, 0.9, 7), rel=1e-12)
    with pytest.raises(ValueError, match="resamples"):
        nll_ratio_interval(generated, real, paired=False, resamples=0)
    with pytest.raises(ValueError, match="one NLL, token count and prompt per real response"):
        nll_ratio_interval(generated, (real[0][:-1], real[1], real[2]), paired=False)
    with pytest.raises(ValueError, match="generation 0 has no tokens"):  # a resample of it alone: 0 / 0
        nll_ratio_interval(([0.0, 10.0], [0, 5], [0, 0]), ([10.0], [5], [0]), paired=True)
    # eight prompts of 128 rows each: 4M numbers hold 31,250 resamples of the widest array (128 rows), so 32,000
    # come in two chunks, the same as a loop drawing them so
    rows = (list(rng.uniform(5, 60, 1024)), list(rng.integers(2, 20, 1024)), [p for p in range(8) for _ in range(128)])
    many = (rows[0][:8], rows[1][:8], list(range(8)))
    got = nll_ratio_interval(rows, many, paired=True, resamples=32_000, confidence=0.9, seed=2)
    assert got == pytest.approx(_loop_interval(rows, many, True, 32_000, 0.9, 2, chunk=31_250), rel=1e-12)
    assert got != pytest.approx(_loop_interval(rows, many, True, 32_000, 0.9, 2), rel=1e-12)
    with pytest.raises(ValueError, match="prompt 1 of 0-2 has no generation"):
        nll_ratio_interval(([1.0, 2.0], [1, 1], [0, 2]), ([1.0], [1], [0]), paired=False)
    with pytest.raises(ValueError, match="the real responses answer 1 prompts, the generations 2"):
        nll_ratio_interval(([1.0, 2.0], [1, 1], [0, 1]), ([1.0], [1], [0]), paired=True)
    with pytest.raises(ValueError, match="answer 3 prompts"):
        nll_ratio_interval(([1.0, 2.0], [1, 1], [0, 1]), ([1.0, 1.0, 1.0], [1, 1, 1], [0, 1, 2]), paired=True)


def test_recovery_accuracy_and_nearest_target():
    assert recovery_accuracy([0, 1, 2, 2], [0, 1, 2, 3]) == 0.75
    assert recovery_accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="targets"):
        recovery_accuracy([0], [0, 1])
    points = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.5, 0.0]])
    candidates = torch.tensor([[[0.1, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.9, 1.2]], [[0.0, 0.0], [1.0, 0.0]]])
    assert nearest_target(points, candidates).tolist() == [0, 1, 0]  # the last is a tie: the lower index


def test_distinct_n_by_hand():
    got = diversity([["a b a", "a b"], ["c c"]])
    # unigrams: a b a | a b | c c -> 7 tokens, 3 distinct; bigrams: (a b)(b a) | (a b) | (c c) -> 4, 3 distinct
    assert got["distinct_1"] == pytest.approx(3 / 7) and got["distinct_2"] == pytest.approx(3 / 4)
    # per prompt: [5 tokens, 2 distinct; 3 bigrams, 2 distinct] and [2 tokens, 1; 1 bigram, 1]
    assert got["distinct_1_per_prompt"] == pytest.approx((2 / 5 + 1 / 2) / 2)
    assert got["distinct_2_per_prompt"] == pytest.approx((2 / 3 + 1) / 2)
    assert got["looping_share"] == 0.0  # "a b a": no run three times in a row
    assert diversity([["c c c", "a b"], ["no loop here", "x y x y x y"]])["looping_share"] == pytest.approx(2 / 4)


def test_loops_by_hand():
    assert loops("Python Over and out Over and out Over and out")  # three words, three times
    assert loops("Yes. yes, YES!")  # one word three times: case and the punctuation around it ignored
    assert loops("a b c d a b c d a b c d")  # four words, the longest span looked for
    assert not loops("a b c d e a b c d e a b c d e")  # five words: longer than the span looked for
    assert loops("a b c d e a b c d e a b c d e", max_span=5)
    assert not loops("Over and out Over and out.")  # twice is not a loop
    assert loops("Over and out Over and out.", copies=2)
    assert not loops("") and not loops("...") and not loops("I am not sure I am")
    assert loops("no , no , no")  # a bare comma is no word: "no no no"
    with pytest.raises(ValueError, match="copies"):
        loops("a a a", copies=1)
    assert looping_share(["a a a", "a b", "x y x y x y", ""]) == pytest.approx(2 / 4)
    assert looping_share([]) == 0.0  # no texts: nothing loops


def test_choose_prompts_is_seeded_distinct_and_in_order():
    prompts = ["a", "b", "a", "c", "d", "b", "e"]
    chosen = choose_prompts(prompts, 3, seed=1)
    assert len(chosen) == 3 and len(set(chosen)) == 3
    assert chosen == sorted(chosen, key=["a", "b", "c", "d", "e"].index) and chosen == choose_prompts(prompts, 3, 1)
    assert choose_prompts(prompts, 10) == ["a", "b", "c", "d", "e"]


def test_label_classifier_on_a_known_answer():
    rng = np.random.default_rng(0)
    centres = {"x": np.array([5.0, 0.0, 0.0]), "y": np.array([0.0, 5.0, 0.0]), "z": np.array([0.0, 0.0, 5.0])}
    labels = [name for name in centres for _ in range(20)]
    features = np.stack([centres[n] + rng.normal(scale=0.3, size=3) for n in labels])
    classifier = fit_label_classifier(features, labels)
    new = np.stack([centres[n] + rng.normal(scale=0.3, size=3) for n in ("z", "x", "y", "x")])
    assert list(classifier.predict(new)) == ["z", "x", "y", "x"]
    assert held_out_accuracy(features, labels) == 1.0
    assert fit_label_classifier(features, ["x"] * len(labels)) is None  # one class: nothing to learn
    assert held_out_accuracy(features[:3], labels[:3]) is None  # too few to hold any out


# --------------------------------------------------------------------------- re-encoding


def test_reencode_scores_the_zfree_nll_and_posterior_of_the_generations(discrete):
    model, tokenizer, config, *_ = discrete
    prompts, texts = ["sun pen 201", "moon tree 250", "x 1"], ["No.", "Ha ha, that is a funny question!", ""]
    examples = generated_examples(tokenizer, config, prompts, texts)
    assert examples[2].response_ids == [tokenizer.eos_token_id]  # an empty generation: its end alone
    assert examples[0].response_ids == tokenizer("No.", add_special_tokens=False)["input_ids"] + [2]
    encoded = reencode(model, examples, tokenizer.pad_token_id, batch_size=2)
    with model.reference.active() as reference, torch.no_grad():
        for i, example in enumerate(examples):
            ids = torch.tensor([example.prompt_ids + example.response_ids])
            logits = reference(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
            nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")[len(example.prompt_ids) - 1 :]
            assert float(encoded["nll"][i]) == pytest.approx(float(nll.sum()), rel=1e-4)
            assert int(encoded["tokens"][i]) == len(example.response_ids)
    batch = collate(examples, tokenizer.pad_token_id)
    expected = model.posterior_logits(model.encoder_outputs(model.frozen_pass(batch))).argmax(-1)
    assert encoded["codes"].tolist() == expected.tolist()


# --------------------------------------------------------------------------- the measure


def test_trained_discrete_codes_are_recovered_and_read_as_their_labels(discrete):
    report = controllability(*discrete, **OPTIONS)
    assert report["prompts"] == 4 and report["generations"] == 4 * NUM_FACTORS
    assert report["code_recovery_accuracy"] == 1.0 and report["recovery_chance"] == 1 / NUM_FACTORS
    assert report["per_slot"] == [{"slot": 0, "accuracy": 1.0, "chance": 1 / NUM_FACTORS}]
    label = report["labels"]["label"]
    assert label["accuracy"] == 1.0 and label["real_accuracy"] == 1.0 and label["generations_scored"] == 16
    # four fixed phrases, one per code: every prompt's four generations differ
    assert report["distinct_2_per_prompt"] == 1.0 and 0 < report["distinct_1"] < 1
    assert report["zfree_nll_per_token"] > 0 and report["real_zfree_nll_per_token"] > 0
    # the real responses of the four prompts generated for, pooled over their tokens, by hand from the cache
    _, _, _, examples, cache, pairs = discrete
    chosen = choose_prompts([p.prompt for p in pairs], 4, 0)
    same = [i for i, p in enumerate(pairs) if p.prompt in chosen]
    assert 0 < len(same) < len(pairs)
    by_hand = sum(float(cache.response_nll[i].double().sum()) for i in same) / sum(
        len(examples[i].response_ids) for i in same
    )
    assert report["real_zfree_nll_per_token_same_prompts"] == pytest.approx(by_hand, rel=1e-9)
    # each ratio, and its bootstrap interval over the four prompts, here about it (a percentile interval need not be)
    for key, real in (("", "real_zfree_nll_per_token"), ("_same_prompts", "real_zfree_nll_per_token_same_prompts")):
        ratio = report["zfree_nll_ratio" + key]
        assert ratio == report["zfree_nll_per_token"] / report[real]
        low, high = report["zfree_nll_ratio_interval" + key]
        assert low <= ratio <= high and low < high
    ratio_line = next(line for line in summary_lines(report) if "z-free NLL of the generations /" in line)
    low, high = report["zfree_nll_ratio_interval_same_prompts"]
    assert ratio_line.endswith(f"same prompts: {report['zfree_nll_per_token'] / by_hand:.3f} [{low:.2f}, {high:.2f}])")
    assert len(report["examples"]) == 2 * NUM_FACTORS and all(e["recovered"] for e in report["examples"])
    assert controllability(*discrete, **OPTIONS) == report  # deterministic
    json.dumps(report, allow_nan=False)


def test_a_collapsed_discrete_encoder_recovers_at_chance(discrete):
    model, *rest = discrete
    collapsed = collapse_encoder(model, model.codebook[0].detach().repeat(model.num_slots))
    report = controllability(collapsed, *rest, **OPTIONS)
    # every generation is read back as code 0: one in K is right, exactly
    assert report["code_recovery_accuracy"] == 1 / NUM_FACTORS
    assert all(e["recovered"] == e["latent"].endswith("=0") for e in report["examples"])
    # only code 0 has real examples, so only its generations stand for a label
    assert report["labels"]["label"]["generations_scored"] == 4


def test_continuous_recovery_and_its_collapsed_chance(continuous):
    report = controllability(*continuous, **OPTIONS)
    assert report["generations"] == 4 * 4 + 4 * NUM_FACTORS  # prior draws, then one attribute per label
    assert 0 <= report["latent_recovery_accuracy"] <= 1 and report["recovery_chance"] == 1 / 4
    assert report["attributes"]["label"]["chance"] == 1 / NUM_FACTORS
    assert report["labels"]["label"]["generations_scored"] == 4 * NUM_FACTORS
    assert controllability(*continuous, **OPTIONS) == report
    model, *rest = continuous
    D = model.latent_vector_dim
    collapsed = collapse_encoder(model, torch.cat([torch.full((D,), 0.3), torch.zeros(D)]))  # mu = 0.3, logvar = 0
    flat = controllability(collapsed, *rest, **OPTIONS)
    # one re-encoded mu per prompt: it is nearest to one target of each group, so one in J is right, exactly
    assert flat["latent_recovery_accuracy"] == 1 / 4
    assert flat["attributes"]["label"]["recovery_accuracy"] == 1 / NUM_FACTORS


def test_bad_options(discrete):
    with pytest.raises(ValueError, match="--generation-num-prompts must be an integer >= 1"):
        controllability(*discrete, num_prompts=0)
    with pytest.raises(ValueError, match="--generation-latents must be an integer >= 2"):
        controllability(*discrete, prior_latents=1)


# --------------------------------------------------------------------------- eval --generation


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(trainer, "load_trained", refuse)


def test_eval_generation_report_and_summary(discrete_run, tmp_path):
    out = tmp_path / "eval.json"
    report, json_path, md_path = run_eval(
        discrete_run.checkpoint,
        output=out,
        progress=False,
        generation=True,
        generation_prompts=3,
        generation_max_new_tokens=40,
        model_and_tokenizer=model_and_tokenizer(),
    )
    saved = json.loads(json_path.read_text())["controllability"]
    assert saved == report["controllability"] and saved["prompts"] == 3 and saved["code_recovery_accuracy"] == 1.0
    summary = md_path.read_text()
    assert "## controllability" in summary and "| code_recovery_accuracy | 1 |" in summary
    plain, _, _ = run_eval(
        discrete_run.checkpoint,
        output=tmp_path / "plain.json",
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    assert "controllability" not in plain


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(generation_prompts=0), "--generation-prompts must be an integer >= 1"),
        (dict(generation_max_new_tokens=0), "--generation-max-new-tokens must be an integer >= 1"),
        (dict(generation_latents=1), "--generation-latents must be an integer >= 2"),
        (dict(generation_top_p=0.9), "--generation-top-p 0.9 applies to sampling"),  # greedy unless a temperature
        (dict(generation_top_p=0), r"--generation-top-p must be a finite number in \(0, 1\]"),
        (dict(generation_samples=0), "--generation-samples must be an integer >= 1"),
        (dict(generation_samples=2), "--generation-samples 2 draws several generations"),  # greedy
    ],
)
def test_eval_generation_options_are_refused_before_the_model_loads(discrete_run, tmp_path, no_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_eval(discrete_run.checkpoint, output=tmp_path / "e.json", progress=False, generation=True, **kwargs)


def test_cli_eval_generation(discrete_run, tmp_path, injected_loader, capsys):
    argv = ["eval", str(discrete_run.run_dir), "--output", str(tmp_path / "e.json"), "--no-progress", "--generation"]
    assert cli.main([*argv, "--generation-prompts", "2", "--generation-max-new-tokens", "40", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "controllability: code recovery 1.000 (chance 0.250) over 8 generations for 2 prompts (greedy" in printed
    sampled = ["--generation-temperature", "1.5", "--output", str(tmp_path / "s.json")]
    assert cli.main([*argv, "--generation-prompts", "2", "--device", "cpu", *sampled]) == 0
    assert "for 2 prompts (sampled at temperature 1.5 (top-p 1)" in capsys.readouterr().out
    drawn = [*sampled[:2], "--generation-samples", "2", "--output", str(tmp_path / "d.json")]
    assert cli.main([*argv, "--generation-prompts", "2", "--device", "cpu", *drawn]) == 0
    assert "over 16 generations for 2 prompts (sampled at temperature 1.5" in capsys.readouterr().out
    assert json.loads((tmp_path / "d.json").read_text())["controllability"]["samples"] == 2
    assert "label label: classifier accuracy on generations 1.000" in printed


def test_every_slot_is_swept_on_an_untrained_two_slot_model():
    from disentanglement.config import build_config
    from disentanglement.data import PromptResponse, tokenize_pairs
    from disentanglement.models import build_cvae

    config = build_config(
        dict(
            preset="raw",
            chat_template=False,
            num_slots=2,
            codebook_size=3,
            latent_tokens=2,
            code_dim=8,
            encoder_hidden=16,
        )
    )
    decoder, tokenizer = model_and_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, decoder).eval()
    pairs = [PromptResponse(f"q {i}", ("yes", "no", "maybe")[i % 3], str(i % 3), f"t:{i}") for i in range(9)]
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 4, "cpu", False)
    report = controllability(model, tokenizer, config, examples, cache, pairs, num_prompts=2, max_new_tokens=4)
    assert report["generations"] == 2 * 2 * 3  # prompts x slots x codes
    assert [s["slot"] for s in report["per_slot"]] == [0, 1] and all(s["chance"] == 1 / 3 for s in report["per_slot"])
    mean = (report["per_slot"][0]["accuracy"] + report["per_slot"][1]["accuracy"]) / 2
    assert report["code_recovery_accuracy"] == pytest.approx(mean)
    assert [e["latent"].count(",") for e in report["examples"]] == [1] * 12  # two codes per latent
    # the read-back by the decoder's codes, slot by slot: slot 0's code k stands for label k; slot 1 gives every
    # example code 0 (a three-way tie: label "0"), so only code 0 of slot 1 is scored there
    decoder_codes = np.array([[i % 3, 0] for i in range(9)])
    read = controllability(
        model, tokenizer, config, examples, cache, pairs, num_prompts=2, max_new_tokens=4,
        detector=lambda factor, text: "0", decoder_codes=decoder_codes,
    )["factor_accuracy"]["decoder_codes"]["label"]  # fmt: skip
    assert (
        read["generations_scored"] == 2 * (3 + 1) and read["accuracy"] == 0.5
    )  # per prompt: slot 0's code 0, slot 1's


# --------------------------------------------------------------------------- the factor read back from the text


def wilson_by_hand(k: int, n: int, z: float = 1.959963984540054) -> list[float]:
    """The Wilson score interval: centre ``(p + z^2 / 2n) / (1 + z^2 / n)``, half-width ``z / (1 + z^2 / n) *
    sqrt(p (1 - p) / n + z^2 / 4n^2)``, z the normal's 97.5 % point."""
    p, shrink = k / n, 1 + z * z / n
    centre = (p + z * z / (2 * n)) / shrink
    half = z / shrink * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [centre - half, centre + half]


def interval_shown(k: int, n: int) -> str:
    low, high = wilson_by_hand(k, n)
    return f"[{low:.2f}, {high:.2f}]"


def _two_stage_atoms(right, count):
    """The exact distribution ``{share: probability}`` of one two-stage resample: the prompts drawn with replacement,
    then each drawn prompt's generations at its share (``right[p]`` of ``count[p]``), by enumeration."""
    from itertools import product

    from scipy.stats import binom

    P, atoms = len(count), {}
    for picks in product(range(P), repeat=P):
        total = sum(count[p] for p in picks)
        parts = [{k: binom.pmf(k, count[p], right[p] / count[p]) for k in range(count[p] + 1)} for p in picks]
        for ks in product(*[list(part) for part in parts]):
            prob = math.prod(part[k] for part, k in zip(parts, ks, strict=True)) / P**P
            atoms[sum(ks) / total] = atoms.get(sum(ks) / total, 0.0) + prob
    return atoms


def test_share_interval_by_hand_and_against_enumeration():
    """The read-back's interval, two-stage: two prompts, 2 of 2 and 1 of 2 right. A draw takes the first prompt
    twice (1/4: share 1), the second twice (1/4: Binomial(4, 1/2) / 4) or one of each (1/2: (2 + Binomial(2, 1/2))
    / 4); so P(0) = 1/64, P(1/4) = 1/16, P(1/2) = 7/32, P(3/4) = 5/16, P(1) = 25/64: the 95 % interval is
    [1/4, 1] and the middle 50 % [1/2, 1]. Prompt ids are any integers. Against the exact distribution of three
    uneven prompts, each percentile away from the atoms' jumps; every generation right is a point; eight prompts
    that each score 15 of 16 are not (resampling the prompts alone would give 0.9375 exactly)."""
    atoms = _two_stage_atoms([2, 1], [2, 2])
    assert atoms == pytest.approx({0.0: 1 / 64, 0.25: 1 / 16, 0.5: 7 / 32, 0.75: 5 / 16, 1.0: 25 / 64})
    hits, prompts = [True, True, True, False], [7, 7, -2, -2]
    assert share_interval(hits, prompts, resamples=20000) == [0.25, 1.0]
    assert share_interval(hits, prompts, resamples=20000, confidence=0.5) == [0.5, 1.0]
    right, count = [3, 1, 2], [3, 2, 4]
    atoms = _two_stage_atoms(right, count)
    values, cdf = np.array(sorted(atoms)), np.cumsum([atoms[v] for v in sorted(atoms)])
    hits = [k < r for r, c in zip(right, count, strict=True) for k in range(c)]
    prompts = [p for p, c in enumerate(count) for _ in range(c)]
    for confidence in (0.9, 0.46):
        tail = (1 - confidence) / 2
        assert min(abs(cdf - tail).min(), abs(cdf - 1 + tail).min()) > 0.007  # away from a jump (5 sd of 20,000)
        expected = [values[np.searchsorted(cdf, q)] for q in (tail, 1 - tail)]
        assert share_interval(hits, prompts, resamples=20000, confidence=confidence) == pytest.approx(expected)
    assert share_interval([True] * 6, [0, 0, 1, 1, 2, 2]) == [1.0, 1.0]
    low, high = share_interval([k < 15 for _ in range(8) for k in range(16)], [p for p in range(8) for _ in range(16)])
    assert low < 0.9 < 0.9375 < high <= 1.0
    for bad in (dict(hits=[], prompts=[]), dict(hits=[True], prompts=[0, 1])):
        with pytest.raises(ValueError, match="need one prompt per generation"):
            share_interval(**bad)
    with pytest.raises(ValueError, match="need resamples >= 1"):
        share_interval([True], [0], resamples=0)


def test_wilson_interval_by_hand():
    for k, n in ((2, 5), (0, 8), (8, 8), (60, 64), (61, 64), (1, 1)):
        assert wilson_interval(k, n) == pytest.approx(wilson_by_hand(k, n), abs=1e-9), (k, n)
    low, high = wilson_interval(61, 64)  # 0.953 of 64 generations: 0.95 is well inside
    assert low < 0.9 < 0.95 < high < 1
    assert wilson_interval(0, 8)[0] == pytest.approx(0, abs=1e-12) and wilson_interval(8, 8)[1] == pytest.approx(1)


def test_factor_accuracy_by_hand():
    def detector(factor, text):  # the first word, when it is a colour
        word = text.split()[0] if text.split() else ""
        return word if word in ("red", "blue", "green") else None

    texts = ["red car", "blue sky", "red sky", "nothing", "green", "blue"]
    expected = [{"c": "red"}, {"c": "blue"}, {"c": "blue"}, {"c": "red"}, {}, {"c": "green", "d": "x"}]
    values = {"c": ["red", "blue", "green", "red"], "d": ["x", "y", "x", "y"]}
    got = factor_accuracy(texts, expected, values, detector)
    # c: scored 0, 1, 2, 3, 5 -> red ok, blue ok, red for blue, none for red, blue for green: 2 of 5, 1 none
    assert got["c"]["accuracy_interval"] == pytest.approx(wilson_by_hand(2, 5))
    assert got["c"] == {
        "accuracy": 2 / 5,
        "accuracy_interval": got["c"]["accuracy_interval"],
        "none_share": 1 / 5,
        "chance": 1 / 3,
        "majority_share": 2 / 5,  # red and blue are each wanted by 2 of the 5: one answer for all is right for 2
        "generations_scored": 5,
        "per_value": {"blue": 1 / 2, "green": 0.0, "red": 1 / 2},
    }
    assert got["d"]["generations_scored"] == 1 and got["d"]["accuracy"] == 0.0 and got["d"]["chance"] == 1 / 2
    assert got["d"]["majority_share"] == 1.0
    empty = factor_accuracy([], [], {"c": ["a", "b"]}, detector)["c"]
    assert empty["accuracy"] is None and empty["majority_share"] is None
    with pytest.raises(ValueError, match="2 texts for 1 expected"):
        factor_accuracy(["a", "b"], [{}], values, detector)
    assert "weighted_accuracy" not in got["c"]
    # weighted by each generation's latent's share: c's right ones weigh 0.5 + 0.2 of the scored 0.5 + 0.2 + 0.1 +
    # 0.2 + 0.0 (generation 4 is not scored for c); d's one scored generation weighs nothing
    weighted = factor_accuracy(texts, expected, values, detector, [0.5, 0.2, 0.1, 0.2, 0.7, 0.0])
    assert weighted["c"]["weighted_accuracy"] == pytest.approx(0.7 / 1.0)
    assert weighted["d"]["weighted_accuracy"] is None
    assert {k: v for k, v in weighted["c"].items() if k != "weighted_accuracy"} == got["c"]
    for bad in ([0.5] * 5, [0.5, 0.2, 0.1, 0.2, 0.7, -0.1], [0.5, 0.2, 0.1, 0.2, 0.7, float("nan")]):
        with pytest.raises(ValueError, match="weights must be 6 finite numbers >= 0"):
            factor_accuracy(texts, expected, values, detector, bad)
    # with the generations' ends: c's scored generations 0, 1, 2, 3, 5, of which 1 and 3 were cut at the cap, leave
    # 0 (right), 2 (wrong) and 5 (wrong); d's one scored generation (5) ended and is wrong
    ends = factor_accuracy(texts, expected, values, detector, None, [True, False, True, False, False, True])
    assert ends["c"]["generations_ended"] == 3 and ends["c"]["ended_accuracy"] == pytest.approx(1 / 3)
    assert ends["d"]["generations_ended"] == 1 and ends["d"]["ended_accuracy"] == 0.0
    assert {k: v for k, v in ends["c"].items() if k not in ("generations_ended", "ended_accuracy")} == got["c"]
    none_ended = factor_accuracy(texts, expected, values, detector, None, [False] * 6)["c"]
    assert none_ended["generations_ended"] == 0 and none_ended["ended_accuracy"] is None
    with pytest.raises(ValueError, match="5 ended flags for 6 texts"):
        factor_accuracy(texts, expected, values, detector, None, [True] * 5)
    # by prompt: c's scored generations 0, 1, 2, 3, 5 answer prompts a, a, b, b, b: a 2 of 2 right, b 0 of 3 (shares
    # 1 and 0: the draws within a prompt change nothing); a draw takes a twice (1/4: share 1), b twice (1/4: 0) or
    # one of each (1/2: 2/5), so the 95 % interval is [0, 1] and the middle 40 % exactly 2/5; generation 4 (not
    # scored for c) does not count
    prompts = [0, 0, 1, 1, 0, 1]
    by_prompt = factor_accuracy(texts, expected, values, detector, None, None, prompts)
    assert by_prompt["c"]["accuracy_interval_by_prompt"] == [0.0, 1.0]
    assert share_interval([True, True, False, False, False], [0, 0, 1, 1, 1], confidence=0.4) == [0.4, 0.4]
    assert by_prompt["d"]["accuracy_interval_by_prompt"] == [0.0, 0.0]
    assert {k: v for k, v in by_prompt["c"].items() if k != "accuracy_interval_by_prompt"} == got["c"]
    assert factor_accuracy([], [], {"c": ["a"]}, detector, None, None, [])["c"]["accuracy_interval_by_prompt"] is None
    with pytest.raises(ValueError, match="5 prompts for 6 texts"):
        factor_accuracy(texts, expected, values, detector, None, None, [0] * 5)


def test_code_shares_by_hand():
    codes = np.array([[0, 2], [1, 2], [0, 0], [0, 2]])
    assert code_shares(codes) == {(0, 0): 0.75, (0, 1): 0.25, (1, 0): 0.25, (1, 2): 0.75}
    assert code_shares(torch.tensor([[3]])) == {(0, 3): 1.0}
    assert code_shares(np.zeros((0, 1), dtype=int)) == {}


def test_the_read_back_weighted_by_the_codes_use(discrete):
    """``weighted_accuracy`` on data where code 0 holds fewer examples than the others (two in three of its examples
    left out): recomputed by hand from the report's generations (every prompt shown), the codes' shares and the
    value each stands for; with code 0's generations all wrong, the plain accuracy loses a quarter and the weighted
    one code 0's share."""
    model, tokenizer, config, examples, cache, pairs = discrete
    codes = posterior_latents(model, examples, cache, tokenizer.pad_token_id)["codes"]
    kept = [i for i in range(len(examples)) if codes[i, 0] != 0 or i % 3 == 0]
    examples, pairs = [examples[i] for i in kept], [pairs[i] for i in kept]
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 16, "cpu", False)
    codes = codes[kept]
    share = float((codes[:, 0] == 0).mean())
    assert 0 < share < 0.2  # uneven: any weighting other than the codes' own would show
    data = (model, tokenizer, config, examples, cache, pairs)
    options = dict(OPTIONS, num_prompts=EXAMPLES_SHOWN, max_new_tokens=64)

    def wrong_for_code_0(factor, text):  # the generations under code 0 read as no value
        return None if text in under_code_0 else clean_detector(factor, text)

    report = controllability(*data, **options, detector=clean_detector)
    entry = report["factor_accuracy"]["factors"]["label"]
    by_hand = weighted_by_hand(report["examples"], codes, codes, [e.label for e in examples])
    assert entry["weighted_accuracy"] == pytest.approx(by_hand) == 1.0 and entry["accuracy"] == 1.0
    under_code_0 = {e["text"] for e in report["examples"] if e["latent"] == "codes=0"}
    broken = controllability(*data, **options, detector=wrong_for_code_0)
    entry = broken["factor_accuracy"]["factors"]["label"]
    assert entry["accuracy"] == pytest.approx(0.75)
    assert entry["weighted_accuracy"] == pytest.approx(1 - share)
    # each of the two prompts has 3 of its 4 generations right: the prompts' resample is always 0.75, and the
    # generations' within them, Binomial(8, 3/4) / 8, spreads it
    low, high = entry["accuracy_interval_by_prompt"]
    assert low < 0.75 < high and [low, high] == share_interval([True] * 6 + [False] * 2, [0] * 8)
    shown = (
        f"accuracy 0.750 {interval_shown(6, 8)} (by prompt [{low:.2f}, {high:.2f}]), weighted by use {1 - share:.3f}"
    )
    assert shown in "\n".join(summary_lines(broken))


def test_synthetic_detector_reads_the_built_in_sets_and_nothing_else():
    from disentanglement.synthetic import make_two_factor

    rows = make_two_factor(rows=16, seed=3)
    name, detector = synthetic_detector([r["source"] for r in rows])
    assert name == "two-factor"
    for row in rows:
        assert {f: detector(f, row["response"]) for f in ("A", "B")} == row["label"]
    assert detector("topic", rows[0]["response"]) is None  # not a factor of the set
    assert synthetic_detector(["synth/two-factor:#0", "synth/clean:#1"]) is None  # two sets
    assert synthetic_detector(["synth/two-factor:#0", "mine:3"]) is None
    assert synthetic_detector(["synth/no-such-set:#0"]) is None
    assert synthetic_detector(["hidden-factor/clean:#0"]) is None
    # a JSONL file's examples are sourced path:line: the set is found by its factors, if it reads the real rows
    factors = {f: [r["label"][f] for r in rows] for f in ("A", "B")}
    responses = [r["response"] for r in rows]
    name, by_factors = synthetic_detector([f"data.jsonl:{i}" for i in range(16)], factors, responses)
    assert name == "two-factor" and by_factors("A", responses[0]) == rows[0]["label"]["A"]
    assert synthetic_detector(["d.jsonl:1"] * 16, factors, ["no marker at all"] * 16) is None  # reads nothing back
    assert synthetic_detector(["d.jsonl:1"] * 16, {"C": ["x"] * 16}, responses) is None  # no set has factor C


def clean_detector(factor, text):
    from disentanglement.testing import detect_style

    found = detect_style(text, "clean", NUM_FACTORS)
    return None if found is None else str(found)


def test_trained_codes_generate_their_factor_as_read_from_the_text(discrete):
    # at 40 new tokens (characters here) the longest phrase is cut short: the detector finds no value in it
    short = controllability(*discrete, **OPTIONS, detector=clean_detector)
    cut = short["factor_accuracy"]["factors"]["label"]
    assert cut["per_value"] == {"0": 0.0, "1": 1.0, "2": 1.0, "3": 1.0} and cut["none_share"] == 0.25
    # ... and those are the generations cut at the cap: the ones that ended are all right
    assert short["truncated_share"] == 0.25 and cut["generations_ended"] == 12 and cut["ended_accuracy"] == 1.0
    low, high = cut["accuracy_interval_by_prompt"]
    assert low < 0.75 < high
    shown = (
        f"accuracy 0.750 {interval_shown(12, 16)} (by prompt [{low:.2f}, {high:.2f}]), weighted by use 0.750, 1.000 "
        "of the 12 that ended (chance"
    )
    assert shown in "\n".join(summary_lines(short))
    options = dict(OPTIONS, max_new_tokens=64)
    report = controllability(*discrete, **options, detector=clean_detector, detector_name="clean phrases")
    entry = report["factor_accuracy"]["factors"]["label"]
    assert report["factor_accuracy"]["detector"] == "clean phrases"
    assert entry["accuracy"] == 1.0 and entry["none_share"] == 0.0 and entry["chance"] == 1 / NUM_FACTORS
    assert entry["generations_scored"] == 4 * NUM_FACTORS
    assert entry["majority_share"] == 0.25  # the four codes stand for four values
    assert (
        f"  factor label read from the text: accuracy 1.000 {interval_shown(16, 16)} (by prompt [1.00, 1.00]), "
        "weighted by use 1.000 (chance "
        "0.250, majority 0.250; no value found 0.000) over 16" in ("\n".join(summary_lines(report)))
    )
    assert report["truncated_share"] == 0.0 and entry["generations_ended"] == 16 and entry["ended_accuracy"] == 1.0
    # a detector that finds nothing: every scored generation is 'no value', none right
    blind = controllability(*discrete, **options, detector=lambda f, t: None)["factor_accuracy"]["factors"]["label"]
    assert blind["accuracy"] == 0.0 and blind["none_share"] == 1.0
    # the tiny data's sources name no built-in set: no detector, no factor_accuracy
    assert "factor_accuracy" not in controllability(*discrete, **OPTIONS)


def test_code_labels_by_hand():
    codes = np.array([[0, 1], [0, 1], [1, 1], [0, 0]])  # 4 examples, 2 slots
    factors = {"a": ["x", "y", "y", "x"], "b": ["p", "p", "q", "q"]}
    assert code_labels(codes, factors) == {
        (0, 0): {"a": "x", "b": "p"},  # rows 0, 1, 3
        (0, 1): {"a": "y", "b": "q"},  # row 2
        (1, 1): {"a": "y", "b": "p"},  # rows 0, 1, 2
        (1, 0): {"a": "x", "b": "q"},  # row 3
    }
    assert code_labels(torch.tensor([[2], [2]]), {"a": ["z", "b"]}) == {(0, 2): {"a": "b"}}  # a tie: the smallest
    assert code_labels(np.zeros((0, 1), dtype=int), {}) == {}
    with pytest.raises(ValueError, match="factor 'a' has 1 values for 2 examples' codes"):
        code_labels(np.array([[0], [1]]), {"a": ["x"]})


def weighted_by_hand(shown, named_by, weighed_by, labels):
    """The read-back of the generations ``shown`` (a report's examples, every prompt's): each code stands for its
    majority value among the examples ``named_by`` (codes ``[E, 1]``) gives it and weighs its share under
    ``weighed_by``; codes that stand for nothing or weigh nothing are left out."""
    named = code_labels(np.asarray(named_by), {"label": labels})
    weighed = np.asarray(weighed_by)[:, 0]
    right = total = 0.0
    for example in shown:
        k = int(example["latent"].removeprefix("codes="))
        share = float((weighed == k).mean())
        if (0, k) in named and share > 0:
            total += share
            right += share * (clean_detector("label", example["text"]) == named[(0, k)]["label"])
    return right / total


def test_read_back_by_the_decoders_codes(discrete, continuous):
    """With the decoder's likeliest codes of the real examples, each code stands for its majority value among the
    examples the decoder gives it: equal to the encoder's read-back where they are the encoder's codes, 0 where
    every code is renamed to the next one (each code then stands for the value its neighbour writes)."""
    model, tokenizer, _, examples, cache, _ = discrete
    codes = posterior_latents(model, examples, cache, tokenizer.pad_token_id)["codes"]  # [E, 1]
    options = dict(OPTIONS, max_new_tokens=64, detector=clean_detector)
    same = controllability(*discrete, **options, decoder_codes=codes)["factor_accuracy"]
    assert same["decoder_codes"] == same["factors"] and same["factors"]["label"]["accuracy"] == 1.0
    renamed = controllability(*discrete, **options, decoder_codes=torch.from_numpy((codes + 1) % model.codebook_size))
    entry = renamed["factor_accuracy"]["decoder_codes"]["label"]
    assert renamed["factor_accuracy"]["factors"]["label"]["accuracy"] == 1.0 and entry["accuracy"] == 0.0
    assert entry["none_share"] == 0.0 and entry["majority_share"] == 0.25  # read, and still four values
    assert (
        "    each code standing for its majority value under the decoder's likeliest codes: accuracy 0.000, "
        "weighted by use 0.000 (majority 0.250) over 16 generations" in summary_lines(renamed)
    )
    assert "decoder_codes" not in controllability(*discrete, **options)["factor_accuracy"]
    # code 0's examples given code 1: code 1 stands for the majority of both, code 0 for none (unscored), and the
    # weighted read-back takes the decoder's shares, not the encoder's (recomputed from every generation shown)
    moved = np.where(codes == 0, 1, codes)
    shown = dict(options, num_prompts=EXAMPLES_SHOWN)
    report = controllability(*discrete, **shown, decoder_codes=moved)
    entry = report["factor_accuracy"]["decoder_codes"]["label"]
    labels = [e.label for e in examples]
    by_hand = weighted_by_hand(report["examples"], moved, moved, labels)
    assert entry["weighted_accuracy"] == pytest.approx(by_hand) and 0 < by_hand < 1
    assert by_hand != pytest.approx(weighted_by_hand(report["examples"], moved, codes, labels))  # the encoder's shares
    # a code the decoder gives no example: its generations are not scored by the decoder's codes
    merged = np.where(codes == 3, 0, codes)
    entry = controllability(*discrete, **options, decoder_codes=merged)["factor_accuracy"]["decoder_codes"]["label"]
    kept = code_labels(merged, {"label": [e.label for e in examples]})[(0, 0)]["label"]
    own = code_labels(codes, {"label": [e.label for e in examples]})[(0, 0)]["label"]
    assert entry["generations_scored"] == 12 and entry["accuracy"] == (1.0 if kept == own else 8 / 12)
    E = len(examples)
    for bad, message in (
        (codes[:2], rf"\[examples, slots\] = \[{E}, 1\]; got int64 of shape \[2, 1\]"),
        (codes[:, 0], rf"got int64 of shape \[{E}\]"),
        (codes.astype(float), "got float64"),
        (codes + model.codebook_size, f"must lie in 0..{model.codebook_size - 1}"),
    ):
        with pytest.raises(ValueError, match=message):
            controllability(*discrete, **options, decoder_codes=bad)
    with pytest.raises(ValueError, match="this model's latent is continuous"):
        controllability(*continuous, **options, decoder_codes=np.zeros((E, 1), dtype=int))


def test_eval_generation_reads_back_by_the_decoders_codes_of_its_own_report(discrete_run, discrete, tmp_path):
    """``eval --generation`` hands the controllability the decoder's codes its own scoring found (in the order of
    the examples, which scoring visits by length), and reports and prints the read-back by them."""
    import disentanglement.controllability as module
    from disentanglement.commands import eval_summary_lines

    model, tokenizer, _, examples, cache, _ = discrete
    expected = evaluate_records(model, examples, cache, tokenizer.pad_token_id, progress=False)[1]["decoder_codes"]
    seen = {}
    real = module.controllability

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "controllability", spy)
        patch.setattr(module, "synthetic_detector", lambda *args: ("clean phrases", clean_detector))
        report, json_path, _ = run_eval(
            discrete_run.checkpoint,
            output=tmp_path / "e.json",
            progress=False,
            generation=True,
            generation_prompts=4,
            generation_max_new_tokens=64,
            model_and_tokenizer=model_and_tokenizer(),
        )
    assert np.array_equal(seen["decoder_codes"], expected) and expected.shape == (len(examples), 1)
    codes = posterior_latents(model, examples, cache, tokenizer.pad_token_id)["codes"]
    assert report["decoder_posterior"]["agreement"] == pytest.approx(float((expected == codes).mean()))
    saved = json.loads(json_path.read_text())["controllability"]["factor_accuracy"]
    assert saved["decoder_codes"]["label"]["accuracy"] == 1.0 and saved["decoder_codes"]["label"]["per_value"]
    lines = eval_summary_lines(report)
    assert any(line.startswith("    each code standing for its majority value under the decoder's") for line in lines)


def test_continuous_attribute_vectors_are_read_from_the_text(continuous):
    report = controllability(*continuous, **OPTIONS, detector=clean_detector)
    entry = report["factor_accuracy"]["factors"]["label"]
    assert entry["generations_scored"] == 4 * NUM_FACTORS  # one per (prompt, attribute); prior draws unscored
    # each attribute vector weighted by its value's share of the real examples (every prompt shown)
    model, tokenizer, config, examples, cache, pairs = continuous
    shown = controllability(*continuous, **dict(OPTIONS, num_prompts=EXAMPLES_SHOWN), detector=clean_detector)
    labels = [e.label for e in examples]
    names = sorted(set(labels))
    right = total = 0.0
    for example in shown["examples"]:
        if example["latent"].startswith("factor label #"):
            value = names[int(example["latent"].rsplit("#", 1)[1])]
            total += labels.count(value) / len(labels)
            right += labels.count(value) / len(labels) * (clean_detector("label", example["text"]) == value)
    assert total > 0
    assert shown["factor_accuracy"]["factors"]["label"]["weighted_accuracy"] == pytest.approx(right / total)
    detected = [clean_detector("label", e["text"]) for e in report["examples"] if e["latent"].startswith("factor")]
    assert len(detected) == 2 * NUM_FACTORS
    # the attribute targets' generations, read back by hand, give the same shares (the first two prompts shown)
    assert 0 <= entry["accuracy"] <= 1 and 0 <= entry["none_share"] <= 1
    assert entry["accuracy"] * 16 == pytest.approx(round(entry["accuracy"] * 16))  # a share of 16 generations


def test_sampled_generations_are_seeded_and_cool_to_greedy(discrete):
    """``temperature`` above 0 samples from the decoder's whole distribution under ``seed``: the same seed gives
    the same report, another seed other texts, and near temperature 0 the greedy text."""
    greedy = controllability(*discrete, **OPTIONS)
    assert greedy["temperature"] == 0.0 and greedy["decoding"] == "greedy, at most 40 new tokens"
    caller = torch.get_rng_state()
    sampled = controllability(*discrete, **OPTIONS, temperature=2.0)
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's random state is kept
    assert sampled["decoding"] == "sampled at temperature 2 (top-p 1), at most 40 new tokens"
    assert controllability(*discrete, **OPTIONS, temperature=2.0) == sampled
    other_seed = controllability(*discrete, **dict(OPTIONS, seed=1), temperature=2.0)
    texts = [e["text"] for e in sampled["examples"]]
    assert texts != [e["text"] for e in greedy["examples"]]
    assert [e["text"] for e in other_seed["examples"]] != texts
    assert sampled["real_zfree_nll_per_token"] == greedy["real_zfree_nll_per_token"]
    # near temperature 0 the samples are the greedy text: sampling draws from the decoder's own distribution
    cold = controllability(*discrete, **OPTIONS, temperature=1e-4)
    assert [e["text"] for e in cold["examples"]] == [e["text"] for e in greedy["examples"]]
    assert cold["zfree_nll_per_token"] == pytest.approx(greedy["zfree_nll_per_token"])
    assert "for 4 prompts (sampled at temperature 2 (top-p 1)" in summary_lines(sampled)[0]
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="--generation-temperature must be a finite number >= 0"):
            controllability(*discrete, **OPTIONS, temperature=bad)


def test_nucleus_sampling_narrows_to_the_greedy_text(discrete):
    """``top_p`` below 1 samples from the nucleus: seeded like the whole distribution, other text than it at the
    same seed, and a nucleus of one token (a tiny mass) is the greedy text whatever the temperature."""
    greedy = controllability(*discrete, **OPTIONS)
    whole = controllability(*discrete, **OPTIONS, temperature=2.0)
    nucleus = controllability(*discrete, **OPTIONS, temperature=2.0, top_p=0.5)
    assert nucleus["top_p"] == 0.5 and whole["top_p"] == 1.0
    assert nucleus["decoding"] == "sampled at temperature 2 (top-p 0.5), at most 40 new tokens"
    assert controllability(*discrete, **OPTIONS, temperature=2.0, top_p=0.5) == nucleus
    assert [e["text"] for e in nucleus["examples"]] != [e["text"] for e in whole["examples"]]
    one_token = controllability(*discrete, **OPTIONS, temperature=2.0, top_p=1e-9)
    assert [e["text"] for e in one_token["examples"]] == [e["text"] for e in greedy["examples"]]
    with pytest.raises(ValueError, match="--generation-top-p 0.9 applies to sampling"):
        controllability(*discrete, **OPTIONS, top_p=0.9)
    for bad in (0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="--generation-top-p must be a number in"):
            controllability(*discrete, **OPTIONS, temperature=1.0, top_p=bad)


def test_generations_cut_at_the_cap_are_counted(discrete, monkeypatch):
    """``truncated_share``: at one new token at most, the share of generations with any text (a generation that
    ended at once is empty; every generation shown, each checked: here none ends); at 64 the trained tiny decoder
    ends every one. The summary line without any ended generation; the run's response cap as the default cap."""
    from disentanglement import controllability as module

    monkeypatch.setattr(module, "EXAMPLES_SHOWN", 10**6)
    one = controllability(*discrete, **dict(OPTIONS, max_new_tokens=1))
    texts = [e["text"] for e in one["examples"]]
    assert len(texts) == one["generations"]
    assert one["truncated_share"] == pytest.approx(np.mean([t != "" for t in texts]))
    assert one["truncated_share"] > 0
    assert "cut at the token cap 1.000" in summary_lines(one)[0]
    none_ended = {**one, "factor_accuracy": {"factors": {"f": {
        "accuracy": 0.5, "none_share": 0.0, "chance": 0.25, "majority_share": 0.5, "generations_scored": 4,
        "generations_ended": 0, "ended_accuracy": None}}}}  # fmt: skip
    assert "accuracy 0.500, none ended (chance 0.250" in "\n".join(summary_lines(none_ended))
    # without a cap the run's response cap is the cap (the tiny runs': 48)
    assert (
        controllability(*discrete, **dict(OPTIONS, max_new_tokens=None))["decoding"] == "greedy, at most 48 new tokens"
    )
    full = controllability(*discrete, **dict(OPTIONS, max_new_tokens=64))
    assert full["truncated_share"] == 0.0 and "cut at the token cap" not in summary_lines(full)[0]


def test_several_samples_per_prompt_and_latent(discrete, continuous, monkeypatch):
    """``samples`` draws that many generations under each target latent for each prompt, each scored on its own:
    the targets repeated per draw (the same prompt and latent), guided against the prompt's other latents of the
    same draw; near temperature 0 every draw is the greedy text, so the read-back over three draws is the greedy
    one over three times the generations; at temperature 2 the draws differ. Greedy several times is refused."""
    from disentanglement import controllability as module

    calls = []
    generate = module.generate_responses

    def recorded(model, tokenizer, rows, vectors, sampling, batch_size, progress, guidance=None, keys=None):
        texts, ended = generate(model, tokenizer, rows, vectors, sampling, batch_size, progress, guidance, keys)
        calls.append({"rows": rows, "vectors": vectors, "keys": keys, "texts": texts})
        return texts, ended

    monkeypatch.setattr(module, "generate_responses", recorded)
    options = dict(OPTIONS, max_new_tokens=64, detector=clean_detector)
    greedy = controllability(*discrete, **options)
    cold = controllability(*discrete, **options, temperature=1e-4, samples=3)
    G = greedy["generations"]
    assert cold["generations"] == 3 * G and cold["samples"] == 3 and greedy["samples"] == 1
    assert (
        cold["decoding"] == "sampled at temperature 0.0001 (top-p 1), at most 64 new tokens, 3 generations per "
        "prompt and latent"
    )
    one, three = calls[0], calls[1]
    assert three["rows"] == one["rows"] * 3 and torch.equal(three["vectors"], one["vectors"].repeat(3, 1))
    assert three["texts"] == one["texts"] * 3
    read, read3 = (r["factor_accuracy"]["factors"]["label"] for r in (greedy, cold))
    assert read3["generations_scored"] == 3 * read["generations_scored"]
    assert read3["accuracy"] == read["accuracy"] and read3["per_value"] == read["per_value"]
    assert cold["examples"] == greedy["examples"]  # the report shows the first draw's generations
    assert len(cold["zfree_nll_ratio_interval_same_prompts"]) == 2
    hot = controllability(*discrete, **options, temperature=2.0, samples=3)
    texts = calls[-1]["texts"]
    assert hot["generations"] == 3 * G and any(texts[i] != texts[i + G] for i in range(G))
    assert controllability(*discrete, **options, temperature=2.0, samples=3) == hot  # seeded
    # guided: each draw is contrasted with the prompt's other codes of its own draw, and cold it is the guided greedy
    guided = controllability(*discrete, **options, guidance=Guidance(3.0))
    guided3 = controllability(*discrete, **options, guidance=Guidance(3.0), temperature=1e-4, samples=2)
    keys = calls[-1]["keys"]
    assert len(set(keys)) == 2 * len(set(calls[-2]["keys"])) and keys[:G] == [k[:2] + (0,) for k in keys[G:]]
    assert calls[-1]["texts"] == calls[-2]["texts"] * 2
    assert (
        guided3["factor_accuracy"]["factors"]["label"]["accuracy"]
        == (guided["factor_accuracy"]["factors"]["label"]["accuracy"])
    )
    # diversity is each draw's, averaged: three copies of the greedy texts score as the greedy texts do
    for key in ("distinct_1", "distinct_2", "distinct_1_per_prompt", "distinct_2_per_prompt", "looping_share"):
        assert cold[key] == pytest.approx(greedy[key]), key
    # continuous: the draws of the prior's and the attributes' targets score as one (their copies share a vector)
    flat = controllability(*continuous, **OPTIONS)
    flat2 = controllability(*continuous, **OPTIONS, temperature=1e-4, samples=2)
    assert flat2["generations"] == 2 * flat["generations"]
    assert flat2["latent_recovery_accuracy"] == flat["latent_recovery_accuracy"]
    assert flat2["attributes"] == flat["attributes"]
    with pytest.raises(ValueError, match="--generation-samples must be an integer >= 1"):
        controllability(*discrete, **OPTIONS, temperature=1.0, samples=0)
    with pytest.raises(ValueError, match="--generation-samples 2 draws several generations .* above 0"):
        controllability(*discrete, **OPTIONS, samples=2)
