"""The tables of docs/what-the-cvae-adds.md from eval reports (``disentangle eval ... --generation``'s JSON).

    python benchmarks/cvae-adds/table.py REPORT.json [REPORT.json ...]

One row per report: its run and step, per factor the latent's NMI beside k-means of the encoder's view and of
the prior features (and of the decoder's own likeliest code, where the report has it), the posterior and z-free NLL
(nats/token), the latent gain (and under the decoder's likeliest codes and the best ones), and (with --generation)
per factor the share of generations whose factor, read back from the text, is the one their code stands for (with
its 95 % interval, the prompts and the generations within them resampled, where the report has it), with chance,
the majority share (the accuracy of one answer for all) and the share where no value was found (and where
eval had the decoder's likeliest codes, the same with each code standing for its majority value among them, its
majority share and generations scored beside it; where no
detector reads the text, as for DailyDialog's act and emotion: per factor, the share that the classifier on the
frozen features gives the code's value, beside chance, the majority share and the classifier's accuracy on
held-out real responses), and the generations' z-free NLL over the real responses' (and the share of generations
that repeat themselves, where the report has it). A report of
``eval --generation-guidance`` is named by its run and ", guided G", one of ``--generation-temperature T`` by ", sampled
at T T" (" top-p P" with ``--generation-top-p P`` below 1; ", N draws" with ``--generation-samples N``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def majority(entry: dict) -> str:
    """``, majority X``: the accuracy of one answer for every generation (reports written before it have none)."""
    return "" if entry.get("majority_share") is None else f", majority {entry['majority_share']:.2f}"


def by_prompt(entry: dict) -> str:
    """`` [0.84, 0.97]``: the read-back's 95 % interval, the prompts and the generations within them resampled
    (reports written before eval gave it have none)."""
    interval = entry.get("accuracy_interval_by_prompt")
    return "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"


def weighted(entry: dict) -> str:
    """`` weighted W`` after an accuracy: the read-back with each code weighted by its share of the real examples
    (reports written before it have none)."""
    return "" if entry.get("weighted_accuracy") is None else f" weighted {entry['weighted_accuracy']:.3f}"


def decoders_gain(decoder: dict) -> str:
    """The latent gain under the decoder's own likeliest codes and under the best ones, where eval reports them
    (section 25)."""
    if "best_latent_gain_nats_per_token" not in decoder:
        return ""
    return (
        f" (decoder's codes {decoder['latent_gain_nats_per_token']:+.4f}, "
        f"best {decoder['best_latent_gain_nats_per_token']:+.4f})"
    )


def row(path: Path) -> str:
    report = json.loads(path.read_text())
    checkpoint = Path(report["checkpoint"])
    run = f"{checkpoint.parent.parent.parent.name}/{checkpoint.parent.parent.name} @{report.get('step')}"
    control = report.get("controllability") or {}  # {} without --generation
    guidance = control.get("guidance")
    if guidance:  # eval --generation-guidance: the same run, generations guided at this scale
        run += f", guided {guidance['scale']:g}"
    temperature = control.get("temperature")
    if temperature:  # eval --generation-temperature: sampled, not greedy
        run += f", sampled at T {temperature:g}" + (
            f" top-p {control['top_p']:g}" if control.get("top_p", 1) < 1 else ""
        )
    if control.get("samples", 1) > 1:  # eval --generation-samples: several draws per prompt and code
        run += f", {control['samples']} draws"
    factors = report.get("factors") or {}
    decoder = (report.get("decoder_posterior") or {}).get("factors") or {}

    def own(name: str) -> str:  # the decoder's likeliest code's NMI, where eval reports it
        return f", decoder {decoder[name]['decoder']:.3f}" if name in decoder else ""

    nmi = "; ".join(
        f"{n} {f['latent']['nmi']:.3f} (view {f['encoder_kmeans']['nmi']:.3f}, prior {f['prior_kmeans']['nmi']:.3f}"
        f"{own(n)})"
        for n, f in factors.items()
    )
    cells = [
        run,
        nmi or f"label {report.get('label_nmi', float('nan')):.3f}",
        f"{report['posterior_nll_nats_per_token']:.3f} / {report['zfree_nll_nats_per_token']:.3f}",
        f"{report['latent_gain_nats_per_token']:+.4f}" + decoders_gain(report.get("decoder_posterior") or {}),
    ]
    if control:
        accuracy = (control.get("factor_accuracy") or {}).get("factors", {})
        by_decoder = (control.get("factor_accuracy") or {}).get("decoder_codes", {})

        def decoders(name: str) -> str:  # the read-back with each code named by the decoder's likeliest codes
            entry = by_decoder.get(name) or {}
            if entry.get("accuracy") is None:
                return ""
            return (
                f"; by the decoder's codes {entry['accuracy']:.3f}{weighted(entry)}{majority(entry)}, "
                f"n {entry['generations_scored']}"
            )

        text = "; ".join(
            f"{n} {e['accuracy']:.3f}{by_prompt(e)}{weighted(e)} (chance {e['chance']:.2f}{majority(e)}, "
            f"none {e['none_share']:.2f}, n {e['generations_scored']}{decoders(n)})"
            for n, e in accuracy.items()
            if e["accuracy"] is not None
        )
        if not text:  # no detector reads the factor from text (DailyDialog): the classifier on the frozen features
            text = "; ".join(
                f"{n} {e['accuracy']:.3f} by the classifier (chance {e['chance']:.2f}{majority(e)}, on real responses "
                f"{'n/a' if e.get('real_accuracy') is None else format(e['real_accuracy'], '.2f')}, "
                f"n {e['generations_scored']})"
                for n, e in (control.get("labels") or {}).items()
                if e.get("accuracy") is not None
            )
        cells.append(text or "-")
        ratio = f"{control['zfree_nll_per_token'] / control['real_zfree_nll_per_token']:.2f}"
        interval = control.get("zfree_nll_ratio_interval")  # reports written before eval gave it have none
        if interval is not None:
            ratio += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
        looping = control.get("looping_share")  # reports written before eval measured it have none
        cells.append(ratio if looping is None else f"{ratio} (looping {looping:.2f})")
    else:
        cells += ["-", "-"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(
        "| run @step | NMI per factor (k-means of the view, of the prior) | posterior / z-free NLL | latent gain "
        "| factor read from the generations [95 % interval by prompt] (chance, majority share, no value, generations; "
        "by the decoder's codes; or by the classifier) "
        "| generations' / real z-free NLL |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in argv:
        print(row(Path(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
