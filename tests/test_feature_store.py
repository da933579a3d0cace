"""The shared frozen-pass store (feature_store.py): one pass per (weights, example) across runs, seeds and
output folders; other weights miss; concurrent writers leave one valid entry; bad entries are recomputed;
least-recently-used eviction; ``disentangle cache list|clear``."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from disentanglement import cli, feature_store, feature_store_files
from disentanglement.config import build_config
from disentanglement.cvae_base import CVAEBase
from disentanglement.data import tokenize_pairs
from disentanglement.features import build_feature_cache
from disentanglement.losses import estimate_zfree_reference_scale
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import train
from helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(chat_template=False)


@pytest.fixture(scope="module")
def pairs():
    return make_hidden_factor_pairs([f"what about item {'y' * (i % 5)} {i}" for i in range(20)], kind="clean")


@pytest.fixture
def passes(monkeypatch):
    """Counts the reference forwards of the frozen pass: examples passed through ``CVAEBase.frozen_pass``."""
    seen = []
    original = CVAEBase.frozen_pass

    def counting(self, batch):
        seen.append(int(batch.input_ids.shape[0]))
        return original(self, batch)

    monkeypatch.setattr(CVAEBase, "frozen_pass", counting)
    return seen


def setup(tokenizer, pairs, seed=0, **overrides):
    config = build_config(dict(chat_template=False, **overrides))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    return build_cvae(config, tiny_llama(len(tokenizer), seed=seed)), examples


def assert_same(a, b):
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a.response_nll, b.response_nll, strict=True))
    assert torch.equal(a.prior_features, b.prior_features) and torch.equal(a.encoder_features, b.encoder_features)


def entries(root):
    return sorted(root.rglob("*.safetensors"))


def test_a_second_run_with_another_seed_and_folder_does_no_frozen_pass(tmp_path, tokenizer, pairs, passes):
    store = tmp_path / "store"

    def run(name, seed):
        config = build_config(
            dict(
                chat_template=False,
                output_dir=str(tmp_path / name),
                max_steps=2,
                batch_size=4,
                eval_every=2,
                eval_batches=1,
                validation_fraction=0.25,
                progress=False,
                seed=seed,
                feature_cache_dir=str(store),
            )
        )
        return train(config, (tiny_llama(len(tokenizer)), tokenizer), pairs)

    first = run("a", 0)
    assert sum(passes) == len(pairs) and len(entries(store)) == len(pairs)
    passes.clear()
    second = run("b", 1)  # another seed: another split and order of the same examples
    assert passes == [] and feature_store.last_stats.computed == 0 and feature_store.last_stats.hits == len(pairs)
    # The same examples' features, bit for bit (the runs hold them in their own split's order).
    by_ids = {
        (tuple(e.prompt_ids), tuple(e.response_ids)): i for i, e in enumerate(first.data.train + first.data.validation)
    }
    order = [by_ids[(tuple(e.prompt_ids), tuple(e.response_ids))] for e in second.data.train + second.data.validation]
    assert order != list(range(len(pairs)))  # the split did change
    a, b = first.cache, second.cache
    for j, i in enumerate(order):
        assert torch.equal(a.response_nll[i], b.response_nll[j])
        assert torch.equal(a.prior_features[i], b.prior_features[j])
        assert torch.equal(a.encoder_features[i], b.encoder_features[j])


def test_store_equals_a_fresh_pass_reuses_subsets_and_misses_other_weights(tmp_path, tokenizer, pairs, passes):
    model, examples = setup(tokenizer, pairs)
    fresh = build_feature_cache(model, examples, tokenizer.pad_token_id, 4, progress=False)
    passes.clear()
    sub = examples[3:11]
    part = feature_store.load_or_build_features(model, sub, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert sum(passes) == len(sub)
    for i, e in enumerate(sub):  # equal to the pass over all examples (other batches): to rounding
        torch.testing.assert_close(part.response_nll[i], fresh.response_nll[3 + i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part.prior_features[i], fresh.prior_features[3 + i], rtol=1e-5, atol=1e-6)
        assert part.response_nll[i].shape == (len(e.response_ids),)
    passes.clear()
    whole = feature_store.load_or_build_features(model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert sum(passes) == len(examples) - len(sub)  # only the examples the store lacked
    for i in range(len(sub)):
        assert torch.equal(whole.response_nll[3 + i], part.response_nll[i])
    passes.clear()
    again = feature_store.load_or_build_features(model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert passes == []
    assert_same(again, whole)
    # Other weights (another seed of the tiny model), or the same weights in bf16: another reference key, a miss.
    other, _ = setup(tokenizer, pairs, seed=1)
    assert feature_store.reference_key(other) != feature_store.reference_key(model)
    feature_store.load_or_build_features(other, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert sum(passes) == len(examples)
    passes.clear()
    model16 = setup(tokenizer, pairs)[0].to(torch.bfloat16)
    assert feature_store.reference_key(model16) != feature_store.reference_key(model)
    feature_store.load_or_build_features(model16, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert sum(passes) == len(examples)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 3


def test_the_weights_hash_is_computed_once_and_follows_in_place_changes(tokenizer, pairs, monkeypatch):
    model, _ = setup(tokenizer, pairs)
    key = feature_store.reference_key(model)
    reads = []
    original = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a, **k: reads.append(1) or original(self, *a, **k))
    assert feature_store.reference_key(model) == key and reads == []  # memoised: no weight read again
    with torch.no_grad():
        next(model.decoder.parameters()).add_(1.0)  # an in-place change bumps the tensor's version
    assert feature_store.reference_key(model) != key and reads


def test_entropy_and_attention_views_get_entries_that_carry_what_they_need(tmp_path, tokenizer, pairs, passes):
    plain, examples = setup(tokenizer, pairs)
    feature_store.load_or_build_features(plain, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    entropic, _ = setup(tokenizer, pairs, token_weight_source="entropy")
    passes.clear()
    cache = feature_store.load_or_build_features(
        entropic, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False
    )
    assert sum(passes) == len(examples) and cache.response_entropy is not None  # entries lacked the entropy
    passes.clear()
    again = feature_store.load_or_build_features(plain, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert passes == [] and again.response_entropy is None  # a superset entry serves the plain model as is
    attention, _ = setup(tokenizer, pairs, encoder_view="attention")
    cache = feature_store.load_or_build_features(
        attention, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False
    )
    assert sum(passes) == len(examples) and cache.response_hidden.shape == (
        sum(len(e.response_ids) for e in examples),
        32,
    )


def test_a_bad_entry_is_recomputed_with_a_warning(tmp_path, tokenizer, pairs, passes, caplog):
    model, examples = setup(tokenizer, pairs)
    good = feature_store.load_or_build_features(model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    files = entries(tmp_path)
    ref = feature_store.reference_key(model)
    key = feature_store.example_key(ref, examples[0])
    target = next(p for p in files if p.stem == key)
    row = feature_store.read_entry(target, key, len(examples[0].response_ids))
    bad_nan = {"response_nll": row[0].clone().fill_(float("nan")), "prior": row[3], "encoder": row[4]}
    save_file(bad_nan, str(target), metadata={"key": key})
    truncated = next(p for p in files if p != target)
    truncated.write_bytes(truncated.read_bytes()[:40])
    passes.clear()
    with caplog.at_level(logging.WARNING, logger="disentanglement.feature_store"):
        again = feature_store.load_or_build_features(
            model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False
        )
    assert sum(passes) == 2 and feature_store.last_stats.recomputed_bad == 2
    assert "non-finite" in caplog.text and "recomputing" in caplog.text
    # The two recomputed in a batch of their own: equal to rounding (other padding); the rest bit for bit.
    torch.testing.assert_close(again.prior_features, good.prior_features, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again.encoder_features, good.encoder_features, rtol=1e-5, atol=1e-6)
    redone = {i for i, e in enumerate(examples) if feature_store.example_key(ref, e) in {target.stem, truncated.stem}}
    assert len(redone) == 2
    for i in set(range(len(examples))) - redone:
        assert torch.equal(again.encoder_features[i], good.encoder_features[i])
    with pytest.raises(ValueError, match="response_nll has shape"):
        feature_store.read_entry(target, key, len(examples[0].response_ids) + 1)  # a shape that does not fit
    with pytest.raises(ValueError, match="another key"):
        feature_store.read_entry(target, "0" * 32, len(examples[0].response_ids))


def test_two_writers_at_once_leave_one_valid_entry_per_example_and_one_pass(tmp_path, tokenizer, pairs, passes):
    model, examples = setup(tokenizer, pairs)
    other_model, _ = setup(tokenizer, pairs)  # the same weights, another module (as another process has)
    start = threading.Barrier(2)
    results, errors = {}, []
    original = CVAEBase.frozen_pass

    def slow(self, batch):  # hold the lock long enough that the other writer has to wait for it
        time.sleep(0.05)
        return original(self, batch)

    def worker(name, m):
        try:
            start.wait()
            results[name] = feature_store.load_or_build_features(
                m, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False
            )
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    import unittest.mock

    with unittest.mock.patch.object(CVAEBase, "frozen_pass", slow):
        threads = [threading.Thread(target=worker, args=(n, m)) for n, m in (("a", model), ("b", other_model))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert sum(passes) == len(examples)  # one writer ran the pass; the other waited, then read its entries
    assert_same(results["a"], results["b"])
    files = entries(tmp_path)
    assert len(files) == len(examples) and not list(tmp_path.rglob("*.tmp"))
    ref = feature_store.reference_key(model)
    for e in examples:
        key = feature_store.example_key(ref, e)
        assert feature_store.read_entry(feature_store._entry_path(tmp_path / ref, key), key, len(e.response_ids))


def assert_rows_equal(a, b):
    """Every field of two caches bit for bit, row by row (dtypes and shapes included)."""
    assert_same(a, b)
    for x, y in zip(a.response_entropy, b.response_entropy, strict=True):
        assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y)
    assert a.response_hidden.dtype == b.response_hidden.dtype == torch.float32
    assert torch.equal(a.response_hidden, b.response_hidden)


def test_copies_of_an_example_get_the_row_the_store_keeps_so_computing_equals_reading(
    tmp_path, tokenizer, pairs, passes
):
    """An example that occurs several times (the chatterbot corpus holds 1,176 distinct pairs in 2,306) has one
    entry. Its copies used to be passed in different batches, whose rounding differs (a batch of copies alone
    shares all but its last token), and each kept its own row in memory while the store kept the last one
    written: a bf16 run that computed its features and one that read them got different c_base (3.6901, 3.6887)."""
    copies = pairs + [pairs[3]] * 9  # with a batch of 4: copies with other examples and a batch of copies only
    overrides = dict(encoder_view="attention", token_weight_source="entropy")  # every field an entry can hold
    model, examples = setup(tokenizer, copies, **overrides)
    model = model.to(torch.bfloat16)
    computed = feature_store.load_or_build_features(
        model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False
    )
    passed, stored = sum(passes), len(entries(tmp_path))
    assert feature_store.last_stats.computed == len(examples)
    passes.clear()
    read = feature_store.load_or_build_features(model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    assert passes == [] and feature_store.last_stats.hits == len(examples)
    assert_rows_equal(computed, read)
    assert passed == stored == len(pairs)  # each distinct example passed and written once
    for i in range(len(pairs), len(examples)):  # every copy holds the one row of its example
        assert torch.equal(computed.response_nll[i], computed.response_nll[3])
        assert torch.equal(computed.encoder_features[i], computed.encoder_features[3])
    assert estimate_zfree_reference_scale(computed.example_base_losses()) == estimate_zfree_reference_scale(
        read.example_base_losses()
    )


def _entry(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(size // 4)}, str(path))
    return path.stat().st_size


def test_least_recently_used_entries_are_evicted_first(tmp_path):
    ref = tmp_path / ("r" * 32)
    paths = [ref / "ab" / f"{name}.safetensors" for name in ("old", "middle", "used", "new")]
    sizes = [_entry(p, 1000) for p in paths]
    now = time.time()
    for age, p in zip((400, 300, 200, 100), paths, strict=True):
        os.utime(p, (now - age, now - age))
    feature_store._touch([paths[0]])  # "old" is used again: now the most recent
    removed = feature_store_files.evict(tmp_path, max_bytes=sum(sizes) - 1)
    assert removed == 1 and [p.exists() for p in paths] == [True, False, True, True]
    removed = feature_store_files.evict(tmp_path, max_bytes=2 * sizes[0])
    assert removed == 1 and [p.exists() for p in paths] == [True, False, False, True]
    assert feature_store_files.evict(tmp_path, max_bytes=10**9) == 0


def test_a_store_over_its_limit_keeps_the_newest_entries(tmp_path, tokenizer, pairs):
    model, examples = setup(tokenizer, pairs)
    feature_store.load_or_build_features(model, examples[:10], tokenizer.pad_token_id, tmp_path, 4, progress=False)
    first = {p.name for p in entries(tmp_path)}
    time.sleep(0.02)
    one = entries(tmp_path)[0].stat().st_size
    feature_store.load_or_build_features(
        model, examples[10:], tokenizer.pad_token_id, tmp_path, 4, progress=False, max_bytes=12 * one
    )
    kept = {p.name for p in entries(tmp_path)}
    assert len(kept) <= 12 and feature_store.last_stats.evicted >= 8
    assert len(kept - first) == 10  # the ten just used stay; the older ones went first


def test_cache_list_and_clear(tmp_path, tokenizer, pairs, capsys, monkeypatch):
    model, examples = setup(tokenizer, pairs)
    feature_store.load_or_build_features(model, examples, tokenizer.pad_token_id, tmp_path, 4, progress=False)
    total = sum(p.stat().st_size for p in entries(tmp_path))
    monkeypatch.setenv(feature_store_files.ENV_DIR, str(tmp_path))
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"feature cache {tmp_path}: {len(examples)} entries, {feature_store_files.human_size(total)}"
    key = feature_store.reference_key(model)
    assert len(out) == 2 and out[1].split()[:3] == [key[:16], str(len(examples)), "entries"]
    assert out[1].endswith("LlamaForCausalLM (float32)") or "(float32)" in out[1]
    assert cli.main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"feature cache {tmp_path}: removed {len(examples)} entries ({feature_store_files.human_size(total)})"
    )
    assert entries(tmp_path) == []
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr().out.strip() == f"feature cache {tmp_path}: 0 entries, 0 B"


def test_the_store_folder_and_limit_come_from_the_config_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(feature_store_files.ENV_DIR, raising=False)
    monkeypatch.delenv(feature_store_files.ENV_MAX_GB, raising=False)
    assert feature_store_files.store_dir() == Path("~/.cache/disentanglement/features").expanduser()
    assert feature_store_files.store_limit_bytes() == 20 * 10**9
    monkeypatch.setenv(feature_store_files.ENV_DIR, str(tmp_path / "env"))
    monkeypatch.setenv(feature_store_files.ENV_MAX_GB, "0.5")
    assert feature_store_files.store_dir() == tmp_path / "env" and feature_store_files.store_limit_bytes() == 5 * 10**8
    assert (
        feature_store_files.store_dir(tmp_path / "cfg") == tmp_path / "cfg"
        and feature_store_files.store_limit_bytes(2) == 2e9
    )
    monkeypatch.setenv(feature_store_files.ENV_MAX_GB, "lots")
    with pytest.raises(ValueError, match="DISENTANGLEMENT_FEATURE_CACHE_MAX_GB must be a number"):
        feature_store_files.store_limit_bytes()


def test_a_store_that_cannot_be_written_is_passed_by(tmp_path, caplog):
    """A read-only cache folder (another user's, a read-only home) costs the store, not the run."""
    tokenizer = tiny_tokenizer(chat_template=False)
    pairs = make_hidden_factor_pairs([f"p {i}" for i in range(6)], kind="clean")
    config = build_config(dict(chat_template=False))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # the store's root is a file: nothing can be made under it
    with caplog.at_level(logging.WARNING):
        cache = feature_store.load_or_build_features(
            model, examples, tokenizer.pad_token_id, blocked, 4, progress=False
        )
    fresh = build_feature_cache(model, examples, tokenizer.pad_token_id, 4, progress=False)
    assert "computing without the store" in caplog.text and len(cache) == len(examples)
    torch.testing.assert_close(cache.encoder_features, fresh.encoder_features)
