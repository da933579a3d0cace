"""``disentangle encode``: per-example rows on the tiny trained checkpoints (``conftest.py``) that agree with
``eval``, ``posterior_latents`` and ``generate``; options refused before the model loads."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from conftest import model_and_tokenizer
from disentanglement import trainer
from disentanglement.commands import run_eval
from disentanglement.data import Example
from disentanglement.encode import (
    decode_from_latent,
    encode_examples,
    encode_pairs,
    raw_pairs,
    run_encode,
)
from disentanglement.evaluation import posterior_latents
from disentanglement.features import build_feature_cache
from disentanglement.generation import SamplingOptions, generate
from disentanglement.latent_file import COMMON_KEYS, CONTINUOUS_KEYS, DISCRETE_KEYS, read_latents, write_rows
from disentanglement.runs import load_examples

#: Small sample counts keep the continuous checks fast; eval gets the same ones.
OPTIONS = dict(iw_samples=3, prior_samples=4, exact_limit=64, batch_size=8, seed=5)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def data_lines(run):
    """``{source: record}`` of the run's JSONL data file, as ``data.load_jsonl`` names the lines."""
    lines = run.data_path.read_text().splitlines()
    return {f"{run.data_path}:{i}": json.loads(line) for i, line in enumerate(lines, start=1)}


@pytest.fixture(scope="module")
def discrete_encoded(discrete_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("encode") / "discrete.jsonl"
    path = run_encode(discrete_run.checkpoint, output=out, progress=False, model_and_tokenizer=model_and_tokenizer())
    report, _, _ = run_eval(
        discrete_run.checkpoint,
        output=out.with_name("eval.json"),
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    return read_rows(path), report


@pytest.fixture(scope="module")
def continuous_encoded(continuous_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("encode") / "continuous.jsonl"
    path = run_encode(
        continuous_run.checkpoint, output=out, progress=False, model_and_tokenizer=model_and_tokenizer(), **OPTIONS
    )
    report, _, _ = run_eval(
        continuous_run.checkpoint,
        output=out.with_name("eval.json"),
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
        **OPTIONS,
    )
    return path, read_rows(path), report


def check_against_eval(rows, report, run):
    """Count, order, raw texts and the per-example numbers that aggregate to the eval report's."""
    _, tokenizer, config, _ = run.load()
    examples, _ = load_examples(None, config, tokenizer)
    assert report["examples"] == len(rows) == len(examples)
    assert [r["source"] for r in rows] == [e.source for e in examples]
    assert [r["response_tokens"] for r in rows] == [len(e.response_ids) for e in examples]
    lines = data_lines(run)
    for row in rows:
        record = lines[row["source"]]
        assert (row["prompt"], row["response"], row["label"]) == (record["prompt"], record["response"], record["label"])
    tokens = np.array([r["response_tokens"] for r in rows], dtype=float)
    assert tokens.sum() == report["response_tokens"]
    assert np.mean([r["kl"] for r in rows]) == pytest.approx(report["kl"]["total"], rel=1e-9, abs=1e-12)
    gain = np.array([r["latent_gain_nats_per_token"] for r in rows])
    assert (gain * tokens).sum() / tokens.sum() == pytest.approx(
        report["latent_gain_nats_per_token"], rel=1e-9, abs=1e-12
    )
    assert np.mean([r["iw_nll"] for r in rows]) == pytest.approx(report["iw_nll"]["nats_per_example"], rel=1e-9)
    assert all(math.isfinite(r["kl"]) and r["kl"] >= -1e-9 for r in rows)


def model_cache_examples(run, data=None, max_examples=None):
    model, tokenizer, config, _ = run.load()
    model.eval()
    examples, _ = load_examples(data, config, tokenizer, max_examples)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 16, "cpu", False)
    return model, tokenizer, config, examples, cache


# --------------------------------------------------------------------------- discrete


def test_discrete_rows_match_eval(discrete_encoded, discrete_run):
    rows, report = discrete_encoded
    # the exact mixture decodes every code: the decoder's own likeliest code per slot comes with each row
    assert all(list(r) == [*COMMON_KEYS, *DISCRETE_KEYS, "decoder_codes"] for r in rows)
    check_against_eval(rows, report, discrete_run)
    same = np.mean([r["codes"] == r["decoder_codes"] for r in rows])
    assert same == pytest.approx(report["decoder_posterior"]["agreement"])
    assert report["latent_gain_nats_per_token"] > 0  # the tiny run uses its latent


def test_discrete_codes_are_the_posterior_argmax_and_posterior_latents(discrete_encoded, discrete_run):
    rows, _ = discrete_encoded
    model, _, _, examples, cache = model_cache_examples(discrete_run)
    latents = posterior_latents(model, examples, cache, model_and_tokenizer()[1].pad_token_id)
    codes = np.array([r["codes"] for r in rows])
    posterior = np.array([r["posterior"] for r in rows])
    prior = np.array([r["prior"] for r in rows])
    M, K = model.num_slots, model.codebook_size
    assert codes.shape == (len(rows), M) and posterior.shape == prior.shape == (len(rows), M, K)
    assert (codes == posterior.argmax(-1)).all()
    assert (codes == latents["codes"]).all()
    np.testing.assert_allclose(posterior, latents["probs"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(posterior.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(prior.sum(-1), 1.0, atol=1e-5)
    assert (np.array([r["prior_codes"] for r in rows]) == prior.argmax(-1)).all()
    # "nearest": KL(one-hot || p) = -log p(k* | x), summed over slots
    expected = -np.log(np.take_along_axis(prior, codes[..., None], -1)[..., 0]).sum(-1)
    np.testing.assert_allclose([r["kl"] for r in rows], expected, rtol=1e-5)


def test_object_labels_pass_through(discrete_run, tmp_path):
    data = tmp_path / "factors.jsonl"
    records = [json.loads(line) for line in discrete_run.data_path.read_text().splitlines()]
    for i, record in enumerate(records):
        record["label"] = {"style": record["label"], "half": "a" if i % 2 else "b"}
    records[3]["label"] = None  # an unlabelled line stays null
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run_encode(
        discrete_run.checkpoint,
        data=str(data),
        output=tmp_path / "out" / "factors.jsonl",
        max_examples=12,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    rows = read_rows(out)
    _, tokenizer, config, _ = discrete_run.load()
    examples, _ = load_examples(str(data), config, tokenizer, 12)
    assert len(rows) == 12 and [r["source"] for r in rows] == [e.source for e in examples]
    by_line = {f"{data}:{i}": r for i, r in enumerate(records, start=1)}
    for row in rows:
        assert row["label"] == by_line[row["source"]]["label"]
        assert row["prompt"] == by_line[row["source"]]["prompt"]
    assert any(isinstance(r["label"], dict) for r in rows)


# --------------------------------------------------------------------------- continuous


def test_continuous_rows_match_eval(continuous_encoded, continuous_run):
    _, rows, report = continuous_encoded
    assert all(list(r) == [*COMMON_KEYS, *CONTINUOUS_KEYS] for r in rows)
    check_against_eval(rows, report, continuous_run)


def test_continuous_mu_is_posterior_latents_mu(continuous_encoded, continuous_run):
    _, rows, _ = continuous_encoded
    model, tokenizer, _, examples, cache = model_cache_examples(continuous_run)
    latents = posterior_latents(model, examples, cache, tokenizer.pad_token_id)
    D = continuous_run.config.latent.latent_dim
    mu = np.array([r["mu"] for r in rows])
    assert mu.shape == (len(rows), D)
    np.testing.assert_allclose(mu, latents["mu"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["logvar"] for r in rows], latents["logvar"], rtol=1e-5, atol=1e-6)
    assert np.array([r["prior_mu"] for r in rows]).shape == np.array([r["prior_logvar"] for r in rows]).shape


def test_deterministic_across_calls(continuous_encoded, continuous_run, tmp_path):
    first, _, _ = continuous_encoded
    again = run_encode(
        continuous_run.checkpoint,
        output=tmp_path / "again.jsonl",
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
        **OPTIONS,
    )
    assert again.read_bytes() == first.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, renamed


def test_encode_examples_api_and_batch_size(continuous_run):
    model, tokenizer, _, examples, cache = model_cache_examples(continuous_run, max_examples=10)
    rows = encode_examples(model, examples, cache, tokenizer.pad_token_id, progress=False, batch_size=3, seed=1)
    assert len(rows) == 10 and [r["source"] for r in rows] == [e.source for e in examples]
    assert all(r["prompt"] is None and r["response"] is None for r in rows)  # no pairs given
    one_batch = encode_examples(model, examples, cache, tokenizer.pad_token_id, progress=False, batch_size=10, seed=1)
    # the posterior does not depend on the batching; the prior samples (and so the gain) may
    np.testing.assert_allclose([r["mu"] for r in rows], [r["mu"] for r in one_batch], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["kl"] for r in rows], [r["kl"] for r in one_batch], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="feature cache holds"):
        encode_examples(model, examples[:3], cache, tokenizer.pad_token_id, progress=False)


def test_raw_pairs_refuses_an_unknown_source(discrete_run):
    _, _, config, _ = discrete_run.load()
    with pytest.raises(ValueError, match="cannot find"):
        raw_pairs(str(discrete_run.data_path), config, [Example([1], [2], "0", "elsewhere.jsonl:1")])


# --------------------------------------------------------------------------- options refused before the model loads


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(trainer, "load_trained", refuse)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("directory", "is a directory"),
        ("under_file", "is a file, so nothing can be written under it"),
        ("suffix", "must end in .jsonl or .parquet"),
        ("max_examples", "--max-examples must be an integer >= 1"),
        ("batch_size", "--batch-size must be an integer >= 1"),
        ("missing_data", "missing.jsonl"),
    ],
)
def test_bad_options_are_refused_before_the_model_loads(discrete_run, tmp_path, no_model, kind, message):
    (tmp_path / "a_file").write_text("x")
    kwargs = dict(output=tmp_path / "latents.jsonl", progress=False)
    if kind == "directory":
        kwargs["output"] = tmp_path
    elif kind == "under_file":
        kwargs["output"] = tmp_path / "a_file" / "latents.jsonl"
    elif kind == "suffix":
        kwargs["output"] = tmp_path / "latents.csv"
    elif kind == "max_examples":
        kwargs["max_examples"] = 0
    elif kind == "batch_size":
        kwargs["batch_size"] = 0
    else:
        kwargs["data"] = str(tmp_path / "missing.jsonl")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run_encode(discrete_run.checkpoint, **kwargs)


def test_parquet_without_pyarrow_is_refused_before_the_model_loads(discrete_run, tmp_path, monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(ValueError, match="needs pyarrow"):
        run_encode(discrete_run.checkpoint, output=tmp_path / "latents.parquet", progress=False)


def test_parquet_round_trip(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"source": "f:1", "label": {"style": "0"}, "codes": [1], "posterior": [[0.25, 0.75]]},
        {"source": "f:2", "label": None, "codes": [0], "posterior": [[0.5, 0.5]]},
    ]
    path = write_rows(rows, tmp_path / "rows.parquet")
    assert pq.read_table(path).to_pylist() == rows


def test_run_encode_parquet_equals_jsonl(discrete_run, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    kwargs = dict(data=str(discrete_run.data_path), max_examples=6, progress=False)
    jsonl = run_encode(
        discrete_run.checkpoint, output=tmp_path / "l.jsonl", model_and_tokenizer=model_and_tokenizer(), **kwargs
    )
    parquet = run_encode(
        discrete_run.checkpoint, output=tmp_path / "l.parquet", model_and_tokenizer=model_and_tokenizer(), **kwargs
    )
    assert pq.read_table(parquet).to_pylist() == read_rows(jsonl)


# --------------------------------------------------------------------------- command line


def parser():
    from disentanglement.cli import build_parser

    return build_parser()


def test_cli_encode(discrete_run, tmp_path, injected_loader, capsys):
    out = tmp_path / "cli" / "latents.jsonl"
    argv = ["encode", str(discrete_run.run_dir), "--data", str(discrete_run.data_path), "--output", str(out)]
    args = parser().parse_args([*argv, "--no-progress", "--max-examples", "8", "--batch-size", "3", "--device", "cpu"])
    assert args.func(args) == 0
    assert f"wrote 8 rows to {out}" in capsys.readouterr().out
    rows = read_rows(out)
    assert len(rows) == 8 and all(set(DISCRETE_KEYS) <= set(r) for r in rows)


def test_cli_encode_refuses_bad_options(discrete_run, tmp_path, no_model):
    args = parser().parse_args(["encode", str(discrete_run.checkpoint), "--output", str(tmp_path), "--no-progress"])
    with pytest.raises(ValueError, match="is a directory"):
        args.func(args)
    with pytest.raises(SystemExit):  # --output is required
        parser().parse_args(["encode", str(discrete_run.checkpoint)])


# --------------------------------------------------------------------------- steering


def test_decode_from_latent_discrete_equals_generate(discrete_encoded, discrete_run):
    rows, _ = discrete_encoded
    model, tokenizer, config, _ = discrete_run.load()
    model.eval()
    sampling = SamplingOptions(temperature=0.9, max_new_tokens=12, seed=3)
    row = rows[0]
    text = decode_from_latent(model, tokenizer, config, row["prompt"], row, sampling)
    expected = generate(model, tokenizer, config, [row["prompt"]], mode="codes", codes=row["codes"], sampling=sampling)
    assert text == expected["generations"][0]["text"]
    assert decode_from_latent(model, tokenizer, config, row["prompt"], row["codes"], sampling) == text
    vector = model.codes_to_vector(torch.tensor([row["codes"]]))[0].tolist()  # the same latent as floats
    assert decode_from_latent(model, tokenizer, config, row["prompt"], vector, sampling) == text
    with pytest.raises(ValueError, match="entries"):
        decode_from_latent(model, tokenizer, config, row["prompt"], [0.0, 1.0, 2.0], sampling)
    with pytest.raises(ValueError, match="must lie in"):
        decode_from_latent(model, tokenizer, config, row["prompt"], [model.codebook_size] * model.num_slots)


def test_decode_from_latent_continuous(continuous_encoded, continuous_run):
    _, rows, _ = continuous_encoded
    model, tokenizer, config, _ = continuous_run.load()
    model.eval()
    sampling = SamplingOptions(greedy=True, max_new_tokens=10)
    row = rows[0]
    text = decode_from_latent(model, tokenizer, config, row["prompt"], row, sampling)
    assert isinstance(text, str)
    assert decode_from_latent(model, tokenizer, config, row["prompt"], row["mu"], sampling) == text
    with pytest.raises(ValueError, match="finite"):
        decode_from_latent(model, tokenizer, config, row["prompt"], [math.nan] * len(row["mu"]), sampling)


def test_encode_is_a_disentangle_subcommand():
    from disentanglement import cli

    parser = cli.build_parser()
    args = parser.parse_args(["encode", "RUN", "--output", "z.jsonl"])
    assert args.command == "encode" and args.output == "z.jsonl"


# --------------------------------------------------------------------------- the Python API and reading rows back


def test_encode_pairs_equals_the_encode_file(discrete_encoded, discrete_run):
    rows, _ = discrete_encoded
    model, tokenizer, config, _ = discrete_run.load()
    model.eval()
    chosen = rows[:6]
    as_tuples = encode_pairs(model, tokenizer, config, [(r["prompt"], r["response"], r["label"]) for r in chosen])
    assert [r["source"] for r in as_tuples] == [f"pair:{i}" for i in range(6)]
    for mine, theirs in zip(as_tuples, chosen, strict=True):
        assert list(mine) == [*COMMON_KEYS, *DISCRETE_KEYS, "decoder_codes"]
        assert mine["codes"] == theirs["codes"] and mine["label"] == theirs["label"]
        np.testing.assert_allclose(mine["posterior"], theirs["posterior"], rtol=1e-5, atol=1e-7)
        assert mine["kl"] == pytest.approx(theirs["kl"], rel=1e-5, abs=1e-7)
    as_mappings = encode_pairs(
        model,
        tokenizer,
        config,
        [{"prompt": r["prompt"], "response": r["response"], "source": r["source"]} for r in chosen],
    )
    assert [r["source"] for r in as_mappings] == [r["source"] for r in chosen]
    assert [r["codes"] for r in as_mappings] == [r["codes"] for r in chosen]
    # the latent read off a pair decodes as the code does
    sampling = SamplingOptions(greedy=True, max_new_tokens=8)
    assert decode_from_latent(model, tokenizer, config, "x 1", as_tuples[0], sampling) == decode_from_latent(
        model, tokenizer, config, "x 1", chosen[0]["codes"], sampling
    )
    with pytest.raises(ValueError, match="pair 0: expected"):
        encode_pairs(model, tokenizer, config, ["just a string"])
    with pytest.raises(ValueError, match="at least one pair"):
        encode_pairs(model, tokenizer, config, [])


def test_read_latents_round_trips_jsonl_and_parquet(discrete_encoded, tmp_path):
    rows, _ = discrete_encoded
    back = read_latents(write_rows(rows, tmp_path / "rows.jsonl"))
    assert back.rows == rows and back.path == str(tmp_path / "rows.jsonl") and len(back) == len(rows)
    pytest.importorskip("pyarrow")
    assert read_latents(write_rows(rows, tmp_path / "rows.parquet")).rows == rows
    mixed = [
        {"source": "f:1", "label": {"style": "a"}, "codes": [1]},
        {"source": "f:2", "label": "b", "codes": [0]},
        {"source": "f:3", "label": None, "codes": [0]},
    ]
    assert read_latents(write_rows(mixed, tmp_path / "mixed.parquet")).rows == mixed  # labels were JSON text
    plain = [{"source": "f:1", "label": '{"not": json', "codes": [1]}, {"source": "f:2", "label": "b", "codes": [0]}]
    assert read_latents(write_rows(plain, tmp_path / "plain.parquet")).rows == plain
