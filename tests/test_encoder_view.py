"""The encoder's view (LatentConfig.encoder_view, encoder_layer), each against a plain computation on a
tiny model: token-weighted pools are loops of sum_t pi_t h_t, the attention pool a hand-written masked
softmax, encoder_layer picks hidden_states[layer]; the cache holds what the frozen pass gives, its
fingerprint follows the settings the features depend on (and only those), training works for every
view with the cache on and off, and checkpoints keep the attention query."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from disentanglement.config import ConfigError, build_config
from disentanglement.data import Example, collate, tokenize_pairs
from disentanglement.features import (
    FEATURE_PASS_VERSION,
    build_feature_cache,
    feature_fingerprint,
    load_or_build_feature_cache,
    save_feature_cache,
)
from disentanglement.generation import prompt_features
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.token_weighting import token_weighting_from_base_nll
from disentanglement.trainer import load_trained, make_optimizer, train
from helpers import tiny_gpt2, tiny_llama, train_and_read_metrics
from references import loop_attention, reference_nll_and_entropy

VIEWS = ["mean_last", "token_weighted", "attention"]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pairs():
    return make_hidden_factor_pairs([f"what about item {'y' * (i % 7)} {i}" for i in range(24)], kind="clean")


def setup(tokenizer, pairs, arch=tiny_llama, **overrides):
    config = build_config(
        dict(preset="raw", chat_template=False, **overrides)
    )  # the recipe these tests were written against (the defaults before issue 23)
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    return build_cvae(config, arch(len(tokenizer))), examples, config


def mixed_batch(examples, one_token: bool = True):
    """Examples of several lengths (so padding), and one whose response is a single token."""
    chosen = [examples[i] for i in (0, 3, 6, 11, 20)]
    if one_token:
        chosen.append(Example(examples[1].prompt_ids, examples[1].response_ids[:1], None, "one token"))
    return collate(chosen, 2)


def reference_pass(model, batch, b):
    """Example ``b`` alone, unpadded, through the reference: (hidden_states, logits, p, r)."""
    p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
    ids = batch.input_ids[b : b + 1, : p + r]
    with torch.no_grad(), model.reference.active() as reference:
        out = reference(input_ids=ids, output_hidden_states=True)
    return [h[0].float() for h in out.hidden_states], out.logits[0].float(), p, r


# -- token_weighted ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alpha", "source", "interpolation"),
    [
        (0.0, "surprisal", 1.0),
        (1.0, "surprisal", 1.0),
        (2.0, "surprisal", 1.0),
        (1.5, "entropy", 0.5),
        (2.0, "dynamic", 1.0),
    ],
)
def test_token_weighted_features_are_a_loop_of_pi_times_h(tokenizer, pairs, alpha, source, interpolation):
    model, examples, _ = setup(
        tokenizer,
        pairs,
        encoder_view="token_weighted",
        token_weight_alpha=alpha,
        token_weight_source=source,
        token_weight_interpolation=interpolation,
        token_weight_eps=1e-4,
    )
    mean_model, _, _ = setup(tokenizer, pairs)
    batch = mixed_batch(examples)
    features, mean_features = model.frozen_pass(batch), mean_model.frozen_pass(batch)
    H = model.hidden_size
    for b in range(len(batch)):
        hidden, logits, p, r = reference_pass(model, batch, b)
        h = hidden[-1]
        nll, entropy = reference_nll_and_entropy(logits, batch.input_ids[b], p, r)
        signal = entropy if source == "entropy" else None  # dynamic: the surprisal shares
        pi = token_weighting_from_base_nll(
            nll[None],
            torch.ones(1, r),
            alpha,
            1e-4,
            signal=None if signal is None else signal[None],
            interpolation=interpolation,
        ).token_weights[0]
        expected = torch.zeros(H)
        for k in range(r):
            expected += pi[k] * h[p + k]  # response token k sits at position p + k
        torch.testing.assert_close(features.encoder_features[b, :H], expected, **TOL)
        torch.testing.assert_close(features.encoder_features[b, H:], h[p + r - 1], **TOL)
        if alpha == 0 or r == 1:  # uniform weights, or one token: the plain mean
            torch.testing.assert_close(features.encoder_features[b, :H], h[p : p + r].mean(0), **TOL)
            torch.testing.assert_close(features.encoder_features[b], mean_features.encoder_features[b], **TOL)
        if r == 1:
            torch.testing.assert_close(features.encoder_features[b, :H], h[p], **TOL)
    if alpha > 0 and source != "entropy":  # the weights matter (a random model's entropy is nearly flat)
        assert not torch.allclose(features.encoder_features[:, :H], mean_features.encoder_features[:, :H], atol=1e-4)
    torch.testing.assert_close(features.prior_features, mean_features.prior_features, rtol=0, atol=0)
    assert model.encoder_input(features) is features.encoder_features  # the head sees them as they are


def test_default_view_is_the_mean_and_the_heads_input_unchanged(tokenizer, pairs):
    model, examples, config = setup(tokenizer, pairs)
    assert config.latent.encoder_view == "mean_last" and config.latent.encoder_layer == -1
    assert model.encoder_pool is None and model.encoder_view_params == {}
    batch = mixed_batch(examples)
    features = model.frozen_pass(batch)
    assert features.response_hidden is None and model.encoder_input(features) is features.encoder_features
    H = model.hidden_size
    for b in range(len(batch)):
        hidden, _, p, r = reference_pass(model, batch, b)
        torch.testing.assert_close(features.encoder_features[b, :H], hidden[-1][p : p + r].mean(0), **TOL)


# -- attention -----------------------------------------------------------------------------------------
def attention_model(tokenizer, pairs, seed=3, **overrides):
    model, examples, config = setup(tokenizer, pairs, encoder_view="attention", **overrides)
    with torch.no_grad():
        model.encoder_pool.query.copy_(torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(seed)))
    return model, examples, config


def test_attention_pool_is_a_masked_softmax_over_the_response(tokenizer, pairs):
    model, examples, _ = attention_model(tokenizer, pairs)
    batch = mixed_batch(examples)
    features = model.frozen_pass(batch)
    assert features.response_hidden.shape == (*batch.input_ids.shape, model.hidden_size)
    assert torch.equal(features.response_mask, batch.target_mask.bool())
    got = model.encoder_input(features)
    H = model.hidden_size
    query = model.encoder_pool.query.detach()
    for b in range(len(batch)):
        hidden, _, p, r = reference_pass(model, batch, b)
        h = hidden[-1]
        torch.testing.assert_close(got[b, :H], loop_attention(query, h, p, r), **TOL)
        torch.testing.assert_close(got[b, H:], h[p + r - 1], **TOL)
        # The frozen part is the mean_last pair (the head replaces the mean by its pool).
        torch.testing.assert_close(features.encoder_features[b, :H], h[p : p + r].mean(0), **TOL)
        weights = model.encoder_pool.weights(features.response_hidden, features.response_mask)[b]
        assert weights[:p].eq(0).all() and weights[p + r :].eq(0).all()
        torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    # A zero query (the initial one) is the plain mean: attention starts where mean_last is.
    fresh, _, _ = setup(tokenizer, pairs, encoder_view="attention")
    assert torch.equal(fresh.encoder_pool.query, torch.zeros(H))
    torch.testing.assert_close(fresh.encoder_input(fresh.frozen_pass(batch)), features.encoder_features, **TOL)


def test_attention_pool_ignores_padding(tokenizer, pairs):
    model, examples, _ = attention_model(tokenizer, pairs)
    short = [examples[i] for i in (0, 3, 6)]
    batch = collate(short, 2)
    longest = max(examples, key=lambda e: len(e.prompt_ids) + len(e.response_ids))
    padded = collate([*short, longest], 2)  # the same three rows with more padding after them
    assert padded.input_ids.shape[1] > batch.input_ids.shape[1]
    alone = model.encoder_input(model.frozen_pass(batch))
    torch.testing.assert_close(model.encoder_input(model.frozen_pass(padded))[:3], alone, **TOL)
    # What lies off the mask never counts, whatever it is.
    features = model.frozen_pass(padded)
    off = ~features.response_mask.unsqueeze(-1)
    features.response_hidden = torch.where(
        off, 1e3 * torch.randn_like(features.response_hidden), features.response_hidden
    )
    torch.testing.assert_close(model.encoder_input(features)[:3], alone, **TOL)


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_attention_query_gets_gradients_and_trains(tokenizer, pairs, latent):
    model, examples, config = setup(tokenizer, pairs, encoder_view="attention", latent=latent, encoder_lr=0.05)
    query = model.encoder_pool.query
    assert any(param is query for param in model.parameter_groups()["encoder"])
    assert not any(param is query for group in ("latent", "decoder") for param in model.parameter_groups()[group])
    optimizer = make_optimizer(model, config)
    (encoder_group,) = [g for g in optimizer.param_groups if any(p is query for p in g["params"])]
    assert encoder_group["lr"] == pytest.approx(0.05)
    model.train()
    batch = mixed_batch(examples)
    for step in range(3):
        optimizer.zero_grad()
        out = model(batch, step=step)
        out.loss.backward()
        assert query.grad is not None and query.grad.abs().sum() > 0, "the query gets a gradient from step 0 on"
        optimizer.step()
    assert query.detach().abs().sum() > 0  # it moved away from its zero start
    assert "encoder_pool.query" in model.trainable_state_dict()


def test_every_view_runs_forward_and_backward_on_gpt2(tokenizer, pairs):
    for view in VIEWS:
        model, examples, _ = setup(tokenizer, pairs, arch=tiny_gpt2, encoder_view=view, encoder_layer=1)
        model.train()
        out = model(mixed_batch(examples))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        for param in model.parameter_groups()["encoder"] + model.parameter_groups()["latent"]:
            assert param.grad is not None


# -- encoder_layer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 1, -2, 2, -3])
@pytest.mark.parametrize("view", VIEWS)
def test_encoder_layer_picks_that_hidden_state(tokenizer, pairs, layer, view):
    model, examples, _ = setup(tokenizer, pairs, encoder_layer=layer, encoder_view=view)
    last, _, _ = setup(tokenizer, pairs, encoder_view=view)
    batch = mixed_batch(examples)
    features, last_features = model.frozen_pass(batch), last.frozen_pass(batch)
    H = model.hidden_size
    for b in range(len(batch)):
        hidden, logits, p, r = reference_pass(model, batch, b)
        h = hidden[layer]
        torch.testing.assert_close(features.prior_features[b], h[p - 1], **TOL)
        torch.testing.assert_close(features.encoder_features[b, H:], h[p + r - 1], **TOL)
        if view != "token_weighted":
            torch.testing.assert_close(features.encoder_features[b, :H], h[p : p + r].mean(0), **TOL)
        if view == "attention":
            torch.testing.assert_close(features.response_hidden[b, p : p + r], h[p : p + r], **TOL)
        nll, _ = reference_nll_and_entropy(logits, batch.input_ids[b], p, r)  # always the last layer's
        torch.testing.assert_close(features.zfree_token_nll[b, p - 1 : p + r - 1], nll, **TOL)
    torch.testing.assert_close(features.zfree_token_nll, last_features.zfree_token_nll, rtol=0, atol=0)
    if layer in (2, -1):
        torch.testing.assert_close(features.encoder_features, last_features.encoder_features, rtol=0, atol=0)
    else:
        assert not torch.allclose(features.prior_features, last_features.prior_features)
    # Generation's prior features come from the same layer.
    prompts = [examples[i].prompt_ids for i in (0, 3)]
    torch.testing.assert_close(prompt_features(model, prompts, 2).prior_features, features.prior_features[:2], **TOL)


@pytest.mark.parametrize("layer", [3, -4, 100])
@pytest.mark.parametrize("training", ["frozen", "lora"])
def test_encoder_layer_out_of_range_is_refused_naming_the_field(tokenizer, pairs, layer, training):
    with pytest.raises(ConfigError, match=r"LatentConfig\.encoder_layer must be in \[-3, 2\] .*2 layers.*got") as info:
        setup(tokenizer, pairs, encoder_layer=layer, decoder_training=training)
    assert info.value.field == "encoder_layer"


def test_the_new_fields_validate():
    with pytest.raises(ConfigError, match=r"LatentConfig\.encoder_view must be one of"):
        build_config({"encoder_view": "max"})
    with pytest.raises(ConfigError, match=r"LatentConfig\.encoder_layer must be an integer"):
        build_config({"encoder_layer": 1.5})


# -- the cache ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [-1, 1])
@pytest.mark.parametrize("view", VIEWS)
def test_cached_features_equal_the_frozen_pass(tokenizer, pairs, tmp_path, view, layer):
    extra = dict(token_weight_alpha=1.7) if view == "token_weighted" else {}
    if view == "attention":
        model, examples, _ = attention_model(tokenizer, pairs, encoder_layer=layer)
    else:
        model, examples, _ = setup(tokenizer, pairs, encoder_view=view, encoder_layer=layer, **extra)
    built = load_or_build_feature_cache(model, examples, 2, tmp_path, batch_size=5, progress=False)
    loaded = load_or_build_feature_cache(model, examples, 2, tmp_path, batch_size=5, progress=False)
    assert loaded is not built and (loaded.response_hidden is not None) == (view == "attention")
    if view == "attention":
        assert loaded.response_hidden.shape == (sum(len(e.response_ids) for e in examples), model.hidden_size)
        assert loaded.response_hidden.dtype == torch.float32
    indices = [17, 3, 0, 22, 9]
    batch = collate([examples[i] for i in indices], 2, indices=indices)
    fresh = model.frozen_pass(batch)
    for cache in (built, loaded):
        for params in (None, model.weighting_params):
            cached = cache.features(batch, params)
            torch.testing.assert_close(cached.zfree_token_nll, fresh.zfree_token_nll, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cached.prior_features, fresh.prior_features, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cached.encoder_features, fresh.encoder_features, rtol=1e-4, atol=1e-5)
            if view == "attention":
                torch.testing.assert_close(cached.response_hidden, fresh.response_hidden, rtol=1e-4, atol=1e-5)
                assert torch.equal(cached.response_mask, fresh.response_mask)
            else:
                assert cached.response_hidden is None
            torch.testing.assert_close(model.encoder_input(cached), model.encoder_input(fresh), rtol=1e-4, atol=1e-5)
    # A subset (the trainer's train and validation parts) hands out the same rows, re-indexed from 0.
    part = loaded.subset(8, 20)
    rebased = collate([examples[i] for i in (9, 17, 8)], 2, indices=[1, 9, 0])
    whole = collate([examples[i] for i in (9, 17, 8)], 2, indices=[9, 17, 8])
    torch.testing.assert_close(
        model.encoder_input(part.features(rebased)), model.encoder_input(loaded.features(whole)), rtol=0, atol=0
    )


def legacy_fingerprint(model, examples) -> str:
    """The fingerprint as it was before the encoder views: existing caches of the default must stay valid."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(FEATURE_PASS_VERSION.encode())
    state = model.decoder.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    for example in examples:
        digest.update(json.dumps([example.prompt_ids, example.response_ids]).encode())
    return digest.hexdigest()


def test_fingerprint_follows_the_views_settings_and_only_them(tokenizer, pairs):
    def fingerprint(**overrides):
        model, examples, _ = setup(tokenizer, pairs, **overrides)
        return feature_fingerprint(model, examples)

    model, examples, _ = setup(tokenizer, pairs)
    default = feature_fingerprint(model, examples)
    assert default == legacy_fingerprint(model, examples)
    # The default view does not depend on the weighting settings, nor does attention.
    for view in ("mean_last", "attention"):
        base = fingerprint(encoder_view=view)
        for other in (dict(token_weight_alpha=2.0), dict(token_weight_eps=1e-3), dict(token_weight_interpolation=0.5)):
            assert fingerprint(encoder_view=view, **other) == base
    assert fingerprint(encoder_view="mean_last", token_weight_source="entropy") == default
    assert fingerprint(encoder_layer=2) == fingerprint(encoder_layer=-1) == default  # the same layer, said twice
    # token_weighted: every weighting setting counts; dynamic weights the encoder by the surprisal shares.
    weighted = fingerprint(encoder_view="token_weighted")
    others = {
        default,
        fingerprint(encoder_view="attention"),
        fingerprint(encoder_layer=1),
        fingerprint(encoder_layer=0),
        weighted,
        fingerprint(encoder_view="token_weighted", token_weight_alpha=2.0),
        fingerprint(encoder_view="token_weighted", token_weight_eps=1e-3),
        fingerprint(encoder_view="token_weighted", token_weight_interpolation=0.5),
        fingerprint(encoder_view="token_weighted", token_weight_source="entropy"),
        fingerprint(encoder_view="token_weighted", encoder_layer=1),
    }
    assert len(others) == 10
    assert fingerprint(encoder_view="token_weighted", token_weight_source="dynamic") == weighted


def test_a_cache_of_another_view_is_rebuilt(tokenizer, pairs, tmp_path):
    mean, examples, _ = setup(tokenizer, pairs)
    first = load_or_build_feature_cache(mean, examples, 2, tmp_path, progress=False)
    assert first.response_hidden is None
    attention, _, _ = setup(tokenizer, pairs, encoder_view="attention")
    rebuilt = load_or_build_feature_cache(attention, examples, 2, tmp_path, progress=False)
    assert rebuilt.response_hidden is not None
    weighted, _, _ = setup(tokenizer, pairs, encoder_view="token_weighted", token_weight_alpha=2.0)
    again = load_or_build_feature_cache(weighted, examples, 2, tmp_path, progress=False)
    assert again.response_hidden is None
    assert not torch.allclose(again.encoder_features, first.encoder_features, atol=1e-4)
    in_memory = build_feature_cache(weighted, examples, 2, progress=False)
    torch.testing.assert_close(again.encoder_features, in_memory.encoder_features, rtol=0, atol=0)


def test_a_cache_with_damaged_hidden_states_is_rebuilt(tokenizer, pairs, tmp_path, caplog):
    import logging

    model, examples, _ = setup(tokenizer, pairs, encoder_view="attention")
    good = build_feature_cache(model, examples, 2, progress=False)
    bad = build_feature_cache(model, examples, 2, progress=False)
    bad.response_hidden = bad.response_hidden[:-3]  # rows that do not fit the response lengths
    save_feature_cache(bad, tmp_path / "frozen_pass.safetensors", feature_fingerprint(model, examples))
    with caplog.at_level(logging.WARNING):
        cache = load_or_build_feature_cache(model, examples, 2, tmp_path, progress=False)
    assert "unreadable" in caplog.text and "response_hidden has shape" in caplog.text
    torch.testing.assert_close(cache.response_hidden, good.response_hidden, rtol=0, atol=0)


# -- training and checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("view", "extra"),
    [
        ("mean_last", dict(encoder_layer=1)),
        ("token_weighted", dict(token_weight_alpha=2.0)),
        ("attention", {}),
        ("attention", dict(latent="discrete", encoder_layer=1)),
    ],
)
def test_training_each_view_with_and_without_the_cache(tokenizer, pairs, tmp_path, view, extra):
    def run(name, use_cache):
        decoder = tiny_llama(len(tokenizer))
        return train_and_read_metrics(
            tmp_path / name,
            decoder,
            tokenizer,
            pairs,
            feature_cache=use_cache,
            encoder_view=view,
            feature_cache_dir=str(tmp_path / "store"),
            **extra,
        )

    cached, uncached = run("cached", True), run("uncached", False)
    assert any((tmp_path / "store").rglob("*.safetensors"))
    assert len(cached) == len(uncached) == 4
    for a, b in zip(cached, uncached, strict=True):
        for key in ("loss", "reconstruction_loss", "kl", "token_weighted_reconstruction_loss"):
            assert math.isfinite(a[key])
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
        if "val_loss" in a:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4), a["step"]


@pytest.mark.parametrize("latent", ["continuous", "discrete"])
def test_checkpoints_save_and_load_the_attention_query(tokenizer, pairs, tmp_path, latent):
    config = build_config(
        dict(
            output_dir=str(tmp_path / "run"),
            max_steps=6,
            batch_size=4,
            progress=False,
            chat_template=False,
            eval_every=0,
            eval_batches=1,
            save_every=6,
            preset="raw",
            encoder_view="attention",
            encoder_lr=0.05,
            latent=latent,
        )
    )
    result = train(config, (tiny_llama(len(tokenizer)), tokenizer), pairs)
    stored = load_file(str(result.checkpoint / "model.safetensors"))
    assert "encoder_pool.query" in stored and stored["encoder_pool.query"].abs().sum() > 0  # it trained
    model, _, loaded_config, _ = load_trained(result.checkpoint, (tiny_llama(len(tokenizer)), tokenizer))
    assert loaded_config.latent.encoder_view == "attention"
    assert torch.equal(model.encoder_pool.query.detach(), stored["encoder_pool.query"])
    # The loaded query is the one used: the pool differs from a fresh model's (zero query, the mean).
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    batch = collate(examples[:4], 2)
    features = model.frozen_pass(batch)
    fresh, _, _ = setup(tokenizer, pairs, encoder_view="attention", latent=latent)
    assert not torch.allclose(model.encoder_input(features), fresh.encoder_input(features))
