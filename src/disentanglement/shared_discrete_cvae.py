"""Shared-codebook discrete CVAE: ``M`` slots, each a categorical over ``K`` codes of ONE codebook.

The codebook ``E [K, C]`` scores the posterior (logits = -||e_m - E_k||^2 / temperature for the
encoder's output ``e_m`` of slot ``m``) and builds the decoder's latent embeddings (the chosen
codes of all slots, concatenated, through the latent projection). With ``decoder_code_table`` the
decoder reads the chosen codes from a table of its own, ``code_table [K, C]``, and the codebook only assigns.

Default assignment ("nearest", measured to learn where softmax/Gumbel variants collapsed, see
LATENT-LEARNING.md): the nearest code, with the decoder seeing ``E_k`` whose gradient reaches the
codebook while a straight-through copy reaches the encoder; codebook loss ``||sg(e) - E_k||^2``,
commitment loss ``||e - sg(E_k)||^2``, and restart of codes unused for ``dead_code_steps`` steps
at a recent encoder output. The posterior is then one-hot and ``KL = -log p(k | x)`` per slot.

Option "gumbel": Gumbel-softmax over the same logits with an annealed temperature and an
optional straight-through hard sample; categorical KL to the prior, per example or between
batch-averaged posterior and prior (``batch_prior_kl``). Argmax at evaluation in both.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .config import DECODER_POSTERIOR_LIMIT
from .cvae_base import CVAEBase, FrozenFeatures, LatentSample, PosteriorSummary, PriorMixture, mlp
from .data import Batch
from .latent_space import DiscreteLatentSpace
from .regularizers import annealed_temperature, categorical_kl


def one_hot_kl(log_p: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``KL(one-hot at k* || p) = -log p(k* | x)`` per slot, ``[B, M]``, of ``log_p [B, M, K]`` and ``codes [B, M]``."""
    return -log_p.gather(-1, codes.unsqueeze(-1)).squeeze(-1)


def code_combinations(K: int, M: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Every combination of ``M`` slots' codes out of ``K``, ``[K^M, M]``, in ``itertools.product(range(K),
    repeat=M)`` order: the exact prior mixture's order, and that of every per-combination score computed from it."""
    return torch.tensor(list(itertools.product(range(K), repeat=M)), device=device).view(-1, M)


def combination_log_probs(log_p: torch.Tensor, combinations: torch.Tensor) -> torch.Tensor:
    """``sum_m log p_m(k_m)`` ``[B, S]`` for each row's per-slot log-probabilities ``log_p [B, M, K]`` and each of the
    ``S`` code combinations ``[S, M]`` (:func:`code_combinations`): the log weight of a combination under a
    distribution that factorises over the slots (the prior's mixture weights, the encoder's soft posterior)."""
    slots = torch.arange(log_p.shape[1], device=log_p.device)
    return log_p[:, slots, combinations].sum(-1)


class SharedDiscreteCVAE(CVAEBase):
    def __init__(self, decoder, latent, reconstruction, kl, divergence=None, **kwargs) -> None:
        super().__init__(decoder, latent, reconstruction, kl, divergence, **kwargs)
        M, K, C, H = latent.num_slots, latent.codebook_size, latent.code_dim, self.hidden_size
        self.codebook = torch.nn.Parameter(torch.randn(K, C))  # [K, C], shared by all slots
        # decoder_code_table: what the decoder reads for each code, apart from the codebook that assigns
        self.code_table = torch.nn.Parameter(self.codebook.detach().clone()) if latent.decoder_code_table else None
        self.encoder = mlp(2 * H, latent.encoder_hidden, M * C)
        self.prior_head = mlp(H, latent.encoder_hidden, M * K) if latent.prior == "learned" else None
        # Step at which each code was last chosen, for dead-code restart.
        self.register_buffer("code_last_used", torch.zeros(K, dtype=torch.long))
        self._recent_encodings: torch.Tensor | None = None

    @property
    def latent_space(self) -> DiscreteLatentSpace:
        """What this family's latents mean to the tools that read, steer and report them (``latent_space.py``)."""
        return DiscreteLatentSpace(self)

    @property
    def latent_vector_dim(self) -> int:
        return self.latent_cfg.num_slots * self.latent_cfg.code_dim

    @property
    def num_slots(self) -> int:
        return self.latent_cfg.num_slots

    @property
    def codebook_size(self) -> int:
        return self.latent_cfg.codebook_size

    def encoder_outputs(self, features: FrozenFeatures) -> torch.Tensor:
        """``e``, ``[B, M, C]``."""
        e = self.encoder(self.encoder_norm(self.encoder_input(features)))
        return e.view(e.shape[0], self.num_slots, self.latent_cfg.code_dim)

    def posterior_logits(self, e: torch.Tensor, detach_codebook: bool = False) -> torch.Tensor:
        """``-||e_m - E_k||^2 / temperature``, ``[B, M, K]`` (``detach_codebook``: no gradient to the codes)."""
        codebook = self.codebook.detach() if detach_codebook else self.codebook
        distances = (e.unsqueeze(2) - codebook).pow(2).sum(-1)  # [B, M, K]
        return -distances / self.latent_cfg.posterior_temperature

    def prior_log_probs(self, features: FrozenFeatures) -> torch.Tensor:
        """``log p(k | x)`` per slot, ``[B, M, K]`` (uniform for the fixed prior)."""
        B, M, K = features.prior_features.shape[0], self.num_slots, self.codebook_size
        if self.prior_head is None:
            return torch.full((B, M, K), -math.log(K), device=features.prior_features.device)
        logits = self.prior_head(self.prior_norm(features.prior_features)).view(B, M, K)
        return F.log_softmax(logits, dim=-1)

    @property
    def decoder_codes(self) -> torch.Tensor:
        """``[K, C]``: what the decoder reads for each code: the codebook, or the ``code_table`` of its own."""
        return self.codebook if self.code_table is None else self.code_table

    def codes_to_vector(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, M]`` code ids -> latent vector ``[B, M * C]`` (used to force codes at generation)."""
        return self.decoder_codes[codes].flatten(1)

    def encode(self, features: FrozenFeatures, step: int) -> LatentSample:
        cfg = self.latent_cfg
        e = self.encoder_outputs(features)  # [B, M, C]
        log_p = self.prior_log_probs(features)  # [B, M, K]
        aux: dict[str, torch.Tensor] = {}
        stats: dict[str, float] = {}
        nearest = cfg.assignment == "nearest"
        if nearest:
            with torch.no_grad():  # the choice itself carries no gradient
                distances = torch.cdist(e, self.codebook.unsqueeze(0), compute_mode="donot_use_mm_for_euclid_dist")
                codes = distances.argmin(-1)  # [B, M], the nearest code
            chosen = self.codebook[codes]  # [B, M, C]
            # value E_k (decoder_code_table: the table's entry k); the decoder's gradient to that (unless
            # codebook_decoder_gradient is off: then the codebook moves by its codebook loss only, as VQ-VAE's)
            # and, straight through, to e
            if self.code_table is not None:
                decoded = self.code_table[codes]
            else:
                decoded = chosen if cfg.codebook_decoder_gradient else chosen.detach()
            # centered_straight_through: through e minus its batch mean, whose gradient is the decoder's minus its
            # mean over the batch (the common shift of every output removed); null (a LatentConfig's own default;
            # build_cvae resolves a run's) wherever there is a batch to centre over, as RunConfig resolves it
            centred = cfg.centered_straight_through
            through = e - e.mean(0, keepdim=True) if centred or (centred is None and e.shape[0] >= 2) else e
            vectors = decoded + (through - through.detach())
            aux["codebook_loss"] = cfg.codebook_loss_weight * F.mse_loss(chosen, e.detach())
            aux["commitment_loss"] = cfg.commitment_weight * F.mse_loss(e, chosen.detach())
            if self.training:
                self._recent_encodings = e.detach().float().reshape(-1, cfg.code_dim)  # bf16 under (CUDA) autocast
                self.code_last_used.index_fill_(0, codes.flatten(), step)
        else:
            logits = self.posterior_logits(e)  # [B, M, K]
            codes = logits.argmax(-1)  # [B, M]
            temperature = annealed_temperature(
                step, cfg.gumbel_temperature, cfg.gumbel_temperature_min, cfg.gumbel_anneal_steps
            )
            stats["temperature"] = temperature
            if self.training:
                weights = F.gumbel_softmax(logits, tau=temperature, hard=cfg.straight_through)  # [B, M, K]
            else:
                weights = F.one_hot(codes, self.codebook_size).to(logits.dtype)
            vectors = weights @ self.decoder_codes  # [B, M, C]
            log_q = F.log_softmax(logits, dim=-1)
            q = log_q.exp()
        if cfg.batch_prior_kl:
            if nearest:  # the posterior is one-hot at ``codes``
                q = F.one_hot(codes, self.codebook_size).to(log_p.dtype)
            q_bar = q.mean(0, keepdim=True)  # [1, M, K]
            p_bar = log_p.exp().mean(0, keepdim=True)
            kl = categorical_kl(q_bar.clamp_min(1e-12).log(), p_bar.clamp_min(1e-12).log())  # [1, M]
            kl = kl.expand(e.shape[0], -1)  # the batch's KL, carried by every example
        elif nearest:
            kl = one_hot_kl(log_p, codes)  # [B, M]
        else:
            kl = categorical_kl(log_q, log_p)  # [B, M]
        return LatentSample(
            vectors.flatten(1), codes, kl, aux, stats, lambda: self.code_usage_stats(codes), encoder_outputs=e
        )

    # -- the decoder's own posterior of the codes (decoder_posterior_weight) ----------------------
    @torch.no_grad()
    def decoder_posterior(
        self, batch: Batch, features: FrozenFeatures, codes: torch.Tensor, sequence_nll: torch.Tensor
    ) -> torch.Tensor:
        """``log r(k | x, y)`` ``[B, M, K]``: the exact posterior of the codes under the current decoder.

        ``r(k_1..k_M | x, y) ∝ prod_m p(k_m | x) p(y | x, k_1..k_M)`` over all ``K^M`` combinations (``p(y | ..)``
        the sequence likelihood, a decoder pass without gradients each), then per slot its marginal. Rows
        whose chosen ``codes [B, M]`` are the combination take its ``sequence_nll [B]`` (the training decode's)
        instead of a decode: the decoder computes each row alone, so that is the value a decode would give, up to
        floating-point rounding (the training decode runs with gradients, on the whole batch) and, with dropout in
        the decoder's adapters, its own dropout mask. The combinations and their prior weights are the exact
        prior mixture's (:meth:`prior_mixture`; the config keeps ``K^M`` within its limit)."""
        mixture = self.prior_mixture(features, exact_limit=DECODER_POSTERIOR_LIMIT)
        sequence_nlls = []
        for combination, vectors in zip(mixture.codes, mixture.vectors, strict=True):  # [M], [B, L]
            known = (codes == combination).all(-1)  # [B]
            nll = torch.where(known, sequence_nll.double(), 0.0)
            rest = (~known).nonzero().flatten()
            if rest.numel():
                token_nll, _ = self.conditioned_token_nll(batch.take(rest), vectors[rest])
                nll[rest] = token_nll.double().sum(-1)
            sequence_nlls.append(nll)
        return mixture.decoder_posterior(torch.stack(sequence_nlls), self.codebook_size).float()  # [B, M, K]

    def decoder_posterior_kl(self, log_r: torch.Tensor, encoder_outputs: torch.Tensor) -> torch.Tensor:
        """The term that trains the encoder towards ``r``, per slot, summed over slots, mean over the batch; ``q`` the
        softmax of the posterior logits of ``encoder_outputs [B, M, C]``, ``r`` fixed. ``decoder_posterior_target``
        "soft": ``KL(r || q) = sum_k r_k (log r_k - log q_k)``, its gradient reaching the encoder and the codebook;
        "hard": ``-log q(argmax_k r_k)``, the codebook detached (the encoder alone moves)."""
        hard = self.latent_cfg.decoder_posterior_target == "hard"
        log_q = F.log_softmax(self.posterior_logits(encoder_outputs, detach_codebook=hard).float(), dim=-1)  # [B, M, K]
        if hard:
            return -log_q.gather(-1, log_r.argmax(-1, keepdim=True)).sum(-1).sum(-1).mean()
        r = log_r.exp()
        return (torch.xlogy(r, r) - r * log_q).sum(-1).sum(-1).mean()  # 0 log 0 = 0

    @torch.no_grad()
    def code_usage_stats(self, codes: torch.Tensor) -> dict[str, float]:
        """Per slot: how many codes the batch ``[B, M]`` uses and the perplexity of their shares."""
        M, K = self.num_slots, self.codebook_size
        slot_offset = torch.arange(M, device=codes.device) * K  # count all slots in one bincount
        counts = torch.bincount((codes + slot_offset).flatten(), minlength=M * K).view(M, K).float()
        share = counts / counts.sum(1, keepdim=True)
        used = (counts > 0).sum(1).tolist()
        perplexity = torch.exp(-(share * share.clamp_min(1e-12).log()).sum(1)).tolist()
        stats = {f"codes_used_slot_{m}": float(used[m]) for m in range(M)}
        stats.update({f"code_perplexity_slot_{m}": perplexity[m] for m in range(M)})
        return stats

    def prior_vectors(
        self, features: FrozenFeatures, num_samples: int, log_p: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Codes drawn from the prior per slot, as latent vectors ``[S, B, M * C]`` (``log_p``: the
        prior's ``[B, M, K]`` log-probabilities, when already computed)."""
        log_p = self.prior_log_probs(features) if log_p is None else log_p  # [B, M, K]
        B, M, K = log_p.shape
        codes = torch.multinomial(log_p.exp().reshape(B * M, K), num_samples, replacement=True)  # [B*M, S]
        codes = codes.view(B, M, num_samples).permute(2, 0, 1)  # [S, B, M]
        return torch.stack([self.codes_to_vector(c) for c in codes])

    # -- evaluation: the posterior, the prior as a mixture, importance samples ------------------
    def posterior_latents(self, features: FrozenFeatures) -> dict[str, torch.Tensor]:
        """``codes [B, M]`` (argmax) and ``probs [B, M, K]`` (the softmax of the posterior logits)."""
        logits = self.posterior_logits(self.encoder_outputs(features))  # [B, M, K]
        return {"codes": logits.argmax(-1), "probs": logits.softmax(-1)}

    def posterior_summary(self, features: FrozenFeatures) -> PosteriorSummary:
        """Argmax codes, the effective posterior and the prior (per-example KL, never the batch-averaged one).

        ``log_q`` is one-hot at the nearest code for "nearest" (``0`` / ``-inf``, KL ``-log p(k* | x)``),
        the softmax of the posterior logits for "gumbel"."""
        logits = self.posterior_logits(self.encoder_outputs(features)).float()  # [B, M, K]
        codes = logits.argmax(-1)  # [B, M]
        log_p = self.prior_log_probs(features).float()  # [B, M, K]
        if self.latent_cfg.assignment == "nearest":
            one_hot = F.one_hot(codes, self.codebook_size).bool()
            log_q = torch.zeros_like(logits).masked_fill(~one_hot, float("-inf"))
            kl = one_hot_kl(log_p, codes)
        else:
            log_q = F.log_softmax(logits, dim=-1)
            kl = categorical_kl(log_q, log_p)
        return PosteriorSummary(self.codes_to_vector(codes), kl, codes=codes, log_q=log_q, log_p=log_p)

    def prior_mixture(
        self,
        features: FrozenFeatures,
        num_samples: int = 16,
        exact_limit: int = 64,
        summary: PosteriorSummary | None = None,
    ) -> PriorMixture:
        """Every combination of codes over the ``M`` slots (``K^M``, weighted by ``prod_m p(k_m | x)``)
        when ``K^M <= exact_limit``; otherwise ``num_samples`` code tuples drawn from the prior, equally
        weighted (:meth:`prior_vectors`, the global torch generator). ``summary``: its prior is reused."""
        log_p = self.prior_log_probs(features).float() if summary is None else summary.log_p  # [B, M, K]
        B, M, K = log_p.shape
        combinations = K**M
        if combinations > exact_limit:
            vectors = self.prior_vectors(features, num_samples, log_p=log_p)  # [S, B, L]
            return PriorMixture(vectors, log_p.new_full((num_samples, B), -math.log(num_samples)), "samples")
        every_code = code_combinations(K, M, log_p.device)  # [S, M]
        vectors = self.codes_to_vector(every_code).unsqueeze(1).expand(-1, B, -1)  # [S, B, L]
        log_weights = combination_log_probs(log_p, every_code).T  # [S, B]
        return PriorMixture(vectors, log_weights, "exact", codes=every_code)

    def importance_samples(
        self, batch: Batch, summary: PosteriorSummary, num_samples: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``log p(y | x, z_k) + log p(z_k | x) - log q(z_k | x, y)`` ``[k, B]``, the sequence NLL
        ``[k, B]`` and whether the bound is exact.

        "nearest": the posterior is one-hot at ``k*``, so the bound is exact at
        ``-log p(y | x, k*) - log p(k* | x)`` (one decoder pass; ``log p(k* | x)`` is the summary's
        KL). "gumbel": codes drawn from the softmax posterior of each slot (the global torch generator).
        """
        if self.latent_cfg.assignment == "nearest":
            token_nll, _ = self.conditioned_token_nll(batch, summary.vector)
            sequence_nll = token_nll.double().sum(-1)  # [B]
            log_prior = -summary.kl_per_unit.sum(-1).double()  # KL(one-hot || p) = -log p(k* | x)
            return (-sequence_nll + log_prior).unsqueeze(0), sequence_nll.unsqueeze(0), True
        B, M, K = summary.log_q.shape
        rows = torch.arange(B, device=summary.codes.device).unsqueeze(1)  # [B, 1]
        slots = torch.arange(M, device=summary.codes.device)
        log_weights, sequence_nlls = [], []
        for _ in range(num_samples):
            codes = torch.multinomial(summary.log_q.exp().reshape(B * M, K), 1).view(B, M)
            token_nll, _ = self.conditioned_token_nll(batch, self.codes_to_vector(codes))
            sequence_nll = token_nll.double().sum(-1)
            log_p = summary.log_p[rows, slots, codes].sum(-1).double()
            log_q = summary.log_q[rows, slots, codes].sum(-1).double()
            log_weights.append(-sequence_nll + log_p - log_q)
            sequence_nlls.append(sequence_nll)
        return torch.stack(log_weights), torch.stack(sequence_nlls), False

    def alternative_vector(self, sample: LatentSample) -> torch.Tensor:
        """Every slot moved to a different code, chosen uniformly among the other ``K - 1``."""
        shift = torch.randint(1, self.codebook_size, sample.latent.shape, device=sample.latent.device)
        alternative = (sample.latent + shift) % self.codebook_size
        return self.codes_to_vector(alternative)

    @torch.no_grad()
    def initialize_from_data(self, features: FrozenFeatures, seed: int) -> None:
        """The codebook's start: k-means of the encoder's outputs (all slots pooled), so that every code
        lies where some examples are; for ``codebook_init`` "prior_kmeans" and "view_kmeans", :meth:`_cluster_means`."""
        if self.latent_cfg.codebook_init in ("prior_kmeans", "view_kmeans"):
            centroids = self._cluster_means(features, seed)
        else:
            centroids = self._kmeans_centroids(features, seed)
        if centroids is not None:
            self.codebook.copy_(centroids)
            if self.code_table is not None:
                self.code_table.copy_(centroids)

    @torch.no_grad()
    def refresh_from_data(self, features: FrozenFeatures, seed: int) -> None:
        """k-means again during training, keeping code identities: each new centroid replaces the old
        code it is matched to (minimum total distance), so codes that already mean something move little
        and the decoder keeps their meaning. It separates two groups of examples that share one code
        while another group occupies two (the failure that dead-code restart cannot repair: no code is dead).
        """
        centroids = self._kmeans_centroids(features, seed)
        if centroids is None:
            return
        from scipy.optimize import linear_sum_assignment

        old_codes, new_codes = linear_sum_assignment(torch.cdist(self.codebook, centroids).cpu().numpy())
        reordered = centroids.clone()
        reordered[torch.as_tensor(old_codes)] = centroids[torch.as_tensor(new_codes)]
        self.codebook.copy_(reordered)

    def _kmeans_centroids(self, features: FrozenFeatures, seed: int) -> torch.Tensor | None:
        """``K`` k-means centroids ``[K, C]`` of the encoder's outputs of all slots; None unless the codebook
        starts from k-means (``codebook_init``) and there are at least ``K`` outputs."""
        if self.latent_cfg.codebook_init != "kmeans":
            return None
        from sklearn.cluster import KMeans

        encodings = self.encoder_outputs(features).reshape(-1, self.latent_cfg.code_dim).float().cpu().numpy()
        if encodings.shape[0] < self.codebook_size:
            return None
        centroids = KMeans(n_clusters=self.codebook_size, n_init=10, random_state=seed).fit(encodings).cluster_centers_
        return torch.as_tensor(centroids, dtype=self.codebook.dtype, device=self.codebook.device)

    def _cluster_means(self, features: FrozenFeatures, seed: int) -> torch.Tensor | None:
        """``[K, C]``: code ``k`` = the mean encoder output (all slots pooled) of the examples in cluster ``k``
        of k-means of some features; None when there are fewer than ``K`` examples.

        ``prior_kmeans``: of the prior features (LayerNorm'ed, as the prior head sees them): the start
        partitions the data as the prompt does, not as the view does. ``view_kmeans``: of the encoder's view
        itself (``encoder_input``, what eval's ``encoder_kmeans`` baseline clusters), not of the encoder's
        outputs: the start partitions the data as k-means of the view does, before the encoder's random
        projection mixes it."""
        from sklearn.cluster import KMeans

        if self.latent_cfg.codebook_init == "view_kmeans":
            points = self.encoder_input(features).float().cpu().numpy()  # [E, 2H]
        else:
            points = self.prior_norm(features.prior_features.float()).cpu().numpy()  # [E, H]
        if points.shape[0] < self.codebook_size:
            return None
        clusters = KMeans(n_clusters=self.codebook_size, n_init=10, random_state=seed).fit_predict(points)  # [E]
        e = self.encoder_outputs(features).float()  # [E, M, C]
        assigned = torch.as_tensor(clusters, device=e.device)
        means = torch.stack([e[assigned == k].reshape(-1, e.shape[-1]).mean(0) for k in range(self.codebook_size)])
        return means.to(dtype=self.codebook.dtype, device=self.codebook.device)

    @torch.no_grad()
    def merge_step_statistics(self, state) -> None:
        """Several processes: a code counts as used in the step when any process's slice used it, and the
        restart candidates are the recent encodings of the whole global batch, in process order (which
        is the order of one process's batch: process ``r`` trains the ``r``-th slice)."""
        if state is None or state.num_processes == 1:
            return
        from accelerate.utils import gather

        from .distributed import all_reduce_max_

        all_reduce_max_(state, self.code_last_used)
        if self._recent_encodings is not None:
            self._recent_encodings = gather(self._recent_encodings)

    def data_dependent_state(self) -> list[torch.Tensor]:
        own = [] if self.code_table is None else [self.code_table]
        return [self.codebook, *own, self.code_last_used]

    @torch.no_grad()
    def post_step(self, step: int) -> None:
        """Restart codes unused for ``dead_code_steps`` steps at random recent encoder outputs.

        ``step`` is the index of the step just taken; codes chosen in it have been unused for 0 steps.
        """
        window = self.latent_cfg.dead_code_steps
        if self.latent_cfg.assignment != "nearest" or window == 0 or self._recent_encodings is None:
            return
        if step - int(self.code_last_used.min()) < window:  # the usual case: every code in use
            return
        dead = ((step - self.code_last_used) >= window).nonzero().flatten()
        recent = self._recent_encodings
        picks = torch.randint(0, recent.shape[0], (dead.numel(),), device=recent.device)
        self.codebook[dead] = recent[picks] + 0.01 * torch.randn_like(recent[picks])
        if self.code_table is not None:
            self.code_table[dead] = self.codebook[dead]
        self.code_last_used[dead] = step
