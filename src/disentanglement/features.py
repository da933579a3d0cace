"""The frozen pass, done once per data set (docs/design.md section 7).

The frozen reference is deterministic per example, so its outputs (z-free per-token NLL of the
response, the prior's and the encoder's features) are computed once and reused by every step;
a training step then costs one decoder forward and backward. For ``encoder_view = "attention"``
the per-token hidden states of every response token are cached too (``[sum_b n_b, H]`` float32,
``4 H`` bytes per response token), and the learned query pools them in the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

from . import reference as reference_pass
from .checkpoints import replace_file_durably
from .cvae_base import ATTENTION_VIEWS, CVAEBase, FrozenFeatures, WeightingParams
from .data import Batch, Example, collate, length_order, pair_ids
from .distributed import barrier, gather_objects, is_main, rank_and_size
from .token_weighting import TokenWeighting, token_weighting_from_base_nll

logger = logging.getLogger(__name__)


# Per-example statistics of a TokenWeighting, in the order FeatureCache stores them.
_WEIGHTING_STATISTICS = (
    "example_base_loss",
    "token_weighted_base_loss",
    "inverse_token_weighted_base_loss",
    "token_concentration_factor",
    "inverse_token_base_scale_factor",
)
_WEIGHTING_CHUNK = 4096  # examples weighted at once (one padded [chunk, longest response] block)


def _flatten(per_example: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-example ``[n_b]`` tensors end to end, ``[sum_b n_b]`` (empty for no examples)."""
    return torch.cat(list(per_example)) if len(per_example) else torch.zeros(0)


@dataclass
class FeatureCache:
    """Per-example frozen-pass outputs, indexed like the example list they were built from.

    The token weighting of each example (``pi``, ``pi_inv`` and the statistics ``b_base``, ``kappa``,
    ``rho``...) is a function of its cached ``b_t`` (and, for the entropy source, its cached entropy)
    alone: it is computed once per weighting setting (:meth:`response_weighting`) and handed out with
    the features, so a training step only looks it up. The ``"dynamic"`` source depends on the
    training model and is computed by the model every step. For ``encoder_view = "attention"`` it also
    holds every response token's hidden state (:attr:`response_hidden`), placed back into ``[B, T, H]``
    per batch for the learned query to pool.
    """

    response_nll: list[torch.Tensor]  # per example [n_b]: b_t of each response token
    prior_features: torch.Tensor  # [E, H]
    encoder_features: torch.Tensor  # [E, 2H]
    # Per example [n_b]: the reference's predictive entropy at each response token (entropy source only).
    response_entropy: list[torch.Tensor] | None = None
    # encoder_view "attention" only: the hidden state at every response token's position, [sum_b n_b, H]
    # float32, example after example (4 H bytes per response token).
    response_hidden: torch.Tensor | None = None
    # Derived once, on first use: per-token weighting per setting; the flat layout of the responses.
    _weightings: dict[WeightingParams, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _flat_nll: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _flat_entropy: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _lengths: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _starts: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.response_nll)

    def example_base_losses(self) -> torch.Tensor:
        """``b_base`` per example, ``[E]``: the mean z-free NLL over its response tokens."""
        return torch.stack([nll.double().mean() for nll in self.response_nll])

    def subset(self, start: int, stop: int) -> FeatureCache:
        """The cache of examples ``start .. stop - 1`` (re-indexed from 0)."""
        entropy = None if self.response_entropy is None else self.response_entropy[start:stop]
        hidden = None
        if self.response_hidden is not None:  # a view of the rows of examples start .. stop - 1
            first = sum(len(n) for n in self.response_nll[:start])
            hidden = self.response_hidden[first : first + sum(len(n) for n in self.response_nll[start:stop])]
        return FeatureCache(
            self.response_nll[start:stop],
            self.prior_features[start:stop],
            self.encoder_features[start:stop],
            entropy,
            hidden,
        )

    def response_weighting(self, params: WeightingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Every response token's ``(b_t, pi_t, pi_inv_t)``, ``[sum_b n_b, 3]`` in example order, and the
        ``[E, 5]`` statistics of :data:`_WEIGHTING_STATISTICS`, for ``params`` (source ``"surprisal"`` or
        ``"entropy"``); computed once per setting."""
        source, alpha, eps, interpolation = params.source, params.alpha, params.eps, params.interpolation
        if source not in ("surprisal", "entropy"):
            raise ValueError(f"the feature cache precomputes surprisal or entropy weights, not {source!r}")
        if source == "entropy" and self.response_entropy is None:
            raise ValueError(
                "token_weight_source 'entropy': this feature cache holds no predictive entropy; build it with a "
                "model whose token_weight_source is 'entropy' (load_or_build_feature_cache rebuilds such a file)"
            )
        key = WeightingParams(source, float(alpha), float(eps), float(interpolation))
        if key not in self._weightings:
            tokens, statistics = [], []
            for first in range(0, len(self), _WEIGHTING_CHUNK):
                nll = self.response_nll[first : first + _WEIGHTING_CHUNK]
                lengths = torch.tensor([len(n) for n in nll])
                padded = torch.nn.utils.rnn.pad_sequence(nll, batch_first=True)  # [E', n_max]
                mask = torch.arange(padded.shape[1]) < lengths.unsqueeze(1)  # [E', n_max]
                signal = None
                if source == "entropy":
                    signal = torch.nn.utils.rnn.pad_sequence(
                        self.response_entropy[first : first + _WEIGHTING_CHUNK], batch_first=True
                    )
                w = token_weighting_from_base_nll(
                    padded, mask.float(), alpha, eps, signal=signal, interpolation=interpolation
                )
                per_token = torch.stack([w.aligned_base_token_nll, w.token_weights, w.inverse_token_weights], -1)
                tokens.append(per_token[mask])  # the response tokens, example after example
                statistics.append(torch.stack([getattr(w, name) for name in _WEIGHTING_STATISTICS], 1))
            self._weightings[key] = (
                torch.cat(tokens) if tokens else torch.zeros(0, 3),
                torch.cat(statistics) if statistics else torch.zeros(0, len(_WEIGHTING_STATISTICS)),
            )
        return self._weightings[key]

    def inverse_term_amplification(self, params: WeightingParams) -> torch.Tensor:
        """Per example, the largest factor by which term 5 multiplies one token's NLL: ``max_t pi_inv_t / rho_b``,
        ``[E]``, from the weighting of ``params`` (:meth:`response_weighting`, so the entry training uses).

        Term 5 is ``(1/c_base) mean_b (sum_t pi_inv_t l_t) / rho_b``. At ``alpha > 0``, ``pi_inv`` gathers on
        the tokens the reference finds easiest and ``rho_b`` is about their ``b_t`` over the mean, so one
        nearly certain token's NLL can weigh thousands of times its share: a rise of 0.01 nats there adds
        ``0.01 * amplification / c_base`` to that example's term (the batch mean divides it by ``B``). At
        ``alpha = 0`` it is ``1 / n_b``, the token's plain share (``rho_b = 1``).
        """
        if not len(self):
            return torch.zeros(0, dtype=torch.float64)
        tokens, statistics = self.response_weighting(params)
        lengths = [len(n) for n in self.response_nll]
        largest = torch.stack([pi_inv.max() for pi_inv in tokens[:, 2].split(lengths)])  # max_t pi_inv_t, [E]
        rho = statistics[:, _WEIGHTING_STATISTICS.index("inverse_token_base_scale_factor")]
        return (largest / rho).double()

    def _place(self, per_token: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Rows of ``per_token`` (``[sum_b n_b, ...]``, one per response token in example order) placed at
        the z-free positions of ``batch`` that predict them: ``[B, T-1, ...]``, zero elsewhere."""
        if self._lengths is None:
            self._lengths = torch.tensor([len(n) for n in self.response_nll])
            self._starts = torch.cumsum(self._lengths, 0) - self._lengths
        idx = batch.indices.cpu()
        if not torch.equal(self._lengths[idx], batch.response_lengths.cpu()):
            raise ValueError("FeatureCache: the batch's response lengths differ from the cached examples'")
        # Position t predicts token t + 1: the supervised positions, in order, hold response tokens k = 0, 1, ...
        supervised = batch.target_mask[:, 1:].cpu().bool()  # [B, T-1]
        if not torch.equal(supervised.sum(1), batch.response_lengths.cpu()):
            raise ValueError("FeatureCache: the batch's target mask does not mark its response lengths")
        k = supervised.cumsum(1) - 1  # [B, T-1], the response token a supervised position predicts
        source = self._starts[idx].unsqueeze(1) + k  # [B, T-1], its row in per_token
        out = per_token.new_zeros(*supervised.shape, *per_token.shape[1:])
        out[supervised] = per_token[source[supervised]]
        return out.to(batch.input_ids.device)

    def features(self, batch: Batch, weighting_params: WeightingParams | None = None) -> FrozenFeatures:
        """The cached :class:`FrozenFeatures` of a collated batch (``batch.indices`` index the cache).

        With ``weighting_params`` (a model's: source, alpha, eps, interpolation) they carry the batch's
        token weighting on the z-free layout too (:meth:`response_weighting`), which a model with the same
        setting uses as is; not for the ``"dynamic"`` source, which the model computes every step.
        """
        device = batch.input_ids.device
        idx = batch.indices.cpu()
        prior, encoder = self.prior_features[idx].to(device), self.encoder_features[idx].to(device)
        hidden = {}
        if self.response_hidden is not None:
            # Token k of a response sits one position after the position that predicts it: [B, T, H].
            placed = F.pad(self._place(self.response_hidden, batch), (0, 0, 1, 0))
            hidden = dict(response_hidden=placed, response_mask=batch.target_mask.bool())
        if weighting_params is None or weighting_params.source == "dynamic":
            if self._flat_nll is None:
                self._flat_nll = _flatten(self.response_nll)
            entropy = None
            if self.response_entropy is not None:
                if self._flat_entropy is None:
                    self._flat_entropy = _flatten(self.response_entropy)
                entropy = self._place(self._flat_entropy, batch)
            return FrozenFeatures(
                self._place(self._flat_nll, batch), prior, encoder, zfree_token_entropy=entropy, batch=batch, **hidden
            )
        tokens, statistics = self.response_weighting(weighting_params)
        per_token = self._place(tokens, batch)  # [B, T-1, 3]: b_t, pi_t, pi_inv_t
        stats = statistics[idx].to(device)  # [B, 5]
        weighting = TokenWeighting(
            token_weights=per_token[..., 1],
            inverse_token_weights=per_token[..., 2],
            aligned_base_token_nll=per_token[..., 0],
            **{name: stats[:, i] for i, name in enumerate(_WEIGHTING_STATISTICS)},
        )
        return FrozenFeatures(
            per_token[..., 0],
            prior,
            encoder,
            zfree_weighting=weighting,
            weighting_params=weighting_params,
            batch=batch,
            **hidden,
        )


def first_copies(examples: Sequence[Example]) -> list[int]:
    """For each example, the index of its first copy (the first example with the same prompt and response ids)."""
    first: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    return [first.setdefault(pair_ids(e), i) for i, e in enumerate(examples)]


def frozen_pass_batches(examples: Sequence[Example], batch_size: int = 16) -> list[list[int]]:
    """The frozen pass's batches: the indices of the examples' first copies (:func:`first_copies`: a corpus that
    repeats a pair, as chatterbot's does, is passed over it once) in length order (little padding), ``batch_size``
    at a time."""
    firsts = first_copies(examples)
    order = [i for i in length_order(examples) if firsts[i] == i]
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def shared_prefix_positions(examples: Sequence[Example], pad_token_id: int, batch_size: int = 16) -> int:
    """Decoder positions the frozen pass over ``examples`` does not compute because every row of a batch shares
    them (:func:`.reference.shared_prefix_length`, from :data:`.reference.MIN_SHARED_PREFIX` tokens): the
    shared prefix runs once per batch, not once per row."""
    saved = 0
    for chunk in frozen_pass_batches(examples, batch_size):
        batch = collate([examples[i] for i in chunk], pad_token_id)
        shared = reference_pass.shared_prefix_length(batch.input_ids, batch.attention_mask)
        if shared >= reference_pass.MIN_SHARED_PREFIX:
            saved += (len(chunk) - 1) * shared
    return saved


@torch.no_grad()
def build_feature_cache(
    model: CVAEBase,
    examples: Sequence[Example],
    pad_token_id: int,
    batch_size: int = 16,
    device: torch.device | str | None = None,
    progress: bool = True,
    description: str = "frozen pass",
    state=None,
) -> FeatureCache:
    """Run the frozen pass once over ``examples`` (in length order, to pad little), on ``device``
    (default: where the model is). Copies of an example (the same prompt and response ids) are passed once and
    share its row: the pass's rounding depends on the batch, so copies passed apart would differ, and the feature
    store, which keeps one entry per example, would hand a later run other numbers than this one's.

    With several processes (``state``, accelerate's ``PartialState``) each process runs every
    ``N``-th batch of the same length-ordered batches and the results are gathered: every process
    gets the whole cache, equal to the one a single process builds (the batches are the same)."""
    if device is None:
        device = next(model.parameters()).device
    rank, size = rank_and_size(state)
    batches = frozen_pass_batches(examples, batch_size)
    # Per example: (response NLL [r], entropy [r] or None, hidden states [r, H] or None, prior [H], encoder [2H]).
    rows: dict[int, tuple] = {}
    for chunk in tqdm(batches[rank::size], desc=description, disable=not progress, unit="batch"):
        batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
        out = model.frozen_pass(batch)
        for row, index in enumerate(chunk):
            p, r = int(batch.prompt_lengths[row]), int(batch.response_lengths[row])
            entropy = hidden = None
            if out.zfree_token_entropy is not None:
                entropy = out.zfree_token_entropy[row, p - 1 : p - 1 + r].float().cpu()
            if out.response_hidden is not None:  # the states at the response tokens' own positions p .. p + r - 1
                hidden = out.response_hidden[row, p : p + r].float().cpu()
            rows[index] = (
                out.zfree_token_nll[row, p - 1 : p - 1 + r].float().cpu(),
                entropy,
                hidden,
                out.prior_features[row].float().cpu(),
                out.encoder_features[row].float().cpu(),
            )
    if size > 1:
        rows = {index: value for part in gather_objects(state, rows) for index, value in part.items()}
    ordered = [rows[first] for first in first_copies(examples)]
    entropy = [r[1] for r in ordered] if ordered and ordered[0][1] is not None else None
    hidden = torch.cat([r[2] for r in ordered]) if ordered and ordered[0][2] is not None else None  # [sum_b n_b, H]
    return FeatureCache(
        [r[0] for r in ordered],
        torch.stack([r[3] for r in ordered]),
        torch.stack([r[4] for r in ordered]),
        entropy,
        hidden,
    )


def batch_features(model: CVAEBase, batch: Batch, cache: FeatureCache | None) -> FrozenFeatures:
    """Cached features when a cache is given, else a fresh frozen pass."""
    return cache.features(batch, model.weighting_params) if cache is not None else model.frozen_pass(batch)


# -- persistence ---------------------------------------------------------------------------------
FEATURE_PASS_VERSION = (
    "frozen-pass-v1: last-layer hidden states; prior = last prompt token; encoder = mean response ++ last token"
)


def feature_fingerprint(model: CVAEBase, examples: Sequence[Example]) -> str:
    """A hash of everything the frozen pass depends on: the reference's weights and every example's
    token ids (which fix the tokenizer, chat template, length caps and data), and the pass itself.

    The encoder's view enters only when it is not the default (``CVAEBase.encoder_view_params``: the
    view, the ``token_weighted`` view's weighting settings, an ``encoder_layer`` other than the last),
    so that caches of the default pass stay valid.

    The weights enter with their dtype as well as their bytes: a bf16 reference (``ModelConfig.dtype``) and
    a float32 one have different fingerprints, so their caches never mix (the cache itself holds float32
    values in both cases). The weights' part is hashed once per reference (:func:`reference_hasher`)."""
    digest = reference_hasher(model)
    for example in examples:
        digest.update(json.dumps([example.prompt_ids, example.response_ids]).encode())
    return digest.hexdigest()


# The hash of (pass version, encoder view, weights) per reference module, with what it was computed from.
_REFERENCE_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _base_name(name: str) -> str:
    """A weight's name in the model peft wrapped: ``base_model.model.X.q_proj.base_layer.weight`` ->
    ``X.q_proj.weight``, so that a LoRA run's reference (the adapters off: the same weights, the same pass)
    hashes as the frozen model does and the two share the frozen-pass store."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _weights_guard(state: dict[str, torch.Tensor]) -> tuple:
    """What identifies the reference's tensors without reading them: name, storage, shape, dtype and the
    in-place version counter of each (an optimizer step or ``load_state_dict`` bumps it)."""
    return tuple(
        (name, t.data_ptr(), tuple(t.shape), t.dtype, t.device.type, t._version)
        for name, t in sorted(state.items())
        if "lora_" not in name
    )


def reference_hasher(model: CVAEBase) -> hashlib.blake2b:
    """A blake2b hasher fed with the pass version, the encoder view and the reference's weights (names,
    shapes, dtypes, bytes; LoRA adapters left out, peft's names read as the base model's), as a copy to
    update further.

    The weights are read once per reference module: later calls reuse the hash while every tensor keeps
    its storage, shape, dtype and in-place version (:func:`_weights_guard`); a change through ``.data``,
    which torch does not count, is not seen."""
    view = model.encoder_view_params
    view_text = json.dumps(view, sort_keys=True) if view else ""
    with model.reference.active() as reference:
        state = reference.state_dict()
        guard = _weights_guard(state)
        memo = _REFERENCE_HASHES.get(reference)
        if memo is not None and memo[0] == guard and memo[1] == view_text:
            return memo[2].copy()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(FEATURE_PASS_VERSION.encode())
        if view_text:
            digest.update(view_text.encode())
        # the reference is the adapter-free model, under its own names (a LoRA run's is the frozen run's)
        named = {_base_name(name): tensor for name, tensor in state.items() if "lora_" not in name}
        for name in sorted(named):
            tensor = named[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            if tensor.numel():  # the bytes in place (a buffer), not a copy
                digest.update(memoryview(tensor.view(torch.uint8).numpy()))
        _REFERENCE_HASHES[reference] = (guard, view_text, digest.copy())
    return digest


def save_feature_cache(cache: FeatureCache, path: Path, fingerprint: str) -> None:
    """Write the cache as safetensors (temporary file, then rename)."""
    lengths = torch.tensor([len(n) for n in cache.response_nll], dtype=torch.long)
    tensors = {
        "response_nll": _flatten(cache.response_nll),
        "response_lengths": lengths,
        "prior_features": cache.prior_features.contiguous(),
        "encoder_features": cache.encoder_features.contiguous(),
    }
    if cache.response_entropy is not None:
        tensors["response_entropy"] = _flatten(cache.response_entropy)
    if cache.response_hidden is not None:
        tensors["response_hidden"] = cache.response_hidden.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file_durably(path, save(tensors, metadata={"fingerprint": fingerprint, "version": FEATURE_PASS_VERSION}))


def load_feature_cache(path: Path, fingerprint: str) -> FeatureCache | None:
    """The cache at ``path`` if it exists and was built for ``fingerprint``, else None."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("fingerprint") != fingerprint:
                return None
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__
        lengths = tensors["response_lengths"].tolist()
        nll = list(torch.split(tensors["response_nll"], lengths))
        entropy = list(torch.split(tensors["response_entropy"], lengths)) if "response_entropy" in tensors else None
        hidden = tensors.get("response_hidden")
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] != sum(lengths)):
            raise ValueError(f"response_hidden has shape {tuple(hidden.shape)} for {sum(lengths)} response tokens")
        return FeatureCache(nll, tensors["prior_features"], tensors["encoder_features"], entropy, hidden)
    except Exception as exc:  # a damaged cache is derived data: rebuild it rather than fail or trust it
        logger.warning("feature cache %s is unreadable (%s: %s); rebuilding it", path, type(exc).__name__, exc)
        return None


def load_or_build_feature_cache(
    model: CVAEBase,
    examples: Sequence[Example],
    pad_token_id: int,
    cache_dir: str | Path | None,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    state=None,
) -> FeatureCache:
    """Reuse the on-disk cache whose fingerprint matches, else run the frozen pass and store it.

    One file per (weights, example list) in ``cache_dir``: the single-file format of earlier versions, kept
    for callers that want it. Training, ``eval``, ``encode`` and ``inspect`` use the per-example store
    shared by every run instead (:func:`feature_store.load_or_build_features`).

    With several processes (``state``) the pass is sharded across them (:func:`build_feature_cache`),
    the main process alone writes the cache, and the others wait for it at a barrier.

    A cache built for other weights, tokenizer, template, caps or data has another fingerprint and
    is never used: it is rebuilt (and the old file replaced). So is one without the predictive
    entropy when the model weights tokens by it, or without the per-token hidden states when its
    encoder attends over them; one built for another encoder view or layer has another fingerprint.
    """
    if cache_dir is None:
        return build_feature_cache(model, examples, pad_token_id, batch_size, device, progress, state=state)
    fingerprint = feature_fingerprint(model, examples)
    path = Path(cache_dir) / "frozen_pass.safetensors"
    cache = load_feature_cache(path, fingerprint)
    needs_entropy = model.reconstruction_cfg.token_weight_source == "entropy"
    needs_hidden = model.latent_cfg.encoder_view in ATTENTION_VIEWS
    if cache is not None and len(cache) == len(examples):
        if needs_entropy and cache.response_entropy is None:
            logger.info("frozen pass: %s holds no predictive entropy (token_weight_source 'entropy'); rebuilding", path)
        elif needs_hidden and cache.response_hidden is None:
            logger.info(
                "frozen pass: %s holds no per-token hidden states (an attention encoder_view); rebuilding", path
            )
        else:
            logger.info("frozen pass: reusing %s (fingerprint %s)", path, fingerprint)
            return cache
    elif path.exists():
        logger.info("frozen pass: %s was built for other weights or data; rebuilding", path)
    cache = build_feature_cache(model, examples, pad_token_id, batch_size, device, progress, state=state)
    if is_main(state):
        try:
            save_feature_cache(cache, path, fingerprint)
            logger.info("frozen pass: cached %d examples in %s (fingerprint %s)", len(cache), path, fingerprint)
        except OSError as exc:  # the cache only saves time: the run goes on without it
            logger.warning("frozen pass: could not write the cache %s (%s); continuing without it", path, exc)
    barrier(state)
    return cache
