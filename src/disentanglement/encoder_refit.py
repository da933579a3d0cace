"""Refitting a trained discrete CVAE's encoder to its decoder's own posterior (``disentangle refit-encoder``).

    disentangle refit-encoder RUN --data train|FILE.jsonl --output-dir REFIT [--objective nll|target|both] [--lr 1e-4]
        [--epochs 30] [--holdout 0.1] [--posterior FILE] [--batch-size 16] [--max-examples N] [--seed S]
        [--encoder-view attention|token_weighted_attention] [--encoder-block mlp|transformer]

The encoder is amortised: one network gives every response its code, and at the end of training it picks the code
the decoder finds likeliest, ``argmax_k p(k | x) p(y | x, k)``, for only part of the responses (a third to a half of
DailyDialog's held-out responses, docs/what-the-cvae-adds.md sections 25-28), while the decoder would gain more
under its own choice (eval's ``decoder_posterior``). The decoder-posterior term (``decoder_posterior_weight``)
teaches the encoder that choice during training, on the batches of its last steps, while the decoder still moves.
Here the decoder is done: with the decoder, the codebook, the prior and every other weight fixed, the exact
posterior ``r(k | x, y)`` of every pair of ``--data`` is computed once (:func:`decoder_posteriors`: every code
combination decoded, no gradients) and the encoder alone is fit to it for ``--epochs`` passes (:func:`fit_encoder`):
by default to the decoder's NLL under its codes in expectation (``--objective nll``: each code's NLL above the best
code's, the regret, weighted by ``q``), or with the run's ``decoder_posterior_target`` (``--objective target``:
``hard``, also for a run trained without the term, the cross-entropy of ``argmax r``; ``soft``, ``KL(r || q)``),
keeping the epoch of the lowest regret under the encoder's codes on a held-out share of the pairs (``--holdout``, at
least one pair; epoch 0 is the encoder as trained, so that regret never rises; with ``--holdout 0`` the last epoch
is kept). ``--objective both`` runs the two fits from the encoder as trained (``nll`` at ``--lr``, ``target`` at
``--target-lr``, 1e-3) on the same held-out pairs and keeps the one whose kept epoch has the lower held-out regret
(:func:`fit_both`): on held-out ``style-in-content`` neither objective alone reached the decoder's own codes on every
seed, the lower regret picked the better refit on each (docs/what-the-cvae-adds.md, section 40). The closing step of
the lagging-encoder remedy (He et al., 2019: train the encoder to its optimum before
the decoder moves again), run once.

Only ``q(z | x, y)`` changes: the prior-mixture NLL of any data is the same number as before, and the latent gain
moves by the posterior NLL alone; codes read off data (``encode``, ``eval``) are the refit encoder's, and generation
under a code is the decoder's, unchanged. The refit writes a new run directory: the source's ``config.yaml`` and
``data_stats.json``, one checkpoint at the source's step with the refit weights (and the source's optimizer and
scheduler states, so that ``train --resume auto --output-dir REFIT`` would go on from it), its
``trainer_state.json`` recording the refit (``encoder_refit``), ``encoder_refit.json``, the report
(:func:`refit_encoder`), and ``decoder_posterior.safetensors``, ``log_r`` ``[E, M, K]`` of every pair of ``--data``
in its order, with what it was computed from (the weights' SHA-256, ``--data``): another refit of the same
checkpoint on the same data takes it with ``--posterior`` and skips the decodes, the refit's whole cost but seconds.
Only the discrete family has codes to enumerate (``K^M`` at most ``config.DECODER_POSTERIOR_LIMIT``).

The fit may also widen the encoder (:func:`widening`): ``--encoder-view`` puts a learned query's attention pool where
the run's pool was (its logits start at that pool's weights: the fit starts from the encoder as trained) and
``--encoder-block`` a trainable block over the per-token states before it (the identity at the start), so that the
encoder can read from the response more than its fixed pool holds, with the targets the decoder gives every pair. The
refit run's config records the widened encoder (eval, encode and generate build it), and its optimizer state takes
the new weights in (:func:`widened_optimizer_state`), so it resumes as any run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save as save_safetensors_bytes
from tqdm.auto import tqdm

from .checkpoints import WIDENED_MODULES, replace_file_durably
from .config import DECODER_POSTERIOR_LIMIT
from .data import collate, length_order
from .evaluation import conditioned_nll
from .reference import eval_mode
from .shared_discrete_cvae import code_combinations, combination_log_probs

if TYPE_CHECKING:
    from .config import LatentConfig, RunConfig
    from .cvae_base import CVAEBase
    from .data import Example
    from .features import FeatureCache
    from .options import RefitOptions

#: The report's name in the refit run's directory, and that of ``log r`` ``[E, M, K]`` of every pair fit.
REPORT_FILE = "encoder_refit.json"
POSTERIOR_FILE = "decoder_posterior.safetensors"


def check_refittable(latent: LatentConfig, where: object) -> None:
    """A ``ValueError`` unless the latent ``latent`` configures has codes whose every combination can be decoded
    (``where``: what the message names, a config file or a model)."""
    if latent.latent != "discrete":
        raise ValueError(
            f"refit-encoder needs a discrete model (codes whose posterior can be enumerated); {where} has latent "
            f"{latent.latent!r}"
        )
    combinations = latent.codebook_size**latent.num_slots
    if combinations > DECODER_POSTERIOR_LIMIT:
        raise ValueError(
            f"refit-encoder decodes every code combination of every pair: {where} has {combinations} "
            f"(codebook_size {latent.codebook_size}, num_slots {latent.num_slots}), more than {DECODER_POSTERIOR_LIMIT}"
        )


@torch.no_grad()
def decoder_posteriors(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    batch_size: int = 16,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_r, regret)``, float64, in example order, on the CPU: ``log r(k | x, y)`` ``[E, M, K]``, the exact
    posterior of the codes under the model's decoder and prior, ``r ∝ prod_m p(k_m | x) p(y | x, k_1..k_M)`` over
    every combination, then per slot its marginal (as the training term and eval compute it:
    ``PriorMixture.decoder_posterior``); and ``regret`` ``[E, S]``, each code combination's sequence NLL minus the
    lowest (nats per response; the combinations in the order of ``itertools.product(range(K), repeat=M)``, the exact
    prior mixture's). In eval mode, in batches of similar length."""
    check_refittable(model.latent_cfg, f"this {type(model).__name__}")
    device = next(model.parameters()).device
    order = length_order(examples)
    out = torch.empty(len(examples), model.num_slots, model.codebook_size, dtype=torch.float64)
    regret = torch.empty(len(examples), model.codebook_size**model.num_slots, dtype=torch.float64)
    with eval_mode(model):
        starts = range(0, len(order), batch_size)
        for start in tqdm(starts, desc="decoder posterior", disable=not progress, unit="batch"):
            chunk = order[start : start + batch_size]
            batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
            features = cache.features(batch)
            mixture = model.prior_mixture(features, exact_limit=DECODER_POSTERIOR_LIMIT)
            with model.reusing_decodes(batch):  # the between placement's prompt runs once for every code
                sequence_nll = torch.stack([conditioned_nll(model, batch, v) for v in mixture.vectors]).double().sum(-1)
            out[chunk] = mixture.decoder_posterior(sequence_nll, model.codebook_size).cpu()
            regret[chunk] = (sequence_nll - sequence_nll.min(0).values).T.cpu()
    return out, regret


def encoder_parameters(model: CVAEBase) -> list[torch.nn.Parameter]:
    """What the refit trains: the weights between the frozen features and the encoder's outputs ``e`` (its MLP,
    and where the run has them its attention pool, its block and its own adapters); never the codebook, the prior,
    the latent's projection or the decoder."""
    parts = [model.encoder, model.encoder_pool, model.encoder_block, model.encoder_adapters]
    return [p for part in parts if part is not None for p in part.parameters()]


@torch.no_grad()
def encoder_codes(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    indices: Sequence[int],
    pad_token_id: int,
    batch_size: int = 64,
) -> torch.Tensor:
    """The encoder's codes ``[len(indices), M]`` of ``examples[indices]``, in the order of ``indices``."""
    device = next(model.parameters()).device
    parts = []
    for start in range(0, len(indices), batch_size):
        chunk = list(indices[start : start + batch_size])
        batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
        parts.append(model.posterior_latents(cache.features(batch))["codes"].cpu())
    return torch.cat(parts) if parts else torch.empty(0, model.num_slots, dtype=torch.long)


def combination_index(codes: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """``[N, M]`` codes -> ``[N]`` their combination's index in ``itertools.product(range(K), repeat=M)`` order."""
    M = codes.shape[-1]
    place = codebook_size ** torch.arange(M - 1, -1, -1, device=codes.device)
    return (codes * place).sum(-1)


def agreement(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    log_r: torch.Tensor,
    indices: Sequence[int],
    pad_token_id: int,
) -> float | None:
    """The share of ``examples[indices]`` whose encoder codes are, in every slot, the argmax of ``log_r`` (None for
    none)."""
    if not len(indices):
        return None
    return agreement_of(encoder_codes(model, examples, cache, indices, pad_token_id), log_r[list(indices)])


def agreement_of(codes: torch.Tensor, log_r: torch.Tensor) -> float:
    """The share of rows whose codes ``[N, M]`` are, in every slot, the argmax of their ``log_r`` ``[N, M, K]``."""
    return float((codes == log_r.argmax(-1)).all(-1).double().mean())


def expected_regret(model: CVAEBase, e: torch.Tensor, regret: torch.Tensor) -> torch.Tensor:
    """``mean_b sum_s q(s | x_b, y_b) regret_bs``: the decoder's NLL under the encoder's codes above the best codes',
    in expectation under ``q(s) = prod_m q_m(k_m)``, ``q_m`` the softmax of the posterior logits of ``e [B, M, C]``
    (the codebook detached), ``regret [B, K^M]`` in ``itertools.product`` order (:func:`decoder_posteriors`)."""
    log_q = F.log_softmax(model.posterior_logits(e, detach_codebook=True).float(), dim=-1)  # [B, M, K]
    M, K = log_q.shape[1:]
    log_q_s = combination_log_probs(log_q, code_combinations(K, M, e.device))  # [B, S]
    return (log_q_s.exp() * regret.to(log_q_s.dtype)).sum(-1).mean()


#: ``fit_encoder``'s objectives: the expected regret under q, or the run's decoder-posterior term.
OBJECTIVES = ("nll", "target")


def fit_encoder(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    log_r: torch.Tensor,
    pad_token_id: int,
    *,
    regret: torch.Tensor | None = None,
    objective: str = "nll",
    epochs: int = 30,
    lr: float = 1e-4,
    holdout: float = 0.1,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Fit :func:`encoder_parameters` (Adam from ``lr``, cosine-decayed to 0 over the fit) for ``epochs`` shuffled
    passes over all but a seeded ``holdout`` share of the examples (at least one where ``holdout > 0``), in eval mode
    (no dropout), to the decoder's scores of every pair: ``log_r`` ``[E, M, K]`` and ``regret`` ``[E, S]``
    (:func:`decoder_posteriors`).

    ``objective`` "nll": the expected regret under the encoder, ``sum_s q(s | x, y) regret_s`` (``q(s)`` the product
    of the slots' softmax of the posterior logits, the codebook fixed), so that a code the encoder gets wrong costs
    what it costs the decoder; "target": the run's decoder-posterior term (:meth:`decoder_posterior_kl`, its
    ``decoder_posterior_target``: the cross-entropy of ``argmax r``, or ``KL(r || q)``), which prices every wrong
    code alike. "nll" refines a trained encoder; an encoder whose codes are confidently far from the decoder's (a
    fresh one) gets little gradient from it (``q`` of the right codes near 0) and learns them with "target". The
    weights kept are those of the epoch (0: as given) of the lowest held-out regret per response
    token (without ``regret``: the highest agreement with ``argmax r``; without a held-out share: the last epoch's).
    Returns the history (per epoch: the mean loss, the agreements and regrets of the fit and held-out pairs), the
    epoch kept, the split's sizes and ``stopped``: None, or why the fit ended early (an epoch whose loss or weights
    are not finite ends it, unrecorded; the kept weights are then the best earlier epoch's)."""
    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must be in [0, 1), got {holdout!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "nll" and regret is None:
        raise ValueError("objective 'nll' needs the regret of every code combination (decoder_posteriors)")
    params = encoder_parameters(model)
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(len(examples), generator=generator).tolist()
    held = sorted(permutation[: max(int(round(holdout * len(examples))), 1 if holdout > 0 else 0)])
    fit = sorted(permutation[len(held) :])
    if not fit:
        raise ValueError(f"no examples left to fit after holding out {len(held)} of {len(examples)}")
    device = next(model.parameters()).device
    K = log_r.shape[-1]
    tokens = torch.tensor([len(ex.response_ids) for ex in examples], dtype=torch.float64)

    def measure(epoch: int, loss: float | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"epoch": epoch, "loss": loss}
        for name, indices in (("fit", fit), ("holdout", held)):
            entry[f"{name}_agreement"] = entry[f"{name}_regret"] = None
            if not indices:
                continue
            codes = encoder_codes(model, examples, cache, indices, pad_token_id)  # [N, M], once for both figures
            entry[f"{name}_agreement"] = agreement_of(codes, log_r[indices])
            if regret is not None:
                chosen = regret[indices, combination_index(codes, K)]
                entry[f"{name}_regret"] = float(chosen.sum() / tokens[indices].sum())
        return entry

    def better(entry: dict[str, Any], than: dict[str, Any]) -> bool:
        if not held:
            return True
        if regret is not None:
            return entry["holdout_regret"] < than["holdout_regret"]
        return entry["holdout_agreement"] > than["holdout_agreement"]

    def loss_of(chunk: list[int], e: torch.Tensor) -> torch.Tensor:
        if objective == "target":
            return model.decoder_posterior_kl(log_r[chunk].to(device), e)
        return expected_regret(model, e, regret[chunk].to(device))

    flags = [p.requires_grad for p in params]
    optimizer = torch.optim.Adam(params, lr=lr)
    steps = epochs * math.ceil(len(fit) / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)  # to 0 at the last step
    stopped = None
    with eval_mode(model):
        history = [measure(0, None)]
        best, best_state = history[0], [p.detach().clone() for p in params]
        try:
            for p in params:
                p.requires_grad_(True)
            for epoch in tqdm(range(1, epochs + 1), desc="refit", disable=not progress, unit="epoch"):
                order = [fit[i] for i in torch.randperm(len(fit), generator=generator).tolist()]
                total, count = 0.0, 0
                for start in range(0, len(order), batch_size):
                    chunk = order[start : start + batch_size]
                    batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
                    loss = loss_of(chunk, model.encoder_outputs(cache.features(batch)))  # e: [B, M, C]
                    optimizer.zero_grad(set_to_none=True)
                    model.zero_grad(set_to_none=True)  # a soft target reaches the codebook, which stays as it is
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    total, count = total + loss.item() * len(chunk), count + len(chunk)
                if not math.isfinite(total) or not all(bool(torch.isfinite(p).all()) for p in params):
                    stopped = f"epoch {epoch}: the loss or the encoder's weights are not finite (lower --lr)"
                    break
                history.append(measure(epoch, total / count))
                if better(history[-1], best):
                    best, best_state = history[-1], [p.detach().clone() for p in params]
        finally:
            for p, flag in zip(params, flags, strict=True):
                p.requires_grad_(flag)
            model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, kept in zip(params, best_state, strict=True):
            p.copy_(kept)
    return {
        "history": history,
        "kept_epoch": best["epoch"],
        "fit_examples": len(fit),
        "holdout_examples": len(held),
        "stopped": stopped,
    }


def fit_both(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    log_r: torch.Tensor,
    regret: torch.Tensor,
    pad_token_id: int,
    options: RefitOptions,
) -> dict[str, Any]:
    """:func:`fit_encoder` with ``options.objective``; with "both", the ``nll`` fit (at ``options.lr``) and the
    ``target`` fit (at ``options.target_lr``), each from the encoder as given and on the same held-out pairs (the same
    seed), keeping the fit whose kept epoch has the lower held-out regret (a tie: ``nll``), the same criterion each fit
    uses to choose its epoch. Returns the kept fit's result, with ``chosen`` and ``fits`` (per objective: its
    ``lr``, ``kept_epoch``, ``after`` and ``history``) for "both"."""
    common = dict(regret=regret, epochs=options.epochs, holdout=options.holdout, batch_size=options.batch_size,
                  seed=options.seed, progress=options.progress)  # fmt: skip
    if options.objective != "both":
        return fit_encoder(model, examples, cache, log_r, pad_token_id, objective=options.objective, lr=options.lr,
                           **common)  # fmt: skip
    params = encoder_parameters(model)
    start = [p.detach().clone() for p in params]
    rates = {"nll": options.lr, "target": options.target_lr}
    fits: dict[str, dict[str, Any]] = {}
    weights: dict[str, list[torch.Tensor]] = {}
    for objective, lr in rates.items():
        with torch.no_grad():
            for p, value in zip(params, start, strict=True):
                p.copy_(value)
        fits[objective] = fit_encoder(model, examples, cache, log_r, pad_token_id, objective=objective, lr=lr, **common)
        weights[objective] = [p.detach().clone() for p in params]

    kept = {objective: fit["history"][fit["kept_epoch"]] for objective, fit in fits.items()}  # each kept epoch's
    chosen = "target" if kept["target"]["holdout_regret"] < kept["nll"]["holdout_regret"] else "nll"
    with torch.no_grad():
        for p, value in zip(params, weights[chosen], strict=True):
            p.copy_(value)
    summary = {
        objective: {
            "lr": rates[objective],
            "kept_epoch": fit["kept_epoch"],
            "after": kept[objective],
            "stopped": fit["stopped"],
            "history": fit["history"],
        }
        for objective, fit in fits.items()
    }
    return {**fits[chosen], "chosen": chosen, "fits": summary}


def posterior_metadata(trainer_state: dict[str, Any], description: str) -> dict[str, str]:
    """What a saved ``log r`` was computed from: the checkpoint's weights (their SHA-256) and ``--data``."""
    return {"source_model_sha256": trainer_state.get("files", {}).get("model.safetensors", ""), "data": description}


def read_posteriors(
    path: str | Path, expected: dict[str, str], shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_r [E, M, K], regret [E, K^M])`` of an earlier refit's :data:`POSTERIOR_FILE`, checked to be of the same
    weights and data (``expected``, :func:`posterior_metadata`), of ``shape`` ``(E, M, K)``, float64 and finite (the
    regrets >= 0); else a ``ValueError`` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
            log_r, regret = handle.get_tensor("log_r"), handle.get_tensor("regret")
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        raise ValueError(f"--posterior {path}: not a {POSTERIOR_FILE} written by refit-encoder ({exc})") from exc
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise ValueError(
                f"--posterior {path}: its {key} is {metadata.get(key)!r}, this refit's {value!r}: it was computed for "
                "other weights or other data"
            )
    E, M, K = shape
    for name, tensor, want in (("log_r", log_r, [E, M, K]), ("regret", regret, [E, K**M])):
        if list(tensor.shape) != want or tensor.dtype != torch.float64 or not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"--posterior {path}: expected finite float64 {name} of shape {want}, got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
    if bool((regret < 0).any()):
        raise ValueError(f"--posterior {path}: regret holds negative values (each is an NLL minus the lowest)")
    return log_r, regret


def check_refittable_config(config: RunConfig, where: Path) -> None:
    """:func:`check_refittable` from a run's config alone, before any model loads (``where``: the file read)."""
    check_refittable(config.latent, where)


#: The attention view that starts as each pooled view (its query at zero): the view ``--encoder-view`` may widen to.
WIDER_VIEW = {"mean_last": "attention", "token_weighted": "token_weighted_attention"}


def widening(latent: LatentConfig, view: str | None, block: str | None, where: object) -> dict[str, str]:
    """The latent config's fields ``--encoder-view`` and ``--encoder-block`` change (empty: none), refused unless the
    widened encoder starts exactly as the run's: the attention view of the run's own pool (its query at zero gives
    that pool, :class:`cvae_base.AttentionPool`), a block (the identity at the start) only over an attention view
    and only where the run has none, or the one it has."""
    overrides: dict[str, str] = {}
    if view is not None and view != latent.encoder_view:
        if WIDER_VIEW.get(latent.encoder_view) != view:
            starts = WIDER_VIEW.get(latent.encoder_view)
            raise ValueError(
                f"--encoder-view {view}: {where} has encoder_view {latent.encoder_view!r}, and the refit can only "
                "widen a pool to the attention view that starts as it"
                + (f" ({starts})" if starts else " (it is an attention view already)")
            )
        overrides["encoder_view"] = view
    if block is not None and block != latent.encoder_block:
        if latent.encoder_block != "none":
            raise ValueError(
                f"--encoder-block {block}: {where} has encoder_block {latent.encoder_block!r} trained; the refit adds "
                "a block where there is none, it does not replace one"
            )
        if overrides.get("encoder_view", latent.encoder_view) not in WIDER_VIEW.values():
            raise ValueError(
                f"--encoder-block {block}: works on the per-token states an attention view pools, and {where} has "
                f"encoder_view {latent.encoder_view!r}: add --encoder-view {WIDER_VIEW[latent.encoder_view]}"
            )
        overrides["encoder_block"] = block
    return overrides


def widened_optimizer_state(
    saved: dict[str, Any], model: CVAEBase, config: RunConfig, overrides: dict[str, str]
) -> dict[str, Any]:
    """The source's optimizer state for the ``model`` widened by ``overrides`` (:func:`widening`; its ``config``): the
    parameters' indices renumbered in the optimizer's order, which the modules the overrides add
    (:data:`checkpoints.WIDENED_MODULES`, in the ``encoder`` group, no state yet: Adam starts theirs at their first
    step) enter; so a resume of the refit run goes on as the source's would."""
    from .trainer import optimizer_groups

    new = tuple(prefix for field, prefix in WIDENED_MODULES.items() if field in overrides)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = optimizer_groups(model, config)
    if [g.get("name") for g in saved["param_groups"]] != list(groups):
        raise ValueError(
            f"the source's optimizer has the groups {[g.get('name') for g in saved['param_groups']]}, the widened "
            f"model {list(groups)}"
        )
    old_index, new_index, renumbered, new_params = 0, 0, {}, []
    for params in groups.values():
        new_params.append(list(range(new_index, new_index + len(params))))
        for param in params:
            if not names[id(param)].startswith(new):
                renumbered[old_index] = new_index
                old_index += 1
            new_index += 1
    if old_index != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ValueError(f"the source's optimizer has other parameters than the widened model's ({old_index} kept)")
    return {
        "state": {renumbered[int(k)]: v for k, v in saved["state"].items()},
        "param_groups": [dict(g, params=p) for g, p in zip(saved["param_groups"], new_params, strict=True)],
    }


def refit_encoder(checkpoint: str | Path, options: RefitOptions | None = None, **overrides: Any) -> dict[str, Any]:
    """``disentangle refit-encoder`` (module docstring): load ``checkpoint``, compute ``r`` on ``options.data``, fit
    the encoder, write the refit run to ``options.output_dir``; returns the report (also written there). Every
    refusal (the output folder, the data, the family, a checkpoint that cannot be resumed) comes before the model
    loads, and nothing is written until the fit is done and finite."""
    from . import runs
    from .checkpoints import nonfinite_tensors, read_checkpoint, save_checkpoint, set_rng_state
    from .options import RefitOptions, with_overrides
    from .safe_io import atomic_write, write_json

    options = with_overrides(RefitOptions, options, overrides)
    source_checkpoint, source_run = runs.resolve_run(checkpoint)
    output_dir = Path(options.output_dir)
    if output_dir.exists() and output_dir.resolve() == source_run.resolve():
        raise ValueError(f"--output-dir {output_dir} is the source run; the refit writes a new run beside it")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(f"--output-dir {output_dir} exists and is not an empty directory: the refit writes a new run")
    runs.check_writable_target(output_dir, "--output-dir", directory=True)
    runs.check_data_option(checkpoint, options.data)
    if options.objective == "both" and options.holdout == 0:
        raise ValueError("--objective both keeps the fit of the lower held-out regret: --holdout must be above 0")
    if options.posterior is not None and not Path(options.posterior).is_file():
        raise ValueError(f"--posterior {options.posterior}: not a file (a refit run's {POSTERIOR_FILE})")
    contents = read_checkpoint(source_checkpoint, for_resume=True)  # the states the refit run keeps for a resume
    check_refittable_config(contents.config, source_checkpoint / "config.yaml")
    overrides = widening(
        contents.config.latent, options.encoder_view, options.encoder_block, source_checkpoint / "config.yaml"
    )
    model, tokenizer, config, state, source_checkpoint, source_run = runs.load_checkpoint(
        checkpoint, device=options.device, latent_overrides=overrides
    )
    run_config = dataclasses.replace(contents.config, latent=config.latent)  # the source's, the encoder widened
    examples, description = runs.load_examples(options.data, config, tokenizer, options.max_examples, options.seed)
    pad = tokenizer.pad_token_id
    cache = runs.stored_features(model, examples, pad, options.batch_size, progress=options.progress)
    started = time.perf_counter()
    metadata = posterior_metadata(state, description)
    if options.posterior is not None:
        shape = (len(examples), contents.config.latent.num_slots, contents.config.latent.codebook_size)
        log_r, regret = read_posteriors(options.posterior, metadata, shape)
    else:
        log_r, regret = decoder_posteriors(model, examples, cache, pad, options.batch_size, options.progress)
    posterior_seconds = time.perf_counter() - started
    fitted = fit_both(model, examples, cache, log_r, regret, pad, options)
    targets = log_r.argmax(-1)  # [E, M]
    report = {
        "source": str(source_checkpoint),
        "data": description,
        "examples": len(examples),
        "objective": options.objective,
        "target": model.latent_cfg.decoder_posterior_target,
        "epochs": options.epochs,
        "lr": options.lr,
        **({"target_lr": options.target_lr} if options.objective == "both" else {}),
        "holdout": options.holdout,
        "seed": options.seed,
        "posterior": options.posterior,
        "encoder_view": config.latent.encoder_view,
        "encoder_block": config.latent.encoder_block,
        "widened": overrides,
        "target_code_counts": [
            torch.bincount(targets[:, m], minlength=model.codebook_size).tolist() for m in range(model.num_slots)
        ],
        "decoder_posterior_seconds": posterior_seconds,
        "fit_seconds": time.perf_counter() - started - posterior_seconds,
        **fitted,
    }
    first, kept = fitted["history"][0], fitted["history"][fitted["kept_epoch"]]
    measured = ("fit_agreement", "holdout_agreement", "fit_regret", "holdout_regret")
    report["before"] = {k: first[k] for k in measured}
    report["after"] = {k: kept[k] for k in measured}
    weights = model.trainable_state_dict()
    bad = nonfinite_tensors(weights) + nonfinite_tensors({"log_r": log_r, "regret": regret})
    if bad:  # the kept epoch is finite (fit_encoder); a decoder whose scores are not is refused here, unwritten
        raise ValueError(f"refit-encoder: non-finite values in {', '.join(bad[:4])}; nothing written")
    optimizer_state = contents.optimizer_state
    if overrides:
        optimizer_state = widened_optimizer_state(optimizer_state, model, run_config, overrides)
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "data_stats.json"):
        if (source_run / name).is_file():
            data = (source_run / name).read_bytes()
            if name == "config.yaml" and overrides:
                data = yaml.safe_dump(run_config.to_dict(), sort_keys=False).encode()
            replace_file_durably(output_dir / name, data, output_dir)
    # the source's trainer state but its parameter norms (those of the old encoder: a resume measures them again)
    dropped = ("files", "format", "param_norms", "param_norm_reference", "suspect")
    trainer_state = {k: v for k, v in state.items() if k not in dropped}
    trainer_state["encoder_refit"] = {k: v for k, v in report.items() if k not in ("history", "fits")}
    set_rng_state(contents.rng_state)  # a resume draws what the source's would have
    report["checkpoint"] = str(
        save_checkpoint(
            output_dir,
            int(state["step"]),
            weights,
            optimizer_state,
            contents.scheduler_state,
            trainer_state,
            run_config,
        )
    )
    # the exact posterior of every pair, in the order of --data (with --max-examples, of the seeded subset)
    posterior = save_safetensors_bytes({"log_r": log_r.contiguous(), "regret": regret.contiguous()}, metadata=metadata)
    atomic_write(output_dir / POSTERIOR_FILE, posterior, output_dir)
    write_json(output_dir / REPORT_FILE, report, output_dir, indent=1)
    return report
