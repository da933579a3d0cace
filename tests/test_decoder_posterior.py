"""The decoder's own posterior of the codes (``decoder_posterior_weight``): r by brute force, KL(r || q) by hand,
the term in the forward from its start step, its gradient's reach, the config's refusals, and that it teaches an
encoder the partition the decoder's codes hold."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from conftest import NUM_FACTORS
from disentanglement.commands import eval_summary_lines
from disentanglement.config import ConfigError, Scoring, build_config
from disentanglement.data import collate
from disentanglement.evaluation import evaluate
from disentanglement.features import build_feature_cache
from disentanglement.metrics import kmeans_assignments
from disentanglement.runs import load_examples
from helpers import prompt_batch
from test_evaluation import untrained
from test_models import make_model


def every_combination(model, batch, features):
    """Every code combination decoded over the whole batch by hand: ``combos`` (a list of ``S`` tuples), and per
    example its ``log p(k | x)`` summed over the slots and its sequence NLL, ``[B, S]`` each (float64)."""
    log_p = model.prior_log_probs(features).double()  # [B, M, K]
    B, M, K = log_p.shape
    combos = list(itertools.product(range(K), repeat=M))
    log_prior, nlls = [], []
    for combo in combos:
        nll, _ = model.conditioned_token_nll(batch, model.codes_to_vector(torch.tensor([combo] * B)))
        nlls.append(nll.double().sum(-1))
        log_prior.append(sum(log_p[:, m, k] for m, k in enumerate(combo)))
    return combos, torch.stack(log_prior, -1), torch.stack(nlls, -1)


def brute_force_posterior(model, batch, features):
    """``log r [B, M, K]``: every combination decoded over the whole batch, the joint normalised, then marginalised."""
    combos, log_prior, nlls = every_combination(model, batch, features)
    B, M, K = nlls.shape[0], len(combos[0]), model.codebook_size
    r = torch.softmax(log_prior - nlls, -1)  # [B, S]
    marginal = torch.zeros(B, M, K, dtype=torch.float64)
    for s, combo in enumerate(combos):
        for m, k in enumerate(combo):
            marginal[:, m, k] += r[:, s]
    return marginal.log()


@pytest.mark.parametrize("slots, size", [(1, 4), (2, 3)])
def test_decoder_posterior_is_the_exact_posterior_by_brute_force(slots, size):
    model, tok, examples, cache = untrained(num_slots=slots, codebook_size=size)
    batch = collate(examples[:5], tok.pad_token_id, indices=range(5))
    features = cache.features(batch)
    with torch.no_grad():
        expected = brute_force_posterior(model, batch, features)
        # the chosen codes' NLL is reused, not decoded again: give it, correct, for arbitrary codes
        codes = torch.randint(0, size, (5, slots), generator=torch.Generator().manual_seed(3))
        nll, _ = model.conditioned_token_nll(batch, model.codes_to_vector(codes))
        log_r = model.decoder_posterior(batch, features, codes, nll.sum(-1))
    assert log_r.shape == (5, slots, size)
    torch.testing.assert_close(log_r.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(log_r.exp().sum(-1), torch.ones(5, slots))
    # the reused NLL is used: a wrong one for the chosen codes moves r towards them
    with torch.no_grad():
        moved = model.decoder_posterior(batch, features, codes, nll.sum(-1) - 50.0)
    chosen = moved.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
    assert (chosen > -1e-3).all(), "a chosen code 50 nats likelier takes (nearly) all the posterior"


def test_decoder_posterior_kl_by_hand():
    model, _, _, _ = untrained(codebook_size=3, posterior_temperature=2.0, decoder_posterior_target="soft")
    e = torch.randn(4, 1, model.latent_cfg.code_dim)
    log_r = torch.log_softmax(torch.randn(4, 1, 3), -1)
    distances = ((e.unsqueeze(2) - model.codebook.detach()) ** 2).sum(-1)  # [B, 1, K]
    log_q = torch.log_softmax(-distances / 2.0, -1)
    expected = (
        sum(float(log_r[b, 0, k].exp() * (log_r[b, 0, k] - log_q[b, 0, k])) for b in range(4) for k in range(3)) / 4
    )
    with torch.no_grad():
        assert float(model.decoder_posterior_kl(log_r, e)) == pytest.approx(expected, rel=1e-5)
        # zero where the encoder's posterior is r itself
        assert float(model.decoder_posterior_kl(log_q, e)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "placement, slots, centered, target",
    [
        ("prefix", 1, False, "soft"),
        ("between", 1, True, "hard"),
        ("between", 2, False, "soft"),
        ("prefix", 2, True, "hard"),
    ],
)
def test_forward_adds_the_term_from_its_start_and_it_trains_the_encoder_not_the_decoder(
    tokenizer, placement, slots, centered, target
):
    model, _ = make_model(
        tokenizer,
        decoder_training="full",
        decoder_posterior_weight=0.7,
        decoder_posterior_start=5,
        codebook_size=3,
        num_slots=slots,
        latent_placement=placement,
        centered_straight_through=centered,
        decoder_posterior_target=target,
    )
    model.train()
    batch = prompt_batch(tokenizer)
    torch.manual_seed(0)
    assert "decoder_posterior_loss" not in model(batch, step=4).aux_losses
    on = model.latent_cfg
    model.latent_cfg = dataclasses.replace(on, decoder_posterior_start=6)
    torch.manual_seed(0)
    before = model(batch, step=5)  # the same step without the term
    model.latent_cfg = on
    torch.manual_seed(0)
    out = model(batch, step=5)
    features = model.frozen_pass(batch)
    e = model.encoder_outputs(features)
    log_r = brute_force_posterior(model, batch, features).float()
    expected = 0.7 * model.decoder_posterior_kl(log_r, e)
    torch.testing.assert_close(out.aux_losses["decoder_posterior_loss"], expected, rtol=1e-4, atol=1e-6)
    agreement = float((log_r.argmax(-1) == out.latent).float().mean())  # per slot
    assert out.logged_stats()["decoder_posterior_agreement"] == pytest.approx(agreement)
    # the loss includes it, and only the encoder and the codebook get its gradient
    added = float(out.aux_losses["decoder_posterior_loss"].detach())
    assert float((out.loss - before.loss).detach()) == pytest.approx(added, rel=1e-4, abs=1e-5)
    model.zero_grad()
    out.aux_losses["decoder_posterior_loss"].backward()
    assert all(p.grad is None or not p.grad.any() for p in model.decoder.parameters())
    assert all(p.grad is None or not p.grad.any() for p in model.prior_head.parameters())
    # the soft KL moves the codebook too; the hard target leaves it to the decoder's losses
    moved = model.codebook.grad is not None and bool(model.codebook.grad.any())
    assert moved == (target == "soft")
    assert any(p.grad is not None and p.grad.any() for p in model.encoder.parameters())
    # not in evaluation
    model.eval()
    assert "decoder_posterior_loss" not in model(batch, step=9).aux_losses


def test_decoder_posterior_options_are_checked():
    with pytest.raises(ConfigError, match="discrete latent"):
        build_config({"latent": "continuous", "decoder_posterior_weight": 1.0})
    with pytest.raises(ConfigError, match="4 \\*\\* 4 = 256"):
        build_config({"codebook_size": 4, "num_slots": 4, "decoder_posterior_weight": 1.0})
    with pytest.raises(ConfigError, match="decoder_posterior_start"):
        build_config({"decoder_posterior_start": -1})
    with pytest.raises(ConfigError, match="decoder_posterior_weight"):
        build_config({"decoder_posterior_weight": -0.5})
    with pytest.raises(ConfigError, match="needs assignment 'nearest'"):
        build_config({"assignment": "gumbel", "decoder_posterior_weight": 1.0})
    assert build_config({"codebook_size": 8, "num_slots": 2, "decoder_posterior_weight": 1.0})


def test_the_term_teaches_a_fresh_encoder_what_the_decoders_codes_hold(discrete_run):
    """The trained run's decoder knows the factor by its codes; a fresh encoder, trained on KL(r || q) alone,
    comes to choose the code the decoder's posterior names, and so recovers the factor."""
    model, tok, config, _ = discrete_run.load()
    examples, _ = load_examples("train", config, tok)
    examples = examples[:96]
    labels = [int(ex.label) for ex in examples]
    model.eval()
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    batch = collate(examples, tok.pad_token_id, indices=range(len(examples)))
    features = cache.features(batch)
    with torch.no_grad():
        zeros = torch.zeros(len(examples), 1, dtype=torch.long)
        nll, _ = model.conditioned_token_nll(batch, model.codes_to_vector(zeros))
        log_r = model.decoder_posterior(batch, features, zeros, nll.sum(-1))
    named = log_r.argmax(-1).squeeze(1)
    decoder_nmi = normalized_mutual_info_score(labels, named.tolist())
    assert decoder_nmi > 0.9, "the trained decoder's codes hold the factor"
    torch.manual_seed(1)
    for layer in model.encoder:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()

    def codes() -> torch.Tensor:
        with torch.no_grad():
            return model.posterior_logits(model.encoder_outputs(features)).argmax(-1).squeeze(1)

    start_agreement = float((codes() == named).float().mean())
    optimizer = torch.optim.Adam(model.encoder.parameters(), lr=3e-3)
    for _ in range(150):
        optimizer.zero_grad()
        model.decoder_posterior_kl(log_r, model.encoder_outputs(features)).backward()
        optimizer.step()
    agreement = float((codes() == named).float().mean())
    encoder_nmi = normalized_mutual_info_score(labels, codes().tolist())
    view_nmi = normalized_mutual_info_score(
        labels, kmeans_assignments(model.encoder_input(features).detach(), NUM_FACTORS)
    )
    assert start_agreement < 0.6, f"a fresh encoder does not know the decoder's codes ({start_agreement:.2f})"
    # measured: agreement 0.43 -> 1.00, the factor's NMI 1.000 against 0.77 for k-means of the encoder's view
    assert agreement > 0.95 and encoder_nmi >= decoder_nmi - 0.05, (agreement, encoder_nmi, decoder_nmi)
    assert encoder_nmi > view_nmi + 0.1, "beyond k-means of the view the encoder reads"


@pytest.mark.parametrize("slots, size", [(1, 3), (2, 2)])
def test_eval_reports_the_decoders_posterior_beside_the_encoders_codes(slots, size):
    # the uniform prior: the untrained decoder's small differences between codes decide, not a random prior head
    model, tok, examples, cache = untrained(num_slots=slots, codebook_size=size, prior="fixed")
    report = evaluate(model, examples, cache, tok.pad_token_id, progress=False, batch_size=5)
    batch = collate(examples, tok.pad_token_id, indices=range(len(examples)))
    features = cache.features(batch)
    with torch.no_grad():
        decoder_codes = brute_force_posterior(model, batch, features).argmax(-1)  # [E, M]
        codes = model.posterior_latents(features)["codes"]
    assert len(set(decoder_codes.flatten().tolist())) > 1, "the untrained decoder's codes differ: a real check"
    entry = report["decoder_posterior"]
    assert entry["agreement"] == pytest.approx(float((codes == decoder_codes).all(-1).float().mean()))
    labels = [ex.label for ex in examples]
    as_ids = [str(row) for row in decoder_codes.tolist()]
    assert entry["factors"]["label"]["decoder"] == pytest.approx(normalized_mutual_info_score(labels, as_ids))
    # the latent gain under the decoder's likeliest code combination, every combination decoded here by hand
    with torch.no_grad():
        _, log_prior, nlls = every_combination(model, batch, features)  # [E, S] each
    joint = log_prior - nlls
    map_nll = nlls.gather(-1, joint.argmax(-1, keepdim=True)).squeeze(-1)
    prior_nll = -joint.logsumexp(-1)
    tokens = sum(len(ex.response_ids) for ex in examples)
    assert tokens == report["response_tokens"]
    expected = float((prior_nll - map_nll).sum()) / tokens
    assert entry["latent_gain_nats_per_token"] == pytest.approx(expected, rel=1e-4)
    assert entry["latent_gain_nats_per_example"] == pytest.approx(float((prior_nll - map_nll).mean()), rel=1e-4)
    # uniform prior: the encoder's code is among those compared, so the decoder's likeliest gains at least as much
    assert entry["latent_gain_nats_per_token"] >= report["latent_gain_nats_per_token"] - 1e-6 and expected > 0
    # and the likeliest code is the one of lowest NLL: the best one
    assert entry["best_latent_gain_nats_per_token"] == pytest.approx(entry["latent_gain_nats_per_token"])
    if slots == 1:  # the encoder's NMI is eval's own for the latent
        assert entry["factors"]["label"]["encoder"] == pytest.approx(report["factors"]["label"]["latent"]["nmi"])
    lines = eval_summary_lines({**report, "data": "d"})
    assert any(line.startswith(f"latent gain under the decoder's likeliest code combination {expected:+.4f}")
               for line in lines)  # fmt: skip
    # a hint only where the decoder's codes hold a factor better by the margin
    for encoder, decoder, hinted in ((0.85, 1.0, True), (0.8, 0.84, False), (0.9, 0.3, False)):
        entry = {"agreement": 0.9, "factors": {"label": {"encoder": encoder, "decoder": decoder}}}
        lines = eval_summary_lines({**report, "data": "d", "decoder_posterior": entry})
        hints = [line for line in lines if line.startswith("hint:")]
        expected = f"factor label better than the encoder's ({decoder:.2f} against {encoder:.2f})"
        assert (len(hints) == 1 and expected in hints[0]) if hinted else not hints, (encoder, decoder, hints)
    # a sampled prior mixture decodes some codes only: no decoder's posterior
    sampled = evaluate(model, examples, cache, tok.pad_token_id, progress=False, scoring=Scoring(exact_limit=1))
    assert sampled["prior_mixture"]["method"] == "samples" and "decoder_posterior" not in sampled


@pytest.mark.parametrize("slots, size", [(1, 3), (2, 2)])
def test_the_latent_gain_under_the_decoders_likeliest_and_the_best_codes_by_hand(slots, size):
    model, tok, examples, cache = untrained(num_slots=slots, codebook_size=size, prior="learned")
    with torch.no_grad():  # a prior far from uniform: the likeliest code given y is then not always the best one
        torch.manual_seed(5)
        for parameter in model.prior_head.parameters():
            parameter.normal_(0.0, 3.0)
    report = evaluate(model, examples, cache, tok.pad_token_id, progress=False, batch_size=5)
    batch = collate(examples, tok.pad_token_id, indices=range(len(examples)))
    features = cache.features(batch)
    with torch.no_grad():
        _, log_prior, nlls = every_combination(model, batch, features)  # [E, S] each
    joint = log_prior - nlls
    likeliest, best = joint.argmax(-1), nlls.argmin(-1)
    assert (likeliest != best).any(), "the prior moves the likeliest code off the best one: a real check"
    prior_nll = -joint.logsumexp(-1)
    tokens = report["response_tokens"]
    entry = report["decoder_posterior"]
    for prefix, chosen in (("", likeliest), ("best_", best)):
        gains = prior_nll - nlls.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        assert entry[f"{prefix}latent_gain_nats_per_token"] == pytest.approx(float(gains.sum()) / tokens, rel=1e-4)
        assert entry[f"{prefix}latent_gain_nats_per_example"] == pytest.approx(float(gains.mean()), rel=1e-4)
    # the best code gains at least as much as any other, the encoder's and the decoder's likeliest among them
    assert entry["best_latent_gain_nats_per_token"] > entry["latent_gain_nats_per_token"]
    assert entry["best_latent_gain_nats_per_token"] >= report["latent_gain_nats_per_token"] - 1e-6
    lines = eval_summary_lines({**report, "data": "d"})
    gain_line = next(line for line in lines if line.startswith("latent gain under the decoder's likeliest"))
    assert f"{entry['best_latent_gain_nats_per_token']:+.4f}" in gain_line


def test_the_hard_target_is_the_cross_entropy_of_the_decoders_code_and_leaves_the_codebook():
    model, _, _, _ = untrained(codebook_size=3, posterior_temperature=2.0, decoder_posterior_target="hard")
    e = torch.randn(4, 1, model.latent_cfg.code_dim, requires_grad=True)
    log_r = torch.log_softmax(torch.randn(4, 1, 3), -1)
    with torch.no_grad():
        distances = ((e.unsqueeze(2) - model.codebook) ** 2).sum(-1)  # [B, 1, K]
        log_q = torch.log_softmax(-distances / 2.0, -1)
        target = log_r.argmax(-1)  # [B, 1]
        expected = -sum(float(log_q[b, 0, target[b, 0]]) for b in range(4)) / 4
    loss = model.decoder_posterior_kl(log_r, e)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert model.codebook.grad is None and e.grad is not None and e.grad.any()
    with pytest.raises(ConfigError, match="decoder_posterior_target"):
        build_config({"decoder_posterior_target": "sharp"})
