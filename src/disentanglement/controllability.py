"""Does forcing a latent steer the response the way the latent means? (``disentangle eval --generation``)

For ``P`` held-out prompts (a seeded choice of the distinct prompts of the evaluated data), generate one
response (greedy, or sampled at a temperature; or ``samples`` sampled ones, each a draw of its own) under each of a
set of target latents, then re-encode every
``(prompt, generation)`` pair with the model's own encoder, tokenised as in training (an empty generation is its
end-of-sequence token alone), and measure:

- **code recovery** (discrete): the targets are, for each slot ``m`` and code ``k``, the prompt's prior-mode
  codes with slot ``m`` set to ``k``; a generation is recovered when the argmax code of slot ``m`` of its
  re-encoding is ``k``. ``code_recovery_accuracy`` is the mean over slots of each slot's accuracy; chance is
  ``1/K`` (a collapsed encoder, which gives every response the same code, scores exactly that).
- **latent recovery** (continuous): the targets are ``J`` seeded draws from the prompt's prior ``p(z | x)``
  (``prior_latents``); a generation is recovered when the posterior mean of its re-encoding is nearer
  (Euclidean) to its own target than to the prompt's other ``J - 1`` targets. Chance ``1/J``.
- **attribute recovery** (continuous, labelled data): per factor and value ``v``, the target is the prompt's
  prior mean plus the attribute vector ``a_v = mean(mu | v) - mean(mu)`` of the real responses' posterior
  means; recovered when the re-encoding's ``mu - prior_mu`` is nearest to ``a_v`` among the factor's values.
- **label accuracy** (labelled data): a scikit-learn ``LogisticRegression`` (on standardised features) is
  trained per factor on the features the encoder sees (``model.encoder_input``: the frozen view, or with
  ``encoder_lora_layers`` that of the encoder's adapted pass) of the real
  responses of the evaluated data, and applied to the same features of the generations. The label a
  target stands for is its attribute's value (continuous) or the most frequent value among the real
  examples assigned to its code in that slot (discrete; codes no real example is assigned to are left
  out). ``real_accuracy`` is the same classifier's accuracy on a seeded quarter of the real responses
  held out from its training (how well the features can tell the labels at all).
- **factor accuracy** (labelled data with a detector, e.g. the built-in synthetic sets): the factor is read back
  from the generated text itself (``synthetic.detect_factor`` for data whose every source is ``synth/NAME:...``);
  per factor, ``accuracy`` is the share of the generations standing for a value (as for label accuracy) whose
  detected value is that value, ``none_share`` the share where the detector finds no single value, and
  ``chance`` one over the factor's number of values among the real examples; ``accuracy_interval`` (Wilson's,
  the generations as independent draws) and ``accuracy_interval_by_prompt`` (the prompts resampled, then the
  generations within each, :func:`share_interval`).
  Where the decoder's own likeliest code of each real example is given (``decoder_codes``: ``eval`` passes
  them where the prior mixture is exact over the codes, the ``decoder_posterior`` of its report), the same
  read-back is scored again with each code standing for its majority value among the real examples the
  *decoder* gives it (``factor_accuracy["decoder_codes"]``): generation decodes under a code, so what the code
  means to the decoder is what its generations should show, where the encoder's assignment can name the same
  groups differently. The generations of a code no real example has as its decoder's likeliest are not scored
  there (its ``generations_scored`` can be smaller); as in the encoder's, a tie goes to the smallest value.
  Both read-backs also give ``weighted_accuracy``, each generation weighted by its latent's share of the real
  examples (its code's in its slot, under the encoder's or the decoder's codes; an attribute vector's value's):
  with one slot, what a generation under a code drawn as the data draws them scores, where ``accuracy`` counts a
  code that holds two examples as much as one that holds sixty; with several, each slot's codes weighted so,
  the slots alike (a target sets one slot and keeps the prompt's prior mode in the others). And ``majority_share``: the share of the scored generations whose
  wanted value is the most common one among them, the accuracy of one answer for every generation (a decoder that
  writes the same value under every latent can score this much; with skewed labels it is well above ``chance``).
- **diversity**: distinct-1/2 over all generations, and the mean over prompts of distinct-1/2 across one
  prompt's generations (with several draws, each draw's, averaged over the draws); ``looping_share``, the share of
  generations that repeat a run of at most four words three times back to back (``metrics.loops``: a loop, which a
  low z-free NLL can hide).
- **fluency**: the z-free reference's NLL of the generations, nats per response token (the
  end-of-sequence token included, as in training), beside the same for all the real responses and for those of
  the prompts generated for (``real_zfree_nll_per_token_same_prompts``); the two ratios (``zfree_nll_ratio``,
  ``..._same_prompts``) and each one's 95 % two-stage percentile bootstrap interval: the generations resampled by
  prompt and, against the same prompts, their real responses with them, against the whole data its real responses
  by their own prompts; each side's rows then drawn again within its drawn prompts (``zfree_nll_ratio_interval``,
  ``..._same_prompts``, :func:`nll_ratio_interval`): with a few prompts a ratio moves by tenths from one prompt set
  to the next.

Deterministic given ``seed`` (greedy decoding by default, or sampling under the seed; the prior draws and the
split are seeded); the caller's random state and the model's mode are kept.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from .config import RunConfig
from .cvae_base import CVAEBase
from .data import Example, PromptResponse, collate, tokenize_pairs
from .evaluation import example_factor_values, posterior_latents
from .features import FeatureCache
from .generation import SamplingOptions, encode_prompts, generate_responses, prompt_features
from .guidance import Guidance
from .latent_space import LatentSpace, code_labels, code_shares
from .metrics import distinct_n, looping_share
from .reference import eval_mode

#: Generations of the first prompts shown in the report.
EXAMPLES_SHOWN = 2

#: ``detector(factor, text)``: the value of ``factor`` that a response text shows, or None when it shows none.
Detector = Callable[[str, str], "str | None"]


# --------------------------------------------------------------------------- pure parts


def recovery_accuracy(recovered: Sequence[Any], targets: Sequence[Any]) -> float:
    """The share of positions where ``recovered[i] == targets[i]`` (0.0 for none)."""
    if len(recovered) != len(targets):
        raise ValueError(f"{len(recovered)} recovered values for {len(targets)} targets")
    return float(np.mean([r == t for r, t in zip(recovered, targets, strict=True)])) if targets else 0.0


def nearest_target(points: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Index of the nearest (Euclidean) candidate of each point: ``points [N, D]``, ``candidates [N, J, D]``
    (each point its own candidates) -> ``[N]``; ties go to the lower index."""
    distances = (candidates - points.unsqueeze(1)).pow(2).sum(-1)  # [N, J]
    return distances.argmin(-1)


def fit_label_classifier(features: np.ndarray, labels: Sequence[str], seed: int = 0):
    """A scikit-learn pipeline (standardisation, then ``LogisticRegression``) fitted on ``features [E, F]``;
    None when the labels have fewer than two values."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if len(set(labels)) < 2:
        return None
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed))
    return classifier.fit(features, list(labels))


def held_out_accuracy(features: np.ndarray, labels: Sequence[str], seed: int = 0) -> float | None:
    """Accuracy on a seeded quarter of ``features`` of the classifier fitted on the rest (None when too few)."""
    order = list(range(len(labels)))
    random.Random(seed).shuffle(order)
    test, fit = order[: len(order) // 4], order[len(order) // 4 :]
    if not test:
        return None
    classifier = fit_label_classifier(features[fit], [labels[i] for i in fit], seed)
    if classifier is None:
        return None
    predicted = classifier.predict(features[test])
    return recovery_accuracy(list(predicted), [labels[i] for i in test])


def diversity(texts_per_prompt: Sequence[Sequence[str]]) -> dict[str, float]:
    """distinct-1/2 over every text, and their means over prompts of each prompt's texts; ``looping_share``, the
    share of the texts that repeat themselves (:func:`metrics.looping_share`)."""
    every = [t for texts in texts_per_prompt for t in texts]
    return {
        "distinct_1": distinct_n(every, 1),
        "distinct_2": distinct_n(every, 2),
        "distinct_1_per_prompt": float(np.mean([distinct_n(t, 1) for t in texts_per_prompt])),
        "distinct_2_per_prompt": float(np.mean([distinct_n(t, 2) for t in texts_per_prompt])),
        "looping_share": looping_share(every),
    }


def choose_prompts(prompts: Sequence[str], count: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts of ``prompts`` (all of them when fewer), a seeded choice in first-seen order."""
    unique = list(dict.fromkeys(prompts))
    chosen = set(random.Random(seed).sample(range(len(unique)), min(count, len(unique))))
    return [p for i, p in enumerate(unique) if i in chosen]


def real_zfree_nll(
    response_nll: Sequence[torch.Tensor], pairs: Sequence[Any] | None = None, prompts: Sequence[str] | None = None
) -> float:
    """The z-free NLL per token of the real responses (``response_nll``: each example's per-token NLL), pooled over
    their tokens; with ``pairs`` and ``prompts``, of the responses whose pair's prompt is one of ``prompts`` only
    (the real responses of the prompts generated for: the generations' like-for-like comparison, where the
    evaluated data's prompts ask for responses of other lengths and kinds than the chosen ones)."""
    chosen = range(len(response_nll))
    if prompts is not None:
        wanted = set(prompts)
        chosen = [i for i, pair in enumerate(pairs) if pair.prompt in wanted]
    tokens = sum(len(response_nll[i]) for i in chosen)
    return float(sum(response_nll[i].double().sum() for i in chosen) / tokens)


def nll_ratio_interval(
    generated: tuple[Sequence[float], Sequence[float], Sequence[int]],
    real: tuple[Sequence[float], Sequence[float], Sequence[int]],
    *,
    paired: bool,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> list[float]:
    """A two-stage percentile bootstrap interval of the generations' pooled z-free NLL per token over the real
    responses'.

    ``generated`` is ``(nll_sums, token_counts, prompt)`` per generation, the prompts numbered ``0 .. P-1``, each
    with a generation at least; ``real`` the same per real response. The generations are resampled by prompt, then
    within each drawn prompt (a prompt drawn ``c`` times brings ``c`` times its ``n`` generations, drawn from them
    with replacement): a prompt's generations share its difficulty, so they are not independent draws, and
    resampling the prompts alone leaves out the noise within a prompt (simulated over eight prompts it covered
    0.87-0.90 of a nominal 0.95, this 0.90-0.99; ``benchmarks/cvae-adds/interval_coverage.py``). ``paired`` (the
    ratio to the real responses of the same prompts): ``real``'s third field is the generations' prompt each
    response answers, every prompt answered, and each resample's real responses are its drawn prompts' (resampled
    within them the same way). Not paired (the ratio to the whole data's real responses): it numbers the real responses' own prompts
    ``0 .. Q-1``, drawn by prompt on their own, then within. Returns ``[low, high]``; with one prompt on each side
    and one row each, both equal the ratio itself. Example::

        nll_ratio_interval(([40.0, 50.0], [10, 10], [0, 1]), ([45.0, 45.0], [10, 10], [0, 1]), paired=True)
    """
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"need resamples >= 1 and 0 < confidence < 1, got {resamples} and {confidence}")
    gen, truth = _prompt_rows(generated, "generation"), _prompt_rows(real, "real response")  # P, Q lists of [n, 2]
    if paired and len(truth) != len(gen):
        raise ValueError(f"paired: the real responses answer {len(truth)} prompts, the generations {len(gen)}")
    rng = np.random.default_rng(seed)
    ratios = []
    widest = max(len(gen), len(truth), *(len(own) for own in gen + truth))  # the widest array drawn per resample
    for draws in _prompt_draws(len(gen), resamples, rng, widest):  # [b, P] counts
        real_draws = draws if paired else rng.multinomial(len(truth), np.full(len(truth), 1 / len(truth)), len(draws))
        g, r = _within_prompts(draws, gen, rng), _within_prompts(real_draws, truth, rng)  # [b, 2]: NLL and tokens
        ratios.append(g[:, 0] / g[:, 1] / (r[:, 0] / r[:, 1]))
    return _percentiles(np.concatenate(ratios), confidence)


def _within_prompts(draws: np.ndarray, rows: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """``[b, 2]``: each resample's NLL and token sums, prompt ``p`` drawn ``draws[:, p]`` times bringing as many
    times its ``n_p`` rows, drawn from them with replacement (a prompt of one row brings that row each time)."""
    sums = np.zeros((len(draws), 2))
    for p, own in enumerate(rows):
        if len(own) == 1:
            sums += draws[:, p, None] * own[0]
        else:
            sums += rng.multinomial(draws[:, p] * len(own), np.full(len(own), 1 / len(own))) @ own
    return sums


def share_interval(
    hits: Sequence[bool], prompts: Sequence[int], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> list[float]:
    """A two-stage percentile bootstrap interval of the share of ``hits`` (``prompts``: each generation's prompt, any
    integer ids): the prompts resampled, then each drawn prompt's generations resampled within it (a binomial draw
    at that prompt's share): a read-back's interval where a prompt's generations are not independent draws (its
    several codes, or several samples under one code, share its wording), without losing the noise within a prompt,
    which resampling prompts alone does (over eight prompts that all score 15 of 16 it would be a point). With every
    generation right (or every one wrong) both ends equal the share: read Wilson's interval there. Example::

        share_interval([True, True, False, True], [0, 0, 1, 1])
    """
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"need resamples >= 1 and 0 < confidence < 1, got {resamples} and {confidence}")
    if not len(hits) or len(hits) != len(prompts):
        raise ValueError(f"need one prompt per generation and a generation at least: {len(hits)}, {len(prompts)}")
    _, index = np.unique(np.asarray(prompts), return_inverse=True)
    right, count = np.bincount(index, weights=np.asarray(hits, dtype=float)), np.bincount(index)  # [P] each
    rng = np.random.default_rng(seed)
    shares = []
    for draws in _prompt_draws(len(count), resamples, rng, len(count)):  # [b, P] counts
        # a prompt drawn c times brings c * n_p generations, each right at its share: Binomial(c * n_p, share_p)
        shares.append(rng.binomial(draws * count, right / count).sum(1) / (draws @ count))
    return _percentiles(np.concatenate(shares), confidence)


def _prompt_draws(prompts: int, resamples: int, rng: np.random.Generator, width: int):
    """``resamples`` bootstrap draws of ``prompts`` prompts, as counts ``[b, prompts]`` in chunks of at most 4M
    numbers (``width``: the widest count array drawn beside them)."""
    chunk = max(1, 4_000_000 // width)
    for done in range(0, resamples, chunk):
        yield rng.multinomial(prompts, np.full(prompts, 1.0 / prompts), size=min(chunk, resamples - done))


def _percentiles(values: np.ndarray, confidence: float) -> list[float]:
    """``[low, high]``: the central ``confidence`` percentile interval of ``values``."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]


def _prompt_rows(rows: tuple[Sequence[float], Sequence[float], Sequence[int]], what: str) -> list[np.ndarray]:
    """Each prompt ``0 .. P-1``'s rows of ``(nll_sums, token_counts, prompt)``, an ``[n_p, 2]`` array of NLL and
    tokens, in the given order."""
    nll, tokens, prompt = (np.asarray(v) for v in rows)
    if not len(nll) or not len(nll) == len(tokens) == len(prompt):
        raise ValueError(f"need one NLL, token count and prompt per {what}: {len(nll)}, {len(tokens)}, {len(prompt)}")
    if prompt.dtype.kind not in "iu" or prompt.min() < 0:
        raise ValueError(f"each {what}'s prompt must be an index >= 0")
    if (tokens <= 0).any():  # a resample of that row alone would be 0 / 0
        raise ValueError(f"{what} {int(np.flatnonzero(tokens <= 0)[0])} has no tokens")
    order = np.argsort(prompt, kind="stable")
    both = np.stack([nll, tokens], axis=1).astype(float)[order]
    grouped = np.split(both, np.cumsum(np.bincount(prompt))[:-1])  # bincount: one count per prompt 0 .. max
    empty = [p for p, own in enumerate(grouped) if not len(own)]
    if empty:
        raise ValueError(f"prompt {empty[0]} of 0-{len(grouped) - 1} has no {what}")
    return grouped


#: A detector is used only when it reads at least this share of the real responses' factor values back.
DETECTOR_MIN_REAL_ACCURACY = 0.9


def synthetic_detector(
    sources: Sequence[str], factors: dict[str, list[str]] | None = None, responses: Sequence[str] | None = None
) -> tuple[str, Detector] | None:
    """``(set name, detector)`` of the built-in synthetic set the data comes from (names joined by ``/`` when
    several sets with the same factors read the data alike), the detector being
    ``synthetic.detect_factor`` of that set; else None. The set is the one every source names
    (``synth/NAME:...``, as ``data synth`` writes in its rows), or else (a JSONL file's examples are sourced
    ``path:line``) the first set whose factors are exactly the data's ``factors`` and whose detector reads
    back at least :data:`DETECTOR_MIN_REAL_ACCURACY` of the real ``responses``' values of every factor."""
    from .synthetic import SYNTHETIC_SETS, detect_factor

    names = {m.group(1) if (m := re.match(r"synth/([^:]+):", s or "")) else None for s in sources}
    if len(names) == 1 and None not in names and (name := next(iter(names))) in SYNTHETIC_SETS:
        candidates = [name]
    elif factors and responses is not None and len(responses) == len(next(iter(factors.values()))):
        candidates = [n for n, spec in SYNTHETIC_SETS.items() if set(spec.factors) == set(factors)]
        candidates = [
            n
            for n in candidates
            if all(
                recovery_accuracy([detect_factor(n, f, r) for r in responses], values) >= DETECTOR_MIN_REAL_ACCURACY
                for f, values in factors.items()
            )
        ]
    else:
        candidates = []
    if not candidates:
        return None
    name = candidates[0]  # sets with the same factors read them alike (style-in-content, style-in-echo)
    factors = SYNTHETIC_SETS[name].factors

    def detector(factor: str, text: str) -> str | None:
        return detect_factor(name, factor, text) if factor in factors else None

    return "/".join(candidates), detector


def majority_share_of(wanted: Sequence[Any]) -> float | None:
    """The share of ``wanted`` equal to its most common value: the accuracy of one answer for all (None if empty)."""
    if not wanted:
        return None
    return max(Counter(wanted).values()) / len(wanted)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> list[float]:
    """The Wilson score interval ``[low, high]`` of a share ``successes / trials`` (scipy's ``binomtest``): how
    far the share of a few dozen generations may sit from the share a decoder would write over many, the
    generations taken as independent draws (they are not quite: one code's share its prompts' together)."""
    from scipy.stats import binomtest

    interval = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    return [float(interval.low), float(interval.high)]


def factor_accuracy(
    texts: Sequence[str],
    expected: Sequence[dict[str, str]],
    values: dict[str, list[str]],
    detector: Detector,
    weights: Sequence[float] | None = None,
    ended: Sequence[bool] | None = None,
    prompts: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per factor of ``values`` (each real example's value), the factor read back from the generated ``texts``
    by ``detector`` against ``expected[i][factor]``, the value generation ``i`` stands for (generations
    without one for the factor are not scored): ``{"accuracy", "accuracy_interval", "none_share", "chance",
    "majority_share", "generations_scored", "per_value": {value: accuracy}}`` (:func:`majority_share_of`; the
    interval :func:`wilson_interval`'s 95 %); accuracy, its interval, none_share and majority_share are None when
    nothing is scored. With ``weights`` (one per text: the share of the real examples
    that generation ``i``'s latent stands for, e.g. its code's) also ``weighted_accuracy``, the scored
    generations' accuracy weighted by them: what a generation under a latent drawn as the data draws them scores,
    where ``accuracy`` counts a code that holds two examples as much as one that holds sixty (None when the scored
    weights sum to 0). With ``ended`` (one per text: whether the generation ended before the token cap) also
    ``ended_accuracy`` and ``generations_ended``: the accuracy over the scored generations that ended (None when
    none did); a generation cut at the cap never wrote its end, where a suffix would be. With ``prompts`` (one per
    text: the prompt it answers) also ``accuracy_interval_by_prompt``, the accuracy's 95 % bootstrap interval with
    the prompts resampled and the generations within them (:func:`share_interval`, seeded by ``seed``): the Wilson
    interval takes every generation as an independent draw, where a prompt's generations share its wording (None
    when nothing is scored)."""
    if len(texts) != len(expected):
        raise ValueError(f"{len(texts)} texts for {len(expected)} expected values")
    if weights is not None and (len(weights) != len(texts) or any(not 0 <= w < math.inf for w in weights)):
        raise ValueError(f"weights must be {len(texts)} finite numbers >= 0, one per text")
    if ended is not None and len(ended) != len(texts):
        raise ValueError(f"{len(ended)} ended flags for {len(texts)} texts")
    if prompts is not None and len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts for {len(texts)} texts")
    out: dict[str, dict[str, Any]] = {}
    for name, real in values.items():
        scored = [i for i, e in enumerate(expected) if name in e]
        detected = [detector(name, texts[i]) for i in scored]
        wanted = [expected[i][name] for i in scored]
        per_value = {
            v: recovery_accuracy([d for d, w in zip(detected, wanted, strict=True) if w == v], [v] * wanted.count(v))
            for v in sorted(set(wanted))
        }
        right = sum(d == w for d, w in zip(detected, wanted, strict=True))
        out[name] = {
            "accuracy": recovery_accuracy(detected, wanted) if scored else None,
            "accuracy_interval": wilson_interval(right, len(scored)) if scored else None,
            "none_share": float(np.mean([d is None for d in detected])) if scored else None,
            "chance": 1 / len(set(real)),
            "majority_share": majority_share_of(wanted),
            "generations_scored": len(scored),
            "per_value": per_value,
        }
        if prompts is not None:
            hits = [d == w for d, w in zip(detected, wanted, strict=True)]
            by_prompt = share_interval(hits, [prompts[i] for i in scored], seed=seed) if scored else None
            out[name]["accuracy_interval_by_prompt"] = by_prompt
        if weights is not None:
            total = sum(weights[i] for i in scored)
            correct = sum(weights[i] for i, d, w in zip(scored, detected, wanted, strict=True) if d == w)
            out[name]["weighted_accuracy"] = correct / total if total > 0 else None
        if ended is not None:
            done = [j for j, i in enumerate(scored) if ended[i]]  # positions among the scored
            out[name]["generations_ended"] = len(done)
            out[name]["ended_accuracy"] = (
                recovery_accuracy([detected[j] for j in done], [wanted[j] for j in done]) if done else None
            )
    return out


# --------------------------------------------------------------------------- re-encoding


def generated_examples(
    tokenizer: Any, config: RunConfig, prompts: Sequence[str], texts: Sequence[str]
) -> list[Example]:
    """``(prompt, generation)`` pairs tokenised as in training; a generation of zero tokens without a chat
    template becomes the end-of-sequence token alone (what training makes of a response's end)."""
    pairs = [PromptResponse(p, t, None, f"generation:{i}") for i, (p, t) in enumerate(zip(prompts, texts, strict=True))]
    use_template = bool(config.data.chat_template and getattr(tokenizer, "chat_template", None))
    empty: set[int] = set()
    if not use_template:
        empty = {i for i, ids in enumerate(tokenizer(list(texts), add_special_tokens=False)["input_ids"]) if not ids}
    examples: list[Example | None] = [None] * len(pairs)
    kept = [i for i in range(len(pairs)) if i not in empty]
    if kept:
        tokenised, _ = tokenize_pairs([pairs[i] for i in kept], tokenizer, config.data)
        for i, example in zip(kept, tokenised, strict=True):
            examples[i] = example
    if empty:
        order = sorted(empty)
        for i, ids in zip(order, encode_prompts([prompts[i] for i in order], tokenizer, config.data), strict=True):
            examples[i] = Example(ids, [int(tokenizer.eos_token_id)], None, pairs[i].source)
    return examples  # type: ignore[return-value]


@torch.no_grad()
def reencode(model: CVAEBase, examples: Sequence[Example], pad_token_id: int, batch_size: int = 16) -> dict[str, Any]:
    """One frozen pass per batch over the generated pairs: the posterior (``codes [G, M]`` or ``mu [G, D]``),
    the encoder's input features ``[G, F]`` and the z-free NLL sum and token count of each response ``[G]``."""
    device = next(model.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(examples), batch_size):
        batch = collate(list(examples[start : start + batch_size]), pad_token_id).to(device)
        features = model.frozen_pass(batch)
        summary = model.posterior_summary(features)
        values = {
            "features": model.encoder_input(features).float(),
            "nll": (features.zfree_token_nll.double() * batch.target_mask[:, 1:].double()).sum(-1),
            "tokens": batch.response_lengths,
        }
        values.update(model.latent_space.reencoded_latent(summary))
        for key, value in values.items():
            parts.setdefault(key, []).append(value.cpu())
    return {key: torch.cat(chunks) for key, chunks in parts.items()}


@torch.no_grad()
def real_encoder_inputs(
    model: CVAEBase, examples: Sequence[Example], cache: FeatureCache, pad_token_id: int, batch_size: int = 32
) -> np.ndarray:
    """``model.encoder_input`` of the real examples, ``[E, F]``, in order (from their cached features)."""
    device = next(model.parameters()).device
    parts = []
    for start in range(0, len(examples), batch_size):
        indices = list(range(start, min(start + batch_size, len(examples))))
        batch = collate([examples[i] for i in indices], pad_token_id, indices=indices).to(device)
        parts.append(model.encoder_input(cache.features(batch)).float().cpu())
    return torch.cat(parts).numpy()


# --------------------------------------------------------------------------- the measure


def controllability(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    examples: Sequence[Example],
    cache: FeatureCache,
    pairs: Sequence[PromptResponse],
    *,
    num_prompts: int = 8,
    samples: int = 1,
    max_new_tokens: int | None = None,
    no_repeat_ngram: int = 0,
    prior_latents: int = 8,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    guidance: Guidance | None = None,
    detector: Detector | None = None,
    detector_name: str | None = None,
    decoder_codes: Any = None,
) -> dict[str, Any]:
    """The controllability report of a model on held-out data (see the module docstring); ``progress`` shows
    a progress bar over the generations; ``max_new_tokens`` defaults to the run's response cap
    (``config.data.max_response_tokens``). ``temperature`` 0 decodes greedily (the default); above 0 it samples
    at that temperature from the decoder's whole distribution (top-p 1, no top-k; a decoder's own generation
    config still applies), seeded by ``seed`` (the same text for the same seed and ``batch_size``): at 1, a
    decoder that fits the data writes responses as predictable to the z-free reference as the real ones, where
    greedy text is more predictable by construction. ``top_p`` below 1 samples from the nucleus instead (the
    likeliest tokens whose probabilities first reach it; sampling only). ``no_repeat_ngram`` N above 0 never
    writes the same N tokens in a row twice in one generation (:class:`.generation.SamplingOptions`), whichever
    the decoding. ``samples`` above 1 (sampling only) draws that many generations under each target latent for each
    prompt, every one scored as a generation of its own (guided, each draw against its own streams of the prompt's
    other latents): where the data has few distinct prompts (held-out ``style-in-content`` has eight), more
    generations to read a factor back from; they share their prompt, so the read-back's Wilson interval, which
    takes them as independent, is the narrower for it, where ``accuracy_interval_by_prompt`` and the NLL ratios'
    intervals resample prompts.

    ``examples`` and ``cache`` are the evaluated data and its frozen-pass features (as for
    ``evaluation.evaluate``), ``pairs`` their raw pairs (same order; the prompts' texts). Returns a JSON-able
    dict: ``prompts``, ``generations``, ``decoding``, ``code_recovery_accuracy`` and ``per_slot`` (discrete) or
    ``latent_recovery_accuracy`` and ``attributes`` (continuous), ``recovery_chance``, ``labels`` (per factor,
    when every example is labelled), distinct-n, ``zfree_nll_per_token``, ``real_zfree_nll_per_token`` (and
    ``..._same_prompts``), the ratios and their intervals,
    and ``examples`` (the first prompts' generations); with labelled data and a ``detector`` (default: the
    synthetic set's, :func:`synthetic_detector`, when the examples' sources name one) also ``factor_accuracy``
    (``{"detector": NAME, "factors": {factor: ...}}``, :func:`factor_accuracy`), and with ``decoder_codes``
    (``[E, M]``, the decoder's likeliest code of each example; discrete latents) its ``decoder_codes``, the same
    per factor with each code standing for its majority value under those codes. Example::

        report = controllability(model, tokenizer, config, examples, cache, pairs, num_prompts=4)
        report["code_recovery_accuracy"], report["labels"]["label"]["accuracy"]
    """
    if len(pairs) != len(examples) or len(cache) != len(examples):
        raise ValueError(f"{len(pairs)} pairs and {len(cache)} cached examples for {len(examples)} examples")
    if decoder_codes is not None:
        decoder_codes = _checked_codes(model, decoder_codes, len(examples))
    if max_new_tokens is None:
        max_new_tokens = config.data.max_response_tokens
    for name, value in (("num_prompts", num_prompts), ("samples", samples), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--generation-{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if isinstance(prior_latents, bool) or not isinstance(prior_latents, int) or prior_latents < 2:
        raise ValueError(f"--generation-latents must be an integer >= 2, got {prior_latents!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < math.inf:
        raise ValueError(f"--generation-temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise ValueError(f"--generation-top-p must be a number in (0, 1], got {top_p!r}")
    if top_p < 1 and temperature == 0:
        raise ValueError(f"--generation-top-p {top_p:g} applies to sampling: set --generation-temperature above 0")
    if samples > 1 and temperature == 0:
        raise ValueError(
            f"--generation-samples {samples} draws several generations per prompt and latent: set "
            "--generation-temperature above 0 (greedy decoding writes the same text each time)"
        )
    if isinstance(no_repeat_ngram, bool) or not isinstance(no_repeat_ngram, int) or no_repeat_ngram < 0:
        raise ValueError(f"--generation-no-repeat-ngram must be an integer >= 0, got {no_repeat_ngram!r}")
    if temperature > 0:
        sampling = SamplingOptions(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            no_repeat_ngram=no_repeat_ngram,
        )
        decoding = f"sampled at temperature {temperature:g} (top-p {top_p:g}), at most {max_new_tokens} new tokens"
    else:
        sampling = SamplingOptions(
            greedy=True, max_new_tokens=max_new_tokens, seed=seed, no_repeat_ngram=no_repeat_ngram
        )
        decoding = f"greedy, at most {max_new_tokens} new tokens"
    decoding += sampling.describe()
    if samples > 1:
        decoding += f", {samples} generations per prompt and latent"
    guidance = guidance if guidance is not None and guidance.scale > 0 else None
    if guidance is not None:
        decoding += f", guided at {guidance.scale:g} (plausibility {guidance.plausibility:g})"
    space = model.latent_space
    prompts = choose_prompts([p.prompt for p in pairs], num_prompts, seed)
    factors = example_factor_values(examples)
    targets, texts, ended, encoded, recovered, real_features = _generate_and_reencode(
        model, tokenizer, config, examples, cache, prompts, factors, sampling, guidance, prior_latents, seed,
        batch_size, progress, samples,
    )  # fmt: skip
    prompt_of = [t["prompt"] for t in targets]  # each generation's prompt: the intervals resample by it
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "generations": len(targets),
        "samples": samples,
        "decoding": decoding,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "guidance": asdict(guidance) if guidance is not None else None,
        "seed": seed,
    }

    def accuracy_of(group: str) -> float:
        members = [i for i, t in enumerate(targets) if t["group"] == group]
        return recovery_accuracy([recovered[i] for i in members], [targets[i]["target"] for i in members])

    report.update(space.recovery_report(accuracy_of, factors, prior_latents))
    if factors and real_features is not None:
        report["labels"] = _labels_report(factors, targets, encoded, real_features, seed)
    if detector is None and factors:
        found = synthetic_detector([e.source for e in examples], factors, [p.response for p in pairs])
        if found is not None:
            detector_name, detector = f"synthetic set {found[0]}", found[1]
    if factors and detector is not None:
        report["factor_accuracy"] = {
            "detector": detector_name or "given",
            "factors": factor_accuracy(
                texts,
                [t["labels"] for t in targets],
                factors,
                detector,
                [t.get("share", 0.0) for t in targets],
                ended,
                prompt_of,
                seed,
            ),
        }
        if decoder_codes is not None:
            named, shares = code_labels(decoder_codes, factors), code_shares(decoder_codes)
            expected = [named.get((t["slot"], t["target"]), {}) for t in targets]
            weights = [shares.get((t["slot"], t["target"]), 0.0) for t in targets]
            report["factor_accuracy"]["decoder_codes"] = factor_accuracy(
                texts, expected, factors, detector, weights, ended, prompt_of, seed
            )
    report.update(_diversity_per_draw(texts, targets, len(prompts), samples))
    report["truncated_share"] = float(np.mean([not e for e in ended]))
    tokens = encoded["tokens"].double()
    report["zfree_nll_per_token"] = float(encoded["nll"].sum() / tokens.sum())
    report["real_zfree_nll_per_token"] = real_zfree_nll(cache.response_nll)
    report["real_zfree_nll_per_token_same_prompts"] = real_zfree_nll(cache.response_nll, pairs, prompts)
    generated = (encoded["nll"].numpy(), tokens.numpy(), prompt_of)
    real_nll = [float(nll.double().sum()) for nll in cache.response_nll]
    real_tokens = [len(nll) for nll in cache.response_nll]
    index = {p: i for i, p in enumerate(prompts)}
    same = [i for i, pair in enumerate(pairs) if pair.prompt in index]
    own = {p: i for i, p in enumerate(dict.fromkeys(pair.prompt for pair in pairs))}  # the data's prompts
    whole = (real_nll, real_tokens, [own[pair.prompt] for pair in pairs])
    answering = ([real_nll[i] for i in same], [real_tokens[i] for i in same], [index[pairs[i].prompt] for i in same])
    for key, real, denominator in (
        ("", whole, report["real_zfree_nll_per_token"]),
        ("_same_prompts", answering, report["real_zfree_nll_per_token_same_prompts"]),
    ):
        report["zfree_nll_ratio" + key] = report["zfree_nll_per_token"] / denominator
        report["zfree_nll_ratio_interval" + key] = nll_ratio_interval(generated, real, paired=bool(key), seed=seed)
    report["examples"] = _shown_examples(space, targets, prompts, texts, recovered)
    return report


def _diversity_per_draw(texts: list[str], targets: list[dict[str, Any]], prompts: int, samples: int) -> dict:
    """:func:`diversity` of each draw's generations (grouped by prompt), averaged over the ``samples`` draws: pooling
    N draws would lower distinct-n by itself (more text, the same vocabulary), so a report's diversity does not
    depend on ``--generation-samples``."""
    per_draw = [
        diversity(
            [[texts[i] for i, t in enumerate(targets) if t["prompt"] == p and t["sample"] == s] for p in range(prompts)]
        )
        for s in range(samples)
    ]
    return {key: float(np.mean([d[key] for d in per_draw])) for key in per_draw[0]}


def _checked_codes(model: CVAEBase, codes: Any, examples: int) -> np.ndarray:
    """``codes`` as an integer array ``[E, M]`` of a discrete model's codes, or a ValueError saying what was expected."""
    kind = model.latent_space.kind
    if kind != "discrete":
        raise ValueError(f"decoder_codes are the codes of a discrete latent; this model's latent is {kind}")
    array = np.asarray(codes.cpu() if isinstance(codes, torch.Tensor) else codes)
    M, K = model.num_slots, model.codebook_size
    if array.shape != (examples, M) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"decoder_codes must be integer codes [examples, slots] = [{examples}, {M}]; got {array.dtype} of shape "
            f"{list(array.shape)}"
        )
    if array.size and (array.min() < 0 or array.max() >= K):
        raise ValueError(f"decoder_codes must lie in 0..{K - 1}; got {array.min()}..{array.max()}")
    return array


def _shown_examples(
    space: LatentSpace, targets: list[dict[str, Any]], prompts: list[str], texts: list[str], recovered: list[int]
) -> list[dict[str, Any]]:
    """The report's ``examples``: the (first sampled) generations for the first ``EXAMPLES_SHOWN`` prompts, each with
    its target latent (named by the latent ``space``) and whether its re-encoding recovered it."""
    shown = []
    for i, t in enumerate(targets):
        if t["prompt"] < EXAMPLES_SHOWN and t["sample"] == 0:
            latent = space.target_name(t)
            shown.append(
                {
                    "prompt": prompts[t["prompt"]],
                    "latent": latent,
                    "text": texts[i],
                    "recovered": bool(recovered[i] == t["target"]),
                }
            )
    return shown


def _generate_and_reencode(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    examples: Sequence[Example],
    cache: FeatureCache,
    prompts: list[str],
    factors: dict[str, list[str]] | None,
    sampling: SamplingOptions,
    guidance: Guidance | None,
    prior_latents: int,
    seed: int,
    batch_size: int,
    progress: bool,
    samples: int = 1,
) -> tuple[list[dict[str, Any]], list[str], list[bool], dict[str, Any], list[int], np.ndarray | None]:
    """Generate ``samples`` times under every target latent of the model's latent space and re-encode the
    generations (in eval mode, under ``seed``): ``(targets, texts, ended, encoded, recovered, real_features)``, the
    targets repeated per draw (``sample`` numbers them; the first draw's first), ``ended`` whether each
    generation ended before the token cap, the last the real examples' encoder inputs when there are factors (else
    None)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    space = model.latent_space
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        latents = posterior_latents(model, examples, cache, pad)
        prompt_ids = encode_prompts(prompts, tokenizer, config.data)
        features = prompt_features(model, prompt_ids, pad)
        targets = space.control_targets(features, latents, factors, prior_latents)
        targets = [dict(t, sample=s) for s in range(samples) for t in targets]
        vectors = torch.stack([t["vector"] for t in targets])  # [G, L]
        rows = [prompt_ids[t["prompt"]] for t in targets]
        # guidance: against the prompt's others of the group, within the same draw
        keys = [(t["prompt"], t["group"], t["sample"]) for t in targets]
        texts, ended = generate_responses(
            model, tokenizer, rows, vectors, sampling, batch_size, progress, guidance, keys
        )
        generated = generated_examples(tokenizer, config, [prompts[t["prompt"]] for t in targets], texts)
        encoded = reencode(model, generated, pad, batch_size)
        recovered = space.recovered(targets, encoded, features)
        real_features = real_encoder_inputs(model, examples, cache, pad) if factors else None
    return targets, texts, ended, encoded, recovered, real_features


def _labels_report(
    factors: dict[str, list[str]],
    targets: list[dict[str, Any]],
    encoded: dict[str, Any],
    real_features: np.ndarray,
    seed: int,
) -> dict[str, Any]:
    """Per factor: a classifier fitted on the real examples' encoder inputs, its accuracy on the generations
    that have a label for the factor, chance, the majority share (:func:`majority_share_of`) and its held-out
    accuracy on real examples."""
    labels_report = {}
    generation_features = encoded["features"].numpy()
    for name, values in factors.items():
        classifier = fit_label_classifier(real_features, values, seed)
        scored = [i for i, t in enumerate(targets) if name in t["labels"]]
        entry: dict[str, Any] = {"classes": len(set(values)), "generations_scored": len(scored)}
        if classifier is not None and scored:
            predicted = classifier.predict(generation_features[scored])
            entry["accuracy"] = recovery_accuracy(list(predicted), [targets[i]["labels"][name] for i in scored])
        else:
            entry["accuracy"] = None
        entry["chance"] = 1 / len(set(values))
        entry["majority_share"] = majority_share_of([targets[i]["labels"][name] for i in scored])
        entry["real_accuracy"] = held_out_accuracy(real_features, values, seed)
        labels_report[name] = entry
    return labels_report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The headline numbers of a controllability report, one per line."""
    if "code_recovery_accuracy" in report:
        recovery = f"code recovery {report['code_recovery_accuracy']:.3f}"
    else:
        recovery = f"latent recovery {report['latent_recovery_accuracy']:.3f}"
    lines = [
        f"controllability: {recovery} (chance {report['recovery_chance']:.3f}) over {report['generations']} "
        f"generations for {report['prompts']} prompts ({report.get('decoding', 'greedy')}); "
        f"distinct-1 {report['distinct_1']:.3f}, distinct-2 {report['distinct_2']:.3f}"
        f"{_looping(report)}{_truncated(report)}; "
        f"z-free NLL {report['zfree_nll_per_token']:.3f} nats/token "
        f"(real responses {report['real_zfree_nll_per_token']:.3f})",
    ]
    for name, entry in report.get("attributes", {}).items():
        lines.append(f"  attribute {name}: recovery {entry['recovery_accuracy']:.3f} (chance {entry['chance']:.3f})")
    for name, entry in report.get("labels", {}).items():
        accuracy = "n/a" if entry["accuracy"] is None else f"{entry['accuracy']:.3f}"
        real = "n/a" if entry["real_accuracy"] is None else f"{entry['real_accuracy']:.3f}"
        lines.append(
            f"  label {name}: classifier accuracy on generations {accuracy} (real held-out {real}, chance "
            f"{entry['chance']:.3f}{_majority(entry)})"
        )
    for name, entry in report.get("factor_accuracy", {}).get("factors", {}).items():
        if entry["accuracy"] is None:
            continue
        lines.append(
            f"  factor {name} read from the text: accuracy {entry['accuracy']:.3f}{_interval(entry)}"
            f"{_by_prompt(entry)}"
            f"{_weighted(entry)}{_ended(entry)} (chance {entry['chance']:.3f}{_majority(entry)}; no value found "
            f"{entry['none_share']:.3f}) over {entry['generations_scored']} generations"
        )
        decoder = report["factor_accuracy"].get("decoder_codes", {}).get(name)
        if decoder is not None and decoder["accuracy"] is not None:
            lines.append(
                f"    each code standing for its majority value under the decoder's likeliest codes: accuracy "
                f"{decoder['accuracy']:.3f}{_weighted(decoder)}{_ended(decoder)} (majority "
                f"{decoder['majority_share']:.3f}) over "
                f"{decoder['generations_scored']} generations"
            )
    if report.get("real_zfree_nll_per_token"):
        line = (
            f"  z-free NLL of the generations / of the real responses: "
            f"{report['zfree_nll_per_token'] / report['real_zfree_nll_per_token']:.3f}"
            f"{_interval(report, 'zfree_nll_ratio_interval')}"
        )
        same = report.get("real_zfree_nll_per_token_same_prompts")
        if same:
            line += (
                f" (/ the real responses of the same prompts: {report['zfree_nll_per_token'] / same:.3f}"
                f"{_interval(report, 'zfree_nll_ratio_interval_same_prompts')})"
            )
        lines.append(line)
    return lines


def _looping(report: dict[str, Any]) -> str:
    """``, looping 0.031`` (reports written before the field have none)."""
    return "" if report.get("looping_share") is None else f", looping {report['looping_share']:.3f}"


def _interval(entry: dict[str, Any], key: str = "accuracy_interval") -> str:
    """`` [0.85, 0.98]``, the 95 % interval under ``key`` (the accuracy's, or an NLL ratio's); reports written before
    the field have none."""
    interval = entry.get(key)
    return "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"


def _by_prompt(entry: dict[str, Any]) -> str:
    """`` (by prompt [0.80, 1.00])``, the accuracy's interval resampled by prompt (older reports have none)."""
    interval = _interval(entry, "accuracy_interval_by_prompt")
    return f" (by prompt{interval})" if interval else ""


def _truncated(report: dict[str, Any]) -> str:
    """``, cut at the token cap 0.047`` when some generations ran to it (older reports have no such field)."""
    share = report.get("truncated_share")
    return "" if not share else f", cut at the token cap {share:.3f}"


def _ended(entry: dict[str, Any]) -> str:
    """``, 0.967 of the 61 that ended`` when some generations were cut at the token cap (else nothing)."""
    count = entry.get("generations_ended")
    if count is None or count == entry["generations_scored"]:
        return ""
    return ", none ended" if count == 0 else f", {entry['ended_accuracy']:.3f} of the {count} that ended"


def _weighted(entry: dict[str, Any]) -> str:
    """``, weighted by use 0.971`` (reports written before the field, or without weights, have none)."""
    weighted = entry.get("weighted_accuracy")
    return "" if weighted is None else f", weighted by use {weighted:.3f}"


def _majority(entry: dict[str, Any]) -> str:
    """``, majority X`` (reports written before the field have none)."""
    return "" if entry.get("majority_share") is None else f", majority {entry['majority_share']:.3f}"
