"""Continuous Gaussian CVAE: diagonal Gaussian posterior ``q(z | x, y)`` and prior ``p(z | x)``
(learned, or the standard normal), reparameterised sample, analytic KL per dimension.
The posterior mean is used at evaluation."""

from __future__ import annotations

import math

import torch

from .cvae_base import CVAEBase, FrozenFeatures, LatentSample, PosteriorSummary, PriorMixture, mlp
from .data import Batch
from .latent_space import ContinuousLatentSpace
from .regularizers import diag_gaussian_log_density, gaussian_kl

LOGVAR_RANGE = (-12.0, 8.0)  # keeps exp(logvar) finite in float32 and bfloat16


class ContinuousCVAE(CVAEBase):
    def __init__(self, decoder, latent, reconstruction, kl, divergence=None, **kwargs) -> None:
        super().__init__(decoder, latent, reconstruction, kl, divergence, **kwargs)
        D, H = latent.latent_dim, self.hidden_size
        self.encoder = mlp(2 * H, latent.encoder_hidden, 2 * D)
        self.prior_head = mlp(H, latent.encoder_hidden, 2 * D) if latent.prior == "learned" else None

    @property
    def latent_space(self) -> ContinuousLatentSpace:
        """What this family's latents mean to the tools that read, steer and report them (``latent_space.py``)."""
        return ContinuousLatentSpace(self)

    @property
    def latent_vector_dim(self) -> int:
        return self.latent_cfg.latent_dim

    def posterior(self, features: FrozenFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of ``q(z | x, y)``, each ``[B, D]``."""
        mu, logvar = self.encoder(self.encoder_norm(self.encoder_input(features))).chunk(2, dim=-1)
        return mu, logvar.clamp(*LOGVAR_RANGE)

    def prior(self, features: FrozenFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of ``p(z | x)``, each ``[B, D]`` (zeros for the standard normal)."""
        B, D = features.prior_features.shape[0], self.latent_cfg.latent_dim
        if self.prior_head is None:
            zeros = features.prior_features.new_zeros(B, D)
            return zeros, zeros
        mu, logvar = self.prior_head(self.prior_norm(features.prior_features)).chunk(2, dim=-1)
        return mu, logvar.clamp(*LOGVAR_RANGE)

    def encode(self, features: FrozenFeatures, step: int) -> LatentSample:
        mu, logvar = self.posterior(features)
        mu_p, logvar_p = self.prior(features)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu) if self.training else mu  # [B, D]
        kl = gaussian_kl(mu, logvar, mu_p, logvar_p)  # [B, D]
        logvar_seen = logvar.detach()

        def logged_stats() -> dict[str, float]:
            return {"posterior_std_mean": float((0.5 * logvar_seen).exp().mean())}

        return LatentSample(vector=z, latent=z.detach(), kl_per_unit=kl, logged_stats=logged_stats)

    def prior_vectors(self, features: FrozenFeatures, num_samples: int) -> torch.Tensor:
        """``[S, B, D]`` draws from ``p(z | x)``."""
        mu, logvar = self.prior(features)
        noise = torch.randn((num_samples, *mu.shape), device=mu.device, dtype=mu.dtype)
        return mu + (0.5 * logvar).exp() * noise

    # -- evaluation: the posterior, the prior as a mixture, importance samples ------------------
    def posterior_latents(self, features: FrozenFeatures) -> dict[str, torch.Tensor]:
        """``mu`` and ``logvar`` of the posterior, each ``[B, D]``."""
        mu, logvar = self.posterior(features)
        return {"mu": mu, "logvar": logvar}

    def posterior_summary(self, features: FrozenFeatures) -> PosteriorSummary:
        """The posterior mean as the latent, the posterior and prior Gaussians and their KL per dimension."""
        mu, logvar = self.posterior(features)
        mu_p, logvar_p = self.prior(features)
        kl = gaussian_kl(mu, logvar, mu_p, logvar_p)  # [B, D]
        return PosteriorSummary(mu, kl, mu=mu, logvar=logvar, prior_mu=mu_p, prior_logvar=logvar_p)

    def prior_mixture(
        self,
        features: FrozenFeatures,
        num_samples: int = 16,
        exact_limit: int = 64,
        summary: PosteriorSummary | None = None,
    ) -> PriorMixture:
        """``num_samples`` draws from ``p(z | x)``, equally weighted (a Gaussian prior has no finite
        exact mixture: ``exact_limit`` does not apply; ``summary`` is not needed). The global torch generator."""
        vectors = self.prior_vectors(features, num_samples)  # [S, B, D]
        B = features.prior_features.shape[0]
        log_weights = vectors.new_full((num_samples, B), -math.log(num_samples)).float()
        return PriorMixture(vectors, log_weights, "samples")

    def importance_samples(
        self, batch: Batch, summary: PosteriorSummary, num_samples: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``log p(y | x, z_k) + log p(z_k | x) - log q(z_k | x, y)`` ``[k, B]`` for reparameterised
        draws ``z_k ~ q`` (the global torch generator), the sequence NLL ``[k, B]``, and ``False`` (not exact)."""
        mu, logvar = summary.mu.float(), summary.logvar.float()
        prior_mu, prior_logvar = summary.prior_mu.float(), summary.prior_logvar.float()
        log_weights, sequence_nlls = [], []
        for _ in range(num_samples):
            z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
            token_nll, _ = self.conditioned_token_nll(batch, z)
            sequence_nll = token_nll.double().sum(-1)
            log_p = diag_gaussian_log_density(z, prior_mu, prior_logvar).double()
            log_q = diag_gaussian_log_density(z, mu, logvar).double()
            log_weights.append(-sequence_nll + log_p - log_q)
            sequence_nlls.append(sequence_nll)
        return torch.stack(log_weights), torch.stack(sequence_nlls), False
