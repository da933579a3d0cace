"""``latent.word_dropout`` (Bowman et al. 2016): in a training step the decoder reads a random share of the response
tokens as zero vectors, while the targets, the z-free reference and the encoder keep every token; evaluation never
drops. Checked against a hook that zeroes the embedding layer's output by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disentanglement.cli import _train_config, build_parser
from disentanglement.config import ConfigError, build_config
from disentanglement.cvae_base import with_word_dropout
from disentanglement.models import build_cvae
from helpers import prompt_batch, tiny_llama


def make_model(tokenizer, **overrides):
    torch.manual_seed(0)
    config = build_config({"zfree_reference_scale": 2.0, **overrides})
    return build_cvae(config, tiny_llama(len(tokenizer)))


def hand_keep(batch) -> torch.Tensor:
    """Drop the first response token of every row and the third of the rows that have one."""
    keep = torch.ones_like(batch.input_ids, dtype=torch.bool)
    for row, (p, r) in enumerate(zip(batch.prompt_lengths.tolist(), batch.response_lengths.tolist(), strict=True)):
        keep[row, p] = False
        if r > 2:
            keep[row, p + 2] = False
    return keep


def test_the_mask_drops_response_tokens_only_at_its_rate(tokenizer):
    batch = prompt_batch(tokenizer)
    response = batch.target_mask.bool()
    torch.manual_seed(0)
    draws = torch.stack([with_word_dropout(batch, 0.3).decoder_input_keep for _ in range(400)])  # [400, B, T]
    assert draws.dtype == torch.bool and draws.shape[1:] == batch.input_ids.shape
    assert draws[:, ~response].all(), "prompt and padding are never dropped"
    dropped_share = (~draws[:, response]).float().mean().item()
    assert abs(dropped_share - 0.3) < 0.02
    assert batch.decoder_input_keep is None, "the batch given is left as it was"
    assert with_word_dropout(batch, 0.0).decoder_input_keep.all()


def test_rows_take_and_to_carry_the_mask(tokenizer):
    batch = dataclasses.replace(prompt_batch(tokenizer), decoder_input_keep=None)
    keep = hand_keep(batch)
    batch = dataclasses.replace(batch, decoder_input_keep=keep)
    assert torch.equal(batch.rows(1, 3).decoder_input_keep, keep[1:3])
    rows = torch.tensor([4, 0, 2])
    assert torch.equal(batch.take(rows).decoder_input_keep, keep[rows])
    assert torch.equal(batch.to("cpu").decoder_input_keep, keep)
    plain = prompt_batch(tokenizer)
    assert plain.take(rows).decoder_input_keep is None and plain.rows(0, 2).decoder_input_keep is None


@pytest.mark.parametrize("placement", ["prefix", "between", "memory"])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_a_dropped_token_is_read_as_a_zero_vector_and_still_scored(tokenizer, placement, latent):
    model = make_model(tokenizer, latent=latent, latent_placement=placement)
    model.eval()
    batch = prompt_batch(tokenizer)
    keep = hand_keep(batch)
    vector = torch.randn(len(batch), model.latent_vector_dim)
    with torch.no_grad():
        got = model.decode(dataclasses.replace(batch, decoder_input_keep=keep), vector, window=False)
        plain = model.decode(batch, vector, window=False)
        every = model.decode(dataclasses.replace(batch, decoder_input_keep=torch.ones_like(keep)), vector, window=False)

        def zero_dropped(module, inputs, output):  # the embedding layer's output, zeroed by hand where dropped
            return output * keep.unsqueeze(-1).to(output.dtype) if output.shape[:2] == keep.shape else output

        handle = model.decoder.get_input_embeddings().register_forward_hook(zero_dropped)
        try:
            expected = model.decode(batch, vector, window=False)
        finally:
            handle.remove()
    assert torch.allclose(got.hidden, expected.hidden, atol=1e-5)
    assert torch.equal(got.input_ids, plain.input_ids), "the targets are the real tokens"
    assert torch.allclose(got.token_nll(), expected.token_nll(), atol=1e-5)
    assert torch.allclose(every.token_nll(), plain.token_nll(), atol=1e-6), "keeping every token changes nothing"
    assert not torch.allclose(got.token_nll(), plain.token_nll(), atol=1e-4), "dropping does change the decoder"


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_forward_drops_in_training_only(tokenizer, latent):
    model = make_model(tokenizer, latent=latent, word_dropout=0.5)
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)

    def loss(rate: float, seed: int = 1) -> torch.Tensor:
        model.latent_cfg = dataclasses.replace(model.latent_cfg, word_dropout=rate)
        torch.manual_seed(seed)
        return model(batch, features=features, step=3).token_nll.detach()

    model.eval()
    assert torch.equal(loss(0.5), loss(0.0)), "evaluation never drops"
    model.train()
    dropped = loss(0.5)
    assert not torch.allclose(dropped, loss(0.0), atol=1e-4)
    # the same draw by hand: the forward's first random numbers are the mask's
    torch.manual_seed(1)
    by_hand = with_word_dropout(batch, 0.5)
    model.latent_cfg = dataclasses.replace(model.latent_cfg, word_dropout=0.5)
    torch.manual_seed(1)
    out = model(batch, features=features, step=3)
    if latent == "discrete":  # the nearest code is deterministic: decode the same latent by hand
        vector = model.codes_to_vector(out.latent)
        expected, _ = model.conditioned_token_nll(by_hand, vector)
        assert torch.allclose(out.token_nll, expected, atol=1e-5)
    assert torch.equal(out.token_nll.detach(), dropped)


def test_the_decoder_posterior_scores_every_code_on_the_same_dropped_tokens(tokenizer, monkeypatch):
    model = make_model(
        tokenizer, latent="discrete", codebook_size=3, decoder_posterior_weight=1.0, word_dropout=0.5, max_steps=10
    )
    model.train()
    batch = prompt_batch(tokenizer)
    features = model.frozen_pass(batch)
    seen = []
    original = model.conditioned_token_nll

    def recording(scored, vector):
        seen.append(scored)
        return original(scored, vector)

    monkeypatch.setattr(model, "conditioned_token_nll", recording)
    torch.manual_seed(1)
    mask = with_word_dropout(batch, 0.5).decoder_input_keep
    torch.manual_seed(1)
    out = model(batch, features=features, step=3)
    assert "decoder_posterior_loss" in out.aux_losses and seen, "the other codes were decoded"
    for scored in seen:
        rows = [int(i) for i in scored.indices]
        position = [batch.indices.tolist().index(i) for i in rows]
        assert torch.equal(scored.decoder_input_keep, mask[position])


def test_config_bounds_and_flag():
    assert build_config({"word_dropout": 0.3}).latent.word_dropout == 0.3
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="word_dropout") as caught:
            build_config({"word_dropout": bad})
        assert caught.value.field == "word_dropout"
    args = build_parser().parse_args(["train", "--data", "x.jsonl", "--word-dropout", "0.25"])
    assert _train_config(args).latent.word_dropout == 0.25
