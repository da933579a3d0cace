"""Both CVAEs on tiny Llama and GPT-2 models built in-process: injection, alignment, gradients, output record."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from disentanglement.config import build_config
from disentanglement.continuous_cvae import ContinuousCVAE
from disentanglement.data import collate, tokenize_pairs
from disentanglement.losses import TERM_WEIGHT_FIELDS
from disentanglement.models import build_cvae
from disentanglement.regularizers import gaussian_kl
from disentanglement.shared_discrete_cvae import SharedDiscreteCVAE
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.token_weighting import align_to_conditioned
from disentanglement.trainer import make_optimizer
from helpers import prompt_batch, tiny_gpt2, tiny_llama, tiny_tokenizer
from references import manual_zfree_nll

ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2}
ALL_TERMS = dict.fromkeys(TERM_WEIGHT_FIELDS.values(), 0.5)


def make_model(tokenizer, arch="llama", **overrides):
    values = dict(
        ALL_TERMS, preset="raw", zfree_reference_scale=2.0, bow_weight=0.1
    )  # the recipe these tests were written against (the defaults before issue 23)
    values.update(overrides)
    config = build_config(values)
    decoder = ARCHITECTURES[arch](len(tokenizer))
    return build_cvae(config, decoder), config


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
def test_forward_backward_every_combination(tokenizer, arch, latent, placement):
    extra = {"divergence_weight": 0.2} if latent == "discrete" else {}
    model, _ = make_model(tokenizer, arch, latent=latent, latent_placement=placement, **extra)
    model.train()
    batch = prompt_batch(tokenizer)
    out = model(batch, step=3)
    assert torch.isfinite(out.loss)
    assert set(out.reconstruction_terms) == set(TERM_WEIGHT_FIELDS)
    out.loss.backward()
    groups = model.parameter_groups()
    assert groups["decoder"] == []
    for param in groups["encoder"] + groups["latent"]:
        assert param.grad is not None, "every trainable latent parameter gets a gradient"
    for param in model.decoder.parameters():
        assert param.grad is None and not param.requires_grad
    if latent == "discrete":
        assert out.latent.shape == (len(batch), 1) and out.latent.dtype == torch.long
        assert out.divergence is not None and out.divergence > 0
        assert torch.allclose(out.divergence_term, -0.2 * out.divergence)
    else:
        assert out.latent.shape == (len(batch), 16)
    assert out.kl_per_unit.ndim == 1
    assert "bow_loss" in out.aux_losses


@pytest.mark.parametrize("placement", ["prefix", "between"])
def test_conditioned_sequence_places_latent_and_aligns_tokens(tokenizer, placement):
    model, _ = make_model(tokenizer, latent_placement=placement)
    batch = prompt_batch(tokenizer)
    P = model.num_latent_tokens
    latent = torch.randn(len(batch), P, model.hidden_size)
    embeds, ids, attention, target, offsets = model.conditioned_inputs(batch, latent)
    token_embeds = model.decoder.get_input_embeddings()(batch.input_ids)
    for b in range(len(batch)):
        start = 0 if placement == "prefix" else int(batch.prompt_lengths[b])
        torch.testing.assert_close(embeds[b, start : start + P], latent[b])
        assert attention[b, start : start + P].eq(1).all() and target[b, start : start + P].eq(0).all()
        for t in range(batch.input_ids.shape[1]):
            c = t if t < start else t + P
            assert ids[b, c] == batch.input_ids[b, t]
            assert target[b, c] == batch.target_mask[b, t]
            torch.testing.assert_close(embeds[b, c], token_embeds[b, t])
            if batch.target_mask[b, t]:
                assert c == t + int(offsets[b]), "supervised tokens sit at z-free position + offset"
    # The z-free supervised positions, moved by the offsets, are exactly the decoder's (the weights
    # computed on the z-free layout and on the conditioned one normalise over the same tokens).
    zfree_positions = batch.target_mask[:, 1:]
    moved = align_to_conditioned(zfree_positions.float(), offsets, target.shape[1] - 1, zfree_mask=zfree_positions)
    assert torch.equal(moved, target[:, 1:].float())
    assert torch.equal(model.conditioned_target_mask(batch), target)


def test_frozen_features_match_a_manual_pass(tokenizer):
    model, _ = make_model(tokenizer)
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)
    out = model.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        torch.testing.assert_close(features.prior_features[b], hidden[b, p - 1])
        torch.testing.assert_close(features.encoder_features[b, : model.hidden_size], hidden[b, p : p + r].mean(0))
        torch.testing.assert_close(features.encoder_features[b, model.hidden_size :], hidden[b, p + r - 1])
        expected = F.cross_entropy(out.logits[b, p - 1 : p + r - 1], batch.input_ids[b, p : p + r], reduction="none")
        torch.testing.assert_close(features.zfree_token_nll[b, p - 1 : p + r - 1], expected)
        assert features.zfree_token_nll[b, : p - 1].eq(0).all() and features.zfree_token_nll[b, p + r - 1 :].eq(0).all()
    assert not features.encoder_features.requires_grad


def test_token_weights_follow_the_reference_surprisal(tokenizer):
    model, _ = make_model(tokenizer, latent_placement="between")
    batch = prompt_batch(tokenizer)
    out = model(batch)
    features = model.frozen_pass(batch)
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        P = model.num_latent_tokens
        base = features.zfree_token_nll[b, p - 1 : p + r - 1]
        # The latent sits between prompt and response: conditioned position = z-free position + P.
        torch.testing.assert_close(out.weighting.aligned_base_token_nll[b, p - 1 + P : p + r - 1 + P], base)
        torch.testing.assert_close(out.weighting.token_weights[b, p - 1 + P : p + r - 1 + P], base / base.sum())
        assert out.target_mask[b].sum() == r


def test_forward_record_terms_agree_with_the_stack(tokenizer):
    model, config = make_model(tokenizer, latent="continuous", beta=0.5, beta_schedule="constant")
    model.eval()
    batch = prompt_batch(tokenizer)
    out = model(batch)
    weights = {term: getattr(config.reconstruction, field) for term, field in TERM_WEIGHT_FIELDS.items()}
    expected = sum(weights[t] * v for t, v in out.reconstruction_terms.items())
    torch.testing.assert_close(out.reconstruction_total, expected)
    mu, logvar = model.posterior(model.frozen_pass(batch))
    mu_p, logvar_p = model.prior(model.frozen_pass(batch))
    kl = gaussian_kl(mu, logvar, mu_p, logvar_p)
    torch.testing.assert_close(out.kl, kl.sum(1).mean())
    torch.testing.assert_close(out.kl_term, 0.5 * kl.mean(0).sum())
    total = out.reconstruction_total + out.kl_term + 0.1 * out.aux_losses["bow_loss"]
    torch.testing.assert_close(out.loss, total)
    torch.testing.assert_close(out.latent, mu)  # the posterior mean at evaluation


def test_discrete_nearest_code_posterior_and_straight_through(tokenizer):
    model, _ = make_model(tokenizer, codebook_size=5, num_slots=2, commitment_weight=0.25)
    assert isinstance(model, SharedDiscreteCVAE)
    model.train()
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)
    sample = model.encode(features, step=0)
    e = model.encoder_outputs(features)
    distances = torch.cdist(e.reshape(-1, e.shape[-1]), model.codebook).view(len(batch), 2, 5)
    torch.testing.assert_close(sample.latent, distances.argmin(-1))
    torch.testing.assert_close(sample.vector, model.codebook[sample.latent].flatten(1))
    log_p = model.prior_log_probs(features)
    torch.testing.assert_close(sample.kl_per_unit, -log_p.gather(-1, sample.latent.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(
        sample.aux_losses["commitment_loss"], 0.25 * (e - model.codebook[sample.latent]).pow(2).mean()
    )
    sample.vector.sum().backward()
    assert model.codebook.grad is not None and model.encoder[0].weight.grad is not None
    # code usage is logged, computed only when asked for
    stats = sample.logged_stats()
    for m in range(2):
        codes = sample.latent[:, m].tolist()
        shares = [codes.count(k) / len(codes) for k in set(codes)]
        assert stats[f"codes_used_slot_{m}"] == len(shares)
        assert stats[f"code_perplexity_slot_{m}"] == pytest.approx(math.exp(-sum(p * math.log(p) for p in shares)))


def test_gumbel_option_kl_and_temperature(tokenizer):
    model, _ = make_model(
        tokenizer,
        assignment="gumbel",
        prior="fixed",
        gumbel_temperature=2.0,
        gumbel_temperature_min=0.5,
        gumbel_anneal_steps=100,
        codebook_size=4,
    )
    model.train()
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)
    sample = model.encode(features, step=100)
    assert sample.stats["temperature"] == pytest.approx(0.5)
    assert model.encode(features, step=50).stats["temperature"] == pytest.approx(1.0)
    log_q = F.log_softmax(model.posterior_logits(model.encoder_outputs(features)), -1)
    expected = (log_q.exp() * (log_q + torch.log(torch.tensor(4.0)))).sum(-1)
    torch.testing.assert_close(sample.kl_per_unit, expected)
    assert sample.vector.shape == (len(batch), model.latent_cfg.code_dim)


def test_batch_prior_kl_is_kl_of_the_batch_mean(tokenizer):
    model, _ = make_model(tokenizer, assignment="gumbel", prior="fixed", batch_prior_kl=True)
    model.train()
    features = model.frozen_pass(prompt_batch(tokenizer))
    sample = model.encode(features, step=0)
    q_bar = F.softmax(model.posterior_logits(model.encoder_outputs(features)), -1).mean(0)  # [M, K]
    expected = (q_bar * (q_bar.log() + torch.log(torch.tensor(4.0)))).sum(-1)
    torch.testing.assert_close(sample.kl_per_unit[0], expected)
    assert torch.equal(sample.kl_per_unit[0], sample.kl_per_unit[-1])


def test_dead_codes_restart_at_recent_encoder_outputs(tokenizer):
    model, _ = make_model(tokenizer, codebook_size=8, dead_code_steps=3)
    model.train()
    features = model.frozen_pass(prompt_batch(tokenizer))
    sample = model.encode(features, step=5)
    used = set(sample.latent.flatten().tolist())
    before = model.codebook.detach().clone()
    model.post_step(5)
    recent = model.encoder_outputs(features).detach().reshape(-1, model.latent_cfg.code_dim)
    for k in range(8):
        if k in used:
            assert torch.equal(model.codebook[k], before[k])
        else:  # unused since step 0: restarted near one of this batch's encoder outputs
            assert torch.cdist(model.codebook[k : k + 1].detach(), recent).min() < 0.3  # noise 0.01 * randn(64)
    assert model.code_last_used.min() == 5


def test_continuous_sampling_is_reparameterised(tokenizer):
    model, _ = make_model(tokenizer, latent="continuous", prior="fixed")
    assert isinstance(model, ContinuousCVAE)
    model.train()
    features = model.frozen_pass(prompt_batch(tokenizer))
    torch.manual_seed(0)
    a = model.encode(features, 0)
    torch.manual_seed(0)
    b = model.encode(features, 0)
    torch.testing.assert_close(a.vector, b.vector)
    a.vector.sum().backward()
    assert model.encoder[0].weight.grad is not None
    mu, logvar = model.posterior(features)
    torch.testing.assert_close(a.kl_per_unit, 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar))
    assert model.prior_vectors(features, 3).shape == (3, mu.shape[0], mu.shape[1])


def test_optimizer_holds_every_trainable_parameter(tokenizer):
    for overrides in ({}, {"latent": "continuous"}, {"decoder_training": "lora"}, {"decoder_training": "full"}):
        model, config = make_model(tokenizer, **overrides)
        optimizer = make_optimizer(model, config)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        assert trainable == in_optimizer, overrides


def test_lora_reference_is_the_adapter_free_model(tokenizer):
    base = tiny_llama(len(tokenizer))
    batch = prompt_batch(tokenizer)
    with torch.no_grad():
        expected = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # The LM head carries adapters too, so the entropy (computed through it) must be taken with them off.
    model, _ = make_model(
        tokenizer, decoder_training="lora", token_weight_source="entropy", lora_target_modules=["q_proj", "lm_head"]
    )
    model.decoder.base_model.model.load_state_dict(base.state_dict(), strict=False)
    for name, param in model.decoder.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)  # adapters now change the output
    features = model.frozen_pass(batch)
    logits = expected
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        nll = F.cross_entropy(logits[b, p - 1 : p + r - 1], batch.input_ids[b, p : p + r], reduction="none")
        torch.testing.assert_close(features.zfree_token_nll[b, p - 1 : p + r - 1], nll)
        # The predictive entropy (token_weight_source "entropy") is the adapter-free model's too.
        log_p = F.log_softmax(logits[b, p - 1 : p + r - 1], dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        torch.testing.assert_close(features.zfree_token_entropy[b, p - 1 : p + r - 1], entropy, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        adapted = model.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert not torch.allclose(adapted, expected)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and n.startswith("decoder.")]
    assert trainable and all("lora_" in n for n in trainable)


def test_full_training_keeps_a_frozen_reference_copy(tokenizer):
    model, _ = make_model(tokenizer, decoder_training="full")
    assert model.reference.copy is not None and model.reference.copy is not model.decoder
    assert all(p.requires_grad for p in model.decoder.parameters())
    assert not any(p.requires_grad for p in model.reference.copy.parameters())
    assert not any(n.startswith("reference") for n, _ in model.named_parameters())


@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
def test_windowed_lm_head_equals_full_logits(tokenizer, placement):
    model, _ = make_model(tokenizer, latent_placement=placement)
    batch = prompt_batch(tokenizer)
    vector = torch.randn(len(batch), model.latent_vector_dim, requires_grad=True)
    decoded = model.decode(batch, vector)
    assert decoded.start > 0 and decoded.hidden.shape[1] < decoded.input_ids.shape[1]
    windowed = decoded.token_nll()
    (grad_windowed,) = torch.autograd.grad(windowed.sum(), vector)
    logits, ids, target, _ = model.decode_logits(batch, vector)
    full = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none") * target[:, 1:]
    (grad_full,) = torch.autograd.grad(full.sum(), vector)
    torch.testing.assert_close(windowed, full)
    torch.testing.assert_close(grad_windowed, grad_full)


def test_divergence_is_the_token_weighted_js_of_two_decodes(tokenizer):
    model, _ = make_model(tokenizer, divergence_weight=1.0)
    model.eval()
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)
    torch.manual_seed(0)
    out = model(batch, features)
    torch.manual_seed(0)
    sample = model.encode(features, 0)
    alternative = model.alternative_vector(sample)
    assert not torch.equal(model.codes_to_vector(sample.latent), alternative)
    la, ids, target, _ = model.decode_logits(batch, sample.vector)
    lb, _, _, _ = model.decode_logits(batch, alternative)
    pa, pb = la[:, :-1].softmax(-1), lb[:, :-1].softmax(-1)
    m = (pa + pb) / 2
    js = 0.5 * (pa * (pa / m).log()).sum(-1) + 0.5 * (pb * (pb / m).log()).sum(-1)  # [B, N]
    expected = (out.weighting.token_weights * js * target[:, 1:]).sum(1).mean()
    torch.testing.assert_close(out.divergence, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("training", ["frozen", "lora", "full"])
def test_frozen_pass_surprisal_is_the_reference_models_own_cross_entropy(tokenizer, training):
    from disentanglement.token_weighting import score_zfree_reference

    model, _ = make_model(tokenizer, decoder_training=training)
    batch = prompt_batch(tokenizer)
    with torch.no_grad():  # a decoder that has trained away from its reference
        for name, param in model.decoder.named_parameters():
            if param.requires_grad and (training == "full" or "lora_B" in name):
                param.add_(0.3 * torch.randn_like(param))
    with model.reference.active() as reference:  # the adapter-free decoder or the frozen copy
        expected = manual_zfree_nll(reference, batch.input_ids, batch.attention_mask, batch.target_mask)
    got = model.frozen_pass(batch).zfree_token_nll
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    seed_scorer = score_zfree_reference(model.decoder, batch.input_ids, batch.attention_mask, batch.target_mask)
    if training == "frozen":  # the seed's scorer on the decoder is the reference itself
        torch.testing.assert_close(got, seed_scorer, rtol=1e-5, atol=1e-6)
    else:  # the trained decoder is not the reference
        assert not torch.allclose(got, seed_scorer, rtol=1e-3, atol=1e-3)


def test_logged_unit_kl_is_raw_and_the_objective_has_free_bits(tokenizer):
    model, _ = make_model(tokenizer, latent="continuous", free_bits=5.0, beta=1.0, beta_schedule="constant")
    model.eval()
    batch = prompt_batch(tokenizer)
    out = model(batch)
    mu, logvar = model.posterior(model.frozen_pass(batch))
    mu_p, logvar_p = model.prior(model.frozen_pass(batch))
    raw = gaussian_kl(mu, logvar, mu_p, logvar_p).mean(0)
    record = out.scalars()
    for i, value in enumerate(raw.tolist()):
        assert record[f"kl_unit_{i}"] == pytest.approx(value, rel=1e-5, abs=1e-7)
        assert record[f"kl_objective_unit_{i}"] == pytest.approx(max(value, 5.0), rel=1e-5)
    torch.testing.assert_close(out.kl_term, raw.clamp_min(5.0).sum())


def test_kmeans_codebook_init_and_identity_keeping_refresh(tokenizer):
    model, _ = make_model(tokenizer, codebook_size=3)
    batch = prompt_batch(tokenizer, n=12)
    features = model.frozen_pass(batch)
    model.initialize_from_data(features, seed=0)
    e = model.encoder_outputs(features).detach().reshape(-1, model.latent_cfg.code_dim)
    codes = torch.cdist(e, model.codebook.detach()).argmin(1)
    assert len(set(codes.tolist())) == 3, "every code starts where some examples are"
    for k in range(3):  # each code is the mean of the encoder outputs nearest to it (a k-means fixed point)
        torch.testing.assert_close(model.codebook[k].detach(), e[codes == k].mean(0), rtol=1e-4, atol=1e-5)
    before = model.codebook.detach().clone()
    with torch.no_grad():
        model.codebook.copy_(before[[2, 0, 1]])  # same centroids, other identities
    model.refresh_from_data(features, seed=5)
    torch.testing.assert_close(model.codebook.detach(), before[[2, 0, 1]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("through", [True, False])
def test_codebook_decoder_gradient_decides_whether_the_decoder_moves_the_chosen_code(through):
    """Nearest assignment: the latent's value is the chosen code either way; the decoder's gradient reaches that
    code only with codebook_decoder_gradient (else only the codebook loss moves it), and reaches the encoder
    output straight through either way."""
    tokenizer = tiny_tokenizer()
    config = build_config(dict(chat_template=False, latent="discrete", codebook_decoder_gradient=through))
    pairs = make_hidden_factor_pairs([f"q {i}" for i in range(6)], kind="clean")
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    features = model.frozen_pass(collate(examples, tokenizer.pad_token_id))
    sample = model.encode(features, step=0)
    torch.testing.assert_close(sample.vector.view(len(examples), -1, model.latent_cfg.code_dim)[:, 0],
                               model.codebook[sample.latent[:, 0]], rtol=0, atol=0)  # fmt: skip
    (sample.vector * torch.randn_like(sample.vector)).sum().backward()  # a stand-in for the decoder's gradient
    assert (model.codebook.grad is not None and model.codebook.grad.abs().sum() > 0) == through
    assert model.encoder[-1].weight.grad.abs().sum() > 0


def _encoder_output_gradient(model, features, decoder_grad):
    """``(gradient at the encoder's outputs [B, M * C], latent value)`` of ``sum(vector * decoder_grad)``."""
    outputs = {}
    handle = model.encoder.register_forward_hook(lambda module, args, out: outputs.setdefault("e", out))
    try:
        sample = model.encode(features, step=0)
    finally:
        handle.remove()
    outputs["e"].retain_grad()
    model.zero_grad()
    (sample.vector * decoder_grad).sum().backward()  # a stand-in for the decoder's gradient
    return outputs["e"].grad.clone(), sample.vector.detach()


@pytest.mark.parametrize(("table", "slots"), [(False, 1), (True, 1), (False, 2)])
def test_centered_straight_through_removes_the_common_shift_of_the_encoder_gradient(table, slots):
    """centered_straight_through: the latent's value is unchanged (the chosen code, or its table entry); the
    gradient that reaches the encoder outputs straight through is the decoder's minus its mean over the batch,
    per slot, computed by hand against the uncentred run of the same weights; a gradient that is the same for
    every example reaches the encoder not at all."""
    tokenizer = tiny_tokenizer()
    pairs = make_hidden_factor_pairs([f"q {i}" for i in range(6)], kind="clean")
    grads, values = {}, {}
    for centered in (False, True):
        config = build_config(
            dict(
                chat_template=False,
                latent="discrete",
                num_slots=slots,
                centered_straight_through=centered,
                decoder_code_table=table,
            )
        )
        examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
        torch.manual_seed(0)
        model = build_cvae(config, tiny_llama(len(tokenizer)))
        features = model.frozen_pass(collate(examples, tokenizer.pad_token_id))
        model.train()
        shape = model.encode(features, step=0).vector.shape
        decoder_grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        grads[centered], values[centered] = _encoder_output_gradient(model, features, decoder_grad)
        if centered:  # the same gradient for every example: nothing reaches the encoder
            same, _ = _encoder_output_gradient(model, features, decoder_grad[:1])
            torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-6)
    torch.testing.assert_close(values[True], values[False], rtol=0, atol=0)
    B, C = len(examples), model.latent_cfg.code_dim
    uncentred = grads[False].view(B, slots, C)
    by_hand = torch.stack([uncentred[:, m] - uncentred[:, m].mean(0) for m in range(slots)], 1).view(B, -1)
    assert not torch.allclose(grads[False], by_hand)  # the uncentred gradient has a common part to remove
    torch.testing.assert_close(grads[True], by_hand, rtol=1e-5, atol=1e-7)
    # a model given the unresolved null (a LatentConfig's own default, not through build_cvae) centres too
    model.latent_cfg = dataclasses.replace(model.latent_cfg, centered_straight_through=None)
    null, _ = _encoder_output_gradient(model, features, decoder_grad)
    torch.testing.assert_close(null, grads[True], rtol=0, atol=0)


def test_centered_straight_through_needs_the_nearest_code_and_a_batch():
    from disentanglement.config import ConfigError

    for bad, why in (
        (dict(latent="continuous"), "latent 'continuous' has no nearest code"),
        (dict(latent="discrete", assignment="gumbel"), "assignment 'gumbel' has no straight-through path"),
        (dict(latent="discrete", batch_size=1), "batch_size >= 2"),
    ):
        with pytest.raises(ConfigError, match=why):
            build_config(dict(bad, centered_straight_through=True))


@pytest.mark.parametrize("codebook_lr", [None, 1e-3])
def test_codebook_lr_gives_the_codebook_a_group_of_its_own(codebook_lr):
    """train.codebook_lr: None keeps the codebook in the latent group at latent_lr (the optimizer as before);
    a value puts exactly the codebook in a 'codebook' group at that rate, and one AdamW step moves a code by
    about that rate (Adam's first step is lr * sign(gradient), before warm-up scales it)."""
    from disentanglement.trainer import make_optimizer

    config = build_config(
        dict(
            chat_template=False,
            latent="discrete",
            codebook_lr=codebook_lr,
            latent_lr=3e-2,
            warmup_steps=0,
            preset="frozen",  # the groups of a frozen decoder (LoRA adds a "decoder" group)
        )
    )
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tiny_tokenizer())))
    optimizer = make_optimizer(model, config)
    groups = {group["name"]: group for group in optimizer.param_groups}
    if codebook_lr is None:
        assert set(groups) == {"encoder", "latent"}
        assert any(param is model.codebook for param in groups["latent"]["params"])
        return
    assert set(groups) == {"encoder", "latent", "codebook"}
    assert groups["codebook"]["params"] == [model.codebook] and groups["codebook"]["lr"] == codebook_lr
    assert not any(param is model.codebook for param in groups["latent"]["params"])
    assert groups["latent"]["lr"] == 3e-2
    before = model.codebook.detach().clone()
    model.codebook.grad = torch.ones_like(model.codebook)
    optimizer.step()
    torch.testing.assert_close(
        before - model.codebook.detach(), torch.full_like(before, codebook_lr), rtol=1e-3, atol=0
    )


def test_warmup_cosine_is_transformers_schedule_and_shifts_by_the_hold():
    """make_scheduler's factor: transformers' cosine schedule with warm-up, bit for bit, for a group that is not
    held; 0 before encoder_hold_steps for a held one, then the same shape started at the hold."""
    from transformers import get_cosine_schedule_with_warmup

    from disentanglement.trainer import warmup_cosine

    param = torch.nn.Parameter(torch.zeros(1))
    reference = get_cosine_schedule_with_warmup(torch.optim.SGD([param], lr=1.0), 10, 120)
    for step in range(125):
        assert warmup_cosine(step, 10, 120) == reference.lr_lambdas[0](step)
    assert [warmup_cosine(step, 10, 120, start=30) for step in (0, 29, 30, 35, 40)] == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert warmup_cosine(80, 10, 120, start=30) == pytest.approx(0.5 * (1 + math.cos(math.pi * 40 / 80)))
    assert warmup_cosine(120, 10, 120, start=30) == 0.0
    no_warmup = get_cosine_schedule_with_warmup(torch.optim.SGD([param], lr=1.0), 0, 50)
    assert all(warmup_cosine(step, 0, 50) == no_warmup.lr_lambdas[0](step) for step in range(51))


def test_codebook_options_are_refused_where_they_mean_nothing_and_checked_on_resume(tmp_path):
    """codebook_lr and decoder_code_table need the discrete latent, the table the nearest assignment, the hold
    another placement than memory; on resume codebook_lr may change between two values (applied) but not from or
    to None (the optimizer's groups would change)."""
    from disentanglement.config import ConfigError
    from disentanglement.resume import check_resume_config

    for given, field in (
        (dict(latent="continuous", codebook_lr=1e-3), "codebook_lr"),
        (dict(latent="continuous", decoder_code_table=True), "decoder_code_table"),
        (dict(latent="discrete", assignment="gumbel", decoder_code_table=True), "decoder_code_table"),
        (dict(latent_placement="memory", encoder_hold_steps=3), "encoder_hold_steps"),
    ):
        with pytest.raises(ConfigError, match=field):
            build_config(given)
    stored = build_config(dict(latent="discrete", codebook_lr=1e-3))
    assert check_resume_config(stored, build_config(dict(latent="discrete", codebook_lr=1e-4)), tmp_path) == {
        "codebook_lr": (1e-3, 1e-4)
    }
    with pytest.raises(ConfigError, match="changes the optimizer's groups"):
        check_resume_config(stored, build_config(dict(latent="discrete")), tmp_path)


def test_encoder_hold_steps_holds_the_encoder_and_the_codebook_while_the_projection_trains():
    """train.encoder_hold_steps = 3: for three optimizer steps the encoder heads and the codebook keep their start
    bit for bit while the latent projection moves; then they move too. Refused when it reaches max_steps."""
    from disentanglement.config import ConfigError
    from disentanglement.trainer import make_optimizer, make_scheduler

    with pytest.raises(ConfigError, match="encoder_hold_steps"):
        build_config(dict(chat_template=False, encoder_hold_steps=5, max_steps=5))
    tokenizer = tiny_tokenizer()
    config = build_config(
        dict(
            chat_template=False, latent="discrete", encoder_hold_steps=3, warmup_steps=1, max_steps=20, preset="frozen"
        )
    )
    pairs = make_hidden_factor_pairs([f"q {i}" for i in range(8)], kind="clean")
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config)
    assert {group["name"] for group in optimizer.param_groups} == {"encoder", "latent", "codebook"}
    batch = collate(examples, tokenizer.pad_token_id)
    held = {"encoder": model.encoder[-1].weight, "codebook": model.codebook}

    def step() -> dict[str, torch.Tensor]:
        before = {name: p.detach().clone() for name, p in held.items()}
        before["projection"] = next(model.latent_projection.parameters()).detach().clone()
        model.train()
        model(batch, step=scheduler.last_epoch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        now = {name: p.detach() for name, p in held.items()}
        now["projection"] = next(model.latent_projection.parameters()).detach()
        return {name: (now[name] - before[name]).abs().max() for name in before}

    encoder_group = next(group["params"] for group in optimizer.param_groups if group["name"] == "encoder")
    moved = []
    for _ in range(6):
        start = [p.detach().clone() for p in encoder_group]
        moved.append(step())
        moved[-1]["encoder group"] = max(
            (p.detach() - s).abs().max() for p, s in zip(encoder_group, start, strict=True)
        )
    # step 0 has learning rate 0 for every group (the warm-up's first factor); the held groups' warm-up starts at
    # step 3 with that factor 0, so they first move at step 4
    for k in range(1, 4):
        assert moved[k]["encoder group"] == 0 and moved[k]["codebook"] == 0, k
        assert moved[k]["projection"] > 0, k
    assert moved[4]["encoder group"] > 0 and moved[4]["codebook"] > 0


def test_decoder_code_table_takes_the_decoders_gradient_and_leaves_the_codebook_to_assign():
    """decoder_code_table: the latent's value is the table's entry of the nearest code (the codebook still
    chooses it); the decoder's gradient reaches the table and the encoder, never the codebook (which moves by its
    codebook loss only); the k-means start, forced codes and dead-code restarts go through the table too."""
    tokenizer = tiny_tokenizer()
    config = build_config(dict(chat_template=False, latent="discrete", decoder_code_table=True, codebook_size=3))
    pairs = make_hidden_factor_pairs([f"q {i}" for i in range(6)], kind="clean")
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    features = model.frozen_pass(collate(examples, tokenizer.pad_token_id))
    start = model.codebook.detach().clone()
    model.initialize_from_data(features, seed=0)
    assert not torch.equal(model.codebook.detach(), start)  # k-means moved the codebook, and the table with it
    torch.testing.assert_close(model.code_table.detach(), model.codebook.detach(), rtol=0, atol=0)
    with torch.no_grad():
        model.code_table.add_(torch.randn_like(model.code_table))  # the table now differs from the codebook
    model.train()
    sample = model.encode(features, step=0)
    e = model.encoder_outputs(features)[:, 0]
    nearest = torch.cdist(e.detach(), model.codebook.detach()).argmin(-1)
    torch.testing.assert_close(sample.latent[:, 0], nearest)
    torch.testing.assert_close(sample.vector.detach(), model.code_table.detach()[nearest], rtol=0, atol=0)
    torch.testing.assert_close(model.codes_to_vector(nearest.unsqueeze(1)), model.code_table[nearest])
    (sample.vector * torch.randn_like(sample.vector)).sum().backward()  # a stand-in for the decoder's gradient
    assert model.code_table.grad.abs().sum() > 0 and model.encoder[-1].weight.grad.abs().sum() > 0
    assert model.codebook.grad is None
    sample.aux_losses["codebook_loss"].backward()
    assert model.codebook.grad.abs().sum() > 0
    groups = model.parameter_groups()
    assert any(p is model.code_table for p in groups["latent"]) and any(p is model.codebook for p in groups["latent"])
    groups = model.parameter_groups(separate_codebook=True)
    assert any(p is model.code_table for p in groups["latent"]) and groups["codebook"] == [model.codebook]
    model.code_last_used.fill_(0)
    model.code_last_used[int(nearest[0])] = 20
    model.post_step(20)  # every other code unused for 20 >= dead_code_steps: restarted, table entry with it
    dead = [k for k in range(3) if k != int(nearest[0])]
    torch.testing.assert_close(model.code_table.detach()[dead], model.codebook.detach()[dead], rtol=0, atol=0)
    assert not torch.equal(model.code_table.detach()[int(nearest[0])], model.codebook.detach()[int(nearest[0])])
