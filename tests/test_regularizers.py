"""The latent regularisers (``regularizers.py``) against hand computations on small tensors: the KL
divergences (and ``torch.distributions``), the diagonal Gaussian density, the beta schedules and the
temperature annealing, free bits and per-token KL (``kl_objective``), and the next-token divergences
(``divergence="js"`` and ``"kl"``), edge cases included."""

import math

import pytest
import torch
from torch.distributions import Categorical, Normal, kl_divergence

from disentanglement import regularizers as R
from disentanglement.config import ConfigError, KLConfig

# --------------------------------------------------------------------------- KL


def test_gaussian_kl_hand_value_standard_prior():
    # KL(N(1, e^0) || N(0, 1)) = 0.5 * (0 - 0 + (1 + 1) / 1 - 1) = 0.5
    # KL(N(0, e^{ln 4}) || N(0, 1)) = 0.5 * (-ln 4 + 4 - 1) = 1.5 - ln 2
    mu = torch.tensor([[1.0, 0.0]])
    logvar = torch.tensor([[0.0, math.log(4.0)]])
    kl = R.gaussian_kl(mu, logvar)
    assert kl.shape == (1, 2)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 1.5 - math.log(2.0)]]))


def test_gaussian_kl_hand_value_with_prior():
    # KL(N(2, 1) || N(1, 4)) = 0.5 * (ln 4 - 0 + (1 + 1) / 4 - 1) = ln 2 - 0.25
    kl = R.gaussian_kl(
        torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[math.log(4.0)]])
    )
    torch.testing.assert_close(kl, torch.tensor([[math.log(2.0) - 0.25]]))


def test_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mu_q, lv_q, mu_p, lv_p = (torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(4))
    expected = kl_divergence(Normal(mu_q, (0.5 * lv_q).exp()), Normal(mu_p, (0.5 * lv_p).exp()))
    torch.testing.assert_close(R.gaussian_kl(mu_q, lv_q, mu_p, lv_p), expected)
    expected_std = kl_divergence(Normal(mu_q, (0.5 * lv_q).exp()), Normal(0.0, 1.0))
    torch.testing.assert_close(R.gaussian_kl(mu_q, lv_q), expected_std)
    # numpy input, broadcast [D] prior
    out = R.gaussian_kl(mu_q.numpy(), lv_q.numpy(), mu_p[0].numpy(), lv_p[0].numpy())
    exp_b = kl_divergence(Normal(mu_q, (0.5 * lv_q).exp()), Normal(mu_p[0], (0.5 * lv_p[0]).exp()))
    torch.testing.assert_close(out, exp_b)


def test_gaussian_kl_is_differentiable():
    mu = torch.zeros(2, 3, requires_grad=True)
    R.gaussian_kl(mu + 1.0, torch.zeros(2, 3)).sum().backward()
    torch.testing.assert_close(mu.grad, torch.ones(2, 3))


def test_categorical_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(1)
    log_q = torch.log_softmax(torch.randn(4, 3, 5, generator=g, dtype=torch.float64), dim=-1)
    log_p_batch = torch.log_softmax(torch.randn(4, 3, 5, generator=g, dtype=torch.float64), dim=-1)
    log_p_fixed = torch.log_softmax(torch.randn(3, 5, generator=g, dtype=torch.float64), dim=-1)
    expected = kl_divergence(Categorical(logits=log_q), Categorical(logits=log_p_batch))
    torch.testing.assert_close(R.categorical_kl(log_q, log_p_batch), expected)
    expected_fixed = kl_divergence(Categorical(logits=log_q), Categorical(logits=log_p_fixed.expand(4, 3, 5)))
    out = R.categorical_kl(log_q, log_p_fixed)
    assert out.shape == (4, 3)
    torch.testing.assert_close(out, expected_fixed)


def test_categorical_kl_hand_value_and_zero_mass():
    # q = (1, 0), p = (1/2, 1/2): KL = ln 2; the zero-mass code contributes 0, not nan
    log_q = torch.tensor([[[0.0, -math.inf]]])
    log_p = torch.log(torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(R.categorical_kl(log_q, log_p), torch.tensor([[math.log(2.0)]]))
    # uniform prior over K: KL = ln K - H(q)
    q = torch.tensor([0.5, 0.25, 0.25])
    kl = R.categorical_kl(q.log().view(1, 1, 3), torch.full((1, 3), -math.log(3.0)))
    h = -(q * q.log()).sum()
    torch.testing.assert_close(kl, (math.log(3.0) - h).view(1, 1))


# --------------------------------------------------------------------------- the diagonal Gaussian density


def test_diag_gaussian_log_density_is_the_sum_of_normal_log_probs():
    g = torch.Generator().manual_seed(2)
    z, mu, logvar = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3))
    expected = Normal(mu, (0.5 * logvar).exp()).log_prob(z).sum(-1)
    torch.testing.assert_close(R.diag_gaussian_log_density(z, mu, logvar), expected)
    # one dimension at the mean with unit variance: -log(2 pi) / 2; two such dimensions: twice that
    at_mean = R.diag_gaussian_log_density(torch.zeros(2), torch.zeros(2), torch.zeros(2))
    assert at_mean.item() == pytest.approx(-math.log(2 * math.pi))
    # one dimension one standard deviation (2) away: -(log(2 pi) + log 4 + 1) / 2
    off = R.diag_gaussian_log_density(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([math.log(4.0)]))
    assert off.item() == pytest.approx(-0.5 * (math.log(2 * math.pi) + math.log(4.0) + 1.0))


def test_as_tensor_keeps_tensors_and_makes_integers_float():
    t = torch.ones(2, dtype=torch.float64)
    assert R.as_tensor(t) is t
    assert R.as_tensor([1, 2]).dtype == torch.float32
    assert R.as_tensor(torch.tensor([1, 2])).dtype == torch.float32


def test_categorical_kl_edge_cases():
    # q puts mass where p has none: infinite
    log_q = torch.log(torch.tensor([[[0.5, 0.5]]]))
    assert math.isinf(R.categorical_kl(log_q, torch.log(torch.tensor([[1.0, 0.0]]))).item())
    # q = p: zero
    torch.testing.assert_close(R.categorical_kl(log_q, log_q[0]), torch.zeros(1, 1))
    with pytest.raises(ValueError, match=r"log_q must be \[B, M, K\]"):
        R.categorical_kl(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="log_p must be"):
        R.categorical_kl(torch.zeros(1, 2, 3), torch.zeros(2, 4))


# --------------------------------------------------------------------------- beta schedules


def test_constant_beta_is_beta_at_every_step():
    cfg = KLConfig(beta=0.3, beta_schedule="constant", beta_warmup_steps=10)
    assert [R.beta_at(step, cfg) for step in (0, 5, 10, 1000)] == [0.3] * 4


def test_linear_beta_rises_from_zero_to_beta_then_stays():
    cfg = KLConfig(beta=0.4, beta_schedule="linear", beta_warmup_steps=4)
    assert [R.beta_at(step, cfg) for step in range(7)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_cyclical_beta_restarts_every_cycle():
    # cycles of 5 steps: a rise over 2 steps (0, beta / 2), then beta for the rest of the cycle
    cfg = KLConfig(beta=1.0, beta_schedule="cyclical", beta_warmup_steps=2, beta_cycle_steps=5)
    assert [R.beta_at(step, cfg) for step in range(11)] == pytest.approx([0, 0.5, 1, 1, 1, 0, 0.5, 1, 1, 1, 0])
    # a rise as long as the cycle never reaches beta
    cfg = KLConfig(beta=1.0, beta_schedule="cyclical", beta_warmup_steps=4, beta_cycle_steps=4)
    assert [R.beta_at(step, cfg) for step in range(6)] == pytest.approx([0, 0.25, 0.5, 0.75, 0, 0.25])


@pytest.mark.parametrize("schedule", ["linear", "cyclical"])
def test_no_warmup_is_beta_from_step_zero(schedule):
    cfg = KLConfig(beta=0.5, beta_schedule=schedule, beta_warmup_steps=0, beta_cycle_steps=3)
    assert [R.beta_at(step, cfg) for step in (0, 1, 3, 7)] == [0.5] * 4


def test_cyclical_rise_longer_than_the_cycle_is_refused():
    with pytest.raises(ConfigError, match="beta_warmup_steps"):
        KLConfig(beta_schedule="cyclical", beta_warmup_steps=5, beta_cycle_steps=4)


def test_annealed_temperature_is_exponential_then_floored():
    assert R.annealed_temperature(0, 2.0, 0.5, 10) == 2.0
    assert R.annealed_temperature(5, 2.0, 0.5, 10) == pytest.approx(2.0 * 0.25**0.5)  # half way: 1.0
    assert R.annealed_temperature(10, 2.0, 0.5, 10) == pytest.approx(0.5)
    assert R.annealed_temperature(99, 2.0, 0.5, 10) == pytest.approx(0.5)
    assert R.annealed_temperature(5, 0.5, 1.0, 10) == 0.5  # start <= minimum: no annealing
    assert R.annealed_temperature(0, 2.0, 0.5, 0) == 0.5  # no annealing steps: the minimum at once


# --------------------------------------------------------------------------- the KL term: free bits, per token

KL = torch.tensor([[1.0, 4.0], [3.0, 0.0]])  # [B=2, U=2]
LENGTHS = torch.tensor([2, 4])  # response tokens of each example


def test_kl_objective_is_beta_times_the_sum_of_batch_means():
    term, per_unit = R.kl_objective(KL, LENGTHS, KLConfig(), beta=0.5)
    torch.testing.assert_close(per_unit, torch.tensor([2.0, 2.0]))  # (1 + 3) / 2, (4 + 0) / 2
    torch.testing.assert_close(term, torch.tensor(0.5 * (2.0 + 2.0)))
    term, per_unit = R.kl_objective(KL, LENGTHS, KLConfig(), beta=0.0)
    assert term.item() == 0.0 and per_unit.tolist() == [2.0, 2.0]  # beta 0: the KL is still reported


def test_kl_per_token_divides_each_example_by_its_response_length():
    term, per_unit = R.kl_objective(KL, LENGTHS, KLConfig(kl_per_token=True), beta=1.0)
    # example 0: [1, 4] / 2 = [0.5, 2]; example 1: [3, 0] / 4 = [0.75, 0]
    torch.testing.assert_close(per_unit, torch.tensor([0.625, 1.0]))
    torch.testing.assert_close(term, torch.tensor(1.625))
    # one-token responses: the same as without
    ones = torch.ones(2, dtype=torch.long)
    torch.testing.assert_close(R.kl_objective(KL, ones, KLConfig(kl_per_token=True), 1.0)[1], torch.tensor([2.0, 2.0]))
    # the lengths are integers; the result has the KL's dtype
    assert R.kl_objective(KL.double(), LENGTHS, KLConfig(kl_per_token=True), 1.0)[1].dtype == torch.float64


def test_free_bits_floor_each_units_batch_mean():
    term, per_unit = R.kl_objective(KL, LENGTHS, KLConfig(free_bits=2.5), beta=2.0)
    torch.testing.assert_close(per_unit, torch.tensor([2.5, 2.5]))  # both means (2, 2) below the floor
    torch.testing.assert_close(term, torch.tensor(2.0 * 5.0))
    # after the per-token division: means [0.625, 1.0], the first floored at 0.8
    term, per_unit = R.kl_objective(KL, LENGTHS, KLConfig(free_bits=0.8, kl_per_token=True), beta=1.0)
    torch.testing.assert_close(per_unit, torch.tensor([0.8, 1.0]))
    torch.testing.assert_close(term, torch.tensor(1.8))
    # a floor below every mean changes nothing
    torch.testing.assert_close(R.kl_objective(KL, LENGTHS, KLConfig(free_bits=1.0), 1.0)[1], torch.tensor([2.0, 2.0]))


def test_a_unit_under_its_free_bits_gets_no_gradient():
    kl = torch.tensor([[1.0, 4.0], [3.0, 2.0]], requires_grad=True)  # unit means 2 and 3
    term, _ = R.kl_objective(kl, LENGTHS, KLConfig(free_bits=2.5), beta=1.0)
    term.backward()
    # unit 0 (mean 2 < 2.5) is floored: no gradient; unit 1: d(beta * mean_b kl) / d kl = 1 / B
    torch.testing.assert_close(kl.grad, torch.tensor([[0.0, 0.5], [0.0, 0.5]]))


# --------------------------------------------------------------------------- the next-token divergences

P = torch.tensor([[0.0, math.log(3.0)]])  # logits of (1/4, 3/4)
Q = torch.zeros(1, 2)  # logits of (1/2, 1/2)


def test_kl_divergence_by_hand_and_not_symmetric():
    # divergence="kl": KL(a || b) = sum_v a_v log(a_v / b_v)
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    backward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    out = R.next_token_divergence(P, Q, kind="kl")
    assert out.shape == (1,) and out.item() == pytest.approx(forward, rel=1e-6)
    assert R.next_token_divergence(Q, P, kind="kl").item() == pytest.approx(backward, rel=1e-6)
    assert forward != pytest.approx(backward)


def test_js_divergence_by_hand_symmetric_and_bounded_by_log_2():
    m = (0.375, 0.625)  # the mixture of (1/4, 3/4) and (1/2, 1/2)
    expected = 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])) + 0.5 * (
        0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    )
    assert R.next_token_divergence(P, Q).item() == pytest.approx(expected, rel=1e-5)  # "js" is the default
    assert R.next_token_divergence(Q, P, kind="js").item() == pytest.approx(expected, rel=1e-5)
    disjoint = R.next_token_divergence(torch.tensor([[30.0, -30.0]]), torch.tensor([[-30.0, 30.0]]))
    assert disjoint.item() == pytest.approx(math.log(2.0), rel=1e-5)


def test_divergences_are_per_position_and_zero_between_equal_distributions():
    g = torch.Generator().manual_seed(3)
    logits, other = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    for kind in ("js", "kl"):
        same = R.next_token_divergence(logits, logits.clone(), kind=kind)
        assert same.shape == (2, 3)
        torch.testing.assert_close(same, torch.zeros(2, 3), atol=1e-6, rtol=0)
    expected = kl_divergence(Categorical(logits=logits), Categorical(logits=other))
    torch.testing.assert_close(R.next_token_divergence(logits, other, kind="kl"), expected)
    # low-precision logits are compared in float32
    assert R.next_token_divergence(logits.bfloat16(), other.bfloat16(), kind="kl").dtype == torch.float32
    with pytest.raises(ValueError, match="divergence must be 'js' or 'kl'"):
        R.next_token_divergence(logits, other, kind="tv")
