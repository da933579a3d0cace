"""The LangVAE side of ``peers.py``: runs in LangVAE's own venv (``langvae==0.6.13``, transformers 4.48).

    .venv-langvae/bin/python langvae_side.py --data FILE --model-dir DIR --plan PLAN --steps N --batch-size B --result OUT

LangVAE's sentence VAE (``LangVAE`` over pythae's ``VAE``) with SmolLM2-135M as the decoder
(``SentenceDecoder``: the latent becomes per-layer key/value context through one ``LazyLinear`` per
layer, and the decoder runs its own free-running loop of ``max_len`` single-token steps) and, as the
encoder, the same SmolLM2 (``SentenceEncoder`` accepts any Hugging Face model through an
``AutoModelPreset``; a causal LM loads as ``AutoModel``, i.e. the bare ``LlamaModel``, mean-pooled over its
last hidden states, frozen, with its embedding cache on), latent size 16 (our continuous latent's).

The steps are LangVAE's own training step (``CyclicalScheduleKLThresholdTrainer.train_step``: the
cyclical beta schedule with one cycle up to ``max_beta`` 1.0, KL threshold ``target_kl`` 2.0, gradient
clipping, AdamW at LangVAE's README's 1e-3) written out as a loop so that each step is timed, on the
same response texts and in the same order as our trainer's batches (``PLAN``, written by ``peers.py``).
The responses are tokenised by LangVAE's ``TokenizedDataSet`` (the decoder's tokenizer, ``max_len`` 32)
before the timed loop, and the encoder's cache is filled before it (as our frozen pass runs before our
steps), so a step is the encoder head, the decoder loop, the loss, backward and AdamW.

Afterwards, on every row: NMI with each factor of k-means on the posterior means, and the per-token NLL
of the response under the posterior mean, as LangVAE's loss computes it (its decoder's free-running
distributions at each position, eval mode). The trivial baseline beside it is the NMI of k-means on the
frozen mean-pooled features that the encoder head reads (``baselines_nmi``, as ours report theirs);
``--baseline-only`` computes just that, in seconds, adds it to ``--result`` (an earlier run's file keeps
everything else) and stops before training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import StepClock, kmeans_nmi  # noqa: E402  (standard library only at import)

LATENT_SIZE = 16
MAX_LEN = 32


def token_ids(x):
    """The token ids of each row of a one-hot sparse batch, as ``SentenceEncoder.forward`` reads them."""
    return [x[i].coalesce().indices()[1] for i in range(x.shape[0])]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--data", "--model-dir", "--out", "--result"):
        parser.add_argument(name, type=Path, required=name != "--out")
    parser.add_argument("--plan", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--baseline-only", action="store_true", help="only the k-means baseline of the frozen features")
    args = parser.parse_args()
    plan_path = args.plan or args.out / "plan.json"

    import torch
    from langvae import LangVAE
    from langvae.data_conversion.tokenization import TokenizedDataSet, collate_sparse_fn
    from langvae.decoders import SentenceDecoder
    from langvae.encoders import SentenceEncoder
    from langvae.trainers.cyclical_schedule_kl import frange_cycle_zero_linear
    from pythae.models.vae import VAEConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    plan = json.loads(plan_path.read_text())
    model_path = str(args.model_dir)

    decoder = SentenceDecoder(model_path, LATENT_SIZE, MAX_LEN, device="cpu")
    encoder = SentenceEncoder(
        model_path,
        LATENT_SIZE,
        decoder.tokenizer,
        caching=True,
        automodel_preset={"cls": "AutoModel", "pooling_method": "mean", "normalize": False},
        device="cpu",
    )
    model = LangVAE(VAEConfig(latent_dim=LATENT_SIZE), encoder, decoder)
    dataset = TokenizedDataSet([row["response"] for row in rows], decoder.tokenizer, decoder.max_len)

    def batch(indices):
        return collate_sparse_fn([dataset[i] for i in indices])

    steps = [batch(indices) for indices in plan["steps"][: args.steps]]
    eval_rows = plan["eval_rows"]
    eval_batches = [batch(eval_rows[i : i + 16]) for i in range(0, len(eval_rows), 16)]
    labels = [rows[i]["label"] for i in eval_rows]
    with torch.no_grad():  # the encoder's cache of every row (a frozen pass up front), then the lazy layers' shapes
        model.eval()
        pooled = [model.encoder.recode(token_ids(inputs["data"])) for inputs in eval_batches]
        # the trivial baseline: k-means of the frozen features LangVAE's encoder head reads (no training)
        baselines = {
            f: {"encoder_kmeans": v} for f, v in kmeans_nmi(torch.cat(pooled).numpy(), labels, args.seed).items()
        }
        if args.baseline_only:  # merged into an earlier result file, if there is one
            earlier = json.loads(args.result.read_text()) if args.result.exists() else {}
            if earlier:
                earlier["baselines_from"] = "langvae_side.py --baseline-only on the same data and plan, after the run"
            args.result.write_text(json.dumps(earlier | {"baselines_nmi": baselines}) + "\n")
            return
        model(steps[0])
    beta = frange_cycle_zero_linear(args.steps, start=0.0, stop=1.0, n_cycle=1, ratio_increase=0.25, ratio_zero=0.25)
    model.target_kl = 2.0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    clock = StepClock(args.warmup)
    clock.start()
    losses = []
    for step, inputs in enumerate(steps):
        model.cur_beta = float(beta[step])
        optimizer.zero_grad(set_to_none=True)
        out = model(inputs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(out.loss))
        clock.step_done(int(inputs["attention_mask"].sum()))
    clock.finish()

    model.eval()
    means, total, count = [], 0.0, 0
    with torch.no_grad():
        for inputs in eval_batches:
            x, mask = inputs["data"], inputs["attention_mask"].float()
            mu = model.encoder(x).embedding
            recon = model.decoder(mu, max_len=x.shape[1])["reconstruction"].clamp_min(1e-30)
            targets = x.to_dense().argmax(dim=-1)
            nll = -torch.log(recon).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            total, count = total + float((nll * mask).sum()), count + int(mask.sum())
            means.append(mu)
    result = {
        **clock.summary(),
        "nmi": kmeans_nmi(torch.cat(means).numpy(), labels, seed=args.seed),
        "baselines_nmi": baselines,
        "nll": total / count,
        "eval_examples": len(eval_rows),
        "encoder": f"{model_path} (AutoModel, mean pooling, frozen)",
        "latent_size": LATENT_SIZE,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    args.result.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
