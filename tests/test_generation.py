"""``disentangle generate`` on checkpoints trained on the synthetic hidden-factor data (``conftest.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import NUM_FACTORS, hidden_factor_prompts, model_and_tokenizer
from disentanglement import cli
from disentanglement.config import build_config
from disentanglement.data import Example, collate
from disentanglement.encode import decode_from_latent, encode_pairs
from disentanglement.evaluation import label_recovery
from disentanglement.features import build_feature_cache
from disentanglement.generation import (
    SamplingOptions,
    encode_prompts,
    format_generations,
    generate,
    generation_inputs,
    parse_range,
    prompt_features,
    traversal_offsets,
)
from disentanglement.latent_file import attribute_vector, code_examples, parse_attribute, read_latents, write_rows
from disentanglement.latent_space import parse_codes
from disentanglement.models import build_cvae
from disentanglement.splits import prepare_data
from disentanglement.testing import detect_style

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
    assert d["looping_share"] == 0.0  # each a fixed phrase, said once
    text = format_generations(result)
    assert "codes=0" in text and "distinct-1" in text and NEW_PROMPTS[0] in text
    assert "responses that repeat themselves 0.000" in text


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
            preset="raw",
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


# --------------------------------------------------------------------------- latents read off data


def data_records(run, count=40):
    return [json.loads(line) for line in run.data_path.read_text().splitlines()[:count]]


@pytest.fixture(scope="module")
def discrete_latents(discrete, discrete_run, tmp_path_factory):
    model, tok, config = discrete
    rows = encode_pairs(model, tok, config, data_records(discrete_run))
    return rows, write_rows(rows, tmp_path_factory.mktemp("latents") / "discrete.jsonl")


@pytest.fixture(scope="module")
def continuous_latents(continuous, continuous_run, tmp_path_factory):
    model, tok, config = continuous
    rows = encode_pairs(model, tok, config, data_records(continuous_run))
    return rows, write_rows(rows, tmp_path_factory.mktemp("latents") / "continuous.jsonl")


def texts(result):
    return [g["text"] for g in result["generations"]]


def prior_means(model, tok, config, prompts):
    features = prompt_features(model, encode_prompts(prompts, tok, config.data), tok.pad_token_id)
    return model.prior(features)[0].detach()  # [B, D]


def test_a_rows_latent_decodes_as_forcing_its_codes(discrete, discrete_latents, tmp_path):
    model, tok, config = discrete
    rows, path = discrete_latents
    for i in (0, 5, 17):
        by_row = generate(model, tok, config, NEW_PROMPTS, latents=path, row=i, sampling=GREEDY)
        forced = generate(model, tok, config, NEW_PROMPTS, codes=rows[i]["codes"], sampling=GREEDY)
        assert by_row["mode"] == "codes" and by_row["row"] == i and texts(by_row) == texts(forced)
        for g in by_row["generations"]:
            assert g["latent_description"]["codes"] == rows[i]["codes"]
            assert g["latent_description"]["row_source"] == rows[i]["source"]
            # the row's code makes the row's own style
            assert detect_style(g["text"], "clean", NUM_FACTORS) == detect_style(rows[i]["response"], "clean")
    pytest.importorskip("pyarrow")
    parquet = write_rows(rows, tmp_path / "discrete.parquet")
    assert texts(generate(model, tok, config, NEW_PROMPTS, latents=parquet, row=5, sampling=GREEDY)) == texts(
        generate(model, tok, config, NEW_PROMPTS, latents=path, row=5, sampling=GREEDY)
    )


def test_a_rows_latent_decodes_its_mu(continuous, continuous_latents):
    model, tok, config = continuous
    rows, path = continuous_latents
    result = generate(model, tok, config, NEW_PROMPTS, latents=path, row=7, sampling=GREEDY)
    assert result["mode"] == "row" and len(result["generations"]) == len(NEW_PROMPTS)
    for prompt, g in zip(NEW_PROMPTS, result["generations"], strict=True):
        assert g["latent_description"]["z"] == pytest.approx(rows[7]["mu"], abs=1e-5)
        assert g["text"] == decode_from_latent(model, tok, config, prompt, rows[7]["mu"], GREEDY)


def test_attribute_vector_is_the_mean_difference_of_mu(continuous):
    model = continuous[0]
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(7, 4))
    labels = [
        {"style": "a", "topic": "x"},
        {"style": "a", "topic": "b"},
        {"style": "b", "topic": "x"},
        {"style": "b", "topic": "y"},
        None,
        {"style": "a", "topic": "y"},
        {"style": "c", "topic": "y"},
    ]
    rows = [{"mu": list(m), "label": label} for m, label in zip(mu, labels, strict=True)]
    vector, description = attribute_vector(model, rows, "style=a")
    np.testing.assert_allclose(vector.numpy(), mu[[0, 1, 5]].mean(0) - mu.mean(0), rtol=1e-6, atol=1e-6)
    assert description == {"label": "style=a", "factor": "style", "value": "a", "rows": 3, "total_rows": 7}
    y, description = attribute_vector(model, rows, "y")  # a plain value of one factor only
    np.testing.assert_allclose(y.numpy(), mu[[3, 5, 6]].mean(0) - mu.mean(0), rtol=1e-6, atol=1e-6)
    assert description["factor"] == "topic"
    with pytest.raises(ValueError, match="several factors.*style=b, topic=b"):
        attribute_vector(model, rows, "b")
    with pytest.raises(ValueError, match="available labels: style=a, style=b, style=c, topic=b, topic=x, topic=y"):
        attribute_vector(model, rows, "polite")
    with pytest.raises(ValueError, match="no row .* has 'style=z'"):
        attribute_vector(model, rows, "style=z")
    strings = [{"mu": list(m), "label": str(i % 2)} for i, m in enumerate(mu)]
    one, _ = attribute_vector(model, strings, "1")
    np.testing.assert_allclose(one.numpy(), mu[1::2].mean(0) - mu.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(attribute_vector(model, strings, "label=1")[0], one)
    with pytest.raises(ValueError, match="has no labels"):
        attribute_vector(model, [{"mu": list(m), "label": None} for m in mu], "1")
    with pytest.raises(ValueError, match="row 2: 'mu' has 3 entries; this checkpoint's latent has 4 dimensions"):
        attribute_vector(model, [*strings[:2], {"mu": [0.0, 0.0, 0.0], "label": "1"}], "1")


def test_attributes_add_their_scaled_vectors(continuous, continuous_latents):
    model, tok, config = continuous
    rows, path = continuous_latents
    result = generate(model, tok, config, NEW_PROMPTS, latents=path, attributes=["1:2", "label=0:-1"], sampling=GREEDY)
    assert result["mode"] == "attribute" and len(result["generations"]) == 2 * len(NEW_PROMPTS)
    mu = np.array([r["mu"] for r in rows])
    labels = np.array([r["label"] for r in rows])
    a1 = mu[labels == "1"].mean(0) - mu.mean(0)
    a0 = mu[labels == "0"].mean(0) - mu.mean(0)
    prior = prior_means(model, tok, config, NEW_PROMPTS).numpy()
    for p in range(len(NEW_PROMPTS)):
        base, steered = [g for g in result["generations"] if g["prompt_index"] == p]
        assert base["latent_description"]["base_only"] and not steered["latent_description"]["base_only"]
        np.testing.assert_allclose(base["latent_description"]["z"], prior[p], atol=1e-4)
        np.testing.assert_allclose(steered["latent_description"]["z"], prior[p] + 2 * a1 - a0, atol=1e-4)
        assert [a["scale"] for a in steered["latent_description"]["attributes"]] == [2.0, -1.0]
    # towards label 1 ("No.") on this tiny run: the steered responses take its style, the bases do not
    towards = generate(model, tok, config, NEW_PROMPTS, latents=path, attributes=["1:2"], sampling=GREEDY)
    styles = [detect_style(t, "clean", NUM_FACTORS) for t in texts(towards)]
    assert styles[1::2] == [1, 1] and 1 not in styles[0::2], texts(towards)
    around_row = generate(model, tok, config, NEW_PROMPTS[:1], latents=path, row=3, attributes=["1:0.5"])
    base, steered = around_row["generations"]
    np.testing.assert_allclose(base["latent_description"]["z"], rows[3]["mu"], atol=1e-4)
    np.testing.assert_allclose(steered["latent_description"]["z"], np.array(rows[3]["mu"]) + 0.5 * a1, atol=1e-4)


def test_parse_attribute():
    assert parse_attribute("polite:2") == ("polite", 2.0)
    assert parse_attribute("style=polite:-1.5") == ("style=polite", -1.5)
    assert parse_attribute("a:b:0.5") == ("a:b", 0.5)  # the last colon splits
    for bad, message in (
        ("polite", "LABEL:SCALE"),
        (":2", "LABEL:SCALE"),
        ("a:x", "not a number"),
        ("a:inf", "finite"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_attribute(bad)


def test_traversal_offsets_are_the_grid():
    assert traversal_offsets(-3, 3, 7) == [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]
    assert traversal_offsets(0, 1, 3) == [0.0, 0.5, 1.0]
    assert traversal_offsets(-1, 2, 2) == [-1.0, 2.0]
    assert parse_range("-3:3") == (-3.0, 3.0) and parse_range((0, 0.5)) == (0.0, 0.5)
    for bad, message in (("3", "LOW:HIGH"), ("a:1", "numbers"), ("3:-3", "LOW < HIGH"), ("1:nan", "LOW < HIGH")):
        with pytest.raises(ValueError, match=message):
            parse_range(bad)
    with pytest.raises(ValueError, match=">= 2"):
        traversal_offsets(-3, 3, 1)


def test_traversal_moves_one_dimension_around_the_base(continuous, continuous_latents):
    model, tok, config = continuous
    rows, path = continuous_latents
    result = generate(model, tok, config, NEW_PROMPTS, traverse=2, traverse_range="-3:3", steps=7, sampling=GREEDY)
    assert result["mode"] == "traverse" and result["traverse"] == {"dim": 2, "offsets": traversal_offsets(-3, 3, 7)}
    prior = prior_means(model, tok, config, NEW_PROMPTS).numpy()
    for p in range(len(NEW_PROMPTS)):
        mine = [g["latent_description"] for g in result["generations"] if g["prompt_index"] == p]
        assert [d["offset"] for d in mine] == [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]
        for d in mine:
            expected = prior[p].copy()
            expected[2] += d["offset"]
            np.testing.assert_allclose(d["z"], expected, atol=1e-4)
            assert d["value"] == pytest.approx(expected[2], abs=1e-4) and d["dim"] == 2
    kwargs = dict(latents=path, row=4, sampling=GREEDY)
    around = generate(model, tok, config, NEW_PROMPTS[:1], traverse=0, traverse_range=(-1, 1), steps=3, **kwargs)
    zs = [g["latent_description"]["z"] for g in around["generations"]]
    for z, offset in zip(zs, (-1, 0, 1), strict=True):
        np.testing.assert_allclose(z, np.array(rows[4]["mu"]) + offset * np.eye(len(z))[0], atol=1e-4)
    # the middle of the traversal is the row's own latent, so it decodes as the row does
    alone = generate(model, tok, config, NEW_PROMPTS[:1], **kwargs)
    assert around["generations"][1]["text"] == alone["generations"][0]["text"]


def test_code_examples_are_the_codes_typical_rows(discrete, discrete_latents):
    model, tok, config = discrete
    rows, path = discrete_latents
    result = generate(model, tok, config, NEW_PROMPTS[:1], latents=path, code_examples=3, sampling=GREEDY)
    entries = result["code_examples"]
    assert [(e["slot"], e["code"]) for e in entries] == [(0, k) for k in range(NUM_FACTORS)]
    for entry in entries:
        k = entry["code"]
        assigned = [i for i, r in enumerate(rows) if r["codes"][0] == k]
        assert entry["rows_with_code"] == len(assigned) and entry["share"] == len(assigned) / len(rows)
        best = sorted(assigned, key=lambda i: (-rows[i]["posterior"][0][k], i))[:3]
        assert [ex["row"] for ex in entry["examples"]] == best
        probabilities = [ex["probability"] for ex in entry["examples"]]
        assert probabilities == sorted(probabilities, reverse=True)
        # what the code means: its typical rows have the style that generating under it gives
        generated = next(g["text"] for g in result["generations"] if g["latent_description"]["codes"] == [k])
        style = detect_style(generated, "clean", NUM_FACTORS)
        assert {detect_style(ex["response"], "clean", NUM_FACTORS) for ex in entry["examples"]} == {style}
    printed = format_generations(result)
    assert "slot 0 code 2:" in printed and "most typical" in printed
    # by hand: the assigned rows with the highest probability of the code, ties in file order
    made_up = [
        {"codes": [1], "posterior": [[0.1, 0.6, 0.2, 0.1]], "response": "a"},
        {"codes": [0], "posterior": [[0.1, 0.8, 0.05, 0.05]], "response": "not assigned to 1"},
        {"codes": [1], "posterior": [[0.0, 0.9, 0.1, 0.0]], "response": "b"},
        {"codes": [1], "posterior": [[0.4, 0.6, 0.0, 0.0]], "response": "c"},
    ]
    picked = code_examples(model, made_up, 0, 1, 2)
    assert [ex["response"] for ex in picked["examples"]] == ["b", "a"] and picked["rows_with_code"] == 3


def test_latent_file_errors(discrete, continuous, discrete_latents, continuous_latents, tmp_path):
    d_rows, d_path = discrete_latents
    c_rows, c_path = continuous_latents
    model, tok, config = continuous
    cases = [
        (dict(latents=d_path, row=0), "has 'codes', not 'mu': it is an encode file of a discrete model"),
        (dict(latents=c_path, row=len(c_rows)), rf"--row {len(c_rows)} is outside \[0, {len(c_rows)}\)"),
        (dict(latents=[{"mu": [0.0] * 3}], row=0), "row 0: 'mu' has 3 entries; this checkpoint's latent has 4"),
        (dict(row=0), "--row needs --latents FILE"),  # was "need" (grammar fixed)
        (dict(latents=c_path), "is read by --row, --attribute or --code-examples"),
        (dict(latents=c_path, attributes=["1"]), "must be LABEL:SCALE"),
        (dict(latents=c_path, attributes=["1:x"]), "not a number"),
        (dict(latents=c_path, attributes=["9:1"]), "available labels: 0, 1, 2, 3"),
        (dict(traverse=4), r"--traverse 4 is outside \[0, 4\)"),
        (dict(traverse=0, steps=1), ">= 2"),
        (dict(latents=c_path, code_examples=2), "needs a discrete model"),
        (dict(mode="prior", latents=c_path, row=0), "--row is used by modes"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(model, tok, config, ["x"], **kwargs)
    model, tok, config = discrete
    cases = [
        (dict(latents=c_path, row=0), "has 'mu', not 'codes': it is an encode file of a continuous model"),
        (dict(latents=[{"codes": [0, 1]}], row=0), r"'codes' has 2 entries; this checkpoint has 1 slot\(s\)"),
        (dict(latents=[{"codes": [7]}], row=0), r"code 7 is not an integer in \[0, 4\)"),
        (dict(latents=d_path, row=0, codes="1"), "both fix the codes"),
        (dict(latents=d_path, attributes=["1:1"]), "--attribute needs a continuous model"),
        (dict(traverse=0), "--traverse needs a continuous model"),
        (dict(code_examples=1), "--code-examples needs --latents FILE"),  # was "need" (grammar fixed)
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(model, tok, config, ["x"], **kwargs)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_latents(tmp_path / "missing.jsonl")
    (tmp_path / "z.csv").write_text("x")
    with pytest.raises(ValueError, match=r"must end in \.jsonl or \.parquet"):
        read_latents(tmp_path / "z.csv")
    (tmp_path / "bad.jsonl").write_text('{"mu": [0]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        read_latents(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        read_latents(tmp_path / "empty.jsonl")


def test_cli_generate_with_latents(
    discrete_run, continuous_run, discrete_latents, continuous_latents, injected_loader, capsys
):
    _, c_path = continuous_latents
    argv = ["generate", str(continuous_run.run_dir), "--prompt", NEW_PROMPTS[0], "--latents", str(c_path)]
    argv += ["--row", "2", "--traverse", "1", "--range", "-1:1", "--steps", "3", "--greedy", "--json"]
    assert cli.main([*argv, "--max-new-tokens", "8", "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mode"] == "traverse" and printed["traverse"]["offsets"] == [-1.0, 0.0, 1.0]
    assert [g["latent_description"]["row"] for g in printed["generations"]] == [2, 2, 2]
    _, d_path = discrete_latents
    argv = ["generate", str(discrete_run.run_dir), "--prompt", NEW_PROMPTS[0], "--latents", str(d_path)]
    assert cli.main([*argv, "--code-examples", "2", "--greedy", "--max-new-tokens", "8"]) == 0
    assert "most typical" in capsys.readouterr().out
    assert cli.main([*argv[:-1], "missing.jsonl", "--row", "0"]) == 2
    assert "no such file" in capsys.readouterr().err
