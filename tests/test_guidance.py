"""Contrastive guidance (``guidance.py``): the guided scores by hand, the KV-cached loop against plain decoding
at scale 0 and against a full recompute of every step under every latent of the set, and the options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from disentanglement.data import Example, collate
from disentanglement.generation import SamplingOptions, encode_prompts, generate_texts
from disentanglement.guidance import Guidance, contrast_sets, guided_generate, guided_scores
from test_memory import memory_model

PLACEMENTS = [("llama", "frozen", "prefix"), ("gpt2", "lora", "between"), ("llama", "frozen", "memory")]


def scores_by_hand(own, set_logprobs, weights, scale, plausibility):
    """One row: the mixture's probabilities summed term by term in float64, the log-ratio, the plausible set
    (scale 0: the own log-probabilities, no cut)."""
    if scale == 0:
        return np.asarray(own, dtype=np.float64)
    own = np.exp(np.asarray(own, dtype=np.float64))
    probs = np.exp(np.asarray(set_logprobs, dtype=np.float64))
    mixture = sum(w * p for w, p in zip(weights, probs, strict=True))
    out = np.log(own) + scale * (np.log(own) - np.log(mixture))
    out[own < plausibility * own.max()] = -np.inf
    return out


@pytest.mark.parametrize(("scale", "plausibility"), [(0.0, 0.1), (1.5, 0.1), (4.0, 0.5), (2.0, 1.0)])
def test_guided_scores_by_hand(scale, plausibility):
    g = torch.Generator().manual_seed(0)
    V = 6
    set_logprobs = torch.log_softmax(torch.randn(2, 3, V, generator=g) * 2, dim=-1)
    # row 1's set has two latents: its third entry is padding (weight 0, any values)
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.75, 0.0]])
    own_index = [1, 0]
    own = set_logprobs[torch.arange(2), torch.tensor(own_index)]
    got = guided_scores(own, set_logprobs, weights.log(), Guidance(scale, plausibility))
    for r, size in enumerate((3, 2)):
        expected = scores_by_hand(own[r], set_logprobs[r, :size], weights[r, :size].tolist(), scale, plausibility)
        finite = np.isfinite(expected)
        assert np.array_equal(torch.isfinite(got[r]).numpy(), finite)
        assert np.allclose(got[r].numpy()[finite], expected[finite], atol=1e-5)
    if plausibility == 1.0:  # only the own latent's most likely token stays
        assert (torch.isfinite(got).sum(-1) == 1).all()


def test_a_latent_equal_to_its_mixture_is_not_moved():
    """When every latent of the set predicts the same distribution, the log-ratio is 0 at any scale."""
    logprobs = torch.log_softmax(torch.randn(1, 1, 5), dim=-1).expand(1, 3, 5)
    weights = torch.full((1, 3), 1 / 3).log()
    got = guided_scores(logprobs[:, 0], logprobs, weights, Guidance(8.0, 1e-9))
    assert torch.allclose(got, logprobs[:, 0], atol=1e-6)


def test_the_scores_favour_the_token_that_tells_the_latent_apart():
    """Two latents; the own one prefers token 0 slightly less than token 1, but token 1 is just as likely
    under the other latent and token 0 is not: guidance turns the choice to token 0."""
    own = torch.tensor([0.40, 0.45, 0.15]).log()
    other = torch.tensor([0.05, 0.45, 0.50]).log()
    set_logprobs = torch.stack([own, other]).unsqueeze(0)
    weights = torch.tensor([[0.5, 0.5]]).log()
    assert guided_scores(own[None], set_logprobs, weights, Guidance(0.0)).argmax().item() == 1
    assert guided_scores(own[None], set_logprobs, weights, Guidance(1.0)).argmax().item() == 0


def test_contrast_sets_group_rows_by_key():
    assert contrast_sets([(0, "slot 0"), (0, "slot 0"), (1, "slot 0"), (0, "slot 1")]) == [[0, 1], [0, 1], [2], [3]]


@pytest.mark.parametrize(("value", "field"), [(-1.0, "scale"), (math.inf, "scale"), (0.0, "plausibility")])
def test_guidance_options_are_checked(value, field):
    with pytest.raises(ValueError, match=field):
        Guidance(**{field: value})


def setup(tokenizer, arch, training, placement, uneven=False):
    """Two prompts, each under every code (with ``uneven``, the second under codes 0 and 1 only): the rows,
    their latents and their contrast keys (the prompt)."""
    model, config = memory_model(tokenizer, arch, training, latent_placement=placement)
    prompts = ["ab", "a longer prompt"]
    ids = encode_prompts(prompts, tokenizer, config.data)
    K = config.latent.codebook_size
    pairs = [(p, k) for p in range(len(prompts)) for k in range(K) if not (uneven and p == 1 and k >= 2)]
    vectors = model.codes_to_vector(torch.tensor([[k] for _, k in pairs])).detach()
    return model, [ids[p] for p, _ in pairs], vectors, [p for p, _ in pairs]


def sets_of(vectors, keys):
    sets = contrast_sets(keys)
    return sets, [vectors[members] for members in sets], [members.index(r) for r, members in enumerate(sets)]


@pytest.mark.parametrize(("arch", "training", "placement"), PLACEMENTS)
def test_scale_zero_is_plain_decoding(tokenizer, arch, training, placement):
    model, rows, vectors, keys = setup(tokenizer, arch, training, placement)
    greedy = SamplingOptions(greedy=True, max_new_tokens=10)
    plain = generate_texts(model, tokenizer, rows, vectors, greedy)
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    _, latent_sets, own = sets_of(vectors, keys)
    tokens = guided_generate(model, rows, latent_sets, own, greedy, Guidance(0.0), eos, pad)
    for text, row in zip(plain, tokens.tolist(), strict=True):
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        assert tokenizer.decode(row[:cut], skip_special_tokens=True) == text


@pytest.mark.parametrize(("arch", "training", "placement"), PLACEMENTS)
def test_every_guided_token_is_the_argmax_of_a_full_recompute(tokenizer, arch, training, placement):
    """Each token of the cached, batched loop is the argmax of the scores computed by hand from full
    decodes (the training layout) of prompt + the tokens before it under every latent of the set, with the
    set's weights from the log-probabilities of the tokens taken so far. Sets of two sizes in one batch, and
    an end-of-sequence token that ends some rows early (the others go on as they would)."""
    model, rows, vectors, keys = setup(tokenizer, arch, training, placement, uneven=True)
    greedy = SamplingOptions(greedy=True, max_new_tokens=8)
    guidance = Guidance(3.0, 0.05)
    sets, latent_sets, own = sets_of(vectors, keys)
    pad = tokenizer.pad_token_id
    free = guided_generate(model, rows, latent_sets, own, greedy, guidance, set(), pad)
    eos = {int(free[0, 2])}  # row 0 ends by its third token
    tokens = guided_generate(model, rows, latent_sets, own, greedy, guidance, eos, pad)
    ended = 0
    for r, prompt_ids in enumerate(rows):
        response = tokens[r].tolist()
        cut = next((i + 1 for i, t in enumerate(response) if t in eos), len(response))
        ended += cut < len(response) or response[-1] in eos
        assert all(t == pad for t in response[cut:])
        if cut == len(response) and response[-1] not in eos:
            assert response == free[r, : len(response)].tolist(), "a row that did not end is as without the eos"
        response = response[:cut]
        batch = collate([Example(prompt_ids, response, None, "test")], pad)
        per_latent = []
        for j in sets[r]:
            with torch.no_grad():
                logits, _, _, offsets = model.decode_logits(batch, vectors[j : j + 1])
            start = int(offsets[0]) + len(prompt_ids) - 1  # predicts the first response token
            per_latent.append(torch.log_softmax(logits[0, start : start + len(response)].double(), dim=-1))
        taken_so_far = np.zeros(len(sets[r]))
        for t, token in enumerate(response):
            weights = np.exp(taken_so_far - np.logaddexp.reduce(taken_so_far))
            step = [lp[t].numpy() for lp in per_latent]
            expected = scores_by_hand(step[sets[r].index(r)], step, weights, guidance.scale, guidance.plausibility)
            assert int(np.argmax(expected)) == token, (r, t)
            taken_so_far += np.array([s[token] for s in step])
    assert ended >= 1


def test_sampled_guided_generation_is_seeded_and_keeps_to_the_plausible_tokens(tokenizer):
    model, rows, vectors, keys = setup(tokenizer, "llama", "frozen", "prefix", uneven=True)
    _, latent_sets, own = sets_of(vectors, keys)
    sampled = SamplingOptions(temperature=1.0, top_p=1.0, max_new_tokens=6)
    guidance, pad = Guidance(2.0, 0.3), tokenizer.pad_token_id
    torch.manual_seed(0)
    first = guided_generate(model, rows, latent_sets, own, sampled, guidance, set(), pad)
    torch.manual_seed(0)
    assert torch.equal(first, guided_generate(model, rows, latent_sets, own, sampled, guidance, set(), pad))
    assert first.shape == (len(rows), 6)
    # every sampled token is one the row's own latent finds plausible (p >= 0.3 of its most likely token's)
    for r, prompt_ids in enumerate(rows):
        batch = collate([Example(prompt_ids, first[r].tolist(), None, "test")], pad)
        with torch.no_grad():
            logits, _, _, offsets = model.decode_logits(batch, latent_sets[r][own[r] : own[r] + 1])
        start = int(offsets[0]) + len(prompt_ids) - 1
        probs = torch.softmax(logits[0, start : start + 6].double(), dim=-1)
        chosen = probs.gather(1, first[r].view(-1, 1)).squeeze(1)
        assert (chosen >= 0.3 * probs.max(-1).values - 1e-9).all()


def test_guided_texts_need_two_latents_per_key(tokenizer):
    model, rows, vectors, keys = setup(tokenizer, "llama", "frozen", "prefix")
    greedy = SamplingOptions(greedy=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="every prompt here has one"):
        generate_texts(model, tokenizer, rows, vectors, greedy, guidance=Guidance(1.0), contrast_keys=range(len(rows)))
    with pytest.raises(ValueError, match="one contrast key per row"):
        generate_texts(model, tokenizer, rows, vectors, greedy, guidance=Guidance(1.0))


def test_guided_texts_do_not_depend_on_the_batch_size(tokenizer):
    """The texts do not depend on how many streams go through at a time (one row's at least)."""
    model, rows, vectors, keys = setup(tokenizer, "llama", "frozen", "prefix")
    greedy = SamplingOptions(greedy=True, max_new_tokens=6)
    kwargs = dict(guidance=Guidance(2.0), contrast_keys=keys)
    one_set = generate_texts(model, tokenizer, rows, vectors, greedy, batch_size=1, **kwargs)
    together = generate_texts(model, tokenizer, rows, vectors, greedy, batch_size=64, **kwargs)
    assert one_set == together
    assert one_set != generate_texts(model, tokenizer, rows, vectors, greedy), "guidance changed some text"


# --------------------------------------------------------------------------- in eval and generate


@pytest.fixture(scope="module")
def discrete(discrete_run):
    from test_controllability import setup as controllability_setup

    return controllability_setup(discrete_run)


def test_guidance_steers_a_weak_code_as_read_from_the_text(discrete):
    """The trained tiny model's codes, their latent embeddings shrunk to a fifth, so that greedy decoding writes the
    code's phrase in about 70 % of 32 generations (8 prompts x 4 codes): guided against the prompt's codes, 90 %
    (measured: 23 and 29 of 32, on one and two threads alike)."""
    from disentanglement.controllability import controllability
    from test_controllability import OPTIONS, clean_detector

    model = discrete[0]
    weight = model.latent_projection.weight.data.clone()
    options = dict(OPTIONS, num_prompts=8, max_new_tokens=64, detector=clean_detector)
    try:
        model.latent_projection.weight.data.mul_(0.2)
        plain = controllability(*discrete, **options)
        guided = controllability(*discrete, **options, guidance=Guidance(3.0))
    finally:
        model.latent_projection.weight.data.copy_(weight)
    accuracy = [r["factor_accuracy"]["factors"]["label"]["accuracy"] for r in (plain, guided)]
    assert accuracy[0] <= 0.8 and accuracy[1] >= accuracy[0] + 0.125, accuracy  # 4 generations of 32 or more
    assert plain["guidance"] is None and guided["guidance"] == {"scale": 3.0, "plausibility": 0.1}
    assert guided["decoding"] == "greedy, at most 64 new tokens, guided at 3 (plausibility 0.1)"
    # scale 0 is no guidance: the same report as without it
    assert controllability(*discrete, **OPTIONS, guidance=Guidance(0.0)) == controllability(*discrete, **OPTIONS)


def test_cli_eval_and_generate_take_guidance(discrete_run, tmp_path, injected_loader, capsys):
    from disentanglement import cli

    argv = ["eval", str(discrete_run.run_dir), "--output", str(tmp_path / "e.json"), "--no-progress", "--generation"]
    options = ["--generation-prompts", "2", "--device", "cpu", "--generation-guidance", "2.5"]
    assert cli.main([*argv, *options, "--generation-guidance-plausibility", "0.2"]) == 0
    # at most the run's data.max_response_tokens (48) new tokens unless told
    assert "(greedy, at most 48 new tokens, guided at 2.5 (plausibility 0.2))" in capsys.readouterr().out
    out = tmp_path / "g.json"
    generate = ["generate", str(discrete_run.run_dir), "--prompt", "sun pen 201", "--greedy", "--device", "cpu"]
    assert cli.main([*generate, "--guidance", "2", "--output", str(out), "--json", "--no-progress"]) == 0
    import json

    result = json.loads(out.read_text())
    assert result["guidance"] == {"scale": 2.0, "plausibility": 0.1} and len(result["generations"]) == 4
    assert cli.main([*generate, "--guidance", "-1"]) == 2
    assert "--guidance" in capsys.readouterr().err
    one_latent = ["--mode", "posterior", "--reference-response", "sun", "--guidance", "2"]
    assert cli.main([*generate, *one_latent]) == 2
    assert "mode 'posterior' gives one latent per prompt" in capsys.readouterr().err
