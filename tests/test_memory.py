"""``latent_placement = "memory"``: per-layer key/value memory slots, on tiny Llama and GPT-2 models.

Each decoder output is checked against a plain attention written out here layer by layer (the memory
keys and values concatenated in front of the sequence's own), the z-free reference, or a full recompute.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from disentanglement.config import ConfigError, Scoring, build_config
from disentanglement.data import Example, collate
from disentanglement.evaluation import score_batch
from disentanglement.generation import SamplingOptions, encode_prompts, generate, generation_inputs, memory_generate
from disentanglement.memory import cache_from_layers
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.token_weighting import token_weighting_from_base_nll
from helpers import prompt_batch, tiny_gpt2, tiny_llama

ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2}
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
CASES = [("llama", "frozen"), ("llama", "lora"), ("gpt2", "frozen"), ("gpt2", "lora")]


def make_batch(tokenizer, n=4):
    return prompt_batch(tokenizer, n, chat_template=False)


def memory_model(tokenizer, arch="llama", training="frozen", **overrides):
    values = dict(
        preset="raw",  # the recipe these tests were written against (the defaults before issue 23)
        latent_placement="memory",
        decoder_training=training,
        chat_template=False,
        latent_tokens=3,
        token_weighted_weight=1.0,
        zfree_reference_scale=2.0,
        lora_target_modules=LORA_TARGETS[arch],
    )
    values.update(overrides)
    config = build_config(values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, ARCHITECTURES[arch](len(tokenizer))).eval()
        if training == "lora":  # make the adapters do something
            for name, param in model.decoder.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.5)
    return model, config


def base_lm(model):
    """The Hugging Face causal LM under a peft wrapper (its LoRA-wrapped modules apply the adapters)."""
    decoder = model.decoder
    return decoder.get_base_model() if hasattr(decoder, "get_base_model") else decoder


def plain_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d)) v over the allowed ``[B, T, P + T]`` keys; q ``[B, h, T, d]``."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = scores.softmax(-1) @ v  # [B, h, T, d]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def manual_memory_forward(lm, ids, attention, keys, values):
    """Final hidden states ``[B, T, H]`` of a tiny Llama or GPT-2 whose layer ``l`` attends to the memory
    ``keys[l], values[l]`` (``[B, h, P, d]``) before the causal past; positions ``0 .. T-1``."""
    B, T = ids.shape
    P = keys.shape[-2]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool)) & attention.bool().unsqueeze(1)  # [B, T, T]
    allowed = torch.cat([torch.ones(B, T, P, dtype=torch.bool), causal], dim=-1)  # [B, T, P + T]
    positions = torch.arange(T).expand(B, T)

    def heads(t, d):
        return t.view(B, T, -1, d).transpose(1, 2)  # [B, h, T, d]

    if hasattr(lm, "transformer"):  # GPT-2
        net = lm.transformer
        x = net.wte(ids) + net.wpe(positions)
        for layer, block in enumerate(net.h):
            d = block.attn.head_dim
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(x.shape[-1], dim=2)
            k = torch.cat([keys[layer], heads(k, d)], dim=2)
            v = torch.cat([values[layer], heads(v, d)], dim=2)
            x = x + block.attn.c_proj(plain_attention(heads(q, d), k, v, allowed))
            x = x + block.mlp(block.ln_2(x))
        return net.ln_f(x)
    net = lm.model
    x = net.embed_tokens(ids)
    cos, sin = net.rotary_emb(x, positions)
    for layer, block in enumerate(net.layers):
        attn = block.self_attn
        d = attn.head_dim
        h = block.input_layernorm(x)
        q, k = apply_rotary_pos_emb(heads(attn.q_proj(h), d), heads(attn.k_proj(h), d), cos, sin)
        k = torch.cat([keys[layer], k], dim=2)  # the memory keys are not rotated
        v = torch.cat([values[layer], heads(attn.v_proj(h), d)], dim=2)
        x = x + attn.o_proj(plain_attention(q, k, v, allowed))
        x = x + block.mlp(block.post_attention_layernorm(x))
    return net.norm(x)


@pytest.mark.parametrize(("arch", "training"), CASES)
def test_decode_equals_a_plain_attention_over_memory_and_sequence(tokenizer, arch, training):
    model, _ = memory_model(tokenizer, arch, training)
    batch = make_batch(tokenizer)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    decoded = model.decode(batch, vector, window=False)
    keys, values = model.memory_keys_values(model.latent_embeddings(vector))  # [Ly, B, h, P, d]
    P = model.num_latent_tokens
    assert keys.shape == values.shape == (2, len(batch), 2, P, 16)
    expected = manual_memory_forward(base_lm(model), batch.input_ids, batch.attention_mask, keys, values)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(decoded.hidden[real], expected[real], rtol=1e-4, atol=1e-5)
    # the sequence is the z-free one: same ids and masks, offsets 0, Tc = T
    assert torch.equal(decoded.input_ids, batch.input_ids) and torch.equal(decoded.target_mask, batch.target_mask)
    assert decoded.offsets.eq(0).all()
    # and the memory matters: without it the states are the z-free decoder's, which differ
    with torch.no_grad():
        plain = base_lm(model)(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
        )
    assert not torch.allclose(decoded.hidden[real], plain.hidden_states[-1][real], atol=1e-3)


@pytest.mark.parametrize(("arch", "training"), CASES)
def test_hidden_memory_gives_the_zfree_states_at_unshifted_positions(tokenizer, arch, training):
    """With the ``P`` memory slots masked out, every layer's states are the z-free pass's exactly: the
    sequence keeps positions ``0 .. T-1``. The same memory inputs with positions moved by ``P`` differ
    (for GPT-2's absolute positions), so the check sees a shift."""
    model, _ = memory_model(tokenizer, arch, training)
    batch = make_batch(tokenizer)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    P = model.num_latent_tokens
    embeds = model.decoder.get_input_embeddings()(batch.input_ids)
    positions = torch.arange(batch.input_ids.shape[1]).expand(len(batch), -1)
    real = batch.attention_mask.bool()

    def states(shift=0):
        extra = model.memory_inputs(
            model.latent_embeddings(vector), batch.attention_mask, positions + shift, embeds.dtype
        )
        assert extra["attention_mask"].shape == (len(batch), P + batch.input_ids.shape[1])
        assert extra["attention_mask"][:, :P].eq(1).all()
        extra["attention_mask"][:, :P] = 0  # hide the memory
        with torch.no_grad():
            return model.decoder(inputs_embeds=embeds, output_hidden_states=True, **extra).hidden_states

    # The decoder itself without memory (frozen: the z-free reference; LoRA: with its adapters on).
    with torch.no_grad():
        zfree = model.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    hidden = states()
    for layer, (mine, ref) in enumerate(zip(hidden, zfree.hidden_states, strict=True)):
        torch.testing.assert_close(mine[real], ref[real], rtol=1e-5, atol=1e-5, msg=f"layer {layer}")
    if arch == "gpt2":
        shifted = states(shift=P)
        assert not torch.allclose(shifted[-1][real], zfree.hidden_states[-1][real], atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_layer_reads_its_own_memory(tokenizer, arch):
    """Changing the values of layer ``l``'s memory alone leaves the states before layer ``l`` unchanged and
    changes those after it; the loss's gradient reaches the keys and values of every layer."""
    model, _ = memory_model(tokenizer, arch)
    batch = make_batch(tokenizer)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    keys, values = (t.detach() for t in model.memory_keys_values(model.latent_embeddings(vector)))
    embeds = model.decoder.get_input_embeddings()(batch.input_ids)
    positions = torch.arange(batch.input_ids.shape[1]).expand(len(batch), -1)
    mask = torch.cat([torch.ones(len(batch), model.num_latent_tokens, dtype=torch.long), batch.attention_mask], 1)
    real = batch.attention_mask.bool()

    def states(v):
        cache = cache_from_layers(zip(keys, v, strict=True), model.decoder)
        with torch.no_grad():
            return model.decoder(
                inputs_embeds=embeds,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                output_hidden_states=True,
            ).hidden_states

    base = states(values)
    layers = keys.shape[0]
    for layer in range(layers):
        changed = values.clone()
        changed[layer] += 1.0
        other = states(changed)
        for i in range(layer + 1):  # hidden_states[i] is the input of layer i
            torch.testing.assert_close(other[i][real], base[i][real])
        for i in range(layer + 1, layers + 1):
            differs = (other[i] - base[i]).abs().amax(-1)[real]  # every real position of every later layer
            assert differs.gt(1e-4).all(), (layer, i)
    model.train()
    model(batch).loss.backward()
    grad = model.latent_memory.projection.weight.grad.view(layers, 2, -1)  # [Ly, key/value, ...]
    assert grad.abs().sum(-1).gt(0).all(), "every layer's keys and values get a gradient"


def test_a_different_latent_changes_every_layer_output(tokenizer):
    model, _ = memory_model(tokenizer)
    batch = make_batch(tokenizer)
    real = batch.attention_mask.bool()
    a, b = torch.randn(2, len(batch), model.latent_vector_dim)
    embeds = model.decoder.get_input_embeddings()(batch.input_ids)
    positions = torch.arange(batch.input_ids.shape[1]).expand(len(batch), -1)
    outs = []
    for vector in (a, b):
        extra = model.memory_inputs(model.latent_embeddings(vector), batch.attention_mask, positions, embeds.dtype)
        with torch.no_grad():
            outs.append(model.decoder(inputs_embeds=embeds, output_hidden_states=True, **extra).hidden_states)
    torch.testing.assert_close(outs[0][0], outs[1][0])  # the token embeddings: z is not in the sequence
    for layer in range(1, len(outs[0])):
        assert (outs[0][layer] - outs[1][layer]).abs().amax(-1)[real].gt(1e-4).all(), layer


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_token_weights_are_the_zfree_ones_unaligned(tokenizer, latent):
    """Offsets 0: the weights on the conditioned positions are those computed on the z-free layout, and
    the decoder's supervised positions are the z-free pass's."""
    model, _ = memory_model(tokenizer, latent=latent, token_weight_alpha=1.0)
    batch = make_batch(tokenizer)
    features = model.frozen_pass(batch)
    out = model(batch, features)
    target = batch.target_mask[:, 1:]
    assert torch.equal(out.target_mask, target)
    assert torch.equal(out.token_nll.ne(0), features.zfree_token_nll.ne(0))
    expected = token_weighting_from_base_nll(
        features.zfree_token_nll, target, 1.0, model.reconstruction_cfg.token_weight_eps
    )
    torch.testing.assert_close(out.weighting.token_weights, expected.token_weights)
    torch.testing.assert_close(out.weighting.aligned_base_token_nll, features.zfree_token_nll * target)


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_evaluation_scores_under_memory(tokenizer, latent):
    """The evaluation's per-token NLLs sit on the z-free positions; the discrete prior mixture's sequence
    NLL (exact: every code) is ``-log sum_k p(k|x) p(y|x,k)``, and the importance-weighted bound (exact for
    the nearest code) ``-log p(y|x,k*) - log p(k*|x)``, both computed here from the memory decoder directly."""
    model, _ = memory_model(tokenizer, latent=latent, codebook_size=3)
    batch = make_batch(tokenizer)
    features = model.frozen_pass(batch)
    with torch.no_grad():
        scores = score_batch(model, batch, features, Scoring(iw_samples=4))
    target = batch.target_mask[:, 1:].float()
    assert torch.equal(scores.target, target)
    torch.testing.assert_close(scores.zfree_nll, features.zfree_token_nll * target)
    posterior, _ = model.conditioned_token_nll(batch, scores.summary.vector)
    torch.testing.assert_close(scores.posterior_nll, posterior.detach() * target)
    for name in ("posterior_nll", "prior_nll"):
        assert torch.isfinite(getattr(scores, name)).all() and getattr(scores, name)[target.bool()].gt(0).all()
    if latent == "discrete":
        with torch.no_grad():
            per_code = torch.stack(
                [
                    model.conditioned_token_nll(batch, model.codes_to_vector(torch.full((len(batch), 1), k)))[0].sum(1)
                    for k in range(3)
                ]
            )  # [K, B]
            log_prior = model.prior_log_probs(features)[:, 0].T  # [K, B]
        expected = -torch.logsumexp(log_prior - per_code, 0)
        torch.testing.assert_close(scores.prior_nll.sum(1).double(), expected.double(), rtol=1e-4, atol=1e-4)
        # the importance-weighted bound is exact for the nearest code: -log p(y|x,k*) - log p(k*|x)
        codes = scores.summary.codes[:, 0]
        assert scores.iw_exact
        rows = torch.arange(len(batch))
        want = per_code[codes, rows] - log_prior[codes, rows]
        torch.testing.assert_close(-scores.iw_log_weights[0], want.double(), rtol=1e-5, atol=1e-4)
    else:  # reparameterised draws: each sample's sequence NLL is the memory decoder's under some z
        assert scores.iw_sequence_nll.shape == (4, len(batch)) and torch.isfinite(scores.iw_log_weights).all()


def test_memory_parameters_train_in_the_encoder_group(tokenizer):
    model, _ = memory_model(tokenizer, "llama", "lora")
    groups = model.parameter_groups()
    memory = list(model.latent_memory.parameters())
    # a large linear map, at the encoder heads' rate (the latent group's 3e-2 is the prompt-tuning rate)
    assert all(any(p is q for q in groups["encoder"]) for p in memory)
    assert {n for n in model.trainable_state_dict() if n.startswith("latent_memory.")} == {
        "latent_memory.projection.weight",
        "latent_memory.projection.bias",
    }
    H, P = model.hidden_size, model.num_latent_tokens
    assert model.latent_memory.projection.weight.shape == (2 * 2 * 2 * 16, H)  # Ly x (k, v) x heads x head_dim
    assert model.latent_projection.out_features == P * H


def test_memory_is_refused_where_it_does_not_apply(tokenizer):
    config = build_config({"latent_placement": "memory"})
    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=8,
        )
    )
    with pytest.raises(ConfigError, match="full .*key/value cache") as info:
        build_cvae(config, sliding)
    assert info.value.field == "latent_placement"
    cross = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, add_cross_attention=True)
    )
    with pytest.raises(ConfigError, match="without cross-attention"):
        build_cvae(config, cross)
    with pytest.raises(ConfigError, match="latent_placement"):
        build_config({"latent_placement": "memories"})
    # activation checkpointing would drop the cache, and with it the memory
    model, _ = memory_model(tokenizer, "gpt2")
    batch = make_batch(tokenizer)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    model.decoder.activation_checkpointing_enable()
    with pytest.raises(ConfigError, match="checkpointing"):
        model.decode(batch, vector)


# --------------------------------------------------------------------------- generation


def response_logits(model, prompt_ids, response, vector, pad_token_id):
    """The training layout's logits ``[len(response), V]`` (``decode``, one right-padded row, positions 0 .. T-1)
    at the positions that predict each response token, under the latent ``vector [1, L]``."""
    batch = collate([Example(prompt_ids, response, None, "test")], pad_token_id)
    with torch.no_grad():
        logits, _, _, _ = model.decode_logits(batch, vector)
    start = len(prompt_ids) - 1  # predicts the first response token
    return logits[0, start : start + len(response)]


def generation_setup(tokenizer, arch, training):
    model, config = memory_model(tokenizer, arch, training)
    ids = encode_prompts(["ab", "a longer prompt", "mid size"], tokenizer, config.data)
    vectors = torch.randn(len(ids), model.latent_vector_dim, generator=torch.Generator().manual_seed(1))
    embeds, attention = generation_inputs(model, ids, vectors, tokenizer.pad_token_id)
    return model, config, ids, vectors, embeds, attention


@pytest.mark.parametrize(("arch", "training"), CASES)
def test_cached_generation_equals_a_full_recompute(tokenizer, arch, training):
    model, _, ids, vectors, embeds, attention = generation_setup(tokenizer, arch, training)
    assert embeds.shape[1] == max(map(len, ids)), "the prompt alone: the latent is in the cache"
    greedy = SamplingOptions(greedy=True, max_new_tokens=12)
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    cached = memory_generate(model, embeds, attention, vectors, greedy, eos, pad)
    recomputed = memory_generate(model, embeds, attention, vectors, greedy, eos, pad, use_cache=False)
    assert cached.shape == (len(ids), 12)
    assert torch.equal(cached, recomputed)
    # sampling: the same draws from the same generator state
    sampled = SamplingOptions(temperature=1.0, top_p=0.95, max_new_tokens=12)
    torch.manual_seed(3)
    cached = memory_generate(model, embeds, attention, vectors, sampled, eos, pad)
    torch.manual_seed(3)
    assert torch.equal(cached, memory_generate(model, embeds, attention, vectors, sampled, eos, pad, use_cache=False))


@pytest.mark.parametrize(("arch", "training"), [("llama", "frozen"), ("gpt2", "lora")])
def test_greedy_generation_is_the_training_decoders_argmax(tokenizer, arch, training):
    """Every greedily generated token (left-padded batch, cached loop) is the argmax of the training
    layout's logits (``decode``, right-padded, positions 0 .. T-1) over prompt + the tokens before it:
    positions continue from the sequence's length, not from P + its length."""
    model, _, ids, vectors, embeds, attention = generation_setup(tokenizer, arch, training)
    greedy = SamplingOptions(greedy=True, max_new_tokens=8)
    tokens = memory_generate(model, embeds, attention, vectors, greedy, set(), tokenizer.pad_token_id)
    for row, prompt_ids in enumerate(ids):
        response = tokens[row].tolist()
        logits = response_logits(model, prompt_ids, response, vectors[row : row + 1], tokenizer.pad_token_id)
        assert logits.argmax(-1).tolist() == response


def test_generate_uses_the_memory_loop(tokenizer):
    model, config, ids, _, _, _ = generation_setup(tokenizer, "llama", "frozen")
    prompts = ["ab", "a longer prompt"]
    greedy = SamplingOptions(greedy=True, max_new_tokens=6)
    result = generate(model, tokenizer, config, prompts, sampling=greedy)
    K = config.latent.codebook_size
    assert len(result["generations"]) == len(prompts) * K
    for g in result["generations"]:
        codes = torch.tensor([g["latent_description"]["codes"]])
        vector = model.codes_to_vector(codes)
        embeds, attention = generation_inputs(model, [ids[g["prompt_index"]]], vector, tokenizer.pad_token_id)
        tokens = memory_generate(model, embeds, attention, vector, greedy, {tokenizer.eos_token_id}, 2, use_cache=False)
        row = tokens[0].tolist()
        cut = row.index(2) if 2 in row else len(row)
        assert g["text"] == tokenizer.decode(row[:cut], skip_special_tokens=True)
    texts = {g["text"] for g in result["generations"] if g["prompt_index"] == 0}
    assert len(texts) > 1, "the codes' memories steer the greedy decode"


def test_lora_memory_trains_saves_and_reloads(tmp_path, tokenizer):
    """Through the trainer with LoRA: the memory projection and the adapters move, the checkpoint holds the
    memory, and the reloaded model decodes exactly as the trained one."""
    from disentanglement.checkpoints import load_trained
    from disentanglement.trainer import train
    from helpers import trainer_config

    config = trainer_config(
        tmp_path / "run", latent_placement="memory", decoder_training="lora", latent_tokens=2, max_steps=3, save_every=3
    )
    decoder = tiny_llama(len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        start = build_cvae(config, tiny_llama(len(tokenizer))).latent_memory.projection.weight.detach().clone()
    prompts = [f"prompt {'x' * i} end" for i in range(12)]
    torch.manual_seed(0)
    result = train(config, (decoder, tokenizer), make_hidden_factor_pairs(prompts, kind="clean", seed=1))
    trained = result.model.eval()
    assert not torch.equal(trained.latent_memory.projection.weight.detach(), start)
    lora_b = [p for n, p in trained.decoder.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.detach().abs().sum() > 0 for p in lora_b), "the adapters trained (they start at 0)"
    loaded, *_ = load_trained(result.checkpoint, (tiny_llama(len(tokenizer)), tokenizer))
    loaded.eval()
    for name, value in trained.trainable_state_dict().items():
        torch.testing.assert_close(loaded.trainable_state_dict()[name], value, msg=name)
    batch = make_batch(tokenizer)
    vector = torch.randn(len(batch), trained.latent_vector_dim)
    with torch.no_grad():
        torch.testing.assert_close(loaded.decode(batch, vector).hidden, trained.decode(batch, vector).hidden)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_memory_is_the_decoders_own_keys_of_the_latent_plus_a_map_that_starts_at_zero(tokenizer, arch):
    model, _ = memory_model(tokenizer, arch)
    assert not model.latent_memory.projection.weight.any() and not model.latent_memory.projection.bias.any()
    latent = model.latent_embeddings(
        torch.randn(3, model.latent_vector_dim, generator=torch.Generator().manual_seed(2))
    )
    with torch.no_grad():
        model.latent_memory.projection.weight.normal_(std=0.1)
        own = model.decoder(inputs_embeds=latent, use_cache=True)["cache"]  # the P embeddings as a sequence
        keys, values = model.memory_keys_values(latent)
        learned = model.latent_memory.projection(latent).view(3, model.num_latent_tokens, len(own.layers), 2, -1)
    for layer, cached in enumerate(own.layers):
        B, heads, P, dim = cached.keys.shape
        per_slot = learned[:, :, layer].view(B, P, 2, heads, dim).permute(2, 0, 3, 1, 4)  # [2, B, Hkv, P, Dh]
        torch.testing.assert_close(keys[layer], cached.keys + per_slot[0])
        torch.testing.assert_close(values[layer], cached.values + per_slot[1])
