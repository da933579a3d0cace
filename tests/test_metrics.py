import json
import math

import numpy as np
import pytest
import torch

from disentanglement import metrics as M

# --------------------------------------------------------------------------- mutual information


def test_gaussian_mi_collapsed_encoder_is_zero():
    n, d = 200, 4
    mu = torch.full((n, d), 0.3)
    logvar = torch.full((n, d), -0.5)
    g = torch.Generator().manual_seed(0)
    assert abs(M.gaussian_mutual_information(mu, logvar, generator=g)) < 1e-9
    # the analytic-entropy variant (He et al.'s calc_mi) is ~0 within estimator noise
    g = torch.Generator().manual_seed(0)
    assert abs(M.gaussian_mutual_information(mu, logvar, num_samples=50, generator=g, analytic_entropy=True)) < 0.05
    assert M.active_units(mu) == 0


def test_gaussian_mi_separated_clusters_is_log_num_clusters():
    clusters, per_cluster, d = 5, 40, 6
    centres = 10.0 * torch.eye(clusters, d)  # dims 5 never vary
    mu = centres.repeat_interleave(per_cluster, dim=0)  # [200, 6]
    logvar = torch.full_like(mu, math.log(0.01))
    g = torch.Generator().manual_seed(0)
    mi = M.gaussian_mutual_information(mu, logvar, num_samples=2, generator=g)
    assert mi == pytest.approx(math.log(clusters), abs=1e-6)  # paired draws: no noise here
    # calc_mi's analytic first term adds Monte Carlo noise (std ~ sqrt(D/2 / draws))
    g = torch.Generator().manual_seed(0)
    mi = M.gaussian_mutual_information(mu, logvar, num_samples=50, generator=g, analytic_entropy=True)
    assert mi == pytest.approx(math.log(clusters), abs=0.1)
    assert M.active_units(mu) == clusters
    var = M.posterior_mean_variance(mu)
    assert var.shape == (d,)
    assert var[-1] == 0.0


def test_gaussian_mi_distinct_examples_bounded_by_log_n():
    n = 8
    mu = 50.0 * torch.eye(n)
    logvar = torch.full_like(mu, -4.0)
    mi = M.gaussian_mutual_information(mu, logvar, num_samples=3, generator=torch.Generator().manual_seed(0))
    assert mi == pytest.approx(math.log(n), abs=1e-6)


def test_gaussian_mi_deterministic_given_generator():
    g = torch.Generator().manual_seed(3)
    mu, logvar = torch.randn(30, 3, generator=g), torch.randn(30, 3, generator=g) * 0.1
    a = M.gaussian_mutual_information(mu, logvar, num_samples=2, generator=torch.Generator().manual_seed(7))
    b = M.gaussian_mutual_information(
        mu.numpy(), logvar.numpy(), num_samples=2, generator=torch.Generator().manual_seed(7), chunk_size=7
    )
    assert a == pytest.approx(b, abs=1e-12)
    assert 0.0 < a <= math.log(30) + 1e-9


def test_categorical_mi_collapsed_is_zero():
    probs = np.tile(np.array([0.2, 0.5, 0.3]), (50, 1))
    assert abs(M.categorical_mutual_information(probs)) < 1e-6
    probs3 = np.tile(np.array([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]]), (50, 1, 1))  # [50, 2, 3]
    assert abs(M.categorical_mutual_information(probs3)) < 1e-6
    assert all(abs(v) < 1e-6 for v in M.categorical_mutual_information_per_slot(probs3))


def test_categorical_mi_one_hot_uniform_is_log_k():
    k = 4
    probs = torch.eye(k).repeat(3, 1)  # [12, 4], each code used 3 times
    assert M.categorical_mutual_information(probs) == pytest.approx(math.log(k), abs=1e-12)
    # two slots: slot 0 identity-like over 4 codes, slot 1 collapsed
    slot1 = torch.zeros(12, 4)
    slot1[:, 2] = 1.0
    probs3 = torch.stack([probs, slot1], dim=1)  # [12, 2, 4]
    per_slot = M.categorical_mutual_information_per_slot(probs3)
    assert per_slot == pytest.approx([math.log(k), 0.0], abs=1e-12)
    assert M.categorical_mutual_information(probs3) == pytest.approx(math.log(k), abs=1e-12)


def test_categorical_mi_hand_value():
    # two examples, q1 = (1, 0), q2 = (1/2, 1/2): H(mean) = H(3/4, 1/4), mean H = ln2 / 2
    probs = np.array([[1.0, 0.0], [0.5, 0.5]])
    h_mean = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert M.categorical_mutual_information(probs) == pytest.approx(h_mean - 0.5 * math.log(2.0))


def test_active_units_threshold_and_unbiased_variance():
    mu = np.array([[0.0, 0.0, 1.0], [0.2, 2.0, 1.0]])  # ddof=1 variances: 0.02, 2.0, 0
    np.testing.assert_allclose(M.posterior_mean_variance(mu), [0.02, 2.0, 0.0])
    assert M.active_units(mu) == 2
    assert M.active_units(mu, threshold=0.05) == 1


# --------------------------------------------------------------------------- code usage


def test_code_usage_uniform_single_and_dead():
    u = M.code_usage(np.arange(8).repeat(3), 8)
    assert u["perplexity"] == pytest.approx(8.0)
    assert u["dead_codes"] == [] and u["used_codes"] == 8
    one = M.code_usage(torch.full((10,), 2), 5)
    assert one["perplexity"] == pytest.approx(1.0)
    assert one["histogram"] == [0, 0, 10, 0, 0]
    assert one["dead_codes"] == [0, 1, 3, 4] and one["used_codes"] == 1
    # codes 0 and 1 used equally out of 4: perplexity 2
    half = M.code_usage([0, 1, 0, 1], 4)
    assert half["perplexity"] == pytest.approx(2.0)
    assert half["dead_codes"] == [2, 3]
    with pytest.raises(ValueError, match="codes must lie"):
        M.code_usage([0, 4], 4)


def test_code_usage_per_slot():
    codes = np.array([[0, 1], [1, 1], [2, 1]])
    usage = M.code_usage_per_slot(codes, 3)
    assert len(usage) == 2
    assert usage[0]["histogram"] == [1, 1, 1] and usage[0]["perplexity"] == pytest.approx(3.0)
    assert usage[1]["dead_codes"] == [0, 2]


# --------------------------------------------------------------------------- clustering vs labels


def test_label_agreement_perfect_with_permuted_ids():
    labels = ["greet", "ask", "greet", "thank", "ask", "thank"]
    assign = [7, 3, 7, 0, 3, 0]
    out = M.label_agreement(assign, labels)
    assert out["nmi"] == pytest.approx(1.0)
    assert out["ari"] == pytest.approx(1.0)
    assert out["homogeneity"] == pytest.approx(1.0) and out["completeness"] == pytest.approx(1.0)


def test_label_agreement_random_is_near_zero():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=4000)
    assign = rng.integers(0, 4, size=4000)
    out = M.label_agreement(assign, labels)
    assert out["nmi"] < 0.01
    assert abs(out["ari"]) < 0.01


def test_label_agreement_contingency_hand_example():
    assign = np.array([1, 1, 0, 0, 0, 2])
    labels = ["b", "a", "a", "a", "b", "b"]
    c = M.label_agreement(assign, labels)["contingency"]
    assert c["rows"] == [0, 1, 2]
    assert c["columns"] == ["a", "b"]
    assert c["counts"] == [[2, 1], [1, 1], [0, 1]]
    assert all(isinstance(v, int) for v in c["rows"])  # JSON-able Python ints


def test_kmeans_recovers_separated_clusters_and_is_deterministic():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [20.0, 0.0], [0.0, 20.0], [20.0, 20.0]])
    truth = np.repeat(np.arange(4), 25)
    x = centres[truth] + rng.normal(scale=0.5, size=(100, 2))
    a = M.kmeans_assignments(x, 4, seed=0)
    assert a.shape == (100,)
    assert M.label_agreement(a, truth)["nmi"] == pytest.approx(1.0)
    np.testing.assert_array_equal(a, M.kmeans_assignments(torch.as_tensor(x), 4, seed=0))


# --------------------------------------------------------------------------- factors beside baselines


def test_agreement_scores_are_the_four_numbers_of_label_agreement():
    assign, labels = [0, 0, 1, 2, 2, 1], ["a", "a", "b", "c", "b", "b"]
    full = M.label_agreement(assign, labels)
    assert M.agreement_scores(assign, labels) == {k: full[k] for k in ("nmi", "ari", "homogeneity", "completeness")}
    assert M.AGREEMENT_METRICS == ("nmi", "ari", "homogeneity", "completeness")


def test_random_assignments_keep_the_cluster_sizes_exactly():
    assign = np.array([0] * 7 + [1] * 2 + [5] * 11 + [3])
    rows = M.random_assignments(assign, permutations=20, seed=3)
    assert rows.shape == (20, assign.size)
    for row in rows:
        np.testing.assert_array_equal(np.sort(row), np.sort(assign))  # the same multiset of cluster ids
    assert len({tuple(row) for row in rows}) > 1  # actually shuffled
    np.testing.assert_array_equal(rows, M.random_assignments(assign, permutations=20, seed=3))
    assert not np.array_equal(rows, M.random_assignments(assign, permutations=20, seed=4))
    with pytest.raises(ValueError, match="permutations"):
        M.random_assignments(assign, permutations=0)


def test_random_baseline_is_the_mean_over_seeded_permutations_and_near_zero():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=4000)
    perfect = (labels + 1) % 4  # the latent recovers the factor exactly
    out = M.random_assignment_agreement(perfect, labels, permutations=20, seed=0)
    assert M.label_agreement(perfect, labels)["nmi"] == pytest.approx(1.0)
    assert out["nmi"] < 0.005 and abs(out["ari"]) < 0.005 and out["homogeneity"] < 0.005
    # computed independently: the mean over the same seeded permutations
    shuffle = np.random.default_rng(0)
    by_hand = [M.label_agreement(shuffle.permutation(perfect), labels) for _ in range(20)]
    for key in M.AGREEMENT_METRICS:
        assert out[key] == pytest.approx(np.mean([r[key] for r in by_hand]), rel=1e-12, abs=1e-15)


def two_factor_case(n_per_cell: int = 10, seed: int = 0):
    """Factor ``style`` (2 values) x factor ``topic`` (3 values), every cell ``n_per_cell`` examples;
    encoder features that separate the style perfectly, prior features that are noise."""
    rng = np.random.default_rng(seed)
    style = np.repeat(np.array(["polite", "rude"]), 3 * n_per_cell)
    topic = np.tile(np.repeat(np.array(["billing", "login", "other"]), n_per_cell), 2)
    centres = {"polite": np.zeros(4), "rude": np.full(4, 30.0)}
    encoder = np.stack([centres[s] for s in style]) + rng.normal(scale=0.5, size=(style.size, 4))
    prior = rng.normal(size=(style.size, 3))
    return style, topic, encoder, prior


def test_encoder_kmeans_baseline_recovers_a_factor_the_features_separate():
    style, topic, encoder, prior = two_factor_case()
    latent = (topic == "billing").astype(int)  # a latent of two clusters that says nothing about the style
    features = {"encoder_kmeans": encoder, "prior_kmeans": prior}
    entry = M.factor_agreement(latent, style, features, seed=0, permutations=20)
    assert entry["values"] == 2 and entry["clusters"] == 2
    assert entry["encoder_kmeans"]["nmi"] == pytest.approx(1.0)
    assert entry["encoder_kmeans"]["ari"] == pytest.approx(1.0)
    assert entry["latent"]["nmi"] == pytest.approx(0.0, abs=1e-12)
    assert entry["latent_beats_baselines"] is False  # the frozen features already hold the style
    assert set(entry) >= {"latent", "encoder_kmeans", "prior_kmeans", "random", "contingency"}
    for name in ("latent", "encoder_kmeans", "prior_kmeans", "random"):
        assert set(entry[name]) == set(M.AGREEMENT_METRICS)


def test_factor_agreement_baselines_computed_independently():
    style, topic, encoder, prior = two_factor_case()
    latent = np.unique(topic, return_inverse=True)[1] * 2  # the latent holds the topic (ids 0, 2, 4)
    features = {"encoder_kmeans": encoder, "prior_kmeans": prior}
    cache: dict = {}
    entries = {
        name: M.factor_agreement(latent, v, features, 7, 5, cache) for name, v in (("style", style), ("topic", topic))
    }
    topic_entry, style_entry = entries["topic"], entries["style"]
    assert topic_entry["latent"] == M.agreement_scores(latent, topic) and topic_entry["latent"]["nmi"] == pytest.approx(
        1
    )
    assert topic_entry["latent_beats_baselines"] is True and style_entry["latent_beats_baselines"] is False
    # k-means with as many clusters as the latent uses (3), whatever the factor's number of values (2 for style)
    assert topic_entry["clusters"] == style_entry["clusters"] == 3 and style_entry["values"] == 2
    for name, x in features.items():
        clusters = M.kmeans_assignments(x, 3, seed=7)
        assert style_entry[name] == M.agreement_scores(clusters, style)
        assert topic_entry[name] == M.agreement_scores(clusters, topic)
    assert set(cache) == {("encoder_kmeans", 3), ("prior_kmeans", 3)}  # one clustering shared by both factors
    for entry, values in ((style_entry, style), (topic_entry, topic)):
        assert entry["random"] == M.random_assignment_agreement(latent, values, permutations=5, seed=7)
        baselines = max(entry[b]["nmi"] for b in M.FACTOR_BASELINES)
        assert entry["latent_beats_baselines"] is (entry["latent"]["nmi"] > baselines)
    assert topic_entry["contingency"] == M.label_agreement(latent, topic)["contingency"]
    json.dumps(entries)  # JSON-able as it is


# --------------------------------------------------------------------------- text and likelihood


def test_distinct_n_hand_examples():
    texts = ["a b a b", "a b c"]
    # unigrams: a b a b a b c -> 3 distinct / 7
    assert M.distinct_n(texts, 1) == pytest.approx(3 / 7)
    # bigrams: (a b) (b a) (a b) | (a b) (b c) -> 3 distinct / 5 (none across texts)
    assert M.distinct_n(texts, 2) == pytest.approx(3 / 5)
    assert M.distinct_n(["one two"], 3) == 0.0
    assert M.distinct_n([], 1) == 0.0
    assert M.distinct_n(["  x\n\ty  "], 1) == 1.0


def test_nats_to_bits():
    assert M.nats_to_bits(math.log(2.0)) == pytest.approx(1.0)
    np.testing.assert_allclose(M.nats_to_bits(np.array([math.log(8.0)])), [3.0])
    torch.testing.assert_close(M.nats_to_bits(torch.tensor([math.log(4.0)])), torch.tensor([2.0]))


def test_importance_weighted_nll():
    x = torch.tensor([[-3.0, -1.5]])
    torch.testing.assert_close(M.importance_weighted_nll(x), torch.tensor([3.0, 1.5]))  # K = 1: -x
    same = torch.full((5, 2), -2.25)
    torch.testing.assert_close(M.importance_weighted_nll(same), torch.tensor([2.25, 2.25]))
    # K = 2, values ln 1 and ln 3: -(log(1 + 3) - log 2) = -ln 2
    w = torch.tensor([[0.0], [math.log(3.0)]])
    torch.testing.assert_close(M.importance_weighted_nll(w), torch.tensor([-math.log(2.0)]))
    # the bound is never above the mean (ELBO) bound
    g = torch.Generator().manual_seed(0)
    r = torch.randn(10, 4, generator=g)
    assert torch.all(M.importance_weighted_nll(r) <= -r.mean(dim=0) + 1e-6)
