"""A/B of one training step, interleaved: case (c) of ``step_cost.py`` with and without a change.

    python benchmarks/ab_step.py --model embedded --threads 1 --repeats 10 --change attention-backward

``--change attention-backward``: A = transformers' own SDPA backward, B = ``attention_backward``'s (the
default since this change). ``--change head-in-one-block``: A = the LM head's window in checkpointed chunks
(recomputed in the backward), B = in one block when it is small (``cvae_base.WHOLE_WINDOW_LOGITS``).
``--change head-at-supervised``: A = the LM head over the whole window (from the first position predicting a
response token, prompt and padding included), B = only at the positions that predict a response token.
``--change length-groups``: A = the decoder over the whole batch at its longest row's width, B = the rows in
length groups (``data.length_groups``, ``cvae_base.DECODER_CALL_POSITIONS``). Each repetition runs A and B once on the same batch, the first of them
alternating, so that load from other work falls on both alike; it prints the median time of each, the
median of the per-repetition ratios A/B, and the useful-FLOP MFU of each (``step_cost.mfu_table``).

``--encoder-lora-layers N``: A = case (c) with the encoder's own LoRA adapters on the top ``N`` layers
(``LatentConfig.encoder_lora_layers``: the encoder's features from an adapted pass of the LM every step, which no
cache can hold), B = case (c), the encoder reading the cached frozen view; ``--change`` is then not used, and no MFU
is printed (A's extra pass is not in the useful-FLOP count of (c)).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import step_cost  # noqa: E402
import torch  # noqa: E402

from disentanglement import attention_backward  # noqa: E402


def without_attention_backward(step):
    def run(batch):
        original = attention_backward._wants_input_gradient
        attention_backward._wants_input_gradient = lambda *a, **k: False
        try:
            step(batch)
        finally:
            attention_backward._wants_input_gradient = original

    return run


def chunked_head(step):
    from disentanglement import cvae_base

    def run(batch):
        original = cvae_base.WHOLE_WINDOW_LOGITS
        cvae_base.WHOLE_WINDOW_LOGITS = 0  # every window in checkpointed chunks, as before
        try:
            step(batch)
        finally:
            cvae_base.WHOLE_WINDOW_LOGITS = original

    return run


def one_decoder_pass(step):
    from disentanglement import cvae_base

    def run(batch):
        original = cvae_base.DECODER_CALL_POSITIONS
        cvae_base.DECODER_CALL_POSITIONS = float("inf")  # never split: the whole batch at the longest row's width
        try:
            step(batch)
        finally:
            cvae_base.DECODER_CALL_POSITIONS = original

    return run


def head_over_the_window(step):
    import torch.nn.functional as F

    from disentanglement import cvae_base
    from disentanglement.losses import default_chunk_size, masked_token_nll_per_position

    def window_nll(self):  # before: the head at every position of the window, prompt and padding included
        B, W, _ = self.hidden.shape
        V = self.head.weight.shape[0]
        chunk = None if B * W * V <= cvae_base.WHOLE_WINDOW_LOGITS else default_chunk_size(B, V)
        ids, mask = self.input_ids[:, self.start :], self.target_mask[:, self.start :]
        return F.pad(masked_token_nll_per_position(self.hidden, ids, mask, chunk, head=self.head), (self.start, 0))

    def run(batch):
        original = cvae_base.Decoded.token_nll
        cvae_base.Decoded.token_nll = window_nll
        try:
            step(batch)
        finally:
            cvae_base.Decoded.token_nll = original

    return run


CHANGES = {
    "head-at-supervised": head_over_the_window,
    "attention-backward": without_attention_backward,
    "head-in-one-block": chunked_head,
    "length-groups": one_decoder_pass,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=step_cost.model_argument, default="tiny")
    parser.add_argument("--change", choices=sorted(CHANGES), default="attention-backward")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--encoder-lora-layers", type=int, default=0, help="A: (c) with the encoder's adapters")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = step_cost.DTYPES[args.dtype]
    setup = step_cost.build_setup(args, max(1, args.repeats), ("c",), dtype=dtype)
    if args.encoder_lora_layers:
        config = setup.config_c
        config = dataclasses.replace(
            config, latent=dataclasses.replace(config.latent, encoder_lora_layers=args.encoder_lora_layers)
        )
        model = step_cost.seeded_cvae(config, setup.decoder, setup.device)
        adapted = step_cost.with_autocast(step_cost.cvae_step(model, config, setup.cache), setup.device)
        steps = {"A": adapted, "B": setup.steps["c"]}
    else:
        steps = {"A": CHANGES[args.change](setup.steps["c"]), "B": setup.steps["c"]}
    times = step_cost.time_round_robin(
        steps, lambda name, rep: setup.batches[rep % len(setup.batches)], args.repeats, args.warmup, setup.device
    )
    print(
        f"model {args.model}, decoder {args.dtype}, batch {args.batch_size}, {torch.get_num_threads()} threads, "
        f"{args.repeats} repeats; load average {step_cost.load_text()}"
    )
    for name in steps:
        q1, q3 = step_cost.quartiles(times[name])
        print(f"  {name}: median {1000 * step_cost.median(times[name]):.1f} ms (q1-q3 {1000 * q1:.1f}-{1000 * q3:.1f})")
    ratio = step_cost.median(times["A"]) / step_cost.median(times["B"])
    print(f"  A/B: {ratio:.3f} (ratio of medians), {step_cost.paired_ratio(times['A'], times['B']):.3f} (paired)")
    if not args.encoder_lora_layers:
        step_cost.mfu_table(setup, times, flop_case="c")
    return 0


if __name__ == "__main__":
    sys.exit(main())
