"""The n-gram rule of decoding (``SamplingOptions.no_repeat_ngram``, ``generate --no-repeat-ngram``, ``eval
--generation-no-repeat-ngram``): the banned tokens by a second, plain implementation; every decoding loop
(transformers' ``generate``, the memory placement's loop, the guided loop) against the rule; the options."""

from __future__ import annotations

import pytest
import torch

from disentanglement.generation import (
    SamplingOptions,
    choose_tokens,
    generate_texts,
    memory_generate,
)
from disentanglement.guidance import Guidance, guided_generate
from test_guidance import PLACEMENTS, sets_of, setup
from test_memory import generation_setup, response_logits


def banned_by_hand(history: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in ``history``: every earlier window of n tokens whose
    first n - 1 equal the last n - 1 of the history bans its last token."""
    if n == 0 or len(history) < n:
        return set()
    tail = history[len(history) - n + 1 :]
    return {history[i + n - 1] for i in range(len(history) - n + 1) if history[i : i + n - 1] == tail}


def repeated_ngram(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


def test_banned_by_hand_on_small_histories():
    assert banned_by_hand([5, 6, 7, 5, 6], 3) == {7}
    assert banned_by_hand([5, 6, 7, 5, 6], 2) == {7}  # after 6 came 7
    assert banned_by_hand([5, 6, 5, 8, 5], 2) == {6, 8}
    assert banned_by_hand([5, 6, 7], 1) == {5, 6, 7}  # n = 1: no token twice
    assert banned_by_hand([5, 6], 3) == set()  # no complete n-gram yet


@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_choice_is_the_best_token_the_rule_allows(n):
    """Random histories with many repeats (a vocabulary of 5) and random scores: the greedy choice is the argmax
    over the tokens the plain implementation allows, rows of one batch each with its own history."""
    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        R, T, V = 4, int(torch.randint(0, 9, (1,), generator=g)), 5
        history = torch.randint(0, V, (R, T), generator=g)
        scores = torch.randn(R, V, generator=g)
        got = choose_tokens(scores, SamplingOptions(greedy=True, no_repeat_ngram=n), list(history.unbind(1)))
        for r in range(R):
            banned = banned_by_hand(history[r].tolist(), n)
            if len(banned) == V:
                continue  # every token banned: nothing is left to prefer
            allowed = [v for v in range(V) if v not in banned]
            assert got[r].item() == max(allowed, key=lambda v: scores[r, v].item())
        assert torch.equal(
            choose_tokens(scores, SamplingOptions(greedy=True), list(history.unbind(1))), scores.argmax(-1)
        )


def test_a_sampled_token_is_never_a_banned_one():
    history = torch.tensor([[1, 2, 3, 1, 2]])
    scores = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0]])  # token 3 all but certain, and banned
    torch.manual_seed(0)
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, no_repeat_ngram=3)
    draws = {choose_tokens(scores, sampling, list(history.unbind(1))).item() for _ in range(200)}
    assert 3 not in draws and draws <= {0, 1, 2, 4}


def decode_rows(tokens: torch.Tensor, eos: set[int]) -> list[list[int]]:
    rows = []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize(("arch", "training", "placement"), PLACEMENTS)
def test_guided_decoding_keeps_the_rule_and_equals_plain_decoding_at_scale_zero(tokenizer, arch, training, placement):
    """The tiny random decoders loop: without the rule some row repeats a bigram; with it none does, guided or
    not, and the guided loop at scale 0 gives transformers' ``generate`` text (``no_repeat_ngram_size``) on the
    prefix and between placements and the memory loop's on the memory placement."""
    model, rows, vectors, keys = setup(tokenizer, arch, training, placement)
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    _, latent_sets, own = sets_of(vectors, keys)
    free = guided_generate(model, rows, latent_sets, own, SamplingOptions(greedy=True, max_new_tokens=16),
                           Guidance(0.0), set(), pad)  # fmt: skip
    assert any(repeated_ngram(row, 2) for row in free.tolist()), "the check needs a decoder that loops"
    ruled = SamplingOptions(greedy=True, max_new_tokens=16, no_repeat_ngram=2)
    plain = generate_texts(model, tokenizer, rows, vectors, ruled)
    at_zero = guided_generate(model, rows, latent_sets, own, ruled, Guidance(0.0), eos, pad)
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in decode_rows(at_zero, eos)] == plain
    guided = guided_generate(model, rows, latent_sets, own, ruled, Guidance(3.0, 0.05), set(), pad)
    for row in at_zero.tolist() + guided.tolist():
        assert not repeated_ngram([t for t in row if t != pad], 2), row


@pytest.mark.parametrize(("arch", "training", "placement"), PLACEMENTS)
@pytest.mark.parametrize("n", [1, 2])
def test_the_plausibility_cut_keeps_a_token_the_rule_allows(tokenizer, arch, training, placement, n):
    """At plausibility 1 guidance keeps only the latent's likeliest token; where the rule bans it, the cut is taken
    among the tokens the rule allows (never a row with none: sampling would fail, greedy would write token 0)."""
    model, rows, vectors, keys = setup(tokenizer, arch, training, placement)
    _, latent_sets, own = sets_of(vectors, keys)
    pad = tokenizer.pad_token_id
    for sampling in (
        SamplingOptions(greedy=True, max_new_tokens=24, no_repeat_ngram=n),
        SamplingOptions(temperature=1.0, top_p=1.0, max_new_tokens=24, no_repeat_ngram=n),
    ):
        torch.manual_seed(0)
        tokens = guided_generate(model, rows, latent_sets, own, sampling, Guidance(3.0, 1.0), set(), pad)
        for row in tokens.tolist():
            assert not repeated_ngram(row, n), row


def test_memory_loop_token_is_the_argmax_the_rule_allows(tokenizer):
    """The memory placement's own loop: each greedy token is the argmax of a full recompute (the training
    layout) over prompt + the tokens before it, among the tokens the plain implementation allows."""
    model, _, ids, vectors, embeds, attention = generation_setup(tokenizer, "llama", "frozen")
    n, steps = 2, 12
    tokens = memory_generate(model, embeds, attention, vectors, SamplingOptions(greedy=True, max_new_tokens=steps,
                             no_repeat_ngram=n), set(), tokenizer.pad_token_id)  # fmt: skip
    free = memory_generate(model, embeds, attention, vectors, SamplingOptions(greedy=True, max_new_tokens=steps),
                           set(), tokenizer.pad_token_id)  # fmt: skip
    assert not torch.equal(tokens, free), "the rule changed nothing: the check needs a decoder that loops"
    for row, prompt_ids in enumerate(ids):
        response = tokens[row].tolist()
        logits = response_logits(model, prompt_ids, response, vectors[row : row + 1], tokenizer.pad_token_id)
        for t, token in enumerate(response):
            scores = logits[t].clone()
            scores[list(banned_by_hand(response[:t], n))] = -torch.inf
            assert token == scores.argmax().item(), (row, t)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_the_option_is_checked(value):
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        SamplingOptions(no_repeat_ngram=value)


def test_the_options_reach_the_sampling_and_its_description():
    on = SamplingOptions(greedy=True, no_repeat_ngram=3)
    assert on.generate_kwargs() == {"do_sample": False, "max_new_tokens": 64, "no_repeat_ngram_size": 3}
    assert on.describe() == ", no 3-gram twice"
    off = SamplingOptions(temperature=1.0, top_p=0.5)
    assert "no_repeat_ngram_size" not in off.generate_kwargs() and off.describe() == ""


def test_controllability_applies_the_rule_and_says_so(discrete_run):
    """``eval --generation``'s report: with the rule no generation repeats a token bigram (where without it they
    do), and its decoding says so."""
    from disentanglement.controllability import controllability
    from test_controllability import OPTIONS
    from test_controllability import setup as controllability_inputs

    inputs = controllability_inputs(discrete_run)
    tokenizer = inputs[1]
    ruled = controllability(*inputs, **OPTIONS, no_repeat_ngram=2)
    assert ruled["decoding"] == "greedy, at most 40 new tokens, no 2-gram twice"
    free = controllability(*inputs, **OPTIONS)  # its phrases repeat character bigrams: the rule changes them
    assert [e["text"] for e in ruled["examples"]] != [e["text"] for e in free["examples"]]
    for example in ruled["examples"]:
        assert not repeated_ngram(tokenizer(example["text"], add_special_tokens=False)["input_ids"], 2), example
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="--generation-no-repeat-ngram must be an integer >= 0"):
            controllability(*inputs, **OPTIONS, no_repeat_ngram=bad)


def test_cli_eval_and_generate_take_the_rule(discrete_run, tmp_path, injected_loader, capsys):
    import json

    from disentanglement import cli

    argv = ["eval", str(discrete_run.run_dir), "--output", str(tmp_path / "e.json"), "--no-progress", "--generation"]
    assert cli.main([*argv, "--generation-prompts", "2", "--device", "cpu", "--generation-no-repeat-ngram", "3"]) == 0
    assert "(greedy, at most 48 new tokens, no 3-gram twice)" in capsys.readouterr().out
    assert cli.main([*argv, "--generation-no-repeat-ngram", "-1"]) == 2
    out = tmp_path / "g.json"
    generate = ["generate", str(discrete_run.run_dir), "--prompt", "sun pen 201", "--greedy", "--device", "cpu"]
    assert cli.main([*generate, "--no-repeat-ngram", "2", "--output", str(out), "--json", "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["sampling"]["no_repeat_ngram"] == 2 and len(result["generations"]) == 4
    assert cli.main([*generate, "--no-repeat-ngram", "-2"]) == 2
