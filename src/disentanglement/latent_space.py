"""What a latent family means to the tools that read, steer and report its latents.

Each family model exposes its latent space as ``model.latent_space``: a :class:`DiscreteLatentSpace`
(``SharedDiscreteCVAE``: ``M`` slots of ``K`` codes) or a :class:`ContinuousLatentSpace`
(``ContinuousCVAE``: a ``D``-dimensional Gaussian). The consumers call it instead of branching on the
family:

- the latent file (``latent_file.py``, ``encode.py``): the row schema (:attr:`LatentSpace.row_keys`,
  the key of a row's latent :attr:`LatentSpace.latent_key`), a row's latent fields from the posterior
  (:meth:`LatentSpace.row_fields`), a row's latent parsed and checked (:meth:`LatentSpace.parse_row_latent`),
  a given latent as the decoder's vector (:meth:`LatentSpace.forced_vector`);
- ``generation.py``: the default mode and the steering plan (:meth:`LatentSpace.default_mode`,
  :meth:`LatentSpace.plan`, the latents to decode for a :class:`SteeringRequest`);
- ``evaluation.py``: the posterior's columns of the eval records (:meth:`LatentSpace.record_columns`), the KL
  unit and the latent's report columns (:meth:`LatentSpace.latent_report`);
- ``explorer.py``: the explorer's groups (:meth:`LatentSpace.explorer_groups`) and what their confidence is;
- ``controllability.py``: the target latents, what a re-encoding recovers and the recovery fields of the
  report (:meth:`LatentSpace.control_targets`, :meth:`LatentSpace.recovered`, :meth:`LatentSpace.recovery_report`).
- ``inspection.py``: an inspected example's latent, the code-usage plot and the heat map's rows
  (:meth:`LatentSpace.example_latent`, :meth:`LatentSpace.code_usage`, :meth:`LatentSpace.heatmap_rows`);
- ``export.py``: the model card's latent shape (:meth:`LatentSpace.shape`); ``frozen_pass.py``: whether the
  codebook starts from k-means (:meth:`LatentSpace.uses_kmeans`); ``verdict.py``: the latent's usage read from an
  eval report (:meth:`LatentSpace.usage_from_report`, the space chosen by :func:`latent_space_of_report`).

What a family cannot do is refused with its own message: :meth:`LatentSpace.require` raises the
``ValueError`` of :attr:`LatentSpace.unsupported` (e.g. ``--attribute`` on a discrete model).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # torch loads when a latent is used, not for --help (latent_file.py imports this module)
    import torch

    from .config import LatentConfig
    from .continuous_cvae import ContinuousCVAE
    from .cvae_base import CVAEBase, FrozenFeatures, PosteriorSummary
    from .latent_file import LatentRows
    from .shared_discrete_cvae import SharedDiscreteCVAE

logger = logging.getLogger(__package__ + ".generation")  # the plan's warnings are generate's
#: Continuous modes whose base latent is a row's mu or the prompt's prior mean.
STEERING_MODES = ("row", "attribute", "traverse")
#: The flag that asks for each steering mode, for messages.
_STEERING_FLAGS = {"row": "--mode row", "attribute": "--attribute", "traverse": "--traverse"}


@dataclass
class SteeringRequest:
    """What :func:`generation.generate` asks a latent space to decode (the options checked already)."""

    mode: str
    num_samples: int = 1
    steps: int = 5
    slot: int | None = None
    codes: str | None = None  # "0,-,2" (discrete)
    all_combinations: bool = False
    max_combinations: int = 64
    posteriors: list[PosteriorSummary] | None = None
    posteriors_b: list[PosteriorSummary] | None = None
    row: int | None = None
    row_value: list | None = None  # the row's codes or mu
    row_description: dict[str, Any] = field(default_factory=dict)
    attributes: list[tuple[torch.Tensor, dict[str, Any], float]] = field(default_factory=list)
    traverse: int | None = None
    offsets: list[float] = field(default_factory=list)


class LatentSpace:
    """The interface of a family's latent space (see the module docstring); ``model`` is the family's CVAE."""

    kind: ClassVar[str]  # "discrete" or "continuous", as reports and files name the family
    latent_key: ClassVar[str]  # the key of a row's latent in the latent file
    row_keys: ClassVar[tuple[str, ...]]  # the family's keys of a latent-file row, in the order written
    kl_units: ClassVar[str]  # the eval report's name of the KL per unit: "per_slot" or "per_dimension"
    confidence: ClassVar[str]  # what an explorer group's confidence in an example is, for the page
    assignment: ClassVar[str]  # how the eval report assigns examples to groups of the latent, for the report
    #: What the family cannot do, and the message that refuses it (``str.format`` fields from :meth:`require`):
    #: ``"mode M"`` (generation mode ``M``), ``"attribute"`` (attribute vectors), ``"code examples"``,
    #: ``"--code-examples"`` (generate's), ``"codes options"`` (``--codes``, ``--slot``, ``--all-combinations``).
    unsupported: ClassVar[dict[str, str]] = {}

    def __init__(self, model: CVAEBase) -> None:
        self.model = model

    def supports(self, what: str) -> bool:
        """Whether the family can do ``what`` (a key of :attr:`unsupported`)."""
        return what not in self.unsupported

    def require(self, what: str, **fields: Any) -> None:
        """A ``ValueError`` with the family's message when it cannot do ``what``."""
        if what in self.unsupported:
            raise ValueError(self.unsupported[what].format(**fields))

    def row_fields(self, features: FrozenFeatures, summary: PosteriorSummary) -> dict[str, list]:
        """The family's fields of a batch's latent-file rows (:attr:`row_keys`), each a list over the batch."""
        raise NotImplementedError

    def parse_row_latent(self, value: list | tuple, where: str) -> list:
        """A row's latent (:attr:`latent_key`) checked against the model; ``where`` names the file and row."""
        raise NotImplementedError

    def forced_vector(self, values: torch.Tensor) -> torch.Tensor | None:
        """The decoder's latent vector of ``values`` when the family reads them as its own latent (codes);
        None: ``values`` are a latent vector."""
        return None

    def expected_entries(self) -> str:
        """What a given latent's entries may be, for messages."""
        return f"{self.model.latent_vector_dim} numbers"

    def default_mode(self, row: int | None) -> str:
        """The generation mode when none is given (and no attribute or traversal asks for one)."""
        raise NotImplementedError

    def plan(self, features: FrozenFeatures, request: SteeringRequest) -> list[LatentChoice]:
        """The latents to decode for ``request``, per prompt of ``features``."""
        raise NotImplementedError

    def record_columns(self, summary: PosteriorSummary) -> dict[str, Any]:
        """The posterior's columns of a batch's eval records (``evaluation.BatchRecords``), numpy arrays."""
        raise NotImplementedError

    def latent_report(self, columns: Mapping[str, Any], seed: int) -> dict:
        """The eval report's latent columns from the posterior's records (``evaluation.BatchRecords``)."""
        raise NotImplementedError

    def assignments(self, latents: Mapping[str, Any], num_clusters: int, seed: int) -> Any:
        """One group id per example of the posterior ``latents`` (``evaluation.posterior_latents``), ``[E]``."""
        raise NotImplementedError

    def slot_assignments(self, latents: Mapping[str, Any]) -> list[Any]:
        """Each slot's own assignment ``[E]`` when the latent has several slots (else none)."""
        return []

    def control_targets(
        self,
        features: FrozenFeatures,
        latents: dict[str, Any],
        factors: dict[str, list[str]] | None,
        prior_latents: int,
    ) -> list[dict[str, Any]]:
        """``controllability``'s target latents: ``{prompt, group, target, vector, labels}``; ``group`` is what
        recovery is measured within and ``target`` the index to recover within it."""
        raise NotImplementedError

    def reencoded_latent(self, summary: PosteriorSummary) -> dict[str, torch.Tensor]:
        """The latent of a re-encoded batch that recovery reads (``codes [B, M]`` or ``mu [B, D]``)."""
        raise NotImplementedError

    def recovered(self, targets: list[dict[str, Any]], encoded: dict[str, Any], features: FrozenFeatures) -> list[int]:
        """The target index each generation's re-encoding recovers, within its group."""
        raise NotImplementedError

    def recovery_report(
        self, accuracy_of: Any, factors: dict[str, list[str]] | None, prior_latents: int
    ) -> dict[str, Any]:
        """The controllability report's recovery fields; ``accuracy_of(group)`` is a group's recovery accuracy."""
        raise NotImplementedError

    def target_name(self, target: dict[str, Any]) -> str:
        """How the report's examples name a target latent."""
        raise NotImplementedError

    def explorer_groups(
        self, rows: Sequence[Mapping[str, Any]], count: int, clusters: int | None, seed: int
    ) -> list[dict[str, Any]]:
        """The explorer's groups of encode ``rows``, each with ``id``, ``title``, ``latent`` (shown) and
        ``generate_under`` (the latent generated under, as :func:`encode.latent_vector` reads it)."""
        raise NotImplementedError

    def example_latent(self, summary: PosteriorSummary) -> dict[str, Any]:
        """The latent of an inspected example (its batch's first), for ``inspection.token_values``' sidecar."""
        raise NotImplementedError

    def code_usage(self, latents: Mapping[str, Any]) -> list[dict] | None:
        """Each slot's code usage over the posterior ``latents`` (``evaluation.posterior_latents``), for the
        code-usage plot; None: the family has no codes."""
        return None

    def heatmap_rows(self, latents: Mapping[str, Any]) -> str:
        """What the heat map's rows are for the posterior ``latents``: argmax codes, code combinations (several
        slots) or k-means clusters."""
        raise NotImplementedError

    @staticmethod
    def shape(latent: LatentConfig) -> str:
        """The latent's shape from its config, for the model card (``export.py``)."""
        raise NotImplementedError

    @staticmethod
    def uses_kmeans(latent: LatentConfig) -> bool:
        """Whether the latent's codebook starts from k-means (``frozen_pass.uses_kmeans``)."""
        return False

    @staticmethod
    def usage_from_report(report: Mapping[str, Any]) -> dict[str, Any]:
        """The latent's usage read from an eval report, for the verdict (``verdict._usage``)."""
        raise NotImplementedError


class DiscreteLatentSpace(LatentSpace):
    """``M`` slots, each one of ``K`` codes: rows hold codes and their probabilities, generation forces codes."""

    kind = "discrete"
    latent_key = "codes"
    row_keys = ("codes", "posterior", "prior_codes", "prior")
    kl_units = "per_slot"
    confidence = "posterior probability"
    assignment = "argmax code"
    unsupported: ClassVar[dict[str, str]] = {
        **{
            f"mode {mode}": f"{flag} needs a continuous model; a discrete model is steered with --codes or --row"
            for mode, flag in _STEERING_FLAGS.items()
        },
        "mode interpolate": "mode 'interpolate' needs a continuous model",
        "attribute": "--attribute needs a continuous model (a discrete model is steered by forcing codes)",
    }
    model: SharedDiscreteCVAE

    def row_fields(self, features: FrozenFeatures, summary: PosteriorSummary) -> dict[str, list]:
        model = self.model
        # as evaluation.posterior_latents: the softmax of the posterior logits
        probs = model.posterior_logits(model.encoder_outputs(features)).softmax(-1).float().cpu()
        return {
            "codes": summary.codes.cpu().tolist(),
            "posterior": probs.tolist(),
            "prior_codes": summary.log_p.argmax(-1).cpu().tolist(),
            "prior": summary.log_p.exp().float().cpu().tolist(),
        }

    def parse_row_latent(self, value: list | tuple, where: str) -> list:
        M, K = self.model.num_slots, self.model.codebook_size
        if len(value) != M:
            raise ValueError(f"{where}: 'codes' has {len(value)} entries; this checkpoint has {M} slot(s)")
        for code in value:
            if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < K:
                raise ValueError(f"{where}: code {code!r} is not an integer in [0, {K}) (this checkpoint's codebook)")
        return [int(c) for c in value]

    def row_posterior(self, file: LatentRows, index: int) -> list[list[float]]:
        """Row ``index``'s ``posterior``: ``M`` lists of ``K`` probabilities (this checkpoint's slots and codebook);
        a ``ValueError`` naming the file, row and field otherwise (a posterior of another K is never read)."""
        M, K = self.model.num_slots, self.model.codebook_size
        posterior = file.rows[index].get("posterior")
        where = f"--latents {file.path} row {index}: 'posterior'"
        if not isinstance(posterior, list | tuple) or len(posterior) != M:
            got = f"{len(posterior)} entries" if isinstance(posterior, list | tuple) else repr(posterior)
            raise ValueError(f"{where} must be {M} list(s) of {K} probabilities (this checkpoint's slots), got {got}")
        for m, probs in enumerate(posterior):
            if not isinstance(probs, list | tuple) or len(probs) != K:
                got = f"{len(probs)} entries" if isinstance(probs, list | tuple) else repr(probs)
                raise ValueError(
                    f"{where} of slot {m} must have {K} probabilities (this checkpoint's codebook size), got {got}: "
                    "an encode file of another checkpoint?"
                )
            for p in probs:
                if isinstance(p, bool) or not isinstance(p, int | float) or not (math.isfinite(p) and 0 <= p <= 1):
                    raise ValueError(f"{where} of slot {m} holds {p!r}; expected probabilities in [0, 1]")
        return [[float(p) for p in probs] for probs in posterior]

    def forced_vector(self, values: torch.Tensor) -> torch.Tensor | None:
        import torch

        model = self.model
        if values.is_floating_point() or values.dtype == torch.bool or len(values) != model.num_slots:
            return None
        codes = values.long()
        if bool(((codes < 0) | (codes >= model.codebook_size)).any()):
            raise ValueError(f"codes {codes.tolist()} must lie in [0, {model.codebook_size})")
        device = next(model.parameters()).device
        return model.codes_to_vector(codes.unsqueeze(0).to(device))[0].detach()

    def expected_entries(self) -> str:
        return f"{self.model.num_slots} integer codes or {self.model.latent_vector_dim} numbers"

    def default_mode(self, row: int | None) -> str:
        return "codes"

    def plan(self, features: FrozenFeatures, request: SteeringRequest) -> list[LatentChoice]:
        """``codes``, ``prior`` and ``posterior`` latents; a row's codes are the forced codes."""
        codes = request.codes
        if request.row_value is not None:
            codes = ",".join(map(str, request.row_value))
        parsed = parse_codes(codes, self.model.num_slots, self.model.codebook_size)
        choices = _discrete_plan(
            self.model,
            features,
            request.mode,
            request.slot,
            parsed,
            request.all_combinations,
            request.max_combinations,
            request.num_samples,
            request.posteriors,
        )
        for choice in choices:
            choice.description.update(request.row_description)
            if request.row_value is not None:  # the output names the row
                choice.label = f"row {request.row} {choice.label}"
        return choices

    def record_columns(self, summary: PosteriorSummary) -> dict[str, Any]:
        """``codes [B, M]`` (int64) and ``probs [B, M, K]`` (the effective posterior, float64)."""
        import numpy as np

        return {
            "codes": summary.codes.cpu().numpy().astype(np.int64),
            "probs": summary.log_q.exp().double().cpu().numpy().astype(np.float64),
        }

    def latent_report(self, columns: Mapping[str, Any], seed: int) -> dict:
        from .evaluation import discrete_latent_report

        return discrete_latent_report(columns["codes"], columns["probs"])

    def assignments(self, latents: Mapping[str, Any], num_clusters: int, seed: int) -> Any:
        """The argmax code (single slot) or code tuple id (several slots)."""
        import numpy as np

        codes = latents["codes"]
        if codes.shape[1] == 1:
            return codes[:, 0]
        _, ids = np.unique(codes, axis=0, return_inverse=True)
        return ids.reshape(-1)

    def slot_assignments(self, latents: Mapping[str, Any]) -> list[Any]:
        codes = latents["codes"]
        return [codes[:, m] for m in range(codes.shape[1])] if codes.shape[1] > 1 else []

    def example_latent(self, summary: PosteriorSummary) -> dict[str, Any]:
        return {"codes": summary.codes[0].tolist()}

    def code_usage(self, latents: Mapping[str, Any]) -> list[dict] | None:
        """``codes [E, M]`` and their posteriors ``probs [E, M, K]``."""
        from .metrics import code_usage_per_slot

        return code_usage_per_slot(latents["codes"], latents["probs"].shape[-1])

    def heatmap_rows(self, latents: Mapping[str, Any]) -> str:
        return "code" if latents["codes"].shape[1] == 1 else "code combination"

    @staticmethod
    def shape(latent: LatentConfig) -> str:
        return f"discrete, {latent.num_slots} slot(s) of {latent.codebook_size} codes"

    @staticmethod
    def uses_kmeans(latent: LatentConfig) -> bool:
        """``codebook_init: kmeans`` (of the encoder's outputs), ``prior_kmeans`` (of the prompt features) or
        ``view_kmeans`` (of the view)."""
        return latent.codebook_init in ("kmeans", "prior_kmeans", "view_kmeans")

    @staticmethod
    def usage_from_report(report: Mapping[str, Any]) -> dict[str, Any]:
        """``{"kind": "codes", "used": [per slot], "of": [per slot], "perplexity": [per slot]}``."""
        usage = report["code_usage"]
        return {
            "kind": "codes",
            "used": [int(u["used_codes"]) for u in usage],
            "of": [int(u.get("codebook_size", len(u.get("histogram", [])))) for u in usage],
            "perplexity": [float(u["perplexity"]) for u in usage if "perplexity" in u],
        }

    def control_targets(
        self,
        features: FrozenFeatures,
        latents: dict[str, Any],
        factors: dict[str, list[str]] | None,
        prior_latents: int,
    ) -> list[dict[str, Any]]:
        """Every code of every slot around the prompt's prior mode (group ``slot m``, target the code, ``slot``
        ``m``), with the label each code stands for (:func:`code_labels` of the real examples' codes) and the
        code's ``share`` of the real examples in that slot (:func:`code_shares`; 0 for a code none has)."""
        model = self.model
        targets: list[dict[str, Any]] = []
        P = features.prior_features.shape[0]
        M, K = model.num_slots, model.codebook_size
        mode = model.prior_log_probs(features).argmax(-1)  # [P, M]
        labels = code_labels(latents["codes"], factors or {})
        shares = code_shares(latents["codes"])
        for p in range(P):
            for m in range(M):
                for k in range(K):
                    codes = mode[p].clone()
                    codes[m] = k
                    targets.append(
                        {
                            "prompt": p,
                            "group": f"slot {m}",
                            "slot": m,
                            "target": k,
                            "vector": model.codes_to_vector(codes.unsqueeze(0))[0],
                            "codes": codes.tolist(),
                            "labels": labels.get((m, k), {}),
                            "share": shares.get((m, k), 0.0),
                        }
                    )
        return targets

    def reencoded_latent(self, summary: PosteriorSummary) -> dict[str, torch.Tensor]:
        return {"codes": summary.codes}

    def recovered(self, targets: list[dict[str, Any]], encoded: dict[str, Any], features: FrozenFeatures) -> list[int]:
        """The re-encoded argmax code of the target's slot."""
        out: list[int] = []
        for t, codes in zip(targets, encoded["codes"].tolist(), strict=True):
            out.append(codes[int(t["group"].split()[1])])
        return out

    def recovery_report(
        self, accuracy_of: Any, factors: dict[str, list[str]] | None, prior_latents: int
    ) -> dict[str, Any]:
        import numpy as np

        model = self.model
        per_slot = [
            {"slot": m, "accuracy": accuracy_of(f"slot {m}"), "chance": 1 / model.codebook_size}
            for m in range(model.num_slots)
        ]
        return {
            "recovery": "the re-encoded argmax code of the slot equals the code generated under",
            "code_recovery_accuracy": float(np.mean([s["accuracy"] for s in per_slot])),
            "recovery_chance": 1 / model.codebook_size,
            "per_slot": per_slot,
        }

    def target_name(self, target: dict[str, Any]) -> str:
        return f"codes={','.join(map(str, target['codes']))}"

    def explorer_groups(
        self, rows: Sequence[Mapping[str, Any]], count: int, clusters: int | None, seed: int
    ) -> list[dict[str, Any]]:
        """One group per (slot, code) (``explorer.discrete_groups``), generated under its codes."""
        from .explorer import discrete_groups

        groups = discrete_groups(rows, self.model.codebook_size, count)
        for g in groups:
            g["id"] = f"s{g['slot']}-c{g['code']}"
            g["title"] = f"slot {g['slot']} · code {g['code']}"
            g["latent"] = {"codes": g["codes"]}
            g["generate_under"] = g["codes"]
        return groups


class ContinuousLatentSpace(LatentSpace):
    """A ``D``-dimensional Gaussian: rows hold the posterior's and the prior's mean and log-variance,
    generation steers ``z`` (prior, posterior, interpolation, rows, attributes, traversals)."""

    kind = "continuous"
    latent_key = "mu"
    row_keys = ("mu", "logvar", "prior_mu", "prior_logvar")
    kl_units = "per_dimension"
    confidence = "minus distance to the centroid"
    assignment = "k-means of posterior means"
    unsupported: ClassVar[dict[str, str]] = {
        "mode codes": "mode 'codes' needs a discrete model; use prior, posterior or interpolate",
        "code examples": "code examples need a discrete model",
        "--code-examples": "--code-examples needs a discrete model (a code's typical responses)",
        "codes options": "{flags}: {count} of a discrete model (codes); this checkpoint is continuous: use --mode "
        "prior, posterior, interpolate, row, attribute or traverse",
    }
    model: ContinuousCVAE

    def row_fields(self, features: FrozenFeatures, summary: PosteriorSummary) -> dict[str, list]:
        return {
            "mu": summary.mu.float().cpu().tolist(),
            "logvar": summary.logvar.float().cpu().tolist(),
            "prior_mu": summary.prior_mu.float().cpu().tolist(),
            "prior_logvar": summary.prior_logvar.float().cpu().tolist(),
        }

    def parse_row_latent(self, value: list | tuple, where: str) -> list:
        D = self.model.latent_vector_dim
        if len(value) != D:
            raise ValueError(f"{where}: 'mu' has {len(value)} entries; this checkpoint's latent has {D} dimensions")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{where}: 'mu' holds {v!r}; expected finite numbers")
        return [float(v) for v in value]

    def default_mode(self, row: int | None) -> str:
        return "row" if row is not None else "prior"

    def plan(self, features: FrozenFeatures, request: SteeringRequest) -> list[LatentChoice]:
        """``prior``, ``posterior`` and ``interpolate`` latents, or the steering modes' (row, attribute, traverse)."""
        if request.mode in STEERING_MODES:
            import torch

            row_mu = None if request.row_value is None else torch.tensor(request.row_value)
            return _steering_plan(
                self.model,
                features,
                request.mode,
                row_mu,
                request.row_description,
                request.attributes,
                request.traverse,
                request.offsets,
            )
        return _continuous_plan(
            self.model,
            features,
            request.mode,
            request.num_samples,
            request.steps,
            request.posteriors,
            request.posteriors_b,
        )

    def record_columns(self, summary: PosteriorSummary) -> dict[str, Any]:
        """``mu`` and ``logvar`` ``[B, D]`` (float64)."""
        import numpy as np

        return {
            "mu": summary.mu.double().cpu().numpy().astype(np.float64),
            "logvar": summary.logvar.double().cpu().numpy().astype(np.float64),
        }

    def latent_report(self, columns: Mapping[str, Any], seed: int) -> dict:
        from .evaluation import continuous_latent_report

        return continuous_latent_report(columns["mu"], columns["logvar"], seed)

    def assignments(self, latents: Mapping[str, Any], num_clusters: int, seed: int) -> Any:
        """k-means of the posterior means (``metrics.kmeans_assignments``)."""
        from .metrics import kmeans_assignments

        return kmeans_assignments(latents["mu"], num_clusters, seed=seed)

    def control_targets(
        self,
        features: FrozenFeatures,
        latents: dict[str, Any],
        factors: dict[str, list[str]] | None,
        prior_latents: int,
    ) -> list[dict[str, Any]]:
        """``prior_latents`` draws from the prior (group ``prior``) and, per factor of at least two values, the
        prior mean plus each value's attribute vector (group ``factor NAME``, target the value's index, ``share``
        the value's share of the real examples)."""
        import torch

        model = self.model
        targets: list[dict[str, Any]] = []
        P = features.prior_features.shape[0]
        prior_mu, _ = model.prior(features)  # [P, D]
        draws = model.prior_vectors(features, prior_latents)  # [J, P, D]
        for p in range(P):
            for j in range(prior_latents):
                targets.append({"prompt": p, "group": "prior", "target": j, "vector": draws[j, p], "labels": {}})
        mu = torch.as_tensor(latents["mu"], dtype=torch.float64)  # [E, D]
        for name, values in (factors or {}).items():
            names = sorted(set(values))
            if len(names) < 2:
                continue
            for index, value in enumerate(names):
                chosen = torch.tensor([v == value for v in values])
                attribute = (mu[chosen].mean(0) - mu.mean(0)).to(prior_mu)  # [D]
                for p in range(P):
                    targets.append(
                        {
                            "prompt": p,
                            "group": f"factor {name}",
                            "target": index,
                            "vector": prior_mu[p] + attribute,
                            "attribute": attribute,
                            "labels": {name: value},
                            "share": values.count(value) / len(values),
                        }
                    )
        return targets

    def reencoded_latent(self, summary: PosteriorSummary) -> dict[str, torch.Tensor]:
        return {"mu": summary.mu.float()}

    def recovered(self, targets: list[dict[str, Any]], encoded: dict[str, Any], features: FrozenFeatures) -> list[int]:
        """The nearest target of the prompt's group: among the prior draws for ``mu``, among the attribute
        vectors for ``mu - prior_mu``."""
        import torch

        from .controllability import nearest_target

        prior_mu = self.model.prior(features)[0].cpu()
        by_group: dict[tuple[int, str, int], list[int]] = {}
        for i, t in enumerate(targets):  # each draw (eval --generation-samples) among its own targets
            by_group.setdefault((t["prompt"], t["group"], t.get("sample", 0)), []).append(i)
        recovered = [0] * len(targets)
        for (p, group, _), members in by_group.items():
            mu = encoded["mu"][members].double()  # [n, D]
            if group == "prior":
                candidates = torch.stack([targets[i]["vector"].double().cpu() for i in members])  # [J, D]
                points = mu
            else:  # mu - prior_mu against the attribute vectors
                candidates = torch.stack([targets[i]["attribute"].double().cpu() for i in members])
                points = mu - prior_mu[p].double().cpu()
            nearest = nearest_target(points, candidates.expand(len(members), -1, -1))
            for i, n in zip(members, nearest.tolist(), strict=True):
                recovered[i] = targets[members[n]]["target"]
        return recovered

    def recovery_report(
        self, accuracy_of: Any, factors: dict[str, list[str]] | None, prior_latents: int
    ) -> dict[str, Any]:
        report: dict[str, Any] = {
            "recovery": (
                f"the re-encoded posterior mean is nearest to its own target among the prompt's {prior_latents} "
                "prior draws"
            ),
            "latent_recovery_accuracy": accuracy_of("prior"),
            "recovery_chance": 1 / prior_latents,
        }
        attributes = {}
        for name, values in (factors or {}).items():
            count = len(set(values))
            if count >= 2:
                attributes[name] = {
                    "recovery_accuracy": accuracy_of(f"factor {name}"),
                    "chance": 1 / count,
                    "values": count,
                }
        if attributes:
            report["attributes"] = attributes
        return report

    def target_name(self, target: dict[str, Any]) -> str:
        return f"{target['group']} #{target['target']}"

    def explorer_groups(
        self, rows: Sequence[Mapping[str, Any]], count: int, clusters: int | None, seed: int
    ) -> list[dict[str, Any]]:
        """k-means clusters of the posterior means (``explorer.cluster_groups``; ``clusters`` of them, or
        ``explorer.default_clusters``), generated under their centroids."""
        from .explorer import cluster_groups, default_clusters

        n = clusters if clusters is not None else default_clusters([r["label"] for r in rows], len(rows))
        if n > len(rows):
            raise ValueError(f"--clusters {n} is more than the {len(rows)} examples of the data")
        groups = cluster_groups([r["mu"] for r in rows], n, count, seed=seed)
        for g in groups:
            g["id"] = f"k{g['cluster']}"
            g["title"] = f"cluster {g['cluster']}"
            g["latent"] = {"centroid": [round(v, 5) for v in g["centroid"]]}
            g["generate_under"] = g["centroid"]
        return groups

    def example_latent(self, summary: PosteriorSummary) -> dict[str, Any]:
        return {"posterior_mean": [round(float(v), 5) for v in summary.mu[0]]}

    def heatmap_rows(self, latents: Mapping[str, Any]) -> str:
        return "cluster (k-means of posterior means)"

    @staticmethod
    def shape(latent: LatentConfig) -> str:
        return f"continuous, {latent.latent_dim} dimensions"

    @staticmethod
    def usage_from_report(report: Mapping[str, Any]) -> dict[str, Any]:
        """``{"kind": "units", "active", "of"}`` (``of``: the posterior mean's dimensions, None when unknown)."""
        of = len(report.get("posterior_mean_variance") or []) or None
        return {"kind": "units", "active": int(report["active_units"]), "of": of}


#: The latent spaces of the families, as a latent-file row names its family (by :attr:`LatentSpace.latent_key`).
LATENT_SPACES: tuple[type[LatentSpace], ...] = (DiscreteLatentSpace, ContinuousLatentSpace)


def code_labels(codes: Any, factors: Mapping[str, Sequence[str]]) -> dict[tuple[int, int], dict[str, str]]:
    """The value each code stands for, ``{(slot, code): {factor: value}}``: per factor, the most frequent value
    among the examples assigned to the code in that slot (ties: the smallest value), from ``codes [E, M]`` (a
    tensor or an array, one row per example, in the order of each factor's ``values``); codes no example is
    assigned to are left out."""
    from collections import Counter

    rows = [[int(c) for c in row] for row in codes.tolist()]
    labels: dict[tuple[int, int], dict[str, str]] = {}
    for name, values in factors.items():
        if len(values) != len(rows):
            raise ValueError(f"factor {name!r} has {len(values)} values for {len(rows)} examples' codes")
        counts: dict[tuple[int, int], Counter] = {}
        for value, row in zip(values, rows, strict=True):
            for m, k in enumerate(row):
                counts.setdefault((m, k), Counter())[value] += 1
        for key, counter in counts.items():
            top = max(counter.values())
            labels.setdefault(key, {})[name] = min(v for v, n in counter.items() if n == top)
    return labels


def code_shares(codes: Any) -> dict[tuple[int, int], float]:
    """Each code's share of the examples, ``{(slot, code): share}``, from ``codes [E, M]`` (a tensor or an array,
    one row per example); codes no example is assigned to are left out."""
    from collections import Counter

    rows = [tuple(int(c) for c in row) for row in codes.tolist()]
    counts = Counter((m, k) for row in rows for m, k in enumerate(row))
    return {key: n / len(rows) for key, n in sorted(counts.items())}


def latent_space_of(family: str) -> LatentSpace:
    """The latent space of the family named ``family`` (``LatentConfig.latent``) without a model: for the
    checks made before a checkpoint loads (what the family supports)."""
    return {space.kind: space for space in LATENT_SPACES}[family](None)  # type: ignore[arg-type]


def latent_space_of_report(report: Mapping[str, Any]) -> LatentSpace:
    """The latent space (without a model) of an eval report: the family its ``latent`` names, or whose usage
    it holds (``code_usage``, for a report without ``latent``); else continuous."""
    if report.get("latent") == DiscreteLatentSpace.kind or "code_usage" in report:
        return DiscreteLatentSpace(None)  # type: ignore[arg-type]
    return ContinuousLatentSpace(None)  # type: ignore[arg-type]


def latent_space_of_latents(latents: Mapping[str, Any]) -> LatentSpace:
    """The latent space (without a model) whose latent ``latents`` hold (``codes`` or ``mu``, as
    ``evaluation.posterior_latents`` gives them)."""
    return next(space for space in LATENT_SPACES if space.latent_key in latents)(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the steering plans


@dataclass
class LatentChoice:
    """One latent to decode for one prompt, with a JSON-able description."""

    prompt_index: int
    label: str
    description: dict[str, Any]
    vector: torch.Tensor  # [L]


def parse_codes(text: str | None, num_slots: int, codebook_size: int) -> list[int | None] | None:
    """``"0,2"`` -> ``[0, 2]``; ``-`` leaves a slot free (its prior mode, or swept). None stays None."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != num_slots:
        raise ValueError(f"--codes needs one entry per slot ({num_slots}), got {len(parts)} in {text!r}")
    codes: list[int | None] = []
    for part in parts:
        if part in ("-", "*", ""):
            codes.append(None)
            continue
        try:
            code = int(part)
        except ValueError:
            raise ValueError(f"--codes entries must be integers or '-', got {part!r}") from None
        if not 0 <= code < codebook_size:
            raise ValueError(f"--codes entry {code} is outside [0, {codebook_size})")
        codes.append(code)
    return codes


def _discrete_plan(
    model: SharedDiscreteCVAE,
    features: FrozenFeatures,
    mode: str,
    slot: int | None,
    codes: list[int | None] | None,
    all_combinations: bool,
    max_combinations: int,
    num_samples: int,
    posteriors: list[PosteriorSummary] | None,
) -> list[LatentChoice]:
    import torch

    M, K = model.num_slots, model.codebook_size
    log_p = model.prior_log_probs(features)  # [B, M, K]
    B = log_p.shape[0]
    choices: list[LatentChoice] = []

    def add(p: int, combo: Sequence[int], label: str, **extra: Any) -> None:
        codes_t = torch.tensor([list(combo)], device=log_p.device)
        choices.append(LatentChoice(p, label, dict(extra, codes=list(combo)), model.codes_to_vector(codes_t)[0]))

    if mode == "prior":
        for p in range(B):
            draws = torch.multinomial(log_p[p].exp(), num_samples, replacement=True).T  # [S, M]
            for s, combo in enumerate(draws.tolist()):
                add(p, combo, f"prior#{s} codes={','.join(map(str, combo))}", prior_sample=s)
        return choices
    if mode == "posterior":
        assert posteriors is not None
        for p, summary in enumerate(posteriors):
            combo = summary.codes[0].tolist()
            add(p, combo, f"posterior codes={','.join(map(str, combo))}", posterior_of="reference_response")
        return choices
    if slot is not None and not 0 <= slot < M:
        raise ValueError(f"--slot {slot} is outside [0, {M})")
    forced = codes if codes is not None else [None] * M
    sweep = slot if slot is not None else (0 if codes is None else None)
    for p in range(B):
        mode_codes = log_p[p].argmax(-1).tolist()  # [M], the prior mode
        base = [forced[m] if forced[m] is not None else mode_codes[m] for m in range(M)]
        if all_combinations:
            options = [[forced[m]] if forced[m] is not None else list(range(K)) for m in range(M)]
            combos = list(itertools.islice(itertools.product(*options), max_combinations))
            total = math.prod(len(o) for o in options)
            if p == 0 and total > max_combinations:
                logger.warning("generating the first %d of %d code combinations", max_combinations, total)
        elif sweep is not None:
            combos = [tuple(base[:sweep] + [k] + base[sweep + 1 :]) for k in range(K)]
        else:
            combos = [tuple(base)]
        for combo in combos:
            add(p, combo, f"codes={','.join(map(str, combo))}")
    return choices


def _continuous_plan(
    model: CVAEBase,
    features: FrozenFeatures,
    mode: str,
    num_samples: int,
    steps: int,
    posteriors: list[PosteriorSummary] | None,
    posteriors_b: list[PosteriorSummary] | None,
) -> list[LatentChoice]:
    choices: list[LatentChoice] = []
    B = features.prior_features.shape[0]

    def z_list(z: torch.Tensor) -> list[float]:
        return [round(float(v), 5) for v in z]

    if mode == "prior":
        draws = model.prior_vectors(features, num_samples)  # [S, B, D]
        for p in range(B):
            for s in range(num_samples):
                choices.append(
                    LatentChoice(p, f"prior#{s}", {"prior_sample": s, "z": z_list(draws[s, p])}, draws[s, p])
                )
    elif mode == "posterior":
        assert posteriors is not None
        for p, summary in enumerate(posteriors):
            mu = summary.mu[0]
            choices.append(LatentChoice(p, "posterior", {"posterior_of": "reference_response", "z": z_list(mu)}, mu))
    else:  # interpolate
        assert posteriors is not None and posteriors_b is not None
        for p, (a, b) in enumerate(zip(posteriors, posteriors_b, strict=True)):
            for i in range(steps):
                t = i / (steps - 1) if steps > 1 else 0.0
                z = (1 - t) * a.mu[0] + t * b.mu[0]
                choices.append(LatentChoice(p, f"t={t:.2f}", {"t": t, "z": z_list(z)}, z))
    return choices


def _steering_plan(
    model: CVAEBase,
    features: FrozenFeatures,
    mode: str,
    row_mu: torch.Tensor | None,
    row_description: dict[str, Any],
    attributes: list[tuple[torch.Tensor, dict[str, Any], float]],
    traverse: int | None,
    offsets: list[float],
) -> list[LatentChoice]:
    """Continuous ``row``, ``attribute`` and ``traverse`` latents (see the module docstring)."""
    prior_mu, _ = model.prior(features)  # [B, D]
    choices: list[LatentChoice] = []

    def z_list(z: torch.Tensor) -> list[float]:
        return [round(float(v), 5) for v in z]

    for p in range(prior_mu.shape[0]):
        if row_mu is not None:
            base, base_name = row_mu.to(prior_mu), f"row {row_description['row']}"
            common: dict[str, Any] = {"base": "row", **row_description}
        else:
            base, base_name = prior_mu[p], "prior mean"
            common = {"base": "prior_mean"}
        if mode == "row":
            choices.append(LatentChoice(p, base_name, {**common, "z": z_list(base)}, base))
            continue
        steered, name = base.clone(), base_name
        for vector, description, scale in attributes:
            steered = steered + scale * vector.to(steered)
            name += f" {'+' if scale >= 0 else '-'} {abs(scale):g}*{description['label']}"
        common["attributes"] = [{**d, "scale": scale} for _, d, scale in attributes]
        if mode == "attribute":
            choices.append(LatentChoice(p, base_name, {**common, "base_only": True, "z": z_list(base)}, base))
            choices.append(LatentChoice(p, name, {**common, "base_only": False, "z": z_list(steered)}, steered))
            continue
        assert traverse is not None
        for offset in offsets:
            z = steered.clone()
            z[traverse] = steered[traverse] + offset
            value = float(z[traverse])
            label = f"{name} dim{traverse}{offset:+.2f} (z[{traverse}]={value:+.3f})"  # the offset and the value
            description = {**common, "dim": traverse, "offset": offset, "value": value, "z": z_list(z)}
            choices.append(LatentChoice(p, label, description, z))
    return choices
