"""Where is a factor lost: in the encoder's view, in the trained encoder, or in the codebook? Section 17.

    python benchmarks/cvae-adds/view_probe.py RUN --train TRAIN.jsonl --data HELDOUT.jsonl --factor style \
        [--values signoff plain]

For a factor of labelled data, the held-out accuracy of a linear probe (standardised logistic regression fitted on
``--train``, scored on ``--data``; beside it the NMI of its predictions with the factor, and the commonest value's
share) that reads the factor from:

- the encoder's view, the frozen features the encoder reads (its pool of the response's states, then the last
  token's state, then both: ``encoder_features``, from the run's frozen pass through the feature store);
- the trained encoder's outputs ``e`` (before the codebook);

beside the NMI with the factor of k-means of each (K = the codebook's size) and of the run's own codes (the nearest
code to ``e``). A factor the view holds (probe near 1) but whose k-means NMI is low is one the view mixes with
others, which only training can separate; a probe on ``e`` below the view's says the encoder did not learn to keep
it apart; k-means of ``e`` above the codes' NMI says the codebook, not the encoder, mixes it. ``--values A B``
restricts the probes to the examples of those values (e.g. the two styles the codes mix). A discrete run whose
encoder reads the cached view only (not the attention views, not ``encoder_lora_layers``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.controllability import majority_share_of  # noqa: E402
from disentanglement.cvae_base import ATTENTION_VIEWS  # noqa: E402
from disentanglement.data import collate, label_factors  # noqa: E402
from disentanglement.metrics import kmeans_assignments  # noqa: E402
from disentanglement.runs import load_checkpoint, load_examples, stored_features  # noqa: E402


def probe_scores(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray
) -> tuple[float, float]:
    """``(accuracy, NMI)`` on the held-out rows of standardised logistic regression (L2, C = 0.1) fitted on the
    training rows: the share it reads right, and the NMI of its predictions with the factor (what a partition the
    representation holds linearly, one cluster per value, scores on eval's measure)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import normalized_mutual_info_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    classifier = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=3000, random_state=0))
    predicted = classifier.fit(train_x, train_y).predict(test_x)
    return float(np.mean(predicted == test_y)), float(normalized_mutual_info_score(test_y, predicted))


def kmeans_nmi(x: np.ndarray, y: np.ndarray, k: int) -> float:
    """NMI of ``y`` with k-means (``k`` clusters, seed 0) of the rows of ``x``: eval's k-means baselines'."""
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(y, kmeans_assignments(x, k, seed=0)))


@torch.no_grad()
def view_and_outputs(model, examples, pad_token_id: int, batch_size: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """``(view [E, 2H], encoder outputs of slot 0 [E, C])``: the frozen features the encoder reads (through the
    feature store) and what the trained encoder makes of them."""
    cache = stored_features(model, examples, pad_token_id, batch_size=16, progress=False)
    outputs = []
    for start in range(0, len(examples), batch_size):
        stop = min(start + batch_size, len(examples))
        batch = collate(examples[start:stop], pad_token_id, indices=list(range(start, stop)))
        outputs.append(model.encoder_outputs(cache.features(batch))[:, 0].float().cpu())
    return cache.encoder_features.float().cpu().numpy(), torch.cat(outputs).numpy()


def labels(examples, factor: str, where: str) -> np.ndarray:
    values = []
    for i, example in enumerate(examples):
        factors = label_factors(example.label) or {}
        if factor not in factors:
            raise SystemExit(f"{where} example {i + 1}: no label {factor!r} (its label: {example.label!r})")
        values.append(str(factors[factor]))
    return np.array(values)


def report(model, train, test, factor: str, values: list[str] | None, pad_token_id: int) -> list[str]:
    """The lines printed: per representation, the probe's held-out accuracy and k-means' NMI; the codes' NMI."""
    from sklearn.metrics import normalized_mutual_info_score

    (train_view, train_e), (test_view, test_e) = (view_and_outputs(model, ex, pad_token_id) for ex in (train, test))
    train_y, test_y = labels(train, factor, "--train"), labels(test, factor, "--data")
    with torch.no_grad():  # the run's own codes: the argmax of its posterior logits (the nearest code) for slot 0
        codes = model.posterior_logits(torch.as_tensor(test_e).unsqueeze(1)).argmax(-1)[:, 0].numpy()
    keep_train = np.ones(len(train_y), bool) if values is None else np.isin(train_y, values)
    keep_test = np.ones(len(test_y), bool) if values is None else np.isin(test_y, values)
    for where, kept in (("--train", train_y[keep_train]), ("--data", test_y[keep_test])):
        if len(set(kept)) < 2:
            raise SystemExit(f"{where}: fewer than two values of {factor!r} to probe among {values or 'its rows'}")
    half = train_view.shape[1] // 2
    parts = {
        "view: pool": (slice(0, half), train_view, test_view),
        "view: last token": (slice(half, None), train_view, test_view),
        "view: both": (slice(None), train_view, test_view),
        "encoder outputs e": (slice(None), train_e, test_e),
    }
    k = model.codebook_size
    which = f"{factor}" + ("" if values is None else f" ({' vs '.join(values)})")
    majority = majority_share_of(test_y[keep_test].tolist())
    lines = [
        f"{which}: {keep_test.sum()} held-out examples (the commonest value's share {majority:.3f}), probes fitted "
        f"on {keep_train.sum()}"
    ]
    for name, (columns, train_x, test_x) in parts.items():
        accuracy, probe_nmi = probe_scores(
            train_x[keep_train][:, columns], train_y[keep_train], test_x[keep_test][:, columns], test_y[keep_test]
        )
        nmi = kmeans_nmi(test_x[keep_test][:, columns], test_y[keep_test], k)
        lines.append(f"  {name:18s} probe accuracy {accuracy:.3f} (NMI {probe_nmi:.3f}), k-means ({k}) NMI {nmi:.3f}")
    codes_nmi = normalized_mutual_info_score(test_y[keep_test], codes[keep_test])
    lines.append(f"  {'the codes':18s} NMI {codes_nmi:.3f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a discrete run directory or checkpoint")
    parser.add_argument(
        "--train", required=True, help="labelled rows to fit the probes on (a JSONL file, or 'train': the run's split)"
    )
    parser.add_argument(
        "--data",
        required=True,
        help="labelled held-out rows to score them on (a JSONL file, or 'validation': the run's split)",
    )
    parser.add_argument("--factor", required=True, help="the label's factor to probe")
    parser.add_argument("--values", nargs="+", default=None, help="only the examples of these values")
    args = parser.parse_args(argv)
    model, tokenizer, config, *_ = load_checkpoint(args.run, device="cpu")
    if not hasattr(model, "codebook"):
        raise SystemExit(f"{args.run}: a discrete run is needed (this one's latent has no codebook)")
    latent = config.latent
    if latent.encoder_view in ATTENTION_VIEWS or latent.encoder_lora_layers > 0:
        raise SystemExit(
            f"{args.run}: its encoder reads its own pool (encoder_view {latent.encoder_view!r}, encoder_lora_layers "
            f"{latent.encoder_lora_layers}), not the cached view this script probes"
        )
    train, _ = load_examples(args.train, config, tokenizer)
    test, _ = load_examples(args.data, config, tokenizer)
    print("\n".join(report(model, train, test, args.factor, args.values, tokenizer.pad_token_id)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
