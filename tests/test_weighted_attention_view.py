"""encoder_view 'token_weighted_attention' (logits log pi_t + q . LN(h_t) / sqrt(H), q = 0 at the start) and
codebook_init 'prior_kmeans', each against an independent computation on a tiny model: at q = 0 the pool IS
the token_weighted view's; with a query it is a hand-written softmax; cached and fresh features agree;
training moves the query; the prior-k-means start is the per-cluster mean of the encoder outputs."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from disentanglement.config import build_config
from disentanglement.data import Example, collate
from disentanglement.features import build_feature_cache, feature_fingerprint
from disentanglement.token_weighting import token_weighting_from_base_nll
from helpers import tiny_cvae, tiny_llama, train_and_read_metrics, view_pairs
from references import reference_nll_and_entropy

TOL = dict(rtol=1e-5, atol=1e-5)
VIEW = "token_weighted_attention"


@pytest.fixture(scope="module")
def pairs():
    return view_pairs()


setup = tiny_cvae


def mixed_batch(examples):
    chosen = [examples[i] for i in (0, 3, 6, 11, 20)]
    chosen.append(Example(examples[1].prompt_ids, examples[1].response_ids[:1], None, "one token"))
    return collate(chosen, 2)


WEIGHTINGS = [
    dict(token_weight_alpha=2.0),
    dict(token_weight_alpha=1.0, token_weight_eps=1e-3),
    dict(token_weight_alpha=1.5, token_weight_source="entropy", token_weight_interpolation=0.5),
    dict(token_weight_alpha=2.0, token_weight_source="dynamic"),
    dict(token_weight_alpha=0.0),
]


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_at_the_start_the_pool_is_the_token_weighted_view(tokenizer, pairs, weighting):
    model, examples, _ = setup(tokenizer, pairs, encoder_view=VIEW, **weighting)
    weighted, _, _ = setup(tokenizer, pairs, encoder_view="token_weighted", **weighting)
    assert torch.equal(model.encoder_pool.query, torch.zeros(model.hidden_size))
    batch = mixed_batch(examples)
    features = model.frozen_pass(batch)
    expected = weighted.encoder_input(weighted.frozen_pass(batch))
    assert features.response_hidden is not None
    torch.testing.assert_close(model.encoder_input(features), expected, **TOL)
    # the frozen part is the token_weighted pair itself (what the encoder falls back to without a query)
    torch.testing.assert_close(features.encoder_features, expected, rtol=0, atol=0)
    # the attention weights at q = 0 are pi_t, exactly the view's weights (each row sums to 1)
    H = model.hidden_size
    a = model.encoder_pool.weights(
        features.response_hidden, features.response_mask, model.encoder_log_token_weights(features)
    )
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        row = torch.zeros(batch.input_ids.shape[1])
        row[p : p + r] = 1 / r
        if weighting["token_weight_alpha"] == 0 or r == 1:
            torch.testing.assert_close(a[b], row, **TOL)
        torch.testing.assert_close(a[b].sum(), torch.tensor(1.0))
        assert a[b, :p].eq(0).all() and a[b, p + r :].eq(0).all()
    assert expected.shape[1] == 2 * H


def test_with_a_query_it_is_a_softmax_of_log_pi_plus_the_query_by_hand(tokenizer, pairs):
    alpha, eps = 2.0, 1e-4
    model, examples, _ = setup(tokenizer, pairs, encoder_view=VIEW, token_weight_alpha=alpha, token_weight_eps=eps)
    with torch.no_grad():
        model.encoder_pool.query.copy_(torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(5)))
    query = model.encoder_pool.query.detach().double()
    batch = mixed_batch(examples)
    got = model.encoder_input(model.frozen_pass(batch))
    H = model.hidden_size
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        ids = batch.input_ids[b : b + 1, : p + r]
        with torch.no_grad(), model.reference.active() as reference:
            out = reference(input_ids=ids, output_hidden_states=True)
        h, logits = out.hidden_states[-1][0].double(), out.logits[0].float()
        nll, _ = reference_nll_and_entropy(logits, batch.input_ids[b], p, r)  # b_t of the r response tokens
        scores = []
        for k in range(r):  # alpha log max(b, eps) + q . LN(h) / sqrt(H); the normaliser of pi cancels
            x = h[p + k]
            key = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-5)
            scores.append(alpha * math.log(max(float(nll[k]), eps)) + float(query @ key) / math.sqrt(H))
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        pooled = sum((w / sum(weights)) * h[p + k] for k, w in enumerate(weights))
        torch.testing.assert_close(got[b, :H], pooled.float(), **TOL)
        torch.testing.assert_close(got[b, H:], h[p + r - 1].float(), **TOL)
        # and it is no longer the token_weighted pool
        pi = token_weighting_from_base_nll(nll[None], torch.ones(1, r), alpha, eps).token_weights[0].double()
        if r > 1:
            assert not torch.allclose(got[b, :H].double(), (pi.unsqueeze(-1) * h[p : p + r]).sum(0), atol=1e-4)


def test_cached_features_give_the_same_pool_and_the_fingerprint_follows_the_weighting(tokenizer, pairs):
    model, examples, _ = setup(tokenizer, pairs, encoder_view=VIEW, token_weight_alpha=2.0)
    with torch.no_grad():
        model.encoder_pool.query.copy_(torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1)))
    cache = build_feature_cache(model, examples, 2, 8, "cpu", False)
    assert cache.response_hidden is not None
    batch = collate([examples[i] for i in (2, 5, 9)], 2, indices=[2, 5, 9])
    for params in (None, model.weighting_params):
        torch.testing.assert_close(
            model.encoder_input(cache.features(batch, params)), model.encoder_input(model.frozen_pass(batch)), **TOL
        )

    def fingerprint(**overrides):
        other, _, _ = setup(tokenizer, pairs, **overrides)
        return feature_fingerprint(other, examples)

    base = fingerprint(encoder_view=VIEW, token_weight_alpha=2.0)
    assert base != fingerprint(encoder_view=VIEW, token_weight_alpha=1.0)
    assert base != fingerprint(encoder_view="token_weighted", token_weight_alpha=2.0)
    assert base != fingerprint(encoder_view="attention", token_weight_alpha=2.0)


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_training_moves_the_query_with_and_without_the_cache(tokenizer, pairs, tmp_path, latent):
    def run(name, use_cache):
        return train_and_read_metrics(
            tmp_path / name,
            tiny_llama(len(tokenizer)),
            tokenizer,
            pairs,
            feature_cache=use_cache,
            encoder_view=VIEW,
            token_weight_alpha=2.0,
            latent=latent,
            encoder_lr=0.05,
            save_every=4,
        )

    cached, uncached = run("cached", True), run("uncached", False)
    for a, b in zip(cached, uncached, strict=True):
        for key in ("loss", "reconstruction_loss", "kl"):
            assert math.isfinite(a[key]) and a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    from safetensors.torch import load_file

    stored = load_file(str(next((tmp_path / "cached" / "checkpoints").glob("step-*")) / "model.safetensors"))
    assert stored["encoder_pool.query"].abs().sum() > 0  # it left its zero start


def test_the_view_is_a_valid_choice_and_other_values_are_refused():
    assert build_config({"encoder_view": VIEW}).latent.encoder_view == VIEW
    assert build_config({"codebook_init": "prior_kmeans"}).latent.codebook_init == "prior_kmeans"
    from disentanglement.config import ConfigError

    with pytest.raises(ConfigError, match=r"LatentConfig\.codebook_init must be one of"):
        build_config({"codebook_init": "prior"})


# -- codebook_init prior_kmeans ------------------------------------------------------------------------
def test_prior_kmeans_start_is_the_mean_encoder_output_of_each_prompt_cluster(tokenizer, pairs):
    model, examples, _ = setup(tokenizer, pairs, latent="discrete", codebook_init="prior_kmeans", codebook_size=3)
    batch = collate(examples, 2)
    features = model.frozen_pass(batch)
    model.initialize_from_data(features, seed=4)
    prior = features.prior_features.double()
    normed = (prior - prior.mean(-1, keepdim=True)) / torch.sqrt(prior.var(-1, unbiased=False, keepdim=True) + 1e-5)
    clusters = KMeans(n_clusters=3, n_init=10, random_state=4).fit_predict(normed.float().numpy())
    with torch.no_grad():
        e = model.encoder_outputs(features)[:, 0].double().numpy()  # one slot
    expected = np.stack([e[clusters == k].mean(0) for k in range(3)])
    np.testing.assert_allclose(model.codebook.detach().double().numpy(), expected, rtol=1e-4, atol=1e-5)
    # not k-means of the encoder outputs (the default start)
    default, _, _ = setup(tokenizer, pairs, latent="discrete", codebook_size=3)
    default.initialize_from_data(default.frozen_pass(batch), seed=4)
    assert not torch.allclose(default.codebook, model.codebook, atol=1e-3)
    # never refreshed: the k-means refresh is the default start's only
    before = model.codebook.detach().clone()
    model.refresh_from_data(features, seed=0)
    assert torch.equal(model.codebook, before)


def test_prior_kmeans_trains(tokenizer, pairs, tmp_path):
    records = train_and_read_metrics(
        tmp_path / "run", tiny_llama(len(tokenizer)), tokenizer, pairs, latent="discrete", codebook_init="prior_kmeans"
    )
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)


# -- codebook_init view_kmeans -------------------------------------------------------------------------
@pytest.mark.parametrize("view", ["token_weighted", VIEW])
def test_view_kmeans_start_is_the_mean_encoder_output_of_each_cluster_of_the_view(tokenizer, pairs, view):
    model, examples, _ = setup(
        tokenizer, pairs, latent="discrete", codebook_init="view_kmeans", codebook_size=3, encoder_view=view
    )
    batch = collate(examples, 2)
    features = model.frozen_pass(batch)
    model.initialize_from_data(features, seed=4)
    # the partition of eval's encoder_kmeans baseline: k-means of the view's features themselves
    clusters = KMeans(n_clusters=3, n_init=10, random_state=4).fit_predict(features.encoder_features.float().numpy())
    with torch.no_grad():
        e = model.encoder_outputs(features)[:, 0].double().numpy()  # one slot
    expected = np.stack([e[clusters == k].mean(0) for k in range(3)])
    np.testing.assert_allclose(model.codebook.detach().double().numpy(), expected, rtol=1e-4, atol=1e-5)
    before = model.codebook.detach().clone()
    model.refresh_from_data(features, seed=0)  # never refreshed
    assert torch.equal(model.codebook, before)
    records = train_and_read_metrics(
        Path(tempfile.mkdtemp()), tiny_llama(len(tokenizer)), tokenizer, pairs, latent="discrete",
        codebook_init="view_kmeans", encoder_view=view,
    )  # fmt: skip
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)
