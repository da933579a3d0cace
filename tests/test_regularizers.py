"""The latent regularisers (``regularizers.py``): the KL divergences, against hand values and
``torch.distributions``."""

import math

import torch
from torch.distributions import Categorical, Normal, kl_divergence

from disentanglement import regularizers as R

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
