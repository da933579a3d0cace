"""The frozen pass done once: cached features equal a fresh pass, the on-disk cache is reused only
when its fingerprint matches, and training with and without it gives the same losses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import disentanglement.features as features_module
from disentanglement.config import build_config
from disentanglement.cvae_base import FrozenFeatures
from disentanglement.data import collate, tokenize_pairs
from disentanglement.features import build_feature_cache, feature_fingerprint, load_or_build_feature_cache
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.token_weighting import TokenWeighting
from helpers import tiny_llama, train_and_read_metrics

FIELDS = [f.name for f in dataclasses.fields(TokenWeighting)]


@pytest.fixture(scope="module")
def pairs():
    return make_hidden_factor_pairs([f"what about item {'y' * (i % 7)} {i}" for i in range(24)], kind="clean")


def setup(tokenizer, pairs, **overrides):
    config = build_config(
        dict(preset="raw", chat_template=False, **overrides)
    )  # the recipe these tests were written against (the defaults before issue 23)
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    return model, examples


def test_cached_features_equal_a_fresh_frozen_pass(tokenizer, pairs):
    model, examples = setup(tokenizer, pairs)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, batch_size=5, progress=False)
    indices = [3, 0, 17, 9]
    batch = collate([examples[i] for i in indices], tokenizer.pad_token_id, indices=indices)
    cached, fresh = cache.features(batch), model.frozen_pass(batch)
    torch.testing.assert_close(cached.zfree_token_nll, fresh.zfree_token_nll, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached.prior_features, fresh.prior_features, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached.encoder_features, fresh.encoder_features, rtol=1e-4, atol=1e-5)
    for i, example in enumerate(examples):
        assert cache.response_nll[i].shape == (len(example.response_ids),)


@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
def test_cached_token_weighting_equals_the_models_own(tokenizer, pairs, placement):
    # The cache weights every example once per (alpha, eps); the model must get what it would compute itself.
    model, examples = setup(tokenizer, pairs, latent_placement=placement, token_weight_alpha=1.7)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, batch_size=5, progress=False)
    indices = [5, 1, 22, 13, 8]
    batch = collate([examples[i] for i in indices], tokenizer.pad_token_id, indices=indices)
    offsets, target = model.alignment_offsets(batch), model.conditioned_target_mask(batch)
    cached = cache.features(batch, model.weighting_params)
    assert cached.zfree_weighting is not None
    torch.testing.assert_close(cached.zfree_token_nll, cache.features(batch).zfree_token_nll, rtol=0, atol=0)
    plain = FrozenFeatures(cached.zfree_token_nll, cached.prior_features, cached.encoder_features)
    got, want = (
        model.token_weighting(batch, cached, offsets, target),
        model.token_weighting(batch, plain, offsets, target),
    )
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7)
    # Weights precomputed for another alpha are not used: the model computes its own.
    other = cache.features(batch, dataclasses.replace(model.weighting_params, source="surprisal", alpha=0.5))
    torch.testing.assert_close(model.token_weighting(batch, other, offsets, target).token_weights, want.token_weights)
    assert not torch.allclose(other.zfree_weighting.token_weights, cached.zfree_weighting.token_weights)


def test_cached_features_reject_a_batch_of_other_examples(tokenizer, pairs):
    model, examples = setup(tokenizer, pairs)
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, batch_size=5, progress=False)
    longer = [e for e in examples if len(e.response_ids) != len(examples[0].response_ids)][0]
    wrong = collate([longer], tokenizer.pad_token_id, indices=[0])  # index 0 holds another response length
    with pytest.raises(ValueError, match="response lengths"):
        cache.features(wrong)


def test_disk_cache_reused_only_for_the_same_weights_and_data(tokenizer, pairs, tmp_path, monkeypatch):
    model, examples = setup(tokenizer, pairs)
    first = load_or_build_feature_cache(model, examples, tokenizer.pad_token_id, tmp_path, progress=False)
    assert (tmp_path / "frozen_pass.safetensors").is_file()

    def must_not_build(*args, **kwargs):
        raise AssertionError("a matching cache must be reused")

    with monkeypatch.context() as patch:
        patch.setattr(features_module, "build_feature_cache", must_not_build)
        again = load_or_build_feature_cache(model, examples, tokenizer.pad_token_id, tmp_path, progress=False)
    torch.testing.assert_close(again.encoder_features, first.encoder_features)
    assert all(torch.equal(a, b) for a, b in zip(again.response_nll, first.response_nll, strict=True))

    fingerprint = feature_fingerprint(model, examples)
    # Other length caps (so other token ids) -> another fingerprint -> rebuilt, never used silently.
    capped_model, capped = setup(tokenizer, pairs, max_response_tokens=5)
    assert feature_fingerprint(capped_model, capped) != fingerprint
    rebuilt = load_or_build_feature_cache(capped_model, capped, tokenizer.pad_token_id, tmp_path, progress=False)
    assert all(len(n) <= 5 for n in rebuilt.response_nll)
    # Other weights -> another fingerprint.
    other_model = build_cvae(
        build_config({"preset": "raw", "chat_template": False}), tiny_llama(len(tokenizer), seed=1)
    )
    assert feature_fingerprint(other_model, examples) != fingerprint


def test_lora_adapters_do_not_change_the_fingerprint(tokenizer, pairs):
    model, examples = setup(tokenizer, pairs, decoder_training="lora")
    before = feature_fingerprint(model, examples)
    for name, param in model.decoder.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param)
    assert feature_fingerprint(model, examples) == before


def test_a_lora_run_shares_the_frozen_runs_cache(tokenizer, pairs):
    """The LoRA reference (adapters off) is the frozen model: same fingerprint under peft's renamed weights,
    and the frozen pass it would run equals the frozen model's, so the store's entries serve both."""
    frozen, examples = setup(tokenizer, pairs)
    lora, _ = setup(tokenizer, pairs, decoder_training="lora")
    assert feature_fingerprint(lora, examples) == feature_fingerprint(frozen, examples)
    for name, param in lora.decoder.named_parameters():  # trained adapters change nothing either
        if "lora_" in name:
            torch.nn.init.normal_(param)
    assert feature_fingerprint(lora, examples) == feature_fingerprint(frozen, examples)
    batch = collate(examples[:6], tokenizer.pad_token_id, indices=list(range(6)))
    a, b = frozen.frozen_pass(batch), lora.frozen_pass(batch)
    assert torch.equal(a.zfree_token_nll, b.zfree_token_nll) and torch.equal(a.encoder_features, b.encoder_features)
    # other weights under the same peft wrapping still differ
    other = build_cvae(
        build_config({"preset": "raw", "chat_template": False, "decoder_training": "lora"}),
        tiny_llama(len(tokenizer), seed=1),
    )
    assert feature_fingerprint(other, examples) != feature_fingerprint(frozen, examples)


def test_training_with_and_without_the_cache_gives_the_same_losses(tokenizer, pairs, tmp_path):
    store = tmp_path / "store"

    def run(name, use_cache):
        decoder = tiny_llama(len(tokenizer))
        return train_and_read_metrics(
            tmp_path / name, decoder, tokenizer, pairs, feature_cache=use_cache, feature_cache_dir=str(store)
        )

    cached = run("cached", True)
    written = sorted(store.rglob("*.safetensors"))
    assert written  # the frozen pass went into the store
    uncached = run("uncached", False)
    assert sorted(store.rglob("*.safetensors")) == written  # without the cache option nothing is stored
    for a, b in zip(cached, uncached, strict=True):
        for key in (
            "loss",
            "reconstruction_loss",
            "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)


def test_a_damaged_or_unwritable_disk_cache_is_rebuilt_not_trusted(tokenizer, pairs, tmp_path, monkeypatch, caplog):
    import errno
    import logging

    import disentanglement.checkpoints as checkpoints

    model, examples = setup(tokenizer, pairs)
    first = load_or_build_feature_cache(model, examples, tokenizer.pad_token_id, tmp_path, progress=False)
    path = tmp_path / "frozen_pass.safetensors"
    path.write_bytes(path.read_bytes()[:300])
    with caplog.at_level(logging.WARNING):
        again = load_or_build_feature_cache(model, examples, tokenizer.pad_token_id, tmp_path, progress=False)
    assert "is unreadable" in caplog.text and "rebuilding" in caplog.text
    torch.testing.assert_close(again.encoder_features, first.encoder_features)

    def read_only(path, data, root=None):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoints, "atomic_write", read_only)  # what replace_file_durably writes with
    other = tmp_path / "elsewhere"
    with caplog.at_level(logging.WARNING):
        cache = load_or_build_feature_cache(model, examples, tokenizer.pad_token_id, other, progress=False)
    assert "could not write the cache" in caplog.text and len(cache) == len(examples)
