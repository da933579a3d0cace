"""Token-weighting options beyond the seed (docs/design.md section 8): another signal in place of the
reference surprisal (the reference's predictive entropy, or the training model's own current NLL)
and interpolation between uniform and token weights.

The reference (:func:`loop_weighting`) is plain Python over float64 scalars: the shares use the
signal ``s_t``, the interpolation mixes in ``m_t / n_b``, and the statistics keep the reference
surprisal ``b_t`` (so the concentration factor still says how the weights meet the reference).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors import safe_open

from disentanglement.config import ConfigError, Scoring, build_config
from disentanglement.data import collate, tokenize_pairs
from disentanglement.evaluation import score_batch
from disentanglement.features import (
    build_feature_cache,
    feature_fingerprint,
    load_feature_cache,
    load_or_build_feature_cache,
    save_feature_cache,
)
from disentanglement.losses import masked_token_nll_per_position, token_weighted_reconstruction_loss
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.token_weighting import (
    TokenWeighting,
    token_weighting_from_base_nll,
)
from helpers import tiny_llama, train_and_read_metrics
from references import loop_entropy, loop_weighting

FIELDS = [f.name for f in dataclasses.fields(TokenWeighting)]


def assert_matches_loop(w: TokenWeighting, ref: dict) -> None:
    for name in FIELDS:
        want = torch.tensor(ref[name], dtype=torch.float64)
        torch.testing.assert_close(getattr(w, name).double(), want, rtol=1e-9, atol=1e-12, msg=name)


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# -- the weighting math ---------------------------------------------------------------------------------
def test_hand_worked_signal_and_interpolation():
    # b = (2, 1, 4), s = (1, 3, 0): alpha 1 gives shares (1/4, 3/4, eps/4 ~ 0); lambda 0.5 mixes in 1/3 each.
    b, s, m = t64([[2.0, 1.0, 4.0]]), t64([[1.0, 3.0, 0.0]]), t64([[1, 1, 1]])
    w = token_weighting_from_base_nll(b, m, alpha=1.0, eps=1e-6, signal=s, interpolation=0.5)
    share = torch.tensor([1.0, 3.0, 1e-6], dtype=torch.float64) / (4.0 + 1e-6)
    want_pi = 0.5 / 3 + 0.5 * share
    torch.testing.assert_close(w.token_weights[0], want_pi, rtol=1e-12, atol=1e-15)
    inv = torch.tensor([1.0, 1 / 3, 1e6], dtype=torch.float64)
    torch.testing.assert_close(w.inverse_token_weights[0], inv / inv.sum(), rtol=1e-12, atol=1e-15)
    # The statistics stay those of b under these weights: b_base = 7/3, kappa = sum pi b / b_base.
    assert float(w.example_base_loss[0]) == pytest.approx(7 / 3, rel=1e-12)
    assert float(w.token_concentration_factor[0]) == pytest.approx(float((want_pi * b[0]).sum()) / (7 / 3), rel=1e-12)
    torch.testing.assert_close(w.aligned_base_token_nll, b)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_random_signal_and_interpolation_match_the_loop(alpha, lam):
    g = torch.Generator().manual_seed(3)
    b = torch.rand(4, 9, generator=g, dtype=torch.float64) * 5
    s = torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    s[0, 2] = 1e-9  # near-zero signal: floored at eps before the power
    m = (torch.rand(4, 9, generator=g) < 0.7).double()
    m[:, 4] = 1  # every example has a supervised position
    m[3] = 0
    m[3, 6] = 1  # one supervised token
    w = token_weighting_from_base_nll(b, m, alpha, 1e-6, signal=s, interpolation=lam)
    assert_matches_loop(w, loop_weighting(b.tolist(), m.tolist(), alpha, 1e-6, signal=s.tolist(), lam=lam))
    assert torch.allclose(w.token_weights.sum(1), torch.ones(4, dtype=torch.float64))
    assert (w.token_weights[m == 0] == 0).all() and (w.inverse_token_weights[m == 0] == 0).all()


def test_defaults_are_the_seeds_weighting():
    g = torch.Generator().manual_seed(5)
    b, m = torch.rand(3, 6, generator=g) * 4, torch.ones(3, 6)
    seed = token_weighting_from_base_nll(b, m, 1.5)
    for w in (
        token_weighting_from_base_nll(b, m, 1.5, signal=b, interpolation=1.0),
        token_weighting_from_base_nll(b, m, 1.5, signal=None, interpolation=1.0),
    ):
        for name in FIELDS:
            torch.testing.assert_close(getattr(w, name), getattr(seed, name), rtol=0, atol=0)


def test_interpolation_zero_is_uniform_and_kappa_is_linear_in_lambda():
    g = torch.Generator().manual_seed(7)
    b = torch.rand(3, 8, generator=g, dtype=torch.float64) * 4 + 0.1
    m = torch.ones(3, 8, dtype=torch.float64)
    m[1, 5:] = 0
    uniform = token_weighting_from_base_nll(b, m, 2.0, interpolation=0.0)
    torch.testing.assert_close(uniform.token_weights, m / m.sum(1, keepdim=True), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(uniform.token_concentration_factor, torch.ones(3, dtype=torch.float64))
    full = token_weighting_from_base_nll(b, m, 2.0)
    mixed = token_weighting_from_base_nll(b, m, 2.0, interpolation=0.25)
    # kappa(lambda) = (1 - lambda) * 1 + lambda * kappa(1); the inverse weights do not move.
    torch.testing.assert_close(
        mixed.token_concentration_factor, 0.75 + 0.25 * full.token_concentration_factor, rtol=1e-12, atol=1e-14
    )
    torch.testing.assert_close(mixed.inverse_token_weights, full.inverse_token_weights, rtol=0, atol=0)
    # With lambda = 0 the token-weighted term is the raw token-mean term.
    nll = torch.rand(3, 8, generator=g, dtype=torch.float64) * m
    raw = ((nll * m).sum(1) / m.sum(1)).mean()
    torch.testing.assert_close(token_weighted_reconstruction_loss(nll, uniform), raw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(interpolation=1.5), "interpolation must be in"),
        (dict(interpolation=-0.1), "interpolation must be in"),
        (dict(signal=torch.ones(2, 3)), "signal"),
        (dict(signal=-torch.ones(2, 4)), "signal must be >= 0"),
    ],
)
def test_invalid_options_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_weighting_from_base_nll(torch.ones(2, 4), torch.ones(2, 4), 1.0, **kwargs)


def test_a_non_finite_signal_gives_nan_weights_not_an_error():
    # A diverged model's own NLL must reach the trainer as a non-finite loss (its divergence handling).
    s = torch.tensor([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0]])
    w = token_weighting_from_base_nll(torch.ones(2, 3), torch.ones(2, 3), 1.0, signal=s)
    assert torch.isnan(w.token_weights[0]).all()
    torch.testing.assert_close(w.token_weights[1], torch.tensor([1 / 6, 2 / 6, 3 / 6]))


def test_weights_on_easy_tokens_give_kappa_below_one():
    # The surprisal source keeps kappa >= 1; a signal that favours the token the reference finds easy does not.
    b, s, m = t64([[1e-4, 2.0, 2.0, 2.0]]), t64([[6.0, 0.1, 0.1, 0.1]]), t64([[1, 1, 1, 1]])
    assert float(token_weighting_from_base_nll(b, m, 1.0).token_concentration_factor[0]) >= 1
    kappa = float(token_weighting_from_base_nll(b, m, 1.0, signal=s).token_concentration_factor[0])
    pi = torch.tensor([6.0, 0.1, 0.1, 0.1]) / 6.3
    assert kappa == pytest.approx(float((pi * torch.tensor([1e-4, 2.0, 2.0, 2.0])).sum()) / (6.0001 / 4), rel=1e-6)
    assert kappa < 0.1


def test_signal_off_the_supervised_positions_is_ignored():
    b, m = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    s = torch.tensor([[float("nan"), 1.0, 2.0]])  # position 0 is not supervised
    w = token_weighting_from_base_nll(b, m, 1.0, signal=s)
    torch.testing.assert_close(w.token_weights, torch.tensor([[0.0, 1 / 3, 2 / 3]]))


# -- predictive entropy ------------------------------------------------------------------------------


def test_nll_and_entropy_match_the_loop_and_shifted_nll_chunked_and_through_a_head():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 5, generator=g)
    head = torch.nn.Linear(5, 11, bias=False)
    logits = head(hidden).detach()
    ids = torch.randint(0, 11, (3, 7), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    want_entropy = loop_entropy(logits, mask)
    want_nll = masked_token_nll_per_position(logits, ids, mask)
    for chunk in (None, 1, 2, 4, 100):
        for args in ((logits,), (hidden,)):
            nll, entropy = masked_token_nll_per_position(
                *args, ids, mask, chunk, head=head if args[0] is hidden else None, entropy=True
            )
            torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(nll, want_nll, rtol=1e-5, atol=1e-6)
    # A -inf logit (a token ruled out) has p log p = 0, not NaN.
    ruled_out = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]])
    _, entropy = masked_token_nll_per_position(ruled_out, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), entropy=True)
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2)]]))
    # Uniform logits: log V at every supervised position, and the NLL of any token is log V too.
    nll, entropy = masked_token_nll_per_position(
        torch.zeros(1, 3, 11), torch.tensor([[0, 4, 9]]), torch.tensor([[0, 1, 1]]), entropy=True
    )
    torch.testing.assert_close(entropy, torch.full((1, 2), math.log(11)))
    torch.testing.assert_close(nll, torch.full((1, 2), math.log(11)))


# -- the models, the cache and training ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def examples(tokenizer):
    pairs = make_hidden_factor_pairs([f"tell me about item {'z' * (i % 5)} {i}" for i in range(16)], kind="clean")
    examples, _ = tokenize_pairs(pairs, tokenizer, build_config(dict(chat_template=False)).data)
    return examples


def model_for(tokenizer, **overrides):
    config = build_config(dict(preset="raw", chat_template=False, token_weighted_weight=1.0, **overrides))
    return build_cvae(config, tiny_llama(len(tokenizer)))


def test_frozen_pass_gives_the_references_predictive_entropy(tokenizer, examples):
    model = model_for(tokenizer, token_weight_source="entropy")
    batch = collate(examples[:4], tokenizer.pad_token_id)
    features = model.frozen_pass(batch)
    with torch.no_grad():
        logits = model.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want = loop_entropy(logits, batch.target_mask)
    torch.testing.assert_close(features.zfree_token_entropy.double(), want, rtol=1e-4, atol=1e-5)
    surprisal = model_for(tokenizer).frozen_pass(batch)
    assert surprisal.zfree_token_entropy is None  # only when asked for
    # The z-free NLL is the same whichever path computed it: a surprisal model reuses an entropy model's cache.
    torch.testing.assert_close(features.zfree_token_nll, surprisal.zfree_token_nll, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(features.encoder_features, surprisal.encoder_features, rtol=0, atol=0)


@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
def test_entropy_weights_from_the_cache_equal_the_models_own(tokenizer, examples, placement):
    model = model_for(
        tokenizer, token_weight_source="entropy", token_weight_interpolation=0.6, latent_placement=placement
    )
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, batch_size=5, progress=False)
    assert cache.response_entropy is not None
    indices = [4, 0, 11, 7]
    batch = collate([examples[i] for i in indices], tokenizer.pad_token_id, indices=indices)
    offsets, target = model.alignment_offsets(batch), model.conditioned_target_mask(batch)
    cached = cache.features(batch, model.weighting_params)
    fresh = model.frozen_pass(batch)
    got = model.token_weighting(batch, cached, offsets, target)
    want = model.token_weighting(batch, fresh, offsets, target)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-6)
    # Independently: the weights are the interpolated entropy shares at the response positions.
    sup = target[:, 1:].bool()
    entropy = fresh.zfree_token_entropy[batch.target_mask[:, 1:].bool()]
    assert torch.equal(got.token_weights[sup] > 0, torch.ones_like(entropy, dtype=torch.bool))
    start = 0
    for row, n in enumerate(batch.response_lengths.tolist()):
        e = entropy[start : start + n].double()
        torch.testing.assert_close(
            got.token_weights[row][sup[row]].double(), 0.4 / n + 0.6 * e / e.sum(), rtol=1e-4, atol=1e-6
        )
        start += n


def test_entropy_cache_round_trip_and_rebuild(tokenizer, examples, tmp_path):
    surprisal = model_for(tokenizer)
    path = tmp_path / "frozen_pass.safetensors"
    plain = load_or_build_feature_cache(surprisal, examples, tokenizer.pad_token_id, tmp_path, 5, progress=False)
    assert plain.response_entropy is None
    with safe_open(str(path), framework="pt") as handle:
        assert "response_entropy" not in handle.keys()  # noqa: SIM118
    # An entropy model does not use a cache without entropy: it rebuilds it (same fingerprint).
    entropic = model_for(tokenizer, token_weight_source="entropy")
    assert feature_fingerprint(entropic, examples) == feature_fingerprint(surprisal, examples)
    cache = load_or_build_feature_cache(entropic, examples, tokenizer.pad_token_id, tmp_path, 5, progress=False)
    assert cache.response_entropy is not None
    loaded = load_feature_cache(path, feature_fingerprint(entropic, examples))
    for a, b in zip(loaded.response_entropy, cache.response_entropy, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # ... and a surprisal model reuses the richer file as it is.
    again = load_or_build_feature_cache(surprisal, examples, tokenizer.pad_token_id, tmp_path, 5, progress=False)
    assert again.response_entropy is not None
    save_feature_cache(cache.subset(2, 5), tmp_path / "sub.safetensors", "x")
    sub = load_feature_cache(tmp_path / "sub.safetensors", "x")
    assert [len(e) for e in sub.response_entropy] == [len(examples[i].response_ids) for i in range(2, 5)]


def test_entropy_source_without_entropy_in_the_features_is_an_error(tokenizer, examples):
    surprisal = model_for(tokenizer)
    cache = build_feature_cache(surprisal, examples, tokenizer.pad_token_id, batch_size=8, progress=False)
    entropic = model_for(tokenizer, token_weight_source="entropy")
    batch = collate(examples[:2], tokenizer.pad_token_id, indices=[0, 1])
    with pytest.raises(ValueError, match="holds no predictive entropy"):
        cache.features(batch, entropic.weighting_params)
    with pytest.raises(ValueError, match="do not carry"):
        entropic(batch, cache.features(batch))


def test_a_diverged_dynamic_step_gives_a_non_finite_loss(tokenizer, examples):
    model = model_for(tokenizer, token_weight_source="dynamic").train()
    with torch.no_grad():
        model.latent_projection.weight.fill_(float("nan"))
    batch = collate(examples[:3], tokenizer.pad_token_id)
    assert not torch.isfinite(model(batch).loss)  # the trainer's divergence handling sees it


def test_dynamic_weights_are_the_models_own_detached_nll(tokenizer, examples):
    model = model_for(tokenizer, token_weight_source="dynamic", token_weight_alpha=1.5).train()
    batch = collate(examples[:5], tokenizer.pad_token_id, indices=range(5))
    cache = build_feature_cache(model, examples[:5], tokenizer.pad_token_id, batch_size=5, progress=False)
    features = cache.features(batch, model.weighting_params)
    assert features.zfree_weighting is None  # nothing to precompute: it changes every step
    out = model(batch, features)
    cond_nll, m = out.token_nll.detach().double(), out.target_mask.double()
    want = loop_weighting(out.weighting.aligned_base_token_nll.tolist(), m.tolist(), 1.5, signal=cond_nll.tolist())
    for name in FIELDS:
        torch.testing.assert_close(
            getattr(out.weighting, name).double(), torch.tensor(want[name], dtype=torch.float64), rtol=1e-5, atol=1e-7
        )
    assert not out.weighting.token_weights.requires_grad
    # The weights are constants of the step: d term_3 / d l = pi / B.
    term = out.reconstruction_terms["token_weighted_reconstruction_loss"]
    (grad,) = torch.autograd.grad(term, out.token_nll)
    torch.testing.assert_close(grad, out.weighting.token_weights / 5, rtol=1e-6, atol=1e-8)
    # Evaluation weights by the posterior-mean NLL it scores.
    model.eval()
    scores = score_batch(model, batch, features, Scoring(iw_samples=1, prior_samples=2))
    l_eval = scores.posterior_nll.double()
    share = l_eval.clamp_min(1e-6) ** 1.5 * m
    torch.testing.assert_close(
        scores.weighting.token_weights.double(), share / share.sum(1, keepdim=True), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("source", ["entropy", "dynamic"])
def test_training_with_each_source_with_and_without_the_cache(tokenizer, tmp_path, source):
    pairs = make_hidden_factor_pairs([f"what about item {'y' * (i % 7)} {i}" for i in range(16)], kind="clean")

    def run(name, use_cache, **weighting):
        weighting = weighting or dict(token_weight_source=source, token_weight_interpolation=0.5)
        decoder = tiny_llama(len(tokenizer))
        return train_and_read_metrics(
            tmp_path / name, decoder, tokenizer, pairs, max_steps=3, eval_every=3, feature_cache=use_cache, **weighting
        )

    cached, uncached = run("cached", True), run("uncached", False)
    term = "normalized_concentration_corrected_token_weighted_reconstruction_loss"
    for a, b in zip(cached, uncached, strict=True):
        for key in ("loss", "token_weighted_reconstruction_loss", term):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
            assert math.isfinite(a[key])
    # The options reached the objective: the seed's weighting gives another term 3 at the first step
    # (same seed, same batch, same initial latent: only the weights differ). The random tiny model's NLL
    # is nearly uniform over tokens, so the weighted means differ little, but far beyond float noise.
    seed_weights = run("seed", True, token_weight_source="surprisal", token_weight_interpolation=1.0)
    assert seed_weights[0]["reconstruction_loss"] == pytest.approx(cached[0]["reconstruction_loss"], rel=1e-6)
    term_3 = "token_weighted_reconstruction_loss"
    assert abs(seed_weights[0][term_3] - cached[0][term_3]) > 1e-5


# -- configuration --------------------------------------------------------------------------------------
def test_config_validates_the_options():
    with pytest.raises(ConfigError, match=r"ReconstructionLossConfig\.token_weight_source.*'attention'"):
        build_config({"token_weight_source": "attention"})
    with pytest.raises(ConfigError, match=r"ReconstructionLossConfig\.token_weight_interpolation.*<= 1"):
        build_config({"token_weight_interpolation": 1.5})
    with pytest.raises(ConfigError, match=r"token_weight_interpolation.*>= 0"):
        build_config({"token_weight_interpolation": -0.5})
    config = build_config({"token_weight_source": "dynamic", "token_weight_interpolation": 0.0})
    assert config.reconstruction.token_weight_source == "dynamic"
