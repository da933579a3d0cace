"""``disentangle generate`` on checkpoints trained on the synthetic hidden-factor data (``conftest.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import NUM_FACTORS, hidden_factor_prompts, model_and_tokenizer
from disentanglement import cli, trainer
from disentanglement.config import build_config
from disentanglement.data import Example, collate, detect_style
from disentanglement.evaluation import label_recovery
from disentanglement.features import build_feature_cache
from disentanglement.generation import (
    SamplingOptions,
    encode_prompts,
    format_generations,
    generate,
    generation_inputs,
    parse_codes,
)
from disentanglement.models import build_cvae
from disentanglement.trainer import prepare_data

GREEDY = SamplingOptions(greedy=True, max_new_tokens=60)
NEW_PROMPTS = ["sun pen 201", "moon tree 250"]  # shaped like the training prompts, never seen


@pytest.fixture(scope="module")
def discrete(discrete_run):
    model, tok, config, _ = discrete_run.load()
    return model, tok, config


@pytest.fixture(scope="module")
def continuous(continuous_run):
    model, tok, config, _ = continuous_run.load()
    return model, tok, config


def test_forcing_each_code_gives_its_own_style(discrete):
    model, tok, config = discrete
    result = generate(model, tok, config, NEW_PROMPTS, sampling=GREEDY)
    assert result["mode"] == "codes" and result["slot"] == 0
    assert len(result["generations"]) == len(NEW_PROMPTS) * NUM_FACTORS
    for p in range(len(NEW_PROMPTS)):
        rows = [g for g in result["generations"] if g["prompt_index"] == p]
        assert [g["latent_description"]["codes"] for g in rows] == [[k] for k in range(NUM_FACTORS)]
        styles = [detect_style(g["text"], "clean", NUM_FACTORS) for g in rows]
        assert None not in styles, [g["text"] for g in rows]
        assert sorted(styles) == list(range(NUM_FACTORS)), [g["text"] for g in rows]

    # the style each code produces is the factor whose examples the encoder assigns to that code
    data = prepare_data(config, tok)
    cache = build_feature_cache(model, data.validation, tok.pad_token_id, progress=False)
    contingency = label_recovery(model, data.validation, cache, tok.pad_token_id)["contingency"]
    for row, counts in zip(contingency["rows"], contingency["counts"], strict=True):
        factor = int(contingency["columns"][max(range(len(counts)), key=counts.__getitem__)])
        text = next(g["text"] for g in result["generations"] if g["latent_description"]["codes"] == [row])
        assert detect_style(text, "clean", NUM_FACTORS) == factor


def test_diversity_across_codes(discrete):
    model, tok, config = discrete
    result = generate(model, tok, config, NEW_PROMPTS[:1], sampling=GREEDY)
    d = result["diversity"]
    assert 0 < d["distinct_1"] <= 1 and 0 < d["distinct_2"] <= 1
    assert d["per_prompt"][0]["responses"] == NUM_FACTORS
    assert d["distinct_2"] > 0.9  # four different phrases
    text = format_generations(result)
    assert "codes=0" in text and "distinct-1" in text and NEW_PROMPTS[0] in text


def test_forced_codes_combinations_and_samples(discrete):
    model, tok, config = discrete
    forced = generate(model, tok, config, NEW_PROMPTS, codes="2", sampling=GREEDY)
    assert [g["latent_description"]["codes"] for g in forced["generations"]] == [[2], [2]]
    styles = {detect_style(g["text"], "clean", NUM_FACTORS) for g in forced["generations"]}
    assert len(styles) == 1 and None not in styles
    every = generate(model, tok, config, NEW_PROMPTS[:1], all_combinations=True, max_combinations=3, sampling=GREEDY)
    assert [g["latent_description"]["codes"] for g in every["generations"]] == [[0], [1], [2]]
    sampled = generate(model, tok, config, NEW_PROMPTS[:1], codes=[1], num_samples=3, sampling=SamplingOptions(seed=5))
    assert [g["sample"] for g in sampled["generations"]] == [0, 1, 2]
    again = generate(model, tok, config, NEW_PROMPTS[:1], codes=[1], num_samples=3, sampling=SamplingOptions(seed=5))
    assert again == sampled  # deterministic given the seed
    prior = generate(model, tok, config, NEW_PROMPTS[:1], mode="prior", num_samples=5, sampling=GREEDY)
    assert len(prior["generations"]) == 5
    assert all(detect_style(g["text"], "clean", NUM_FACTORS) is not None for g in prior["generations"])
    posterior = generate(
        model, tok, config, NEW_PROMPTS[:1], mode="posterior", reference_response="No.", sampling=GREEDY
    )
    assert detect_style(posterior["generations"][0]["text"], "clean", NUM_FACTORS) == 1


def test_parse_codes():
    assert parse_codes(None, 2, 4) is None
    assert parse_codes("0,3", 2, 4) == [0, 3]
    assert parse_codes("-,1", 2, 4) == [None, 1]
    with pytest.raises(ValueError, match="one entry per slot"):
        parse_codes("0", 2, 4)
    with pytest.raises(ValueError, match="outside"):
        parse_codes("4", 1, 4)
    with pytest.raises(ValueError, match="integers"):
        parse_codes("a", 1, 4)


def test_left_padding_matches_unbatched_generation(discrete):
    model, tok, config = discrete
    ids = encode_prompts(NEW_PROMPTS, tok, config.data)
    assert len(ids[0]) < len(ids[1])
    vectors = model.codes_to_vector(torch.tensor([[0], [3]]))
    embeds, attention = generation_inputs(model, ids, vectors, tok.pad_token_id)
    P = model.num_latent_tokens
    assert embeds.shape[:2] == attention.shape == (2, len(ids[1]) + P)
    gap = len(ids[1]) - len(ids[0])
    assert attention[0, :gap].sum() == 0 and attention[0, gap:].all() and attention[1].all()
    # [z][x]: the latent embeddings come first, right after the padding
    torch.testing.assert_close(embeds[0, gap : gap + P], model.latent_embeddings(vectors)[0])
    batched = generate(model, tok, config, NEW_PROMPTS, sampling=GREEDY)
    for p, prompt in enumerate(NEW_PROMPTS):
        alone = generate(model, tok, config, [prompt], sampling=GREEDY)
        assert [g["text"] for g in alone["generations"]] == [
            g["text"] for g in batched["generations"] if g["prompt_index"] == p
        ]


def test_training_prompts_keep_their_format(discrete):
    model, tok, config = discrete
    data = prepare_data(config, tok)
    prompt = hidden_factor_prompts()[0]
    ids = encode_prompts([prompt], tok, config.data)[0]
    assert ids in [e.prompt_ids for e in data.train + data.validation]


def test_continuous_prior_posterior_and_interpolation(continuous):
    model, tok, config = continuous
    prior = generate(model, tok, config, NEW_PROMPTS, num_samples=3, sampling=GREEDY)
    assert prior["mode"] == "prior" and len(prior["generations"]) == 6
    z = [g["latent_description"]["z"] for g in prior["generations"]]
    assert all(len(v) == config.latent.latent_dim for v in z) and len({tuple(v) for v in z}) == 6
    assert 0 <= prior["diversity"]["distinct_1"] <= 1

    a, b = "No.", "Ha ha, that is a funny question!"
    post = generate(model, tok, config, NEW_PROMPTS[:1], mode="posterior", reference_response=a, sampling=GREEDY)
    post_b = generate(model, tok, config, NEW_PROMPTS[:1], mode="posterior", reference_response=b, sampling=GREEDY)
    line = generate(
        model,
        tok,
        config,
        NEW_PROMPTS[:1],
        mode="interpolate",
        reference_response=a,
        reference_response_b=b,
        steps=3,
        sampling=GREEDY,
    )
    rows = line["generations"]
    assert [g["latent_description"]["t"] for g in rows] == [0.0, 0.5, 1.0]
    za, zb = post["generations"][0]["latent_description"]["z"], post_b["generations"][0]["latent_description"]["z"]
    assert rows[0]["latent_description"]["z"] == za and rows[2]["latent_description"]["z"] == zb
    mid = [(x + y) / 2 for x, y in zip(za, zb, strict=True)]
    assert rows[1]["latent_description"]["z"] == pytest.approx(mid, abs=1e-4)
    assert rows[0]["text"] == post["generations"][0]["text"] and rows[2]["text"] == post_b["generations"][0]["text"]


def test_mode_errors(discrete, continuous):
    model, tok, config = discrete
    with pytest.raises(ValueError, match="continuous"):
        generate(model, tok, config, ["x"], mode="interpolate", reference_response="a", reference_response_b="b")
    with pytest.raises(ValueError, match="reference-response"):
        generate(model, tok, config, ["x"], mode="posterior")
    with pytest.raises(ValueError, match="slot"):
        generate(model, tok, config, ["x"], slot=3)
    model, tok, config = continuous
    with pytest.raises(ValueError, match="discrete"):
        generate(model, tok, config, ["x"], mode="codes")
    with pytest.raises(ValueError, match="reference-response-b"):
        generate(model, tok, config, ["x"], mode="interpolate", reference_response="a")


@pytest.fixture
def injected_loader(monkeypatch):
    original = trainer.load_trained
    monkeypatch.setattr(trainer, "load_trained", lambda checkpoint, _=None: original(checkpoint, model_and_tokenizer()))


def test_cli_generate_text_and_json(discrete_run, continuous_run, tmp_path, injected_loader, capsys):
    out = tmp_path / "gen.json"
    argv = ["generate", str(discrete_run.run_dir), "--prompt", NEW_PROMPTS[0], "--prompt", NEW_PROMPTS[1]]
    assert cli.main([*argv, "--greedy", "--max-new-tokens", "60", "--output", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "codes=3" in printed and "distinct-2" in printed
    result = json.loads(out.read_text())
    assert result["sampling"]["greedy"] is True and result["checkpoint"] == str(discrete_run.checkpoint)
    assert len(result["generations"]) == 2 * NUM_FACTORS and "distinct_1" in result["diversity"]

    argv = ["generate", str(continuous_run.checkpoint), "--prompt", "x 1", "--num-samples", "2", "--json"]
    assert cli.main([*argv, "--temperature", "0.5", "--top-p", "0.8", "--seed", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mode"] == "prior" and printed["sampling"]["temperature"] == 0.5

    assert cli.main(["generate", str(continuous_run.checkpoint), "--prompt", "x", "--mode", "codes"]) == 2
    assert "discrete" in capsys.readouterr().err


@pytest.mark.parametrize(("placement", "training"), [("prefix", "frozen"), ("between", "frozen"), ("between", "lora")])
def test_generation_layout_matches_teacher_forcing(placement, training):
    """The first generated token's logits, from left-padded ``inputs_embeds``, are the training layout's."""
    config = build_config(
        dict(
            chat_template=False,
            latent_placement=placement,
            decoder_training=training,
            latent_tokens=2,
            code_dim=8,
            encoder_hidden=16,
        )
    )
    decoder, tok = model_and_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, decoder).eval()
        if training == "lora":  # make the adapters do something
            for name, param in model.decoder.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.5)
    prompts = ["ab", "a longer prompt"]
    ids = encode_prompts(prompts, tok, config.data)
    vectors = model.codes_to_vector(torch.tensor([[1], [2]]))
    embeds, attention = generation_inputs(model, ids, vectors, tok.pad_token_id)
    P = model.num_latent_tokens
    latent = model.latent_embeddings(vectors)
    if placement == "between":  # [x][z]: the latent right before the response
        torch.testing.assert_close(embeds[:, -P:], latent)
    out = model.decoder.generate(
        inputs_embeds=embeds,
        attention_mask=attention,
        max_new_tokens=1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    first = out.logits[0]  # [2, V]
    for row, prompt_ids in enumerate(ids):
        example = Example(prompt_ids, [5], None, "test")
        logits, _, _, _ = model.decode_logits(collate([example], tok.pad_token_id), vectors[row : row + 1])
        position = len(prompt_ids) + P - 1  # predicts the first response token in both layouts
        torch.testing.assert_close(first[row], logits[0, position], rtol=1e-4, atol=1e-4)
    result = generate(model, tok, config, prompts, sampling=SamplingOptions(greedy=True, max_new_tokens=4))
    assert len(result["generations"]) == 2 * config.latent.codebook_size
    assert all(isinstance(g["text"], str) for g in result["generations"])
