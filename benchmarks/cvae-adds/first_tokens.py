"""Does the code change what the decoder writes first? Each code's distribution of the first response token.

    python benchmarks/cvae-adds/first_tokens.py RUN --data HELDOUT.jsonl|validation [--prompts 16] [--top 4]

For ``--prompts`` distinct prompts of ``--data`` (eval's seeded choice, :func:`controllability.choose_prompts`),
the decoder's distribution of the first response token under each code of slot 0 (the other slots at the
prompt's prior mode, as ``eval --generation`` sweeps them), laid out as generation lays it out. Printed: per
code, the mean over the prompts of that distribution's most likely tokens, and of the real responses assigned
to the code (their posterior code) the share that begins with each of those tokens; then the mean over prompts
of the total variation distance between two codes' first-token distributions (0: the code changes nothing
there; 1: disjoint), for every pair. A code that holds a factor decided at the first token (a style's prefix)
but whose distribution matches the others' is a code the decoder does not read there (section 13's
``chatterbot-style``), and no decoding of its own can write that factor.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.controllability import choose_prompts  # noqa: E402
from disentanglement.encode import raw_pairs  # noqa: E402
from disentanglement.evaluation import posterior_latents  # noqa: E402
from disentanglement.features import build_feature_cache  # noqa: E402
from disentanglement.generation import encode_prompts, generation_inputs, prompt_features  # noqa: E402
from disentanglement.memory import positions_from_mask  # noqa: E402
from disentanglement.reference import eval_mode  # noqa: E402
from disentanglement.runs import load_checkpoint, load_examples  # noqa: E402


@torch.no_grad()
def first_token_distributions(model, prompt_ids: list[list[int]], codes: torch.Tensor, pad: int) -> torch.Tensor:
    """``[prompts, K, V]``: the first response token's probabilities under each code of slot 0, for ``codes``
    ``[prompts, M]`` the prompts' prior-mode codes (slot 0's replaced by each code in turn); the memory placement
    through its own cache, the sequence placements as ``generate`` lays them out (left-padded)."""
    K = model.codebook_size
    rows, vectors = [], []
    for p, ids in enumerate(prompt_ids):
        for k in range(K):
            chosen = codes[p].clone()
            chosen[0] = k
            rows.append(ids)
            vectors.append(model.codes_to_vector(chosen.unsqueeze(0))[0])
    vectors = torch.stack(vectors)
    embeds, mask = generation_inputs(model, rows, vectors, pad)
    positions = positions_from_mask(mask)
    if model.latent_memory is not None:  # the memory's cache, its mask and the sequence's own positions
        extra = model.memory_inputs(model.latent_embeddings(vectors), mask, positions, embeds.dtype)
    else:
        extra = {"attention_mask": mask, "position_ids": positions}
    with eval_mode(model):
        logits = model.decoder(inputs_embeds=embeds, logits_to_keep=1, **extra).logits[:, -1].float()
    return torch.softmax(logits, dim=-1).view(len(prompt_ids), K, -1)


def total_variation(distributions: torch.Tensor) -> torch.Tensor:
    """``[K, K]``: the mean over prompts of ``0.5 * sum_v |p_i(v) - p_j(v)|`` for ``[prompts, K, V]``."""
    difference = distributions.unsqueeze(2) - distributions.unsqueeze(1)  # [prompts, K, K, V]
    return 0.5 * difference.abs().sum(-1).mean(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--top", type=int, default=4)
    args = parser.parse_args(argv)
    model, tokenizer, config, _, _, _ = load_checkpoint(args.run, device="cpu")
    model.eval()
    pad = tokenizer.pad_token_id
    examples, _ = load_examples(None if args.data == "validation" else args.data, config, tokenizer)
    pairs = raw_pairs(None if args.data == "validation" else args.data, config, examples)
    prompts = choose_prompts([p.prompt for p in pairs], args.prompts, 0)
    prompt_ids = encode_prompts(prompts, tokenizer, config.data)
    prior_codes = model.prior_log_probs(prompt_features(model, prompt_ids, pad)).argmax(-1)  # [prompts, M]
    distributions = first_token_distributions(model, prompt_ids, prior_codes, pad)
    cache = build_feature_cache(model, examples, pad, 16, "cpu", False)
    assigned = posterior_latents(model, examples, cache, pad)["codes"][:, 0]
    firsts = [tokenizer.convert_ids_to_tokens(e.response_ids[0]) if e.response_ids else "" for e in examples]
    mean = distributions.mean(0)  # [K, V]
    print(f"{args.run}: first response token over {len(prompts)} prompts of {args.data}, slot 0's codes")
    print("| code | real responses | most likely first tokens (mean probability; share of the code's real responses) |")
    print("| --- | --- | --- |")
    for k in range(model.codebook_size):
        mine = Counter(f for f, a in zip(firsts, assigned.tolist(), strict=True) if a == k)
        n = sum(mine.values())
        top = mean[k].topk(args.top)
        names = tokenizer.convert_ids_to_tokens(top.indices.tolist())
        cells = [f"{t!r} {float(p):.2f} ({mine[t] / max(n, 1):.2f})" for t, p in zip(names, top.values, strict=True)]
        print(f"| {k} | {n} | " + "; ".join(cells) + " |")
    tv = total_variation(distributions)
    pairs_tv = [f"{i}-{j} {float(tv[i, j]):.3f}" for i in range(len(tv)) for j in range(i + 1, len(tv))]
    print("total variation between two codes' first-token distributions (mean over prompts): " + ", ".join(pairs_tv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
