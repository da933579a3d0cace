"""encoder_lora_layers (item 2c of issue 22: the encoder's features from a LoRA-adapted pass of the LM), against
independent computations on tiny models: at the start the adapted pass is the frozen one; with adapters set, its
view is that of a copy of the LM whose weights have ``W + (alpha / r) B A`` merged in, on the adapted layers only;
the decoder and the z-free reference never see the adapters; the gradient reaches them from their zero start;
cached and fresh features, chunked and whole passes agree; training moves them and a checkpoint keeps them."""

from __future__ import annotations

import math

import pytest
import torch

import disentanglement.cvae_base as cvae_base
from disentanglement.config import ConfigError, build_config
from disentanglement.data import collate
from disentanglement.encoder_adapters import adapted_modules
from disentanglement.features import build_feature_cache
from disentanglement.models import build_cvae
from disentanglement.trainer import load_trained
from helpers import tiny_cvae, tiny_llama, train_and_read_metrics, view_pairs

TOL = dict(rtol=1e-5, atol=1e-5)
VIEWS = ("token_weighted", "mean_last", "token_weighted_attention")


@pytest.fixture(scope="module")
def pairs():
    return view_pairs()


def randomise(model, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.encoder_adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def merged_copy(model, layers: range) -> torch.nn.Module:
    """A copy of the tiny Llama with every adapter merged into its projection's weight: ``W + s B A``
    (``nn.Linear``'s weight is ``[out, in]``), built afresh (tiny_cvae's decoder is ``tiny_llama`` of seed 0, whatever
    wraps it), the projections named by hand: ``model.layers.i.self_attn.q_proj``
    and ``v_proj`` for the layers ``layers`` the test expects to be adapted."""
    adapters = model.encoder_adapters
    merged = tiny_llama(model.decoder.get_input_embeddings().weight.shape[0])  # the reference's weights, built anew
    with torch.no_grad():
        for i in layers:
            attention = merged.model.layers[i].self_attn
            for target in ("q_proj", "v_proj"):
                up, down = adapters.up[f"{i}_{target}"], adapters.down[f"{i}_{target}"]
                getattr(attention, target).weight += adapters.scaling * up @ down
    return merged


def pooled_by_hand(hidden: torch.Tensor, batch) -> torch.Tensor:
    """``mean_last`` written out: per row, the mean of the response tokens' states ++ the last token's state."""
    rows = []
    for b in range(hidden.shape[0]):
        start, end = int(batch.prompt_lengths[b]), int(batch.prompt_lengths[b] + batch.response_lengths[b])
        rows.append(torch.cat([hidden[b, start:end].mean(0), hidden[b, end - 1]]))
    return torch.stack(rows)


def view_by_hand(model, merged, batch) -> torch.Tensor:
    """The encoder's input from ``merged``'s hidden states: pooled by hand for ``mean_last``, as the frozen pass
    pools for the other views."""
    states = merged(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
    ).hidden_states
    hidden = states[model.encoder_layer_index].float()
    if model.latent_cfg.encoder_view == "mean_last":
        return pooled_by_hand(hidden, batch)
    features = model.frozen_pass(batch)
    view = model.view_features(hidden, batch, model.encoder_token_weights(features))
    model_features = type(features)(**{**features.__dict__, **view})
    return model.encoder_input.__func__(_without_adapters(model), model_features)


class _without_adapters:
    """``model`` seen with no encoder adapters (so that ``encoder_input`` pools the features it is given)."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return None if name == "encoder_adapters" else getattr(self._model, name)


@pytest.mark.parametrize("training", ["frozen", "lora", "full"])
@pytest.mark.parametrize("view", VIEWS)
def test_at_the_start_the_adapted_pass_is_the_frozen_one(tokenizer, pairs, view, training):
    model, examples, _ = tiny_cvae(
        tokenizer, pairs, encoder_view=view, encoder_lora_layers=1, decoder_training=training
    )
    plain, _, _ = tiny_cvae(tokenizer, pairs, encoder_view=view, decoder_training=training)
    batch = collate(examples[:6], 2)
    features = model.frozen_pass(batch)
    assert model.encoder_adapters.is_zero()
    with torch.enable_grad():  # the pass runs (without gradients, zero adapters skip it)
        adapted = model.encoder_input(features)
    torch.testing.assert_close(adapted, plain.encoder_input(features), **TOL)
    with torch.no_grad():  # zero adapters, no gradient: the cached view itself, no pass
        torch.testing.assert_close(model.encoder_input(features), plain.encoder_input(features), rtol=0, atol=0)
        if view != "token_weighted_attention":
            assert model.encoder_input(features) is features.encoder_features


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("view", VIEWS)
def test_the_adapted_view_is_a_merged_copys_and_only_its_layers_move(tokenizer, pairs, view, layers):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_view=view, encoder_lora_layers=layers)
    randomise(model)
    adapters = model.encoder_adapters
    assert adapters.layers == range(2 - layers, 2)  # the top layers of the 2-layer model
    assert sorted(adapters.down.keys()) == sorted(f"{i}_{t}" for i in adapters.layers for t in ("q_proj", "v_proj"))
    batch = collate(examples[:6], 2)
    got = model.encoder_input(model.frozen_pass(batch))
    with torch.no_grad():
        torch.testing.assert_close(got, view_by_hand(model, merged_copy(model, range(2 - layers, 2)), batch), **TOL)
    plain, _, _ = tiny_cvae(tokenizer, pairs, encoder_view=view)
    assert (got - plain.encoder_input(plain.frozen_pass(batch))).abs().max() > 1e-3  # the adapters changed it


def test_an_earlier_feature_layer_adapts_the_layers_below_it(tokenizer, pairs):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_lora_layers=1, encoder_layer=1)
    assert model.encoder_adapters.layers == range(0, 1)  # hidden_states[1] is layer 0's output
    randomise(model)
    batch = collate(examples[:6], 2)
    with torch.no_grad():
        by_hand = view_by_hand(model, merged_copy(model, range(0, 1)), batch)
    torch.testing.assert_close(model.encoder_input(model.frozen_pass(batch)), by_hand, **TOL)


@pytest.mark.parametrize("training", ["frozen", "lora"])
def test_the_decoder_and_the_reference_never_see_the_adapters(tokenizer, pairs, training):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_lora_layers=2, decoder_training=training)
    batch = collate(examples[:6], 2)
    adapters = model.encoder_adapters
    with model.reference.active() as reference:  # transformers' own hooks on layers come and go: not those
        projections = list(adapted_modules(reference, adapters.targets, adapters.layers).values())
    hooks = [len(m._forward_hooks) for m in projections]
    before = model.frozen_pass(batch)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    decoded = model.decode(batch, vector).hidden
    randomise(model)
    model.encoder_input(before)  # runs the adapted pass: its hooks come off after it
    after = model.frozen_pass(batch)
    torch.testing.assert_close(after.zfree_token_nll, before.zfree_token_nll, rtol=0, atol=0)
    torch.testing.assert_close(after.encoder_features, before.encoder_features, rtol=0, atol=0)
    torch.testing.assert_close(model.decode(batch, vector).hidden, decoded, rtol=0, atol=0)
    assert [len(m._forward_hooks) for m in projections] == hooks  # the adapters' hooks are gone


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_the_gradient_reaches_the_adapters_from_their_zero_start(tokenizer, pairs, latent):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_lora_layers=2, latent=latent, decoder_training="frozen")
    model.train()
    out = model(collate(examples[:6], 2))
    out.loss.backward()
    ups = list(model.encoder_adapters.up.values())
    assert all(up.grad is not None and up.grad.abs().sum() > 0 for up in ups)  # B = 0 still gets a gradient
    assert all(p.grad is None for p in model.decoder.parameters())  # the frozen decoder stays frozen
    encoder_group = model.parameter_groups()["encoder"]
    assert all(any(p is q for q in encoder_group) for p in model.encoder_adapters.parameters())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("training", ["frozen", "lora"])
def test_the_adapters_gradients_are_the_merged_weights_gradients_through_a_and_b(
    tokenizer, pairs, training, checkpointing
):
    """``W' = W + s B A``: ``dL/dB = s G A^T`` and ``dL/dA = s B^T G`` for ``G = dL/dW'`` of the merged copy; the
    decoder's activation checkpointing changes nothing (the encoder's pass runs in eval mode, not checkpointed: a
    checkpoint's recompute would run without the adapters), nor do the decoder's own LoRA adapters (off in it)."""
    model, examples, _ = tiny_cvae(
        tokenizer,
        pairs,
        encoder_view="mean_last",
        encoder_lora_layers=2,
        gradient_checkpointing=checkpointing,
        decoder_training=training,
    )
    randomise(model)
    batch = collate(examples[:6], 2)  # rows that share a prefix: its row's gradient gathers theirs
    features = model.frozen_pass(batch)
    model.train()
    probe = torch.randn(len(batch), 2 * model.hidden_size, generator=torch.Generator().manual_seed(3))
    (model.encoder_input(features) * probe).sum().backward()
    merged = merged_copy(model, range(0, 2))
    merged.requires_grad_(True)
    (view_by_hand(model, merged, batch) * probe).sum().backward()
    adapters = model.encoder_adapters
    for i in range(2):
        for target in ("q_proj", "v_proj"):
            g = getattr(merged.model.layers[i].self_attn, target).weight.grad  # [out, in]
            up, down = adapters.up[f"{i}_{target}"], adapters.down[f"{i}_{target}"]
            torch.testing.assert_close(up.grad, adapters.scaling * g @ down.T, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(down.grad, adapters.scaling * up.T @ g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("view", ["token_weighted", "token_weighted_attention"])
@pytest.mark.parametrize("source", ["surprisal", "dynamic", "entropy"])
def test_cached_and_fresh_features_agree_for_every_weight_source(tokenizer, pairs, source, view):
    model, examples, _ = tiny_cvae(
        tokenizer, pairs, encoder_view=view, encoder_lora_layers=2, token_weight_source=source
    )
    randomise(model)
    batch = collate(examples[:10], 2, indices=list(range(10)))
    cache = build_feature_cache(model, examples[:10], pad_token_id=2)
    with torch.no_grad():
        torch.testing.assert_close(
            model.encoder_input(cache.features(batch, model.weighting_params)),
            model.encoder_input(model.frozen_pass(batch)),
            **TOL,
        )


def test_cached_and_fresh_features_and_chunked_passes_agree(tokenizer, pairs, monkeypatch):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_view="token_weighted_attention", encoder_lora_layers=2)
    randomise(model)
    batch = collate(examples[:10], 2, indices=list(range(10)))
    cache = build_feature_cache(model, examples[:10], pad_token_id=2)
    cached = cache.features(batch, model.weighting_params)
    assert cached.batch is batch
    with torch.no_grad():
        fresh = model.encoder_input(model.frozen_pass(batch))
        torch.testing.assert_close(model.encoder_input(cached), fresh, **TOL)
        monkeypatch.setattr(cvae_base, "ADAPTED_PASS_ROWS", 3)  # 4 chunks of 3, 3, 3 and 1 rows
        torch.testing.assert_close(model.encoder_input(cached), fresh, **TOL)


def test_features_without_their_batch_are_refused(tokenizer, pairs):
    model, examples, _ = tiny_cvae(tokenizer, pairs, encoder_lora_layers=1)
    randomise(model)
    features = model.frozen_pass(collate(examples[:4], 2))
    features.batch = None
    with pytest.raises(ValueError, match="encoder's pass needs the batch's tokens"):
        model.encoder_input(features)


def test_gpt2s_conv1d_projections_are_adapted(tokenizer, pairs):
    from disentanglement.data import tokenize_pairs
    from disentanglement.testing import tiny_gpt2

    config = build_config(
        dict(chat_template=False, encoder_lora_layers=2, encoder_lora_target_modules=["c_attn"], encoder_lora_rank=4)
    )
    model = build_cvae(config, tiny_gpt2(len(tokenizer)))
    assert sorted(model.encoder_adapters.down.keys()) == ["0_c_attn", "1_c_attn"]
    assert model.encoder_adapters.up["0_c_attn"].shape == (96, 4)  # c_attn: 32 -> 3 x 32
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    batch = collate(examples[:4], 2)
    features = model.frozen_pass(batch)
    model.train()
    model(batch, features).loss.backward()
    assert model.encoder_adapters.up["0_c_attn"].grad.abs().sum() > 0


def test_training_moves_the_adapters_and_a_checkpoint_keeps_them(tokenizer, pairs, tmp_path):
    records = train_and_read_metrics(
        tmp_path / "run",
        tiny_llama(len(tokenizer)),
        tokenizer,
        pairs,
        encoder_view="token_weighted",
        encoder_lora_layers=2,
        latent="discrete",
        encoder_lr=0.05,
        save_every=4,
    )
    assert all(math.isfinite(r["loss"]) for r in records)
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    model, _, config, _ = load_trained(checkpoint, (tiny_llama(len(tokenizer)), tokenizer))
    assert config.latent.encoder_lora_layers == 2
    assert not model.encoder_adapters.is_zero()  # they left their zero start, and were saved
    fresh, _, _ = tiny_cvae(tokenizer, pairs, encoder_view="token_weighted", encoder_lora_layers=2, latent="discrete")
    saved = model.trainable_state_dict()
    assert any(name.startswith("encoder_adapters.up.") for name in saved)
    fresh.load_state_dict(saved, strict=False)
    for name, up in fresh.encoder_adapters.up.items():
        torch.testing.assert_close(up, model.encoder_adapters.up[name], rtol=0, atol=0)


def test_the_options_are_checked(tokenizer, pairs):
    assert build_config({}).latent.encoder_lora_layers == 0
    with pytest.raises(ConfigError, match=r"encoder_lora_layers"):
        build_config({"encoder_lora_layers": -1})
    with pytest.raises(ConfigError, match=r"encoder_lora_rank"):
        build_config({"encoder_lora_layers": 1, "encoder_lora_rank": 0})
    with pytest.raises(ConfigError, match=r"encoder_lora_target_modules must name at least one module"):
        build_config({"encoder_lora_layers": 1, "encoder_lora_target_modules": []})
    with pytest.raises(ValueError, match=r"name no linear projection in layers 1\.\.1 of LlamaForCausalLM"):
        tiny_cvae(tokenizer, pairs, encoder_lora_layers=1, encoder_lora_target_modules=["nope"])
    with pytest.raises(ValueError, match=r"hidden_states\[1\] has 1 transformer layers below it: set at most 1"):
        tiny_cvae(tokenizer, pairs, encoder_lora_layers=2, encoder_layer=1)
    with pytest.raises(ValueError, match=r"not the token embeddings"):
        tiny_cvae(tokenizer, pairs, encoder_lora_layers=1, encoder_layer=0)
