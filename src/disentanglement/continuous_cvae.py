"""Continuous Gaussian CVAE: diagonal Gaussian posterior ``q(z | x, y)`` and prior ``p(z | x)``
(learned, or the standard normal), reparameterised sample, analytic KL per dimension.
The posterior mean is used at evaluation."""

from __future__ import annotations

import torch

from .cvae_base import CVAEBase, FrozenFeatures, LatentSample, mlp
from .regularizers import gaussian_kl

LOGVAR_RANGE = (-12.0, 8.0)  # keeps exp(logvar) finite in float32 and bfloat16


class ContinuousCVAE(CVAEBase):
    def __init__(self, decoder, latent, reconstruction, kl, divergence=None, **kwargs) -> None:
        super().__init__(decoder, latent, reconstruction, kl, divergence, **kwargs)
        D, H = latent.latent_dim, self.hidden_size
        self.encoder = mlp(2 * H, latent.encoder_hidden, 2 * D)
        self.prior_head = mlp(H, latent.encoder_hidden, 2 * D) if latent.prior == "learned" else None

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
