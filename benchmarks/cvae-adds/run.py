"""docs/what-the-cvae-adds.md's runs: train, then ``eval --generation``, for every (set, recipe, seed), several at
once (one thread each), each skipped when its report exists; then the tables (``table.py``).

    python benchmarks/cvae-adds/run.py [--out runs/cvae-adds] [--jobs 2] [--dailydialog FILE.jsonl] [--only NAME ...]
        [--recipes NAME ...] [--seeds N ...] [--dtype auto|bfloat16|float32] [--guidance G ...] [--refit]
        [--heldout-split]

Synthetic sets (``disentangle data synth``): 800 training rows of seed 0 and 200 "held-out" rows of seed 1 (drawn
from the same combinations: every one of them is a training pair; ``--heldout-split``: 200 rows whose prompts
never occur in training, ``data synth --heldout``), the
thesis base (``benchmarks/thesis/base.yaml``: frozen SmolLM2-135M, K = 4 codes in one slot, 120 steps of 8) in
bf16 (``--dtype auto``: float32 on a CPU without bf16 matmul instructions); ``chatterbot-style`` (the corpus with
a hidden style marker) is evaluated on its run's validation split.
DailyDialog (``--dailydialog``, a JSONL of ``disentangle data dailydialog``): trained on the pairs of dialogues
0-699, evaluated on 700-999, ``dailydialog.yaml`` (K = 8, 200 steps), on the first 600 evaluation pairs after
eval's seeded choice; its generations are read by the act classifier on the frozen features (no detector reads a
dialogue act from text). A run whose report exists is skipped: delete the report to score it again (DailyDialog
reports written before its evals passed ``--generation`` have no controllability).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISENTANGLE = [sys.executable, "-m", "disentanglement.cli"]
#: the default's objective: terms 1 + 3 at alpha 2
TERMS_1_3 = ["--reconstruction-weight", "1", "--token-weighted-weight", "1", "--token-weight-alpha", "2"]
#: that objective with the token_weighted view over the bases' frozen decoder: preset frozen, the default until
#: section 34 (the tables' "default" rows); most recipes below change it. The default since is centered-lora-240
DEFAULT = [*TERMS_1_3, "--encoder-view", "token_weighted"]
#: LoRA adapters on the decoder (the z-free reference: the same model with the adapters off)
LORA = ["--decoder-training", "lora", "--decoder-lr", "1e-3"]
#: the default with the centred straight-through and LORA (section 6's centered-lora); its variants add to it
CENTERED_LORA = [*DEFAULT, "--centered-straight-through", *LORA]
#: the whole decoder fine-tuned (float32 weights, the z-free reference a frozen copy)
FULL = ["--decoder-training", "full", "--decoder-lr", "5e-5"]
#: the default with the centred straight-through and FULL (section 12's centered-full)
CENTERED_FULL = [*DEFAULT, "--centered-straight-through", *FULL]
#: CENTERED_FULL with the latent between prompt and response, 240 steps (sections 14-16's centered-full-between*)
CENTERED_FULL_BETWEEN = [*CENTERED_FULL, "--max-steps", "240", "--latent-placement", "between"]
#: the code between prompt and response from a random codebook (sections 15-17's *-between-random)
BETWEEN_RANDOM = ["--latent-placement", "between", "--codebook-init", "random"]
#: section 20's recipe (configs/steer.yaml): CENTERED_FULL_BETWEEN from a random codebook, the decoder's likeliest code
#: teaching the encoder from step 180 (the hard target)
DPOST_HARD_LATE = [*CENTERED_FULL_BETWEEN, "--codebook-init", "random", "--decoder-posterior-weight", "1",
                   "--decoder-posterior-start", "180", "--decoder-posterior-target", "hard"]  # fmt: skip
#: that with the bag-of-words loss at the weight of term 1 (section 23), the base of section 24's variations
DPOST_HARD_LATE_BOW = [*DPOST_HARD_LATE, "--bow-weight", "1"]
#: that with word dropout 0.3 (section 24), the base of sections 25-27's variations
DPOST_HARD_LATE_BOW_WD = [*DPOST_HARD_LATE_BOW, "--word-dropout", "0.3"]


def teaching_last_60(steps: int, recipe: list[str] = DPOST_HARD_LATE_BOW_WD) -> list[str]:
    """A recipe (the word-dropout one unless told) trained ``steps`` steps, the decoder's likeliest code teaching over
    the last 60 as at 240."""
    return [*recipe, "--max-steps", str(steps), "--decoder-posterior-start", str(steps - 60)]


#: a trainable encoder (section 26): the attention pool over one transformer layer on the cached per-token states
TRAINABLE_ENCODER = ["--encoder-view", "token_weighted_attention", "--encoder-block", "transformer"]
#: raw reconstruction (term 1 alone, the mean_last view: preset raw)
RAW = ["--reconstruction-weight", "1", "--token-weighted-weight", "0", "--token-weight-alpha", "1",
       "--encoder-view", "mean_last"]  # fmt: skip
#: RAW with LORA: the likelihood to compare the LoRA recipes with
RAW_LORA = [*RAW, *LORA]
RECIPES = {
    "default": DEFAULT,
    "term3": ["--reconstruction-weight", "0", "--token-weighted-weight", "1", "--token-weight-alpha", "2",
              "--encoder-view", "token_weighted"],
    "seed": ["--reconstruction-weight", "1", "--token-weighted-weight", "1", "--token-weight-alpha", "1",
             "--encoder-view", "mean_last"],
    "attention": [*TERMS_1_3, "--encoder-view", "token_weighted_attention"],
    "block": [*TERMS_1_3, "--encoder-view", "token_weighted_attention", "--encoder-block", "transformer"],
    # the default with the encoder held at its start (k-means of the view): clustering, plus a decoder that learns
    # to generate each cluster
    "fixed-encoder": [*DEFAULT, "--encoder-lr", "1e-9"],
    # the default with the codebook started at the partition of k-means of the view itself
    "view-kmeans": [*DEFAULT, "--codebook-init", "view_kmeans"],
    # both: the codebook at the view's partition, the encoder held there (the decoder side learns to use the codes)
    "view-kmeans-fixed": [*DEFAULT, "--codebook-init", "view_kmeans", "--encoder-lr", "1e-9"],
    # the codes moved by the codebook loss only, not by the decoder's gradient (VQ-VAE's rule)
    "vq-codes": [*DEFAULT, "--no-codebook-decoder-gradient"],
    # the codebook at the encoder's rate (1e-3) in a group of its own, the latent projection at latent_lr (3e-2)
    "codebook-lr": [*DEFAULT, "--codebook-lr", "1e-3"],
    # that, from the partition of k-means of the view itself
    "codebook-lr-vk": [*DEFAULT, "--codebook-lr", "1e-3", "--codebook-init", "view_kmeans"],
    # the encoder and the codebook nearly held (1e-5, 1e-4): the latent projection learns to decode the start's codes
    "slow-encoder": [*DEFAULT, "--encoder-lr", "1e-5", "--codebook-lr", "1e-4"],
    # the decoder reads the codes from a table of its own; the codebook only assigns
    "code-table": [*DEFAULT, "--decoder-code-table"],
    # that, with the encoder and codebook held for the first 30 steps
    "code-table-hold": [*DEFAULT, "--decoder-code-table", "--encoder-hold-steps", "30"],
    # that, with the encoder and codebook nearly held throughout: the start's partition, decoded
    "code-table-slow": [*DEFAULT, "--decoder-code-table", "--encoder-lr", "1e-5", "--codebook-lr", "1e-4"],
    # the code table with the encoder at a tenth of its rate and the codebook at 1e-3: can the encoder move at all?
    "code-table-mid": [*DEFAULT, "--decoder-code-table", "--encoder-lr", "1e-4", "--codebook-lr", "1e-3"],
    # code-table-slow from the partition of k-means of the view itself: the view's clusters, decoded
    "code-table-slow-vk": [*DEFAULT, "--decoder-code-table", "--encoder-lr", "1e-5",
                           "--codebook-lr", "1e-4", "--codebook-init", "view_kmeans"],
    # code-table-slow trained longer (240 steps instead of 120)
    "code-table-slow-240": [*DEFAULT, "--decoder-code-table", "--encoder-lr", "1e-5",
                            "--codebook-lr", "1e-4", "--max-steps", "240"],
    # the straight-through gradient centred over the batch: the encoder may move examples apart, not all together
    "centered": [*DEFAULT, "--centered-straight-through"],
    # that, with the decoder reading its codes from a table of its own
    "centered-table": [*DEFAULT, "--centered-straight-through", "--decoder-code-table"],
    # centered trained longer (400 steps instead of 120)
    "centered-400": [*DEFAULT, "--centered-straight-through", "--max-steps", "400"],
    # code-table-slow with LoRA adapters on the decoder (reference: the adapters off): the decoder can learn what
    # the prompt predicts (the phrasing), so that the codes need carry only what it does not
    "code-table-slow-lora": [*DEFAULT, "--decoder-code-table", "--encoder-lr", "1e-5", "--codebook-lr", "1e-4", *LORA],
    # the default with the centred straight-through and LoRA adapters on the decoder
    "centered-lora": CENTERED_LORA,
    # raw reconstruction (term 1 alone, the mean_last view: preset raw), with LoRA adapters on the decoder: the
    # likelihood to compare the LoRA recipes with
    "raw-lora": RAW_LORA,
    # raw-lora trained 240 steps: the likelihood to compare centered-lora-240 with
    "raw-lora-240": [*RAW_LORA, "--max-steps", "240"],
    # the centred straight-through with the attention view: a pool that can learn to look at the style's tokens
    "centered-attention": [*TERMS_1_3, "--encoder-view", "token_weighted_attention", "--centered-straight-through"],
    # centered without the k-means refresh of the codebook (every 25 steps of the first half by default), which
    # re-clusters the encoder outputs where the view still clusters them (by topic on style-in-content)
    "centered-norefresh": [*DEFAULT, "--centered-straight-through", "--codebook-refresh-every", "0"],
    # centered-lora with term 3's weights from the training model's own current NLL (token_weight_source dynamic):
    # once the adapters have learnt the content, what is left surprising is what the latent has not explained;
    # trained 240 steps, twice centered-lora's 120, so that the adapters have time to learn the content
    # (centered-lora-240 is the same without the dynamic weights: its control)
    "centered-lora-dynamic": [*CENTERED_LORA, "--token-weight-source", "dynamic", "--max-steps", "240"],
    # centered-lora trained 240 steps: centered-lora-dynamic's control (the steps without the dynamic weights)
    "centered-lora-240": [*CENTERED_LORA, "--max-steps", "240"],
    # centered-lora from the partition of k-means of the view itself (two-factor's rare word at NMI 1.000)
    "centered-lora-vk": [*CENTERED_LORA, "--codebook-init", "view_kmeans"],
    # the default with the latent between prompt and response ([x][z][y]), whose prompt part the decoder can run
    # once for every code (issue 25); and centered-lora-240 so placed
    "between": [*DEFAULT, "--latent-placement", "between"],
    "centered-lora-240-between": [*CENTERED_LORA, "--max-steps", "240", "--latent-placement", "between"],
    # the default (centered-lora-240) with the bag-of-words loss at term 1's weight (section 35): whether a code made
    # to predict the response's words keeps what the adapters take from it on real text
    "centered-lora-240-bow": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "1"],
    # that with the bag-of-words loss at three and ten times term 1's weight (section 36): does a code made to
    # predict more of the response's words hold more of DailyDialog's act?
    "centered-lora-240-bow3": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "3"],
    "centered-lora-240-bow10": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "10"],
    # the bag-of-words loss over term 3's weights (section 36): z made to predict the words the prompt does not
    "centered-lora-240-bowtw": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "1",
                                "--bow-token-weighting", "token_weighted"],  # fmt: skip
    # the bag-of-words loss with the attention pool whose logits start at term 3's shares (item 2 (a), section 37):
    # can a code made to predict the response's words teach the pool to look at the tokens the act shows in?
    "centered-lora-240-bow-attn": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "1",
                                   "--encoder-view", "token_weighted_attention"],  # fmt: skip
    # the continuous latent (a Gaussian of 16 dimensions) with the default's objective, view, adapters and steps
    # (section 37): its encoder's mean moves by the reparameterised gradient, with no code to be assigned first
    "continuous-lora-240": [*DEFAULT, *LORA, "--latent", "continuous", "--max-steps", "240"],
    # the default (and with the bag-of-words loss) from a random codebook (section 37): chatterbot-style's codes
    # start at its view's topic clusters; does a start away from them let training find the marker?
    "centered-lora-240-random": [*CENTERED_LORA, "--max-steps", "240", "--codebook-init", "random"],
    "centered-lora-240-bow-random": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "1",
                                     "--codebook-init", "random"],  # fmt: skip
    # that between prompt and response (section 38): the code beside the first response token, where a prefix
    # marker is decided (section 15's whole-decoder recipe took chatterbot-style's marker best placed there)
    "centered-lora-240-between-random": [*CENTERED_LORA, "--max-steps", "240", *BETWEEN_RANDOM],
    # that with the bag-of-words loss (section 38): DailyDialog's act shows in a response's first words
    "centered-lora-240-bow-between-random": [*CENTERED_LORA, "--max-steps", "240", "--bow-weight", "1",
                                             *BETWEEN_RANDOM],  # fmt: skip
    # between prompt and response from a random codebook with eight codes (section 38): with four, ahoy's and
    # listen's prefixes shared one code
    "centered-lora-240-between-random-k8": [*CENTERED_LORA, "--max-steps", "240", *BETWEEN_RANDOM,
                                            "--codebook-size", "8"],  # fmt: skip
    # that with a 48-token response cap (section 41): at 32, 9 % of chatterbot-style's training responses lost their
    # end and any suffix, and the generations cut at 32 tokens were a third to two thirds of the misses
    "centered-lora-240-between-random-k8-r48": [*CENTERED_LORA, "--max-steps", "240", *BETWEEN_RANDOM,
                                                "--codebook-size", "8", "--max-response-tokens", "48"],  # fmt: skip
    # that trained twice as long (section 42): on its own generations the decoder under a `signoff` code gave the
    # end-of-turn token 0.4-0.55 after the marker (0.81 in the mean on real responses), and ran on
    "centered-lora-480-between-random-k8-r48": [*CENTERED_LORA, "--max-steps", "480", *BETWEEN_RANDOM,
                                                "--codebook-size", "8", "--max-response-tokens", "48"],  # fmt: skip
    # that with five codes (section 39): one spare code for style-in-content's four styles, where eight split each
    "centered-lora-240-between-random-k5": [*CENTERED_LORA, "--max-steps", "240", *BETWEEN_RANDOM,
                                            "--codebook-size", "5"],  # fmt: skip
    # the prefix placement with eight codes (section 38): the encoder's outputs hold chatterbot-style's marker
    # linearly at 0.887 (section 37) and its four codes 0.431; do more, purer codes each write one marker?
    "centered-lora-240-random-k8": [*CENTERED_LORA, "--max-steps", "240", "--codebook-init", "random",
                                    "--codebook-size", "8"],  # fmt: skip
    # item 2 (c): centered with the encoder's own LoRA adapters on all 30 layers of SmolLM2-135M: its features come
    # from an adapted pass of the LM every step (the pass is not cached), so the encoder can change what it pools
    "centered-encoder-lora": [*DEFAULT, "--centered-straight-through", "--encoder-lora-layers", "30"],
    # that on the best recipe for style-in-content (section 7's centered-lora-dynamic)
    "centered-lora-dynamic-encoder-lora": [*CENTERED_LORA, "--token-weight-source", "dynamic", "--max-steps", "240",
                                           "--encoder-lora-layers", "30"],
    # two slots of 4 codes instead of one: on style-in-content the answer among a topic's five is as unexplained by
    # the prompt as the style (log 5 against log 4 nats); with room for both, does one slot take the style?
    "centered-2slots": [*DEFAULT, "--centered-straight-through", "--num-slots", "2"],
    "centered-lora-dynamic-2slots": [*CENTERED_LORA, "--token-weight-source", "dynamic", "--max-steps", "240",
                                     "--num-slots", "2"],
    # the decoder fine-tuned whole (float32 weights, the z-free reference a frozen copy): a decoder that learns the
    # 40 answer sentences fast, so that the latent need carry only what the prompt does not say (section 7's lever)
    "centered-full": [*CENTERED_FULL, "--max-steps", "240"],
    # centered-full trained longer (400 steps instead of 240)
    "centered-full-400": [*CENTERED_FULL, "--max-steps", "400"],
    # centered-full with the latent between prompt and response ([x][z][y]): the code next to the first response
    # token, where chatterbot-style's marker is decided (section 14: under the prefix placement the decoder barely
    # reads the code there)
    "centered-full-between": CENTERED_FULL_BETWEEN,
    # that from a random codebook (no k-means start, so no refresh either): on chatterbot-style seed 1 the codes of
    # centered-full-between kept the corpus's category, which k-means of the view (the start) separates
    "centered-full-between-random": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random"],
    # that with the attention pool (item 2 (a)): its logits start at the surprisal shares and can learn to look at
    # the style's tokens, where the fixed shares put 72 % of the pool on style-in-content's content (section 7)
    "centered-full-between-random-attention": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random",
                                               "--encoder-view", "token_weighted_attention"],
    # centered-full-between-random trained longer (400 steps instead of 240): does the suffix that stays mixed
    # (section 16) part with more steps?
    "centered-full-between-random-400": [*CENTERED_FULL, "--max-steps", "400", *BETWEEN_RANDOM],
    # centered-full-between-random with a fifth of the commitment weight (0.05): the trained encoder's outputs mix
    # style-in-content's suffix styles though its view holds them (a linear probe: 1.000 on the view, 0.90 on the
    # outputs); does the commitment loss, which pulls each output to its code, hold them in their mixed codes?
    "centered-full-between-random-commit": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random",
                                            "--commitment-weight", "0.05"],
    # centered-full-between-random whose encoder, from step 120 (half way), also learns the decoder's own exact
    # posterior of the codes, r ∝ p(k | x) p(y | x, k) (section 18): the sequence likelihood counts a suffix decided at
    # one position in full, where the encoder's outputs kept style-in-content's suffix along a minor direction only
    "centered-full-between-random-dpost": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random",
                                           "--decoder-posterior-weight", "1", "--decoder-posterior-start", "120",
                                           "--decoder-posterior-target", "soft"],
    # that with the hard target: the cross-entropy of the decoder's likeliest code, reaching the encoder only (the
    # soft KL, which also moved the codebook the decoder reads, lowered seeds 0 and 1)
    "centered-full-between-random-dpost-hard": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random",
                                                "--decoder-posterior-weight", "1", "--decoder-posterior-start", "120",
                                                "--decoder-posterior-target", "hard"],
    # that at three times the weight: on style-in-content the hard term left 7-13 % of the held-out pairs (53 % on
    # seed 0) with an encoder code other than the decoder's likeliest, and the encoder's NMI 0.08 below the decoder's
    "centered-full-between-random-dpost-hard-w3": [*CENTERED_FULL_BETWEEN, "--codebook-init", "random",
                                                   "--decoder-posterior-weight", "3",
                                                   "--decoder-posterior-start", "120",
                                                   "--decoder-posterior-target", "hard"],
    # the hard term from step 180 instead of 120: on style-in-echo's seed 0 the term from 120 lowered the codes
    # (0.853 to 0.805), we read it as the encoder tied to a decoder that had not yet parted the styles
    "centered-full-between-random-dpost-hard-late": DPOST_HARD_LATE,
    # that with five codes for chatterbot-style's four styles: at K = 4 two codes shared a marker on every seed and no
    # code stood for the responses without one (section 21)
    "centered-full-between-random-dpost-hard-late-k5": [*DPOST_HARD_LATE, "--codebook-size", "5"],
    # that trained twice as long, the decoder's likeliest code teaching over the last 60 steps as at 240 (section 43:
    # on held-out style-in-content the `signoff` code ended after the content sentence on seeds 0 and 1, guided or not)
    "centered-full-between-random-dpost-hard-late-k5-480": [*teaching_last_60(480, DPOST_HARD_LATE), "--codebook-size",
                                                            "5"],  # fmt: skip
    # that with eight codes: a code's read-back is its purity, and on held-out style-in-content the five codes left
    # `plain` and `signoff` in shared codes (section 44's seed 1: two codes of 19 / 22 and 24 / 28); on
    # chatterbot-style eight codes read the marker back from 0.97 (section 42)
    "centered-full-between-random-dpost-hard-late-k8-480": [*teaching_last_60(480, DPOST_HARD_LATE), "--codebook-size",
                                                            "8"],  # fmt: skip
    # that with the bag-of-words loss (Zhao, Zhao and Eskenazi 2017's remedy for a dialogue CVAE's unused latent): the
    # code must predict the response's words, at the weight of term 1 (section 23: DailyDialog's latent gain, item 4)
    "centered-full-between-random-dpost-hard-late-bow": DPOST_HARD_LATE_BOW,
    # that with word dropout (Bowman et al. 2016's remedy): the decoder reads 30 % of the response tokens as zero
    # vectors in training, so that it must take more of the response from the code (section 23)
    "centered-full-between-random-dpost-hard-late-wd": [*DPOST_HARD_LATE, "--word-dropout", "0.3"],
    # the bag-of-words recipe with sixteen codes: a code of K can carry at most log K nats a response, and on
    # DailyDialog the eight codes gave 0.45 of log 8 = 2.08 (a latent gain of 0.030 nats a token, item 4 asks 0.05)
    "centered-full-between-random-dpost-hard-late-bow-k16": [*DPOST_HARD_LATE_BOW, "--codebook-size", "16"],
    # the bag-of-words recipe with four codes, one per dialogue act: eight codes split the act's values (homogeneity
    # 0.28, completeness 0.20), so the act's NMI with them sat at 0.234, short of item 2's +0.2 over the view (0.256)
    "centered-full-between-random-dpost-hard-late-bow-k4": [*DPOST_HARD_LATE_BOW, "--codebook-size", "4"],
    # the bag-of-words recipe without word dropout, twice as long: at 240 steps it held the act best (0.234), and twice
    # the steps raised the word-dropout recipe's gain and act (sections 26-27)
    "centered-full-between-random-dpost-hard-late-bow-480": teaching_last_60(480, DPOST_HARD_LATE_BOW),
    # two codes: a question mark alone holds DailyDialog's act at NMI 0.43 (600 held-out responses), more than any
    # latent (at most 0.244); at K = 4 one code was mostly questions and the others mixed the other acts (section 30)
    "centered-full-between-random-dpost-hard-late-bow-k2": [*DPOST_HARD_LATE_BOW, "--codebook-size", "2"],
    # the bag-of-words loss at three times the weight: does a code made to predict more of the words hold more of the
    # act (item 2's +0.2 over the view) and give the decoder more (item 4's gain)?
    "centered-full-between-random-dpost-hard-late-bow3": [*DPOST_HARD_LATE, "--bow-weight", "3"],
    # both remedies together: the loss makes the codes predict the words, the dropped inputs make the decoder need them
    "centered-full-between-random-dpost-hard-late-bow-wd": DPOST_HARD_LATE_BOW_WD,
    # that with half the response tokens dropped: at 0.3 the gain rose from 0.030 to 0.035 nats a token (section 24);
    # does the decoder, needing the code more, take more from it (item 4's 0.05)?
    "centered-full-between-random-dpost-hard-late-bow-wd5": [*DPOST_HARD_LATE_BOW, "--word-dropout", "0.5"],
    # the loss with word dropout and the decoder's likeliest code teaching the encoder at three times the weight: the
    # encoder gave the decoder its likeliest code on a third of the responses, and the gain was 0.6 of what that code
    # gives (section 25); does a stronger term close that gap?
    "centered-full-between-random-dpost-hard-late-bow-wd-dpost3": [*DPOST_HARD_LATE_BOW_WD,
                                                                   "--decoder-posterior-weight", "3"],
    # the decoder's likeliest code teaching the encoder from step 120 instead of 180: twice the steps for the encoder to
    # learn the decoder's choice (it agreed on 36-40 % of the training batches, section 25); those steps decode all K
    "centered-full-between-random-dpost-hard-late-bow-wd-early": [*DPOST_HARD_LATE_BOW_WD,
                                                                  "--decoder-posterior-start", "120"],
    # an encoder that can learn what its frozen view does not show: the attention pool (logits from the surprisal
    # shares) over one trainable transformer layer on the cached per-token states (item 2 (a) and (b)); can it give the
    # decoder its likeliest code more often than the fixed pooled view?
    "centered-full-between-random-dpost-hard-late-bow-wd-tblock": [*DPOST_HARD_LATE_BOW_WD, *TRAINABLE_ENCODER],
    # both: the trainable encoder taught from step 120
    "centered-full-between-random-dpost-hard-late-bow-wd-tblock-early": [*DPOST_HARD_LATE_BOW_WD, *TRAINABLE_ENCODER,
                                                                         "--decoder-posterior-start", "120"],
    # the loss with word dropout trained twice as long (480 steps of 8: 0.88 of an epoch of DailyDialog's 4,372 training
    # pairs, where 240 saw 0.44), the decoder's code teaching over the last 60 as before: the teaching term from an
    # earlier step concentrated the codes and lowered what the decoder takes from them (section 26); do more steps
    # of the decoder raise it?
    "centered-full-between-random-dpost-hard-late-bow-wd-480": teaching_last_60(480),
    # four times as long (960 steps of 8: 1.76 epochs), the teaching term still over the last 60: 480 steps raised the
    # latent gain on both seeds (section 26); does the rise go on past one epoch, or does the decoder overfit?
    "centered-full-between-random-dpost-hard-late-bow-wd-960": teaching_last_60(960),
    # 480 steps with the decoder's learning rate four times as high (2e-4 against 5e-5): the gain rose with steps by
    # less each doubling (+0.041 at 480, +0.046 at 960, sections 26-27); does a decoder that moves faster take more
    # from the codes within one epoch?
    "centered-full-between-random-dpost-hard-late-bow-wd-480-lr2e-4": teaching_last_60(
        480, [*DPOST_HARD_LATE_BOW_WD, "--decoder-lr", "2e-4"]
    ),
    # raw reconstruction (term 1 alone, the mean_last view) with the whole decoder, the code between prompt and
    # response from a random codebook: the likelihood to compare centered-full-between-random with, and whether
    # term 3 and its view matter once the decoder can learn the content
    "raw-full-between-random": [*RAW, *FULL, "--max-steps", "240", *BETWEEN_RANDOM],
    # centered-full with term 3's weights from the training model's own current NLL
    "centered-full-dynamic": [*CENTERED_FULL, "--token-weight-source", "dynamic", "--max-steps", "240"],
    # the attention view trained longer (400 steps instead of 120)
    "attention-400": [*TERMS_1_3, "--encoder-view", "token_weighted_attention", "--max-steps", "400"],
}  # fmt: skip
PLAN = [  # (set, recipe, seeds)
    ("two-factor", "default", (0, 1, 2)),
    ("style-in-echo", "default", (0, 1, 2)),
    ("chatterbot-style", "default", (0, 1, 2)),
    ("style-in-content", "default", (0,)),
    ("style-in-content", "attention", (0,)),
    ("style-in-content", "block", (0,)),
    ("dailydialog", "code-table-slow-vk", (0,)),
    ("dailydialog", "default", (0, 1, 2)),
    ("dailydialog", "seed", (0, 1, 2)),
    ("dailydialog", "block", (0,)),
    ("two-factor", "view-kmeans", (0, 1, 2)),
    ("style-in-echo", "view-kmeans", (0, 1, 2)),
    ("style-in-content", "attention-400", (0,)),
    ("two-factor", "fixed-encoder", (0, 1)),
    ("two-factor", "view-kmeans-fixed", (0,)),
    ("two-factor", "vq-codes", (0, 1, 2)),
    ("style-in-echo", "vq-codes", (0, 1, 2)),
    ("two-factor", "code-table-hold", (0, 1, 2)),
    ("two-factor", "code-table-slow", (0, 1, 2)),
    ("style-in-echo", "code-table-hold", (0, 1, 2)),
    ("style-in-echo", "code-table-slow", (0, 1, 2)),
    ("two-factor", "code-table-mid", (0, 1)),
    ("two-factor", "code-table-slow-240", (1,)),
    ("style-in-echo", "code-table-slow-vk", (0, 1, 2)),
    ("two-factor", "code-table-slow-vk", (0, 1, 2)),
    ("two-factor", "code-table", (0, 1, 2)),
    ("style-in-echo", "code-table", (0, 1, 2)),
    ("two-factor", "slow-encoder", (0, 1, 2)),
    ("style-in-echo", "slow-encoder", (0, 1, 2)),
    ("two-factor", "codebook-lr", (0, 1, 2)),
    ("style-in-echo", "codebook-lr", (0, 1, 2)),
    ("two-factor", "codebook-lr-vk", (0, 1, 2)),
    ("style-in-echo", "codebook-lr-vk", (0, 1, 2)),
    ("two-factor", "centered", (0, 1, 2)),
    ("style-in-echo", "centered", (0, 1, 2)),
    ("style-in-content", "centered", (0, 1, 2)),
    ("two-factor", "code-table-slow-lora", (0, 1, 2)),
    ("style-in-echo", "code-table-slow-lora", (0, 1, 2)),
    ("two-factor", "centered-table", (0, 1, 2)),
    ("style-in-echo", "centered-table", (0, 1, 2)),
    ("style-in-content", "centered-table", (0, 1, 2)),
    ("style-in-content", "centered-400", (0,)),
    ("dailydialog", "centered", (0,)),
    ("two-factor", "centered-lora", (0, 1, 2)),
    ("style-in-echo", "centered-lora", (0, 1, 2)),
    ("style-in-content", "centered-lora", (0, 1, 2)),
    ("chatterbot-style", "code-table-slow-lora", (0, 1, 2)),
    ("two-factor", "raw-lora", (0,)),
    ("style-in-echo", "raw-lora", (0,)),
    ("dailydialog", "centered-lora", (0, 1, 2)),
    ("style-in-content", "centered-attention", (0, 1, 2)),
    ("style-in-content", "centered-norefresh", (0, 1, 2)),
    ("style-in-content", "centered-lora-dynamic", (0, 1, 2)),
    ("chatterbot-style", "centered-lora", (0,)),
    ("style-in-content", "centered-lora-240", (0,)),
    ("two-factor", "centered-lora-vk", (1,)),
    ("style-in-echo", "centered-lora-vk", (1,)),
    ("two-factor", "centered-lora-dynamic", (0,)),
    ("style-in-echo", "centered-lora-dynamic", (0,)),
    ("dailydialog", "centered-lora-dynamic", (0, 1, 2)),
    ("two-factor", "centered-lora-240", (0, 1, 2)),
    ("style-in-echo", "centered-lora-240", (0, 1, 2)),
    ("two-factor", "raw-lora-240", (0, 1, 2)),
    ("style-in-echo", "raw-lora-240", (0, 1, 2)),
    ("two-factor", "between", (0, 1, 2)),
    ("style-in-echo", "between", (0, 1, 2)),
    ("two-factor", "centered-lora-240-between", (0,)),
    ("style-in-echo", "centered-lora-240-between", (0,)),
    ("style-in-content", "centered-encoder-lora", (0, 1, 2)),
    ("style-in-content", "centered-lora-dynamic-encoder-lora", (0,)),
    ("style-in-content", "centered-2slots", (0, 1, 2)),
    ("style-in-content", "centered-lora-dynamic-2slots", (0,)),
    ("style-in-content", "centered-full", (0, 1, 2)),
    ("style-in-content", "centered-full-dynamic", (0,)),
    ("style-in-content", "centered-full-400", (0, 1)),
    ("dailydialog", "centered-full", (0, 1, 2)),
    ("chatterbot-style", "centered-full", (0, 1)),
    ("chatterbot-style", "centered-full-400", (0,)),
    ("chatterbot-style", "centered-full-between", (0, 1, 2)),
    ("dailydialog", "centered-full-between", (0,)),
    ("chatterbot-style", "centered-full-between-random", (0, 1, 2, 3, 4)),
    # section 16: the same recipe on the synthetic sets, to see whether it can be one recipe
    ("style-in-content", "centered-full-between-random", (0, 1, 2)),
    ("two-factor", "centered-full-between-random", (0, 1)),
    ("style-in-echo", "centered-full-between-random", (0, 1, 2)),
    ("style-in-content", "centered-full-between-random-attention", (0,)),
    # section 17: longer training on the best seed, and raw reconstruction with the same decoder and placement
    ("style-in-content", "centered-full-between-random-400", (1,)),
    ("style-in-content", "raw-full-between-random", (1,)),
    ("two-factor", "raw-full-between-random", (0,)),
    ("style-in-echo", "raw-full-between-random", (0,)),
    ("style-in-content", "centered-full-between-random-commit", (1,)),
    # section 18: the decoder's own posterior of the codes teaching the encoder
    ("style-in-content", "centered-full-between-random-dpost", (0, 1)),
    ("style-in-content", "centered-full-between-random-dpost-hard", (0, 1, 2)),
    ("style-in-echo", "centered-full-between-random-dpost-hard", (0,)),
    # section 19: the hard term at three times the weight; two-factor's third seed of section 16's recipe (item 3)
    ("style-in-content", "centered-full-between-random-dpost-hard-w3", (0, 1, 2)),
    ("two-factor", "centered-full-between-random", (2,)),
    # section 20: the hard term from step 180 on every seed of the three synthetic sets (items 1-3)
    ("style-in-echo", "centered-full-between-random-dpost-hard-late", (0, 1, 2)),
    ("two-factor", "centered-full-between-random-dpost-hard-late", (0, 1, 2)),
    ("style-in-content", "centered-full-between-random-dpost-hard-late", (0, 1, 2)),
    # section 21: the same recipe on the real prose of chatterbot-style and on DailyDialog's act (items 1 and 4)
    ("chatterbot-style", "centered-full-between-random-dpost-hard-late", (0, 1, 2)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late", (0, 1, 2)),
    # section 23: five codes, so that the responses without a marker can have one of their own (item 1)
    ("chatterbot-style", "centered-full-between-random-dpost-hard-late-k5", (0, 1, 2)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow", (0, 1, 2)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-wd", (0,)),
    ("style-in-content", "centered-full-between-random-dpost-hard-late-wd", (0, 1, 2)),
    ("chatterbot-style", "centered-full-between-random-dpost-hard-late-wd", (0, 1, 2)),
    # section 24: the bag-of-words recipe's other DailyDialog seeds, and sixteen codes for more latent gain (item 4)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-k16", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow3", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd", (0, 1, 2)),
    # section 25: half the tokens dropped (item 4's latent gain)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd5", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-dpost3", (0,)),
    # section 26: an encoder taught longer, one that can learn beyond its view, and both (item 4's latent gain)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-early", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-tblock", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-tblock-early", (0,)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-480", (0, 1, 2)),
    # section 27: past one epoch (item 4's latent gain)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-960", (0, 1, 2)),
    # section 29: the encoder refit on style-in-content (item 2's 0.8, run with --refit), and five codes there: at
    # K = 4 seed 2's decoder named two codes by one style (section 20)
    ("style-in-content", "centered-full-between-random-dpost-hard-late-k5", (0, 1, 2)),
    # section 30: four codes for DailyDialog's four acts (item 2's +0.2 over the view on real dialogue)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-k4", (0, 1, 2)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-k2", (0, 1, 2)),
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-480", (0, 1)),  # stopped at step 80 for k2
    # section 31: the decoder's learning rate four times as high at 480 steps (item 4's latent gain)
    ("dailydialog", "centered-full-between-random-dpost-hard-late-bow-wd-480-lr2e-4", (0, 1, 2)),
    # section 34: centered-lora-240, the default since, on the real-text sets with three seeds (chatterbot-style on
    # its run's validation split, held out by pair since section 33), beside the frozen recipe there
    ("chatterbot-style", "centered-lora-240", (0, 1, 2)),
    ("dailydialog", "centered-lora-240", (0, 1, 2)),
    # section 35: the default with the bag-of-words loss on the real-text sets, and on the held-out synthetic sets
    ("dailydialog", "centered-lora-240-bow", (0, 1, 2)),
    ("chatterbot-style", "centered-lora-240-bow", (0, 1, 2)),
    ("two-factor", "centered-lora-240-bow", (0, 1, 2)),
    ("style-in-echo", "centered-lora-240-bow", (0, 1, 2)),
    # section 36: the bag-of-words loss's weight on DailyDialog (item 2's +0.2 over the view on real dialogue)
    ("dailydialog", "centered-lora-240-bow3", (0, 1, 2)),
    ("dailydialog", "centered-lora-240-bow10", (0,)),
    ("dailydialog", "centered-lora-240-bowtw", (0,)),
    ("two-factor", "centered-lora-240-bowtw", (0,)),
    ("style-in-echo", "centered-lora-240-bowtw", (0,)),
    ("chatterbot-style", "centered-lora-240-bowtw", (0,)),
    ("style-in-content", "centered-lora-240", (0, 1, 2)),
    ("style-in-content", "centered-lora-240-bow", (0,)),
    ("style-in-content", "centered-lora-240-bowtw", (0,)),
    # section 37: the bag-of-words loss with the attention pool, a random codebook (with and without the loss), the
    # continuous latent (items 1 and 2 on the real-text sets); the random codebook on the synthetic sets (item 3)
    ("dailydialog", "centered-lora-240-bow-attn", (0, 1, 2)),
    ("style-in-content", "centered-lora-240-bow-attn", (0,)),
    ("chatterbot-style", "centered-lora-240-bow-attn", (0,)),
    ("chatterbot-style", "centered-lora-240-bow-random", (0,)),
    ("chatterbot-style", "continuous-lora-240", (0,)),
    ("chatterbot-style", "centered-lora-240-random", (0, 1, 2)),
    ("style-in-content", "centered-lora-240-random", (0,)),
    ("dailydialog", "centered-lora-240-bow-random", (0, 1, 2)),
    ("two-factor", "centered-lora-240-random", (0, 1, 2)),
    ("style-in-echo", "centered-lora-240-random", (0, 1, 2)),
    # section 38: chatterbot-style's marker read back (item 1) with the code between prompt and response, or with
    # eight codes, from a random codebook
    ("chatterbot-style", "centered-lora-240-between-random", (0, 1, 2)),
    ("chatterbot-style", "centered-lora-240-random-k8", (0, 1, 2)),
    ("dailydialog", "centered-lora-240-bow-between-random", (0, 1, 2)),
    ("style-in-content", "centered-lora-240-between-random", (0, 1, 2)),
    ("chatterbot-style", "centered-lora-240-between-random-k8", (0, 1, 2)),
    ("two-factor", "centered-lora-240-between-random", (0, 1, 2)),  # item 3: could it be the default?
    ("style-in-echo", "centered-lora-240-between-random", (0, 1, 2)),
    # section 39: eight codes between prompt and response on held-out style-in-content (with --refit)
    ("style-in-content", "centered-lora-240-between-random-k8", (0, 1, 2)),
    ("style-in-content", "centered-lora-240-between-random-k5", (0, 1, 2)),
    # section 41: eight codes between prompt and response with a 48-token response cap (with --refit; seed 0 first)
    ("chatterbot-style", "centered-lora-240-between-random-k8-r48", (0, 1, 2)),
    # section 42: that trained twice as long
    ("chatterbot-style", "centered-lora-480-between-random-k8-r48", (0, 1, 2)),
    # section 43: section 40's five codes with `steer` on held-out style-in-content (with --heldout-split --dtype
    # float32 --refit), trained twice as long; seed 1, the one whose `signoff` code never wrote its marker, first
    ("style-in-content", "centered-full-between-random-dpost-hard-late-k5-480", (0, 1, 2)),
    # section 45: that with eight codes (--heldout-split --dtype float32; refit --objective both)
    ("style-in-content", "centered-full-between-random-dpost-hard-late-k8-480", (0, 1, 2)),
]


def sh(args: list[str], log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    with log.open("a") as out:
        out.write("$ " + " ".join(args) + "\n")
        out.flush()
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


#: the file that marks an --out folder whose synthetic held-out files are held out by prompt (--heldout-split)
HELDOUT_MARKER = "heldout-split"


def data_files(out: Path, name: str, dailydialog: Path | None, heldout_split: bool = False) -> tuple[Path, str]:
    """The training file and what to evaluate on, written the first time (``heldout_split``: a synthetic set's
    held-out rows from ``data synth --heldout``, whose prompts never occur in training; else seed 1's rows, which
    are drawn from the same combinations as the training rows: at 800 rows every one of them is a training pair)."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    log = out / "data.log"
    if heldout_split:
        (data / HELDOUT_MARKER).touch()
    if name == "dailydialog":
        train, rest = data / "dd-train.jsonl", data / "dd-eval.jsonl"
        if not train.exists():
            sh([*DISENTANGLE, "data", "split", str(dailydialog), "--dialogues", "0-699", "--output", str(train),
                "--rest", str(rest)], log)  # fmt: skip
        return train, str(rest)
    train, heldout = data / f"{name}-train.jsonl", data / f"{name}-heldout.jsonl"
    rows = [] if name == "chatterbot-style" else ["--rows", "800"]
    if heldout_split and name != "chatterbot-style":
        if not (train.exists() and heldout.exists()):
            sh([*DISENTANGLE, "data", "synth", name, "--output", str(train), *rows, "--seed", "0", "--heldout",
                str(heldout), "--heldout-rows", "200"], log)  # fmt: skip
        return train, str(heldout)
    if not train.exists():
        sh([*DISENTANGLE, "data", "synth", name, "--output", str(train), *rows, "--seed", "0"], log)
    if name == "chatterbot-style":
        return train, "validation"  # the run's validation split: no pair of it in training (data.py's split)
    if not heldout.exists():
        sh([*DISENTANGLE, "data", "synth", name, "--output", str(heldout), "--rows", "200", "--seed", "1"], log)
    return train, str(heldout)


def one_run(
    out: Path,
    name: str,
    recipe: str,
    seed: int,
    dailydialog: Path | None,
    dtype: str,
    guidance: list[float],
    refit: bool = False,
) -> list[Path]:
    """Train and evaluate one (set, recipe, seed), then evaluate it again at each ``guidance`` scale and, with
    ``refit``, its encoder refit to the decoder's codes (:func:`refit_run`); the reports."""
    report = plain_run(out, name, recipe, seed, dailydialog, dtype)
    run = out / "runs" / f"{name}-{recipe}" / f"seed-{seed}"
    reports = [report]
    if refit:
        reports.append(refit_run(out, name, recipe, seed, dailydialog))
    for scale in guidance:
        guided = report.with_name(f"{report.stem}-guided-{scale:g}.json")
        if not guided.exists():
            sh([*DISENTANGLE, "eval", str(run), "--data", data_files(out, name, dailydialog)[1], *generation_options(name),
                "--generation-guidance", f"{scale:g}", "--output", str(guided), "--no-progress"],
               run.parent / f"seed-{seed}.log")  # fmt: skip
        reports.append(guided)
    return reports


def refit_dir(out: Path, name: str, recipe: str, seed: int) -> Path:
    """Where ``--refit`` writes a trained run's refit run: beside it, ``seed-S-refit``."""
    return out / "runs" / f"{name}-{recipe}" / f"seed-{seed}-refit"


def refit_commands(out: Path, name: str, recipe: str, seed: int, evaluate: str) -> tuple[list[list[str]], Path]:
    """``refit-encoder`` of a trained run into ``RUN-refit`` (on the run's training split), then ``eval`` of the refit
    run as the run itself is evaluated: the commands and the report's path."""
    run = out / "runs" / f"{name}-{recipe}" / f"seed-{seed}"
    refit = refit_dir(out, name, recipe, seed)
    report = out / "evals" / f"{name}-{recipe}-seed-{seed}-refit.json"
    return [
        [*DISENTANGLE, "refit-encoder", str(run), "--output-dir", str(refit), "--no-progress"],
        [*DISENTANGLE, "eval", str(refit), "--data", evaluate, *generation_options(name), "--output", str(report),
         "--no-progress"],
    ], report  # fmt: skip


def refit_run(out: Path, name: str, recipe: str, seed: int, dailydialog: Path | None) -> Path:
    """The trained run's encoder fit to its decoder's own likeliest codes (``disentangle refit-encoder``), evaluated."""
    commands, report = refit_commands(out, name, recipe, seed, data_files(out, name, dailydialog)[1])
    if report.exists():
        return report
    refit = refit_dir(out, name, recipe, seed)
    log = refit.parent / f"seed-{seed}-refit.log"
    if not (refit / "encoder_refit.json").exists():
        shutil.rmtree(refit, ignore_errors=True)  # an interrupted refit starts again
        sh(commands[0], log)
    sh(commands[1], log)
    return report


def generation_options(name: str) -> list[str]:
    """eval's options for a run of set ``name``: at most 32 new tokens a generation, the cap the reports of
    sections 1-41 were made with (eval's default became the run's response cap; DailyDialog's config has 48)."""
    cap = ["--generation", "--generation-max-new-tokens", "32"]
    return ["--max-examples", "600", *cap] if name == "dailydialog" else cap


def plain_run(out: Path, name: str, recipe: str, seed: int, dailydialog: Path | None, dtype: str) -> Path:
    run = out / "runs" / f"{name}-{recipe}" / f"seed-{seed}"
    report = out / "evals" / f"{name}-{recipe}-seed-{seed}.json"
    if report.exists():
        return report
    train, evaluate = data_files(out, name, dailydialog)
    config = ROOT / "benchmarks" / ("cvae-adds/dailydialog.yaml" if name == "dailydialog" else "thesis/base.yaml")
    run.mkdir(parents=True, exist_ok=True)
    log = run.parent / f"seed-{seed}.log"
    sh([*DISENTANGLE, "train", "--config", str(config), *RECIPES[recipe], "--data", str(train), "--dtype",
        dtype, "--seed", str(seed), "--output-dir", str(run), "--resume", "auto", "--no-progress", "--no-verdict"],
       log)  # fmt: skip
    report.parent.mkdir(parents=True, exist_ok=True)
    sh([*DISENTANGLE, "eval", str(run), "--data", evaluate, *generation_options(name), "--output", str(report),
        "--no-progress"], log)  # fmt: skip
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cvae-adds")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dailydialog", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="sets to run (default: all of the plan)")
    parser.add_argument("--recipes", nargs="*", default=None, help="recipes to run (default: all of the plan's)")
    parser.add_argument("--seeds", nargs="*", type=int, default=None, help="seeds to run (default: the plan's)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the decoder's dtype (default auto: bf16 on a CPU with AMX-BF16 or AVX512-BF16, as the tables were "
        "measured, float32 elsewhere: on an AVX2-only CPU bf16 matmuls measured 80x slower than float32)",
    )
    parser.add_argument(
        "--guidance",
        nargs="*",
        type=float,
        default=[],
        help="also evaluate each run with eval --generation-guidance at these scales (reports NAME-guided-G.json)",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="also refit each run's encoder to its decoder's codes (refit-encoder) and evaluate that (NAME-refit.json)",
    )
    parser.add_argument(
        "--heldout-split",
        action="store_true",
        help="evaluate the synthetic sets on rows whose prompts never occur in training (data synth --heldout; "
        "200 rows) instead of seed 1's rows, which repeat training pairs; use an --out folder of its own",
    )
    args = parser.parse_args(argv)
    todo = [
        (name, recipe, seed)
        for name, recipe, seeds in PLAN
        for seed in seeds
        if (args.only is None or name in args.only)
        and (args.recipes is None or recipe in args.recipes)
        and (args.seeds is None or seed in args.seeds)
        and (name != "dailydialog" or args.dailydialog)
    ]
    marked = (args.out / "data" / HELDOUT_MARKER).exists()
    if marked != args.heldout_split and any((args.out / "data").glob("*-heldout.jsonl")):
        parser.error(f"{args.out}/data holds synthetic files made {'with' if marked else 'without'} --heldout-split")
    for name, _, _ in todo:  # data first, once, before the runs share it
        data_files(args.out, name, args.dailydialog, args.heldout_split)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            pool.submit(one_run, args.out, *t, args.dailydialog, args.dtype, args.guidance, args.refit): t for t in todo
        }
        reports = []
        for future, t in futures.items():
            try:
                reports += future.result()
                print("done", *t, flush=True)
            except subprocess.CalledProcessError as error:
                print("FAILED", *t, error, flush=True)
    subprocess.run([sys.executable, str(Path(__file__).parent / "table.py"), *map(str, reports)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
