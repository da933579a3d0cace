"""The shared base of both CVAEs: frozen features pass, latent injection and the objective.

Shapes: ``B`` examples; ``T`` z-free length of ``[x][y]``; ``P`` latent embeddings; conditioned
length ``Tc = T + P`` (``Tc = T`` for the memory placement); ``N = Tc - 1`` conditioned positions;
``H`` hidden size; ``V`` vocabulary.

One no-grad pass of the frozen model over the z-free sequence ``[x][y]`` gives the z-free
per-token surprisal, the prior's features (hidden state at the last prompt token) and the
encoder's features: a pool of the response's hidden states, concatenated with the last token's.
The pool is the encoder's view (``LatentConfig.encoder_view``): the plain mean (``mean_last``, the
default), the sum weighted by term 3's token weights ``pi_t`` (``token_weighted``), a learned
query's attention over the per-token states (``attention``, pooled in the step by
:class:`AttentionPool`), or that attention with ``log pi_t`` added to its logits
(``token_weighted_attention``: it starts exactly at the ``token_weighted`` pool and can move away). Features come from ``hidden_states[encoder_layer]`` (the last layer by
default); the surprisal always from the last.
The latent family (a subclass) turns features into a latent vector; a linear projection turns
it into ``P`` soft embeddings placed ``[z][x][y]`` (``prefix``) or ``[x][z][y]`` (``between``), or
mapped to ``P`` key/value memory slots of every attention layer (``memory``, :mod:`.memory`): the
decoder then sees ``[x][y]`` at its z-free positions, with the memory as a past-key-value cache.
The injection and the layout it gives the decoder's input are :mod:`.injection`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention_backward import fast_attention_backward
from .config import ConfigError, DivergenceConfig, KLConfig, LatentConfig, ReconstructionLossConfig
from .data import Batch, length_groups
from .encoder_adapters import EncoderAdapters
from .injection import LatentLayout, latent_memory, latent_projection
from .losses import (
    apply_head,
    default_chunk_size,
    masked_token_nll_per_position,
    reconstruction_loss_stack,
    uniform_token_weights,
)
from .memory import cache_from_layers, plain_cache
from .reference import ZFreeReference, eval_mode, forward_sharing_prefix, reference_hidden_states, unused_logits
from .regularizers import beta_at, kl_objective, next_token_divergence
from .token_weighting import (
    TokenWeighting,
    align_to_conditioned,
    align_token_weighting,
    token_weighting_from_base_nll,
)


@dataclass(frozen=True)
class WeightingParams:
    """The settings a token weighting depends on besides the data (term 3's ``token_weight_*`` fields);
    hashable, the key under which a feature cache keeps the weights it precomputed."""

    source: str  # "surprisal", "entropy" or "dynamic"
    alpha: float
    eps: float
    interpolation: float


@dataclass
class FrozenFeatures:
    """What one no-grad pass of the frozen model over ``[x][y]`` yields (deterministic per example)."""

    zfree_token_nll: torch.Tensor  # [B, T-1], b_t on the z-free layout, zero off the response
    prior_features: torch.Tensor  # [B, H], hidden state at the last prompt token
    # [B, 2H], the response pool ++ the last token's hidden state: the pool is the mean (encoder_view
    # "mean_last", and "attention", whose encoder replaces it by its own pool of response_hidden) or
    # sum_t pi_t h_t ("token_weighted").
    encoder_features: torch.Tensor
    # The reference's predictive entropy on the same layout, when token_weight_source = "entropy".
    zfree_token_entropy: torch.Tensor | None = None
    # Optional: the token weighting on the z-free layout, precomputed (by the feature cache) for
    # ``weighting_params`` (source, alpha, eps, interpolation); a model uses it only when those are its own.
    zfree_weighting: TokenWeighting | None = None
    weighting_params: WeightingParams | None = None
    # encoder_view "attention" only: the hidden states at the response tokens' positions of [x][y],
    # [B, T, H], zero elsewhere, and the [B, T] boolean mask of those positions (target_mask).
    response_hidden: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    # The batch these are the features of (frozen_pass and FeatureCache.features set it): the encoder's adapted
    # pass (LatentConfig.encoder_lora_layers) runs over its tokens every step.
    batch: Batch | None = None


@dataclass
class LatentSample:
    """A latent family's posterior draw for a batch."""

    vector: torch.Tensor  # [B, L], what the projection turns into P latent embeddings
    latent: torch.Tensor  # discrete codes [B, M] (long) or continuous z [B, D]
    kl_per_unit: torch.Tensor  # [B, U], per slot or per dimension
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # weighted scalars added to the loss
    stats: dict[str, float] = field(default_factory=dict)
    # Statistics for the log only, computed when the output is logged: no work (or device sync) in the step.
    logged_stats: Callable[[], dict[str, float]] | None = None
    encoder_outputs: torch.Tensor | None = None  # discrete: e [B, M, C], whose logits the decoder's posterior trains


@dataclass
class CVAEOutput:
    """One record per forward: the loss, every term, KL, divergence and the latent."""

    loss: torch.Tensor
    reconstruction_terms: dict[str, torch.Tensor]
    reconstruction_total: torch.Tensor
    kl: torch.Tensor  # mean over the batch of the per-example KL, nats
    kl_per_unit: torch.Tensor  # [U], batch-mean KL per slot or dimension, nats
    kl_objective_per_unit: torch.Tensor  # [U], what enters the objective: after per-token division and free bits
    kl_term: torch.Tensor
    beta: float
    divergence: torch.Tensor | None
    divergence_term: torch.Tensor
    aux_losses: dict[str, torch.Tensor]
    latent: torch.Tensor
    token_nll: torch.Tensor  # [B, N]
    target_mask: torch.Tensor  # [B, N]
    weighting: TokenWeighting
    stats: dict[str, float]
    logged_stats: Callable[[], dict[str, float]] | None = None

    def scalars(self) -> dict[str, float]:
        """Everything worth logging, as floats."""
        out = {k: float(v.detach()) for k, v in self.reconstruction_terms.items()}
        out.update(
            loss=float(self.loss.detach()),
            reconstruction_total=float(self.reconstruction_total.detach()),
            kl=float(self.kl.detach()),
            kl_term=float(self.kl_term.detach()),
            beta=self.beta,
            divergence_term=float(self.divergence_term.detach()),
        )
        if self.divergence is not None:
            out["divergence"] = float(self.divergence.detach())
        for i, (raw, objective) in enumerate(
            zip(self.kl_per_unit.tolist(), self.kl_objective_per_unit.tolist(), strict=True)
        ):
            out[f"kl_unit_{i}"] = raw  # batch-mean KL of the unit in nats (a collapsed unit shows 0)
            out[f"kl_objective_unit_{i}"] = objective  # after per-token division and free bits
        out.update({k: float(v.detach()) for k, v in self.aux_losses.items()})
        out.update(self.stats)
        if self.logged_stats is not None:
            out.update(self.logged_stats())
        return out


@dataclass
class Decoded:
    """The decoder's final hidden states over the window of conditioned positions ``start .. Tc-1``.

    Logits are produced from them by the LM head only where needed: at the positions that predict a
    response token for the NLL (:meth:`token_nll`; never the whole ``[B, T, V]`` block), or at chosen
    positions (:meth:`logits_at`).
    """

    hidden: torch.Tensor  # [B, Tc - start, H]
    head: nn.Module  # the LM head: [.., H] -> [.., V]
    start: int
    input_ids: torch.Tensor  # [B, Tc], 0 at latent positions
    target_mask: torch.Tensor  # [B, Tc], 1 on response tokens
    offsets: torch.Tensor  # [B], alignment_offsets of the z-free positions

    def token_nll(self) -> torch.Tensor:
        """Masked per-token NLL ``[B, Tc-1]``, zero where nothing is supervised.

        The LM head runs only at the ``S`` positions that predict a response token (not at the window's
        prompt and padding positions), gathered into one sequence: its logits in one block when they hold
        at most :data:`WHOLE_WINDOW_LOGITS` elements (no activation checkpointing, so the backward does not
        run the head again), else chunk by chunk."""
        B, W, H = self.hidden.shape
        V = self.head.weight.shape[0]
        supervised = self.target_mask[:, self.start + 1 :].bool()  # [B, W - 1]: position t predicts token t + 1
        if W < 2:
            return self.hidden.new_zeros(B, self.start + max(W - 1, 0), dtype=torch.float32)
        # One sequence [1, S + 1, H] whose position s predicts token s + 1: the supervised states, then a
        # last position that predicts nothing; its ids are the targets shifted by one.
        states = torch.cat([self.hidden[:, :-1][supervised], self.hidden.new_zeros(1, H)]).unsqueeze(0)
        targets = self.input_ids[:, self.start + 1 :][supervised]
        ids = torch.cat([targets.new_zeros(1), targets]).unsqueeze(0)
        mask = F.pad(torch.ones_like(targets, dtype=self.target_mask.dtype), (1, 0)).unsqueeze(0)
        S = targets.numel()
        chunk = None if S * V <= WHOLE_WINDOW_LOGITS else default_chunk_size(1, V)
        nll = masked_token_nll_per_position(states, ids, mask, chunk, head=self.head)[0]  # [S]
        window = torch.zeros(B, W - 1, dtype=nll.dtype, device=nll.device).masked_scatter(supervised, nll)
        return F.pad(window, (self.start, 0))

    def logits_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, V]`` at the window positions selected by a boolean ``[B, Tc - start]`` mask."""
        return self.head(self.hidden[positions])

    def logits(self) -> torch.Tensor:
        """All logits of the window, ``[B, Tc - start, V]`` (materialises the full block); past a row's length
        they are undefined (the decoder may run rows in length groups: :meth:`CVAEBase._decoder_hidden`)."""
        return apply_head(self.head, self.hidden)


#: What one more decoder call costs, in positions of work (:func:`.data.length_groups`): a batch is split by
#: length only where that saves more positions than this per extra call (measured: ``benchmarks/README.md``).
DECODER_CALL_POSITIONS = 64

#: With ``latent_placement: between`` (``[x][z][y]``) the prompt's keys and values do not depend on ``z``: the decoder
#: runs the prompt once and ``[z][y]`` from its cache (:meth:`CVAEBase._decode_after_prompt`); False: one pass.
SPLIT_PROMPT = True

#: Logits of a step's supervised positions computed in one block up to this many elements (256 MiB in float32; at
#: SmolLM2's 49,152-token vocabulary: 1,365 response tokens in the batch), instead of checkpointed chunks whose
#: backward recomputes the head's matmul and log-softmax (measured: ``benchmarks/README.md``, "Speed").
WHOLE_WINDOW_LOGITS = 1 << 26


def _row_groups(lengths: torch.Tensor) -> list[list[int]]:
    """The rows of ``lengths [B]`` in :func:`.data.length_groups` on the CPU; one group elsewhere (on a GPU an extra
    call costs kernel launches: measured on CPUs only)."""
    if lengths.device.type != "cpu":
        return [list(range(lengths.shape[0]))]
    return length_groups(lengths.tolist(), DECODER_CALL_POSITIONS)


def _in_row_order(parts: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """``parts`` (one tensor per group of rows, rows first) put back in the batch's row order. One group is the
    batch in its own order (:func:`_row_groups` and :func:`.data.length_groups` keep it)."""
    if len(groups) == 1:
        assert groups[0] == list(range(len(groups[0]))), "one group out of row order"
        return parts[0]
    order = torch.tensor([r for rows in groups for r in rows], device=parts[0].device)
    return torch.cat(parts)[torch.argsort(order)]


def _pad_last(mask: torch.Tensor) -> torch.Tensor:
    """A ``[B, W-1]`` position mask extended to the ``[B, W]`` window (its last position predicts nothing)."""
    return F.pad(mask, (0, 1), value=False)


def with_word_dropout(batch: Batch, rate: float) -> Batch:
    """``batch`` with ``decoder_input_keep``: each response token dropped (False) with probability ``rate``, drawn
    from torch's generator; prompt and padding always kept. Every decode of the returned batch (and of its rows:
    the decoder posterior's other codes) reads the same tokens."""
    dropped = (torch.rand(batch.target_mask.shape, device=batch.target_mask.device) < rate) & batch.target_mask.bool()
    return dataclasses.replace(batch, decoder_input_keep=~dropped)


def mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    # tanh-approximated GELU: within 1e-3 of the erf form and half its cost on the CPU.
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(approximate="tanh"), nn.Linear(d_hidden, d_out))


#: Rows per chunk of the encoder's adapted pass without gradients (:meth:`CVAEBase.adapted_features`).
ADAPTED_PASS_ROWS = 64

#: The encoder views whose pool is learned over the per-token states (cached per token).
ATTENTION_VIEWS = ("attention", "token_weighted_attention")


class AttentionPool(nn.Module):
    """A learned query's attention over the response's hidden states (``encoder_view = "attention"``).

    ``a_t = softmax_t(q . LayerNorm(h_t) / sqrt(H))`` over the response positions only (prompt and
    padding masked out), pooled ``sum_t a_t h_t``, ``[B, H]``. The key's LayerNorm has no parameters;
    the query starts at zero, so before training the pool is the plain mean of ``mean_last``.
    With ``log_prior`` (``[B, T]``; ``encoder_view = "token_weighted_attention"`` passes ``log pi_t``, i.e.
    ``alpha log b_t`` up to a constant per example) the logits are ``log_prior_t + q . LayerNorm(h_t) /
    sqrt(H)``: at ``q = 0`` the weights are ``softmax(log pi) = pi``, the ``token_weighted`` pool.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm = nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.scale = hidden_size**-0.5

    def weights(self, hidden: torch.Tensor, mask: torch.Tensor, log_prior: torch.Tensor | None = None) -> torch.Tensor:
        """``a_t``, ``[B, T]`` for ``[B, T, H]`` states and a ``[B, T]`` mask (rows sum to 1 over the mask);
        ``log_prior [B, T]`` is added to the logits (its values off the mask are never used)."""
        scores = ((self.key_norm(hidden) @ self.query.to(hidden.dtype)) * self.scale).float()  # [B, T]
        if log_prior is not None:
            scores = scores + torch.where(mask.bool(), log_prior.float(), torch.zeros_like(scores))
        return torch.softmax(scores.masked_fill(~mask.bool(), float("-inf")), dim=1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, log_prior: torch.Tensor | None = None) -> torch.Tensor:
        weights = self.weights(hidden, mask, log_prior).to(hidden.dtype)  # [B, T], exactly 0 off the response
        return (weights.unsqueeze(-1) * hidden).sum(1)


class GatedMLP(nn.Module):
    """``W_out (silu(W_gate LN(h)) * W_up LN(h))`` per token, ``[.., H] -> [.., H]``; ``W_out`` starts at zero."""

    def __init__(self, hidden_size: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False)  # the Linear layers absorb an affine
        self.gate = nn.Linear(hidden_size, inner)
        self.up = nn.Linear(hidden_size, inner)
        self.out = nn.Linear(inner, hidden_size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        return self.out(F.silu(self.gate(x)) * self.up(x))


class EncoderBlock(nn.Module):
    """A trainable block over the response's per-token states before the encoder's pool (``encoder_block``):
    ``h + MLP(h)`` (``"mlp"``), or one pre-norm transformer layer ``h' = h + Attn(LN(h))`` over the response
    positions, then ``h' + MLP(h')`` (``"transformer"``; no position embedding: the order it sees is what
    the states carry). Every residual branch ends in a projection that
    starts at zero, so the block starts as the identity: training starts from the view, and can move away.
    Positions off the mask stay zero (the pool never reads them)."""

    def __init__(self, kind: str, hidden_size: int) -> None:
        super().__init__()
        self.kind = kind
        self.attention = None
        if kind == "transformer":
            heads = next(h for h in (8, 6, 4, 3, 2, 1) if hidden_size % h == 0)
            self.attention_norm = nn.LayerNorm(hidden_size, elementwise_affine=False)
            self.attention = nn.MultiheadAttention(hidden_size, heads, batch_first=True)
            nn.init.zeros_(self.attention.out_proj.weight)
            nn.init.zeros_(self.attention.out_proj.bias)
        self.mlp = GatedMLP(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` states and their ``[B, T]`` mask -> ``[B, T, H]``, zero off the mask."""
        keep = mask.bool().unsqueeze(-1)
        if self.attention is not None:
            x = self.attention_norm(hidden)
            attended, _ = self.attention(x, x, x, key_padding_mask=~mask.bool(), need_weights=False)
            hidden = hidden + torch.where(keep, attended, torch.zeros_like(attended))
        return torch.where(keep, hidden + self.mlp(hidden), torch.zeros_like(hidden))


def weighted_pool(hidden: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """``sum_t pi_t h_t``, ``[B, H]``: ``[B, T-1]`` token weights on the z-free positions that predict
    each token (position ``t`` weights token ``t + 1``) applied to the ``[B, T, H]`` states at the
    tokens' own positions."""
    return (token_weights.to(hidden.dtype).unsqueeze(-1) * hidden[:, 1:]).sum(1)


def num_hidden_layers(model: nn.Module) -> int | None:
    """The number of transformer layers of a Hugging Face causal LM (peft-wrapped or not), if it says."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    return int(layers) if isinstance(layers, int) else None


def bag_of_words_loss(bow_logits: torch.Tensor, token_ids: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """``mean_b sum_t w_bt -log softmax(bow_logits[b])[y_bt]`` for ``[B, V]`` logits and ``[B, T]`` ids and
    weights, each row of weights summing to 1 over the response tokens and 0 elsewhere: ``m_t / n_b`` for Zhao,
    Zhao and Eskenazi (2017)'s loss (``uniform``), term 3's ``pi_t`` for ``token_weighted``."""
    log_probs = F.log_softmax(bow_logits.float(), dim=-1)  # [B, V]
    token_log_probs = log_probs.gather(1, token_ids)  # [B, T]
    return -(token_log_probs * token_weights.to(token_log_probs.dtype)).sum(1).mean()


@dataclass
class PosteriorSummary:
    """What the evaluation needs of ``q(z | x, y)`` and ``p(z | x)`` for a batch, as each latent family
    builds it (``model.posterior_summary``).

    ``vector`` is the latent the decoder sees at evaluation: the argmax code of every slot
    (discrete) or the posterior mean (continuous). Discrete ``log_q`` is the effective posterior:
    one-hot at the nearest code for the default "nearest" assignment (``0`` / ``-inf``), the
    softmax of the posterior logits for "gumbel".
    """

    vector: torch.Tensor  # [B, L]
    kl_per_unit: torch.Tensor  # [B, U], per-example KL(q || p) per slot or dimension
    codes: torch.Tensor | None = None  # [B, M]
    log_q: torch.Tensor | None = None  # [B, M, K]
    log_p: torch.Tensor | None = None  # [B, M, K]
    mu: torch.Tensor | None = None  # [B, D]
    logvar: torch.Tensor | None = None  # [B, D]
    prior_mu: torch.Tensor | None = None  # [B, D]
    prior_logvar: torch.Tensor | None = None  # [B, D]


@dataclass
class PriorMixture:
    """Latents drawn from (or enumerating) the prior for a batch, with log mixture weights, as each
    latent family builds it (``model.prior_mixture``)."""

    vectors: torch.Tensor  # [S, B, L]
    log_weights: torch.Tensor  # [S, B], logsumexp over S is 0 for every example
    method: str  # "exact" (every code or code combination, weighted by p(k | x)) or "samples"
    codes: torch.Tensor | None = None  # [S, M], "exact": the code of each slot in each latent

    @property
    def size(self) -> int:
        return self.vectors.shape[0]

    def decoder_posterior(self, sequence_nll: torch.Tensor, codebook_size: int) -> torch.Tensor:
        """``log r(k | x, y)`` ``[B, M, K]`` of an exact mixture, from every latent's ``sequence_nll [S, B]``:
        ``r ∝ p(k | x) p(y | x, k)`` over the code combinations, then per slot its marginal."""
        if self.codes is None:
            raise ValueError(f"the decoder's posterior needs the exact mixture over codes, not {self.method!r}")
        return slot_marginals(self.log_weights.double().T - sequence_nll.double().T, self.codes, codebook_size)


def _with_agreement(
    logged_stats: Callable[[], dict[str, float]] | None, decoder_codes: torch.Tensor, codes: torch.Tensor
) -> Callable[[], dict[str, float]]:
    """``logged_stats`` plus ``decoder_posterior_agreement``: the share of the batch's slots ``[B, M]`` whose code
    is the decoder's likeliest (per slot; eval's ``agreement`` counts an example only when every slot agrees),
    computed when the step is logged, not in every step."""

    def stats() -> dict[str, float]:
        out = logged_stats() if logged_stats is not None else {}
        out["decoder_posterior_agreement"] = float((decoder_codes == codes).float().mean())
        return out

    return stats


def slot_marginals(log_joint: torch.Tensor, codes: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """Per-slot log marginals ``[B, M, K]`` of the unnormalised log joint ``[B, S]`` over code combinations ``codes
    [S, M]``: ``log sum_{s: codes[s, m] = k} softmax(log_joint)_s``."""
    log_r = log_joint.log_softmax(-1)
    M, K = codes.shape[1], codebook_size
    return torch.stack(
        [torch.stack([log_r[:, codes[:, m] == k].logsumexp(-1) for k in range(K)], -1) for m in range(M)], 1
    )


class CVAEBase(nn.Module):
    """Frozen features, latent injection and the loss; subclasses define the latent."""

    def __init__(
        self,
        decoder: nn.Module,
        latent: LatentConfig,
        reconstruction: ReconstructionLossConfig,
        kl: KLConfig,
        divergence: DivergenceConfig | None = None,
        decoder_training: str = "frozen",
        reference: ZFreeReference | None = None,
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self.latent_cfg = latent
        self.reconstruction_cfg = reconstruction
        self.kl_cfg = kl
        self.divergence_cfg = divergence or DivergenceConfig()
        self.decoder_training = decoder_training
        if decoder_training == "frozen":
            self.decoder.requires_grad_(False)
        if decoder_training != "frozen" and reference is None:
            raise ValueError(f"decoder_training={decoder_training!r} needs its z-free reference (models.build_cvae)")
        if reference is not None and not (
            reference.decoder is decoder
            and reference.adapters_off == (decoder_training == "lora")
            and (reference.copy is not None) == (decoder_training == "full")
        ):
            raise ValueError(
                f"the z-free reference does not fit decoder_training={decoder_training!r}: frozen is the decoder, "
                "lora the decoder with adapters off, full a frozen copy (build it with models.build_cvae)"
            )
        # A plain attribute, not a submodule: its frozen copy (if any) stays outside the module tree.
        object.__setattr__(self, "reference", reference if reference is not None else ZFreeReference(decoder))
        embeddings = decoder.get_input_embeddings()
        self.hidden_size = embeddings.weight.shape[1]
        self.num_latent_tokens = latent.latent_tokens
        self.zfree_reference_scale: float | None = reconstruction.zfree_reference_scale
        H = self.hidden_size
        layers = num_hidden_layers(decoder)
        if layers is not None and not -(layers + 1) <= latent.encoder_layer <= layers:
            raise ConfigError(
                f"LatentConfig.encoder_layer must be in [{-(layers + 1)}, {layers}] for this model "
                f"({layers} layers: hidden_states[0] is the token embeddings, -1 the last layer), "
                f"got {latent.encoder_layer}",
                field="encoder_layer",
            )
        # The hidden_states index of the features, counted from 0 (None: not known, the model's last).
        self.encoder_layer_index = latent.encoder_layer % (layers + 1) if layers is not None else None
        self.decoder_layers = layers
        # encoder_view "attention": the learned query, trained with the encoder heads ("encoder" group).
        # encoder_view "token_weighted_attention": the same query, its logits starting at log pi_t.
        self.encoder_pool = AttentionPool(H) if latent.encoder_view in ATTENTION_VIEWS else None
        # reusing_decodes: (batch, [(vector, nll, target)], {"prompt": the prompt's cache for the between placement})
        self._decode_memo: tuple[Batch, list, dict] | None = None
        # encoder_block: a trainable block over the per-token states before that pool, the identity at the start.
        self.encoder_block = EncoderBlock(latent.encoder_block, H) if latent.encoder_block != "none" else None
        # encoder_lora_layers: the encoder's own LoRA adapters on the reference's top layers (encoder_adapters.py).
        self.encoder_adapters = None
        if latent.encoder_lora_layers:
            if self.encoder_layer_index is None:
                raise ConfigError(
                    f"LatentConfig.encoder_lora_layers needs a model whose config gives num_hidden_layers "
                    f"({type(decoder).__name__} does not)",
                    field="encoder_lora_layers",
                )
            rank = latent.encoder_lora_rank
            with self.reference.active() as reference:
                self.encoder_adapters = EncoderAdapters(
                    reference,
                    latent.encoder_lora_layers,
                    self.encoder_layer_index,
                    latent.encoder_lora_target_modules,
                    rank,
                    alpha=2.0 * rank,
                )
        # Parameter-free: the first Linear of each head absorbs any affine, and a norm of frozen
        # features without parameters has nothing to differentiate.
        self.encoder_norm = nn.LayerNorm(2 * H, elementwise_affine=False)
        self.prior_norm = nn.LayerNorm(H, elementwise_affine=False)
        # Latent injection (:mod:`.injection`): the projection to P embeddings, where they go, and the memory.
        self.latent_projection = latent_projection(self.latent_vector_dim, latent.latent_tokens, embeddings)
        self.latent_memory = latent_memory(latent.latent_placement, H, decoder)
        self.layout = LatentLayout(latent.latent_placement, latent.latent_tokens, H)
        vocab_size = decoder.get_output_embeddings().weight.shape[0]
        self.bow_head = nn.Linear(self.latent_vector_dim, vocab_size) if latent.bow_weight > 0 else None

    # -- what subclasses define ---------------------------------------------------------------
    @property
    def latent_vector_dim(self) -> int:
        raise NotImplementedError

    def encode(self, features: FrozenFeatures, step: int) -> LatentSample:
        raise NotImplementedError

    def prior_vectors(self, features: FrozenFeatures, num_samples: int) -> torch.Tensor:
        """Latent vectors drawn from the prior, ``[num_samples, B, L]``."""
        raise NotImplementedError

    def alternative_vector(self, sample: LatentSample) -> torch.Tensor | None:
        """A different latent for the same example (for the inter-latent divergence), or None."""
        return None

    def posterior_latents(self, features: FrozenFeatures) -> dict[str, torch.Tensor]:
        """The posterior's parameters for a batch (discrete: ``logits``, ``probs``, ``codes``; continuous:
        ``mu``, ``logvar``), without sampling."""
        raise NotImplementedError

    def posterior_summary(self, features: FrozenFeatures) -> PosteriorSummary:
        """What evaluation needs of ``q(z | x, y)`` and ``p(z | x)`` for a batch (per-example KL)."""
        raise NotImplementedError

    def prior_mixture(
        self,
        features: FrozenFeatures,
        num_samples: int = 16,
        exact_limit: int = 64,
        summary: PosteriorSummary | None = None,
    ) -> PriorMixture:
        """Latents enumerating or sampling ``p(z | x)``, with log mixture weights."""
        raise NotImplementedError

    def importance_samples(
        self, batch: Batch, summary: PosteriorSummary, num_samples: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Log importance weights ``[k, B]``, the sequence NLLs ``[k, B]`` and whether the bound is exact."""
        raise NotImplementedError

    def decoder_posterior(
        self, batch: Batch, features: FrozenFeatures, codes: torch.Tensor, sequence_nll: torch.Tensor
    ) -> torch.Tensor:
        """Discrete: ``log r(k | x, y)`` ``[B, M, K]``, the exact posterior of the codes under the current decoder."""
        raise NotImplementedError(f"{type(self).__name__} has no codes to score")

    def decoder_posterior_kl(self, log_r: torch.Tensor, encoder_outputs: torch.Tensor) -> torch.Tensor:
        """Discrete: ``KL(r || q)``, summed over slots, mean over the batch."""
        raise NotImplementedError(f"{type(self).__name__} has no codes to score")

    def initialize_from_data(self, features: FrozenFeatures, seed: int) -> None:
        """Data-dependent initialisation before training (e.g. the codebook's k-means start); nothing by default."""

    def refresh_from_data(self, features: FrozenFeatures, seed: int) -> None:
        """Data-dependent refresh during training (e.g. the codebook's k-means refresh); nothing by default."""

    def post_step(self, step: int) -> None:
        """Called after the optimizer step whose forward passes ran with ``step`` (e.g. dead-code restart)."""

    # -- several processes -------------------------------------------------------------------------
    def merge_step_statistics(self, state) -> None:
        """Several processes (``state``, :mod:`distributed`): make what the step's forwards recorded (e.g.
        the codes used) that of the whole global batch, before :meth:`post_step`; nothing by default."""

    def data_dependent_state(self) -> list[torch.Tensor]:
        """The tensors that change outside the optimizer (k-means, restarts): broadcast from the main
        process after such a change, so that every process holds the same; none by default."""
        return []

    # -- the encoder's view ----------------------------------------------------------------------
    def encoder_input(self, features: FrozenFeatures) -> torch.Tensor:
        """What the encoder head sees, ``[B, 2H]`` (before its LayerNorm): ``features.encoder_features``,
        except for the attention views, where the response pool is the learned query's; with the encoder's adapters
        (``encoder_lora_layers``) the states pooled are those of their pass (:meth:`adapted_features`)."""
        if self.encoder_adapters is not None:
            features = self.adapted_features(features)
        if self.encoder_pool is None:
            return features.encoder_features
        view = self.latent_cfg.encoder_view
        if features.response_hidden is None or features.response_mask is None:
            raise ValueError(
                f"encoder_view {view!r} needs the per-token response hidden states, which these features do "
                "not carry: pass features from frozen_pass or FeatureCache.features of a cache built by a model "
                f"with encoder_view {view!r}"
            )
        log_prior = self.encoder_log_token_weights(features) if view == "token_weighted_attention" else None
        hidden = features.response_hidden
        if self.encoder_block is not None:
            dtype = self.encoder_block.mlp.out.weight.dtype
            hidden = self.encoder_block(hidden.to(dtype), features.response_mask)  # [B, T, H], zero off the response
        pooled = self.encoder_pool(hidden, features.response_mask, log_prior)  # [B, H]
        return torch.cat([pooled, features.encoder_features[:, self.hidden_size :].to(pooled.dtype)], dim=-1)

    def adapted_features(self, features: FrozenFeatures) -> FrozenFeatures:
        """``features`` with the encoder's view (``encoder_features`` and, for the attention views, the per-token
        states) taken from a pass of the reference over the batch's ``[x][y]`` with the encoder's adapters on
        (``encoder_lora_layers``), with gradients where they are enabled; the z-free surprisal, the token
        weights and the prior's features stay the frozen pass's. Eval mode (no dropout, no checkpointing: a
        checkpoint's recompute would run without the adapters' hooks)."""
        batch = features.batch
        if batch is None:
            raise ValueError(
                "LatentConfig.encoder_lora_layers: the encoder's pass needs the batch's tokens, which these "
                "features do not carry: pass features from frozen_pass or FeatureCache.features"
            )
        if not torch.is_grad_enabled() and self.encoder_adapters.is_zero():
            return features  # adapters at their start: the adapted pass is the frozen one (the codebook's k-means)
        # Without gradients (k-means of thousands of examples, evaluation) in chunks of rows, each pooled before
        # the next: every layer's states of a chunk are held at once, never those of the whole batch.
        step = len(batch) if torch.is_grad_enabled() else ADAPTED_PASS_ROWS
        weights = self.encoder_token_weights(features)  # [B, T-1] or None
        views = []
        with (
            self.reference.active() as reference,
            self.encoder_adapters.active(reference),
            eval_mode(reference),
            fast_attention_backward(reference, in_eval_mode=True),  # on the CPU in bf16, as decode's
        ):
            for start in range(0, len(batch), step):
                rows = batch.rows(start, start + step) if step < len(batch) else batch
                hidden_states, _ = forward_sharing_prefix(
                    reference, rows.input_ids, rows.attention_mask, share=plain_cache(reference)
                )
                hidden = hidden_states[self.encoder_layer_index].float()  # [b, T, H]
                views.append(
                    self.view_features(hidden, rows, None if weights is None else weights[start : start + step])
                )
        view = {name: torch.cat([v[name] for v in views]) for name in views[0]} if len(views) > 1 else views[0]
        return dataclasses.replace(features, **view)

    def encoder_token_weights(self, features: FrozenFeatures, mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The ``token_weighted`` views' ``pi_t`` ``[B, T-1]`` on the z-free layout (None for the others): the
        features' own precomputed weighting where it is the view's (cached features carry no entropy to recompute
        it from), else recomputed from their z-free ``b_t`` (and entropy) on ``mask`` (``[B, T-1]``; default the
        batch's response positions)."""
        if self.latent_cfg.encoder_view not in ("token_weighted", "token_weighted_attention"):
            return None
        w = self.encoder_weighting_params
        if features.zfree_weighting is not None and features.weighting_params == w:
            return features.zfree_weighting.token_weights
        if w.source == "entropy" and features.zfree_token_entropy is None:
            raise ValueError("the entropy-weighted view needs the features' z-free entropy, which these do not carry")
        return token_weighting_from_base_nll(
            features.zfree_token_nll,
            features.batch.target_mask[:, 1:] if mask is None else mask,
            w.alpha,
            w.eps,
            signal=features.zfree_token_entropy if w.source == "entropy" else None,
            interpolation=w.interpolation,
        ).token_weights

    def view_features(
        self, hidden: torch.Tensor, batch: Batch, token_weights: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The encoder's view of the ``[B, T, H]`` states of ``[x][y]`` at the features' layer: ``encoder_features``
        ``[B, 2H]`` (the response's pool, ``token_weights``' sum for the ``token_weighted`` views, else the mean, ++
        the last token's state) and, for the attention views, ``response_hidden`` (zero off the response) and
        ``response_mask``."""
        mask = batch.target_mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
        if token_weights is not None:
            pooled = weighted_pool(hidden, token_weights)  # [B, H]
        else:
            pooled = (hidden * mask).sum(1) / mask.sum(1)  # [B, H], the mean
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last_token = hidden[rows, batch.prompt_lengths + batch.response_lengths - 1]  # [B, H]
        view = {"encoder_features": torch.cat([pooled, last_token], dim=-1)}
        if self.latent_cfg.encoder_view in ATTENTION_VIEWS:
            view.update(response_hidden=hidden * mask, response_mask=batch.target_mask.bool())
        return view

    def encoder_log_token_weights(self, features: FrozenFeatures) -> torch.Tensor:
        """``log pi_t`` of the ``token_weighted`` view (:attr:`encoder_weighting_params`) placed at the response
        tokens' own positions, ``[B, T]`` (0 off the response): recomputed from the features' z-free ``b_t``
        (and entropy, :meth:`encoder_token_weights`), so cached and fresh features give the same."""
        mask = features.response_mask[:, 1:]  # [B, T-1]: position t predicts token t + 1
        pi = self.encoder_token_weights(features, mask).double()  # [B, T-1]
        log_pi = torch.where(mask.bool() & (pi > 0), pi.clamp_min(1e-300).log(), torch.zeros_like(pi))
        return F.pad(log_pi, (1, 0))  # [B, T], token t + 1 at its own position

    @property
    def encoder_view_params(self) -> dict[str, object]:
        """What the frozen pass's features depend on besides weights and data (for the cache fingerprint):
        empty for ``mean_last`` from the last layer (the view that came first), so that its caches stay valid."""
        params: dict[str, object] = {}
        cfg = self.latent_cfg
        if cfg.encoder_view != "mean_last":
            params["encoder_view"] = cfg.encoder_view
        if cfg.encoder_view in ("token_weighted", "token_weighted_attention"):
            w = self.encoder_weighting_params
            params.update(source=w.source, alpha=w.alpha, eps=w.eps, interpolation=w.interpolation)
        if self.encoder_layer_index is None:
            if cfg.encoder_layer != -1:
                params["encoder_layer"] = cfg.encoder_layer
        elif self.encoder_layer_index != self.decoder_layers:
            params["encoder_layer"] = self.encoder_layer_index
        return params

    @property
    def encoder_weighting_params(self) -> WeightingParams:
        """The weighting of the ``token_weighted`` view's ``pi_t``: the model's own, with the surprisal
        shares in place of ``dynamic`` weights (which change every step)."""
        own = self.weighting_params
        return dataclasses.replace(own, source="surprisal") if own.source == "dynamic" else own

    # -- parameters ----------------------------------------------------------------------------
    #: Names of the trainable parameters that train in the ``latent`` group (``stability.parameter_norms`` too).
    LATENT_GROUP_PREFIXES = ("latent_projection.", "codebook", "code_table")

    def parameter_groups(self, separate_codebook: bool = False) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by learning-rate group: encoder heads, latent embeddings, decoder; with
        ``separate_codebook`` the discrete codebook in a ``codebook`` group of its own (``train.codebook_lr``)."""
        groups: dict[str, list[nn.Parameter]] = {"encoder": [], "latent": [], "decoder": []}
        if separate_codebook:
            groups["codebook"] = []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            if name.startswith("decoder."):
                groups["decoder"].append(param)
            elif separate_codebook and name.startswith("codebook"):
                groups["codebook"].append(param)
            elif name.startswith(self.LATENT_GROUP_PREFIXES):
                groups["latent"].append(param)
            else:
                groups["encoder"].append(param)
        return groups

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: trainable weights (decoder ones included) and the latent model's buffers."""
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        return {
            n: t.detach().clone()
            for n, t in self.state_dict().items()
            if n in trainable or not n.startswith("decoder.")
        }

    def _apply(self, fn, recurse=True):
        # Device and dtype moves reach the reference copy, which is kept outside the module tree.
        super()._apply(fn, recurse)
        self.reference.move(fn)
        return self

    def train(self, mode: bool = True) -> CVAEBase:
        super().train(mode)
        # A frozen decoder stays in eval mode (no dropout): it is the z-free reference too.
        self.decoder.train(mode and self.decoder_training != "frozen")
        return self

    # -- the frozen pass -------------------------------------------------------------------------
    @torch.no_grad()
    def frozen_pass(self, batch: Batch) -> FrozenFeatures:
        """One no-grad pass of the reference over ``[x][y]``: z-free NLL (last layer) and both heads'
        features (``hidden_states[encoder_layer]``; the response pool of the configured encoder view)."""
        with self.reference.active() as reference:
            hidden_states = reference_hidden_states(reference, batch.input_ids, batch.attention_mask)
            hidden = hidden_states[-1]  # [B, T, H], after the final norm
            head = reference.get_output_embeddings()  # inside the block: the adapter-free head too
            start = int((batch.prompt_lengths - 1).min())  # first position that predicts a response token
            window_args = (
                hidden[:, start:],
                batch.input_ids[:, start:],
                batch.target_mask[:, start:],
                default_chunk_size(batch.input_ids.shape[0], head.weight.shape[0]),
            )
            entropy = None
            if self.reconstruction_cfg.token_weight_source == "entropy":  # both from one pass of the head
                window, entropy_window = masked_token_nll_per_position(*window_args, head=head, entropy=True)
                entropy = F.pad(entropy_window.float(), (start, 0))  # [B, T-1]
            else:
                window = masked_token_nll_per_position(*window_args, head=head)
        zfree_nll = F.pad(window.float(), (start, 0))  # [B, T-1]
        if self.latent_cfg.encoder_layer != -1:
            hidden = hidden_states[self.latent_cfg.encoder_layer]  # [B, T, H], the features' layer
        hidden = hidden.float()
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        prior_features = hidden[rows, batch.prompt_lengths - 1]  # [B, H]
        features = FrozenFeatures(zfree_nll, prior_features, None, zfree_token_entropy=entropy, batch=batch)
        # term 3's pi_t for the token_weighted views (token_weighted_attention's pool starts there)
        view = self.view_features(hidden, batch, self.encoder_token_weights(features))
        return dataclasses.replace(features, **view)

    # -- injection and decoding ------------------------------------------------------------------
    def latent_embeddings(self, vector: torch.Tensor) -> torch.Tensor:
        """``[B, L] -> [B, P, H]`` soft latent embeddings."""
        return self.latent_projection(vector).view(vector.shape[0], self.num_latent_tokens, self.hidden_size)

    def alignment_offsets(self, batch: Batch) -> torch.Tensor:
        """``[B]``: z-free position ``t`` of a response token is conditioned position ``t + offset``
        (:meth:`.injection.LatentLayout.alignment_offsets`)."""
        return self.layout.alignment_offsets(batch)

    def conditioned_target_mask(self, batch: Batch) -> torch.Tensor:
        """The ``[B, Tc]`` token mask of the conditioned sequence (1 on response tokens), without decoding."""
        return self.layout.target_mask(batch)

    def conditioned_inputs(
        self, batch: Batch, latent_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Insert ``P`` latent embeddings into the z-free batch (:meth:`.injection.LatentLayout.inputs`):
        ``inputs_embeds [B, Tc, H]``, ``input_ids [B, Tc]`` (0 at latent positions), ``attention_mask [B, Tc]``,
        ``target_mask [B, Tc]`` and ``alignment_offsets [B]``."""
        token_embeds = self.decoder.get_input_embeddings()(batch.input_ids)  # [B, T, H]
        if batch.decoder_input_keep is not None:  # word dropout: a dropped token is read as a zero vector
            token_embeds = token_embeds * batch.decoder_input_keep.unsqueeze(-1).to(token_embeds.dtype)
        return self.layout.inputs(batch, token_embeds, latent_embeds)

    def decode(self, batch: Batch, vector: torch.Tensor, window: bool = True) -> Decoded:
        """Run the decoder under a latent.

        The decoder's own head never runs (``logits_to_keep``): :class:`Decoded` applies it where logits are
        needed. With ``window`` the hidden states kept start at the first position that predicts a response
        token (prompt and latent positions never need logits).
        """
        latent_embeds = self.latent_embeddings(vector)
        embeds, ids, attention, target, offsets = self.conditioned_inputs(batch, latent_embeds)
        extra = self.layout.decoder_arguments(self.latent_memory, self.decoder, latent_embeds, attention, embeds.dtype)
        start = 0
        if window:
            supervised = target[:, 1:].bool()  # [B, N]
            start = int(supervised.float().argmax(dim=1).min())  # first position predicting a response token
        # On the CPU in bf16, SDPA's own backward is slow: attention_backward's runs instead (same forward).
        with self._frozen_layers_checkpointed(), fast_attention_backward(self.decoder):
            if window and self._splits_prompt():
                hidden = self._decode_after_prompt(batch, embeds, attention, start)
            else:
                hidden = self._decoder_hidden(embeds, extra)[:, start:]  # [B, Tc - start, H], after the final norm
        return Decoded(hidden, self.decoder.get_output_embeddings(), start, ids, target, offsets)

    def _splits_prompt(self) -> bool:
        """Whether :meth:`decode` runs the prompt apart (:data:`SPLIT_PROMPT`): the between placement on a decoder
        whose layers keep a plain full-attention cache, and not under activation checkpointing with gradients
        (transformers' checkpointed layers drop a cache)."""
        if not (SPLIT_PROMPT and self.layout.placement == "between"):
            return False
        checkpointed = getattr(self.decoder, "is_activation_checkpointing", False) and torch.is_grad_enabled()
        return not checkpointed and plain_cache(self.decoder)

    def _prompt_keys_values(self, batch: Batch) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The decoder's keys and values ``[B, Hkv, X, Dh]`` of every layer over every row's prompt (``X`` the
        longest prompt; a row's positions past its own prompt are masked), and that mask ``[B, X]``. Inside
        :meth:`reusing_decodes` the prompt runs once for every latent. A frozen decoder's prompt takes no gradient
        and runs without; a prefix every prompt shares runs once (:func:`.reference.forward_sharing_prefix`), except in a
        trained decoder's training steps (dropout)."""
        memo = self._decode_memo
        reuse = memo is not None and memo[0] is batch and not torch.is_grad_enabled()
        if reuse and "prompt" in memo[2]:
            return memo[2]["prompt"]
        X = int(batch.prompt_lengths.max())
        positions = torch.arange(X, device=batch.input_ids.device).unsqueeze(0)
        mask = (positions < batch.prompt_lengths.unsqueeze(1)).to(batch.attention_mask.dtype)  # [B, X]
        groups = _row_groups(batch.prompt_lengths)  # prompts of very different lengths at their own widths
        parts = []  # per group, per layer: (keys, values) [rows, Hkv, X, Dh], zeros past the group's width
        grad = torch.is_grad_enabled() and self.decoder_training != "frozen"
        # a trained decoder in training mode: every row draws its own dropout, with gradients or without
        share = not (self.decoder_training != "frozen" and self.decoder.training)
        with torch.set_grad_enabled(grad):
            for rows in groups:
                index = torch.tensor(rows, device=mask.device)
                w = int(batch.prompt_lengths[index].max())
                ids, group_mask = batch.input_ids[index, :w], mask[index, :w]
                _, cache = forward_sharing_prefix(
                    self.decoder, ids, group_mask, output_hidden_states=False, keep_cache=True, share=share
                )
                pad = (0, 0, 0, X - w)
                parts.append([(F.pad(layer.keys, pad), F.pad(layer.values, pad)) for layer in cache.layers])
        layers = [
            tuple(_in_row_order([part[n][kv] for part in parts], groups) for kv in (0, 1)) for n in range(len(parts[0]))
        ]
        prompt = (layers, mask)
        if reuse:
            memo[2]["prompt"] = prompt
        return prompt

    def _decode_after_prompt(
        self, batch: Batch, embeds: torch.Tensor, attention: torch.Tensor, start: int
    ) -> torch.Tensor:
        """The between placement's window ``[B, Tc - start, H]`` (as :meth:`_decoder_hidden` gives it): the prompt
        (:meth:`_prompt_keys_values`), then each row's ``[z][y]`` (its conditioned positions ``p_b .. p_b + P + r_b
        - 1``) at its own positions, reading the prompt's keys and values; on the CPU rows of very different
        lengths in :func:`.data.length_groups`, as :meth:`_decoder_hidden` runs them. The same computation as one
        pass over ``[x][z][y]`` (causal attention: the prompt never reads ``z``), on fewer positions: the prompt
        once for every latent and, for a frozen decoder, without a backward. A row's window positions before its
        latent (its prompt's last ones, where another row's prompt is shorter) are zero: nothing reads them."""
        layers, prompt_mask = self._prompt_keys_values(batch)
        B, Tc, H = embeds.shape
        p = batch.prompt_lengths.unsqueeze(1)  # [B, 1]
        lengths = self.num_latent_tokens + batch.response_lengths  # [B]: each row's [z][y]
        L = int(lengths.max())
        where = p + torch.arange(L, device=embeds.device).unsqueeze(0)  # [B, L]: conditioned position of suffix j
        index = where.clamp(max=Tc - 1)
        suffix = embeds.gather(1, index.unsqueeze(-1).expand(-1, -1, H))  # [B, L, H]
        suffix_mask = (attention.gather(1, index) * (where < Tc)).to(prompt_mask.dtype)
        groups = _row_groups(lengths)
        parts = []
        for rows in groups:
            w = int(lengths[rows].max())
            part = layers
            if len(groups) > 1:
                rows_index = torch.tensor(rows, device=embeds.device)
                part = [(keys[rows_index], values[rows_index]) for keys, values in layers]
            else:
                rows_index = slice(None)
            out = self.decoder(
                inputs_embeds=suffix[rows_index, :w],
                attention_mask=torch.cat([prompt_mask[rows_index], suffix_mask[rows_index, :w]], dim=1),
                position_ids=index[rows_index, :w],  # padding past Tc - 1 at Tc - 1: never past one pass's ids
                cache=cache_from_layers(part, self.decoder),
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=unused_logits(suffix),
            )
            parts.append(F.pad(out.hidden_states[-1], (0, 0, 0, L - w)))  # [rows, L, H], after the final norm
        hidden = _in_row_order(parts, groups)  # [B, L, H]
        k = start + torch.arange(Tc - start, device=embeds.device).unsqueeze(0) - p  # [B, W]: suffix position
        window = hidden.gather(1, k.clamp(0, L - 1).unsqueeze(-1).expand(-1, -1, H))
        return window * ((k >= 0) & (k < L)).unsqueeze(-1).to(window.dtype)

    def _decoder_hidden(self, embeds: torch.Tensor, extra: dict[str, object]) -> torch.Tensor:
        """The decoder's final hidden states ``[B, Tc, H]`` (after the final norm).

        Right-padded rows of very different lengths run as :func:`.data.length_groups`, each group at its
        own width, so that the decoder does not compute the padding of the short rows up to the longest one's
        length: the same computation on every real position (causal attention never reads the padding to its
        right), fewer positions in all. A row's positions past its group's width are then zero, where one
        pass gives the decoder's values at the padding; nothing reads either (every loss masks them). The memory
        placement (a cache and positions), left-padded masks and other devices than the CPU run in one pass.
        The groups depend on the rows' lengths alone, so a row's states do not depend on the other rows'
        values (what :meth:`reusing_decodes` relies on)."""
        mask = extra.get("attention_mask")
        groups = None
        cpu = embeds.device.type == "cpu"  # on a GPU an extra call costs kernel launches: measured on CPUs only
        if cpu and set(extra) == {"attention_mask"} and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            lengths = mask.sum(dim=1)
            if bool((mask[:, :-1] >= mask[:, 1:]).all()):  # right-padded: each row is ones, then zeros
                groups = _row_groups(lengths)
        if groups is None or len(groups) == 1:
            return self._decoder_final_hidden(embeds, extra)
        width = embeds.shape[1]
        parts = []
        for rows in groups:
            index = torch.tensor(rows, device=embeds.device)
            w = int(lengths[index].max())
            hidden = self._decoder_final_hidden(embeds[index, :w], {"attention_mask": mask[index, :w]})
            parts.append(F.pad(hidden, (0, 0, 0, width - w)))
        return _in_row_order(parts, groups)

    def _decoder_final_hidden(self, embeds: torch.Tensor, extra: dict[str, object]) -> torch.Tensor:
        out = self.decoder(
            inputs_embeds=embeds,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=unused_logits(embeds),  # the head runs on the hidden states, chunk by chunk
            **extra,  # attention_mask (and, for the memory placement, cache and position_ids)
        )
        return out.hidden_states[-1]

    def memory_keys_values(self, latent_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory's ``(keys, values)`` ``[Ly, B, Hkv, P, Dh]`` of ``[B, P, H]`` latent embeddings
        (:meth:`memory.LatentMemory.keys_values`)."""
        return self.latent_memory.keys_values(self.decoder, latent_embeds)

    @contextlib.contextmanager
    def _frozen_layers_checkpointed(self) -> Iterator[None]:
        """A training step's forward through a frozen, checkpointed decoder: its layers checkpoint.

        transformers checkpoints a layer only in training mode, and a frozen decoder stays in eval mode
        (:meth:`train`). Inside the block each checkpointed layer's own ``training`` flag is set, not its
        submodules' (dropout, attention dropout): the layer checkpoints and computes as in eval mode (for
        Llama- and GPT-2-style layers, whose dropout lives in submodules; a layer whose own forward applied
        dropout by its flag would drop out here). The recompute in the backward runs the layer's plain
        forward, so it needs no flag.
        """
        layers = []
        if self.training and self.decoder_training == "frozen" and torch.is_grad_enabled():
            layers = [
                m
                for m in self.decoder.modules()
                if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and not m.training
            ]
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False

    def memory_inputs(
        self, latent_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, object]:
        """The decoder's extra arguments for the memory placement (:meth:`memory.LatentMemory.decoder_inputs`)."""
        return self.latent_memory.decoder_inputs(self.decoder, latent_embeds, attention_mask, position_ids, dtype)

    def decode_logits(
        self, batch: Batch, vector: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full decoder logits under a latent: ``(logits [B, Tc, V], input_ids, target_mask, offsets)``; past a
        row's length the logits are undefined."""
        decoded = self.decode(batch, vector, window=False)
        return decoded.logits(), decoded.input_ids, decoded.target_mask, decoded.offsets

    def conditioned_token_nll(self, batch: Batch, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``l_t`` under a latent vector: ``(token_nll [B, N], target_mask [B, N])``.

        Inside :meth:`reusing_decodes` of ``batch`` (no gradients), a latent whose every row was decoded
        before in the block gives those rows back instead of decoding again."""
        memo = self._decode_memo
        reuse = memo is not None and memo[0] is batch and not torch.is_grad_enabled()
        if reuse and memo[1]:
            token_nll = torch.zeros_like(memo[1][0][1])
            found = torch.zeros(vector.shape[0], dtype=torch.bool, device=vector.device)
            for seen, nll, _ in memo[1]:
                rows = (seen == vector).all(dim=-1) & ~found  # [B]: decoded before under this very latent
                token_nll[rows] = nll[rows]
                found |= rows
            if bool(found.all()):
                return token_nll, memo[1][0][2]
        decoded = self.decode(batch, vector)
        token_nll, target = decoded.token_nll(), decoded.target_mask[:, 1:]
        if reuse:
            memo[1].append((vector.detach().clone(), token_nll, target))
        return token_nll, target

    @contextlib.contextmanager
    def reusing_decodes(self, batch: Batch) -> Iterator[None]:
        """Score ``batch`` under several latents without decoding a (row, latent) pair twice: e.g. the
        "nearest" posterior's code is one of the codes the exact prior mixture decodes every row under.
        The decoder computes each row alone (its other rows never enter it), so a reused row is the row a
        new decode would give. The memo knows nothing of the model's state: change no parameter and not the
        mode inside the block."""
        previous, self._decode_memo = self._decode_memo, (batch, [], {})
        try:
            yield
        finally:
            self._decode_memo = previous

    def token_weighting(
        self,
        batch: Batch,
        features: FrozenFeatures,
        offsets: torch.Tensor,
        conditioned_target: torch.Tensor,
        token_nll: torch.Tensor | None = None,
        alpha: float | None = None,
    ) -> TokenWeighting:
        """The token weights on the conditioned positions.

        ``conditioned_target`` is the decoder's ``[B, Tc]`` token mask; the z-free NLL (and entropy)
        land on its supervised positions by the alignment offsets (the conditioned layout is built so).
        ``token_nll`` is the decoder's ``[B, Tc-1]`` NLL ``l_t``, needed only by the ``"dynamic"`` source;
        ``alpha`` overrides the configured one (for inspection).
        """
        params = self.weighting_params
        if alpha is not None:
            params = dataclasses.replace(params, alpha=float(alpha))
        source, alpha, eps, interpolation = params.source, params.alpha, params.eps, params.interpolation
        positions, zfree_mask = conditioned_target.shape[1] - 1, batch.target_mask[:, 1:]
        if features.zfree_weighting is not None and features.weighting_params == params:
            return align_token_weighting(features.zfree_weighting, offsets, positions, zfree_mask)

        def aligned(values: torch.Tensor) -> torch.Tensor:
            return align_to_conditioned(values, offsets, positions, zfree_mask=zfree_mask)

        signal = None
        if source == "entropy":
            if features.zfree_token_entropy is None:
                raise ValueError(
                    "token_weight_source 'entropy' needs the reference's predictive entropy, which these "
                    "features do not carry: pass features from frozen_pass or FeatureCache.features of a "
                    "cache built by a model with token_weight_source 'entropy'"
                )
            signal = aligned(features.zfree_token_entropy)
        elif source == "dynamic":
            if token_nll is None:
                raise ValueError("token_weight_source 'dynamic' needs the decoder's token_nll")
            signal = token_nll.detach()
        base = aligned(features.zfree_token_nll)
        return token_weighting_from_base_nll(
            base, conditioned_target[:, 1:], alpha, eps, signal=signal, interpolation=interpolation
        )

    @property
    def weighting_params(self) -> WeightingParams:
        """The token weighting's settings (source, alpha, eps, interpolation)."""
        cfg = self.reconstruction_cfg
        return WeightingParams(
            cfg.token_weight_source,
            float(cfg.token_weight_alpha),
            float(cfg.token_weight_eps),
            float(cfg.token_weight_interpolation),
        )

    # -- the objective ---------------------------------------------------------------------------
    def forward(self, batch: Batch, features: FrozenFeatures | None = None, step: int = 0) -> CVAEOutput:
        if features is None:
            features = self.frozen_pass(batch)
        if self.training and self.latent_cfg.word_dropout > 0:
            batch = with_word_dropout(batch, self.latent_cfg.word_dropout)
        sample = self.encode(features, step)
        decoded = self.decode(batch, sample.vector)
        token_nll = decoded.token_nll()  # [B, N]
        target = decoded.target_mask[:, 1:]  # [B, N]
        weighting = self.token_weighting(batch, features, decoded.offsets, decoded.target_mask, token_nll)
        stack = reconstruction_loss_stack(
            token_nll, target, weighting, self.reconstruction_cfg, self.zfree_reference_scale
        )
        beta = beta_at(step, self.kl_cfg)
        kl_term, kl_per_unit = kl_objective(sample.kl_per_unit, batch.response_lengths, self.kl_cfg, beta)
        loss = stack.total + kl_term
        aux = dict(sample.aux_losses)
        logged_stats = sample.logged_stats
        latent_cfg = self.latent_cfg
        if latent_cfg.decoder_posterior_weight > 0 and self.training and step >= latent_cfg.decoder_posterior_start:
            sequence_nll = (token_nll.detach() * target).sum(-1)  # [B]: the chosen codes' own, not decoded again
            log_r = self.decoder_posterior(batch, features, sample.latent, sequence_nll)  # [B, M, K]
            kl_r = self.decoder_posterior_kl(log_r, sample.encoder_outputs)
            aux["decoder_posterior_loss"] = latent_cfg.decoder_posterior_weight * kl_r
            logged_stats = _with_agreement(logged_stats, log_r.argmax(-1), sample.latent)
        for value in aux.values():
            loss = loss + value
        if self.bow_head is not None:
            if latent_cfg.bow_token_weighting == "token_weighted":
                bow_weights = weighting.token_weights
            else:
                bow_weights = uniform_token_weights(target)
            bow_logits = self.bow_head(sample.vector)
            aux["bow_loss"] = bag_of_words_loss(bow_logits, decoded.input_ids[:, 1:], bow_weights)
            loss = loss + latent_cfg.bow_weight * aux["bow_loss"]
        divergence = None
        divergence_term = token_nll.new_zeros(())
        if self.divergence_cfg.divergence_weight > 0:
            alternative = self.alternative_vector(sample)
            if alternative is not None:
                divergence = self.inter_latent_divergence(batch, decoded, alternative, weighting)
                divergence_term = -self.divergence_cfg.divergence_weight * divergence
                loss = loss + divergence_term
        return CVAEOutput(
            loss=loss,
            reconstruction_terms=stack.terms,
            reconstruction_total=stack.total,
            kl=sample.kl_per_unit.detach().sum(1).mean(),
            kl_per_unit=sample.kl_per_unit.detach().mean(0),
            kl_objective_per_unit=kl_per_unit.detach(),
            kl_term=kl_term,
            beta=beta,
            divergence=divergence,
            divergence_term=divergence_term,
            aux_losses=aux,
            latent=sample.latent,
            token_nll=token_nll,
            target_mask=target,
            weighting=weighting,
            stats=sample.stats,
            logged_stats=logged_stats,
        )

    def inter_latent_divergence(
        self, batch: Batch, decoded: Decoded, alternative: torch.Tensor, weighting: TokenWeighting
    ) -> torch.Tensor:
        """``mean_b sum_t pi_t D(p(.|z), p(.|z'))`` over supervised positions (docs/design.md section 5)."""
        other = self.decode(batch, alternative)
        target = decoded.target_mask[:, 1:].bool()  # [B, N]
        start = decoded.start
        supervised = target[:, start:]  # [B, N - start]: the positions the window's logits cover
        per_token = decoded.hidden.new_zeros(target.shape, dtype=torch.float32)  # [B, N]
        # Position t of the window holds the logits that predict conditioned token start + t + 1.
        per_token[:, start:][supervised] = next_token_divergence(
            decoded.logits_at(_pad_last(supervised)),
            other.logits_at(_pad_last(supervised)),
            self.divergence_cfg.divergence,
        )
        return (weighting.token_weights.to(per_token.dtype) * per_token).sum(1).mean()
