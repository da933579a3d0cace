"""``latent.bow_weight``'s bag-of-words loss (Zhao, Zhao and Eskenazi 2017) and ``latent.bow_token_weighting``:
the loss by hand on small tensors (padding, one response token, near-zero surprisal), then in the model's forward
against the response's tokens read in the batch's own layout and the reference's surprisal computed from its full
logits, for both latent families, every placement, with and without the chat template and with word dropout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disentanglement.cli import _train_config, build_parser
from disentanglement.config import ConfigError, build_config
from disentanglement.cvae_base import bag_of_words_loss
from disentanglement.models import build_cvae
from disentanglement.token_weighting import token_weighting_from_base_nll
from helpers import prompt_batch, tiny_llama
from references import manual_zfree_nll


def loop_bow(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> float:
    """``mean_b sum_t w_bt (logsumexp(l_b) - l_b[y_bt])`` with Python loops and math."""
    total = 0.0
    for b in range(ids.shape[0]):
        row = [float(x) for x in logits[b]]
        top = max(row)
        lse = top + math.log(sum(math.exp(x - top) for x in row))
        total += sum(float(weights[b, t]) * (lse - row[int(ids[b, t])]) for t in range(ids.shape[1]))
    return total / ids.shape[0]


def test_the_loss_by_hand_with_padding_one_token_and_any_weights():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 7), torch.randint(0, 7, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    uniform = mask / mask.sum(1, keepdim=True)
    assert bag_of_words_loss(logits, ids, uniform).item() == pytest.approx(loop_bow(logits, ids, uniform), rel=1e-6)
    # the row of one response token: -log p(that token), whatever the weighting
    alone = bag_of_words_loss(logits[1:2], ids[1:2], uniform[1:2]).item()
    assert alone == pytest.approx(-F.log_softmax(logits[1].double(), -1)[ids[1, 1]].item(), rel=1e-6)
    skewed = torch.rand(3, 5) * mask
    skewed = skewed / skewed.sum(1, keepdim=True)
    assert bag_of_words_loss(logits, ids, skewed).item() == pytest.approx(loop_bow(logits, ids, skewed), rel=1e-6)
    # term 3's weights with a token the reference predicts with certainty (surprisal 0, floored at eps) and padding
    base = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0], [1e-9, 1.0, 0.5, 0.0, 4.0]])
    pi = token_weighting_from_base_nll(base, mask, alpha=2.0, eps=1e-6).token_weights
    assert bag_of_words_loss(logits, ids, pi).item() == pytest.approx(loop_bow(logits, ids, pi), rel=1e-6)


def make_model(tokenizer, **overrides):
    torch.manual_seed(0)
    config = build_config({"preset": "frozen", "bow_weight": 0.5, "zfree_reference_scale": 2.0, **overrides})
    return build_cvae(config, tiny_llama(len(tokenizer)))


def forward_and_bow_logits(model, batch, training: bool = False):
    """The model's output (in eval mode unless ``training``) and the bag-of-words head's ``[B, V]`` logits of that
    forward (the head drawn anew at a scale that makes its logits far from uniform, so that the tokens' weights
    tell)."""
    with torch.no_grad():
        model.bow_head.weight.normal_(0.0, 2.0)
    seen = []
    handle = model.bow_head.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    model.train(training)
    with torch.no_grad():
        out = model(batch, step=3)
    handle.remove()
    assert len(seen) == 1
    return out, seen[0].double()


def by_hand(batch, logits, weight_of) -> torch.Tensor:
    """The loss read in the batch's own layout: response token ``p + i`` of row ``b`` weighted ``weight_of(b)[i]``."""
    losses = []
    for b in range(len(batch)):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        log_probs = F.log_softmax(logits[b], -1)[batch.input_ids[b, p : p + r]]
        losses.append(-(weight_of(b) * log_probs).sum())
    return torch.stack(losses).mean()


def uniform_share(batch):
    """Each response token of row ``b`` weighted ``1 / r_b``."""
    return lambda b: torch.ones(int(batch.response_lengths[b])).double() / int(batch.response_lengths[b])


def surprisal_share(model, batch, alpha: float):
    """Each response token of row ``b`` weighted by its tempered share of the reference's surprisal, ``b_t^alpha /
    sum b^alpha`` (floored at eps 1e-6), the surprisal from the reference's full logits."""
    surprisal = manual_zfree_nll(model.decoder, batch.input_ids, batch.attention_mask, batch.target_mask)

    def share(b):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        tempered = surprisal[b, p - 1 : p + r - 1].clamp_min(1e-6) ** alpha
        return tempered / tempered.sum()

    return share


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
@pytest.mark.parametrize("chat_template", [True, False])  # without it the responses do not all end alike
def test_uniform_is_the_mean_over_the_response_tokens(tokenizer, latent, placement, chat_template):
    model = make_model(tokenizer, latent=latent, latent_placement=placement)
    assert model.latent_cfg.bow_token_weighting == "uniform"
    batch = prompt_batch(tokenizer, chat_template=chat_template)
    out, logits = forward_and_bow_logits(model, batch)
    expected = by_hand(batch, logits, uniform_share(batch))
    torch.testing.assert_close(out.aux_losses["bow_loss"].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
@pytest.mark.parametrize(
    "latent, placement, chat_template",
    [("discrete", "prefix", True), ("continuous", "between", True), ("discrete", "memory", False)],
)
def test_token_weighted_weighs_each_token_by_the_references_surprisal_share(
    tokenizer, alpha, latent, placement, chat_template
):
    model = make_model(
        tokenizer, bow_token_weighting="token_weighted", token_weight_alpha=alpha, latent=latent,
        latent_placement=placement,
    )  # fmt: skip
    batch = prompt_batch(tokenizer, chat_template=chat_template)
    out, logits = forward_and_bow_logits(model, batch)
    expected = by_hand(batch, logits, surprisal_share(model, batch, alpha))
    torch.testing.assert_close(out.aux_losses["bow_loss"].double(), expected, rtol=1e-4, atol=1e-5)
    uniform = by_hand(batch, logits, uniform_share(batch))
    if alpha == 0:  # every token the same share: Zhao et al.'s loss
        torch.testing.assert_close(out.aux_losses["bow_loss"].double(), uniform, rtol=1e-5, atol=1e-6)
    else:  # and the uniform loss is told apart at the tolerance the weighted one met
        with pytest.raises(AssertionError):
            torch.testing.assert_close(out.aux_losses["bow_loss"].double(), uniform, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        out.loss,
        out.reconstruction_total
        + out.kl_term
        + sum(value * (0.5 if name == "bow_loss" else 1.0) for name, value in out.aux_losses.items()),
    )


@pytest.mark.parametrize("weighting", ["uniform", "token_weighted"])
def test_word_dropout_leaves_the_targets_whole(tokenizer, weighting):
    """In a training step with word dropout the decoder reads some response tokens as zeros; the bag of words still
    counts every one of them."""
    model = make_model(tokenizer, bow_token_weighting=weighting, word_dropout=0.5)
    batch = prompt_batch(tokenizer, chat_template=False)
    torch.manual_seed(1)
    out, logits = forward_and_bow_logits(model, batch, training=True)
    assert not out.weighting.token_weights.requires_grad
    share = surprisal_share(model, batch, alpha=2.0) if weighting == "token_weighted" else uniform_share(batch)
    expected = by_hand(batch, logits, share)
    torch.testing.assert_close(out.aux_losses["bow_loss"].double(), expected, rtol=1e-4, atol=1e-5)


def test_the_gradient_reaches_the_head_and_the_encoder_not_the_weights(tokenizer):
    model = make_model(tokenizer, bow_token_weighting="token_weighted", latent="continuous")
    model.train()
    batch = prompt_batch(tokenizer)
    out = model(batch, step=3)
    assert not out.weighting.token_weights.requires_grad
    model.zero_grad()
    out.aux_losses["bow_loss"].backward()
    assert model.bow_head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameter_groups()["encoder"])


def test_config_refuses_another_weighting_and_the_flag_sets_it():
    with pytest.raises(ConfigError, match="bow_token_weighting") as caught:
        build_config({"bow_token_weighting": "surprisal"})
    assert caught.value.field == "bow_token_weighting"
    args = build_parser().parse_args(["train", "--data", "x.jsonl", "--bow-token-weighting", "token_weighted"])
    assert _train_config(args).latent.bow_token_weighting == "token_weighted"
