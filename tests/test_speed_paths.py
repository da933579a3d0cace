"""The step's and the scorer's fast paths compute what the plain computation does, each against a second
straightforward implementation on a tiny model: the decoder's rows in length groups (values and
gradients) against one pass over the padded batch, the LM head at the supervised positions only against
the head over the whole window, decodes reused in scoring against scoring without reuse, and
``length_groups`` against every split by brute force."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from disentanglement import cvae_base
from disentanglement.config import build_config
from disentanglement.data import collate, length_groups, tokenize_pairs
from disentanglement.evaluation import score_batch
from disentanglement.losses import masked_token_nll_per_position
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from helpers import tiny_llama, tiny_tokenizer

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def model_and_batch():
    tokenizer = tiny_tokenizer()
    # prompts of very different lengths: a batch with much padding, which the length groups split
    prompts = [f"what about {'item ' * (1 + (i * 7) % 23)}{i}" for i in range(12)]
    pairs = make_hidden_factor_pairs(prompts, kind="clean")
    config = build_config(dict(chat_template=False, codebook_size=4, token_weighted_weight=1.0))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    batch = collate(examples, tokenizer.pad_token_id)
    return model, batch


@contextlib.contextmanager
def one_decoder_pass():
    original = cvae_base.DECODER_CALL_POSITIONS
    cvae_base.DECODER_CALL_POSITIONS = float("inf")
    try:
        yield
    finally:
        cvae_base.DECODER_CALL_POSITIONS = original


def count_decoder_calls(model):
    calls = []
    original = model.decoder.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["inputs_embeds"].shape)
        return original(*args, **kwargs)

    return calls, counted


def test_length_groups_by_brute_force():
    rng = torch.Generator().manual_seed(0)
    for n, cost in itertools.product((1, 2, 5, 7), (0, 3, 40)):
        lengths = torch.randint(1, 60, (n,), generator=rng).tolist()
        groups = length_groups(lengths, cost, max_groups=3)
        assert sorted(i for g in groups for i in g) == list(range(n)) and all(g == sorted(g) for g in groups)

        def total(split, lengths=lengths, cost=cost):
            return sum(len(g) * max(lengths[i] for i in g) + cost for g in split)

        order = sorted(range(n), key=lambda i: (lengths[i], i))
        best = min(  # every cut of the sorted rows into at most 3 consecutive groups
            total([order[a:b] for a, b in zip((0, *cuts), (*cuts, n), strict=True)])
            for k in range(min(3, n))
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert total(groups) == best
    assert length_groups([5, 5, 5, 5], 1) == [[0, 1, 2, 3]]  # nothing to save: one group
    assert length_groups([3, 50, 4, 49], 1) == [[0, 2], [1, 3]]


def test_decoding_in_length_groups_is_one_pass_on_every_real_position(model_and_batch):
    model, batch = model_and_batch
    model.train()
    vector = torch.randn(len(batch), model.latent_vector_dim, requires_grad=True)
    calls, counted = count_decoder_calls(model)
    model.decoder.forward = counted
    try:
        grouped = model.decode(batch, vector)
        nll = grouped.token_nll()
        (grad,) = torch.autograd.grad(nll.sum(), vector)
        grouped_calls = len(calls)
        with one_decoder_pass():
            plain = model.decode(batch, vector)
            plain_nll = plain.token_nll()
            (plain_grad,) = torch.autograd.grad(plain_nll.sum(), vector)
    finally:
        del model.decoder.forward
    assert grouped_calls >= 2 and len(calls) == grouped_calls + 1  # the batch was split; the plain pass is one call
    assert sum(s[0] * s[1] for s in calls[:grouped_calls]) < calls[-1][0] * calls[-1][1]  # fewer positions
    torch.testing.assert_close(nll, plain_nll, **TOL)
    torch.testing.assert_close(grad, plain_grad, **TOL)
    # the hidden states agree on every real position (the padding's differ: nothing reads them)
    width = batch.attention_mask.shape[1] + model.num_latent_tokens
    real = F.pad(batch.attention_mask, (model.num_latent_tokens, 0), value=1).bool()[:, grouped.start : width]
    torch.testing.assert_close(grouped.hidden[real], plain.hidden[real], **TOL)


def test_the_head_at_the_supervised_positions_is_the_head_over_the_window(model_and_batch):
    model, batch = model_and_batch
    vector = torch.randn(len(batch), model.latent_vector_dim)
    decoded = model.decode(batch, vector)
    window = masked_token_nll_per_position(
        decoded.hidden,
        decoded.input_ids[:, decoded.start :],
        decoded.target_mask[:, decoded.start :],
        head=decoded.head,
    )
    expected = F.pad(window, (decoded.start, 0))
    torch.testing.assert_close(decoded.token_nll(), expected, **TOL)
    # the chunked, checkpointed path (chunks of 3 of the supervised positions): the same values and gradients
    hidden = decoded.hidden.detach().requires_grad_(True)
    decoded.hidden = hidden
    (one_block,) = torch.autograd.grad((decoded.token_nll() * torch.arange(1.0, 1 + expected.shape[1])).sum(), hidden)
    originals = cvae_base.WHOLE_WINDOW_LOGITS, cvae_base.default_chunk_size
    cvae_base.WHOLE_WINDOW_LOGITS, cvae_base.default_chunk_size = 0, lambda batch, vocab: 3
    try:
        chunked = decoded.token_nll()
        (chunked_grad,) = torch.autograd.grad((chunked * torch.arange(1.0, 1 + expected.shape[1])).sum(), hidden)
    finally:
        cvae_base.WHOLE_WINDOW_LOGITS, cvae_base.default_chunk_size = originals
    torch.testing.assert_close(chunked, expected, **TOL)
    torch.testing.assert_close(chunked_grad, one_block, **TOL)
    # by hand at one supervised position
    b, t = 0, int(decoded.target_mask[0, 1:].nonzero()[0])
    logits = decoded.head(decoded.hidden[b, t - decoded.start]).float()
    hand = -torch.log_softmax(logits, -1)[decoded.input_ids[b, t + 1]]
    torch.testing.assert_close(decoded.token_nll()[b, t], hand, **TOL)


def test_scoring_reuses_the_exact_mixtures_decodes_and_gives_the_same_scores(model_and_batch):
    model, batch = model_and_batch
    model.eval()
    features = model.frozen_pass(batch)
    calls, counted = count_decoder_calls(model)
    model.decoder.forward = counted
    try:
        torch.manual_seed(0)
        reused = score_batch(model, batch, features)
        reused_calls = len(calls)
        calls.clear()
        original = type(model).reusing_decodes
        type(model).reusing_decodes = lambda self, batch: contextlib.nullcontext()
        try:
            torch.manual_seed(0)
            plain = score_batch(model, batch, features)
        finally:
            type(model).reusing_decodes = original
    finally:
        del model.decoder.forward
    groups = len(length_groups(batch.attention_mask.sum(1).add(model.num_latent_tokens).tolist(), 64))
    assert reused_calls == 4 * groups and len(calls) == 6 * groups  # 4 codes; not the posterior and the bound again
    for name in ("posterior_nll", "prior_nll", "zfree_nll", "iw_log_weights", "iw_sequence_nll"):
        torch.testing.assert_close(getattr(reused, name), getattr(plain, name), rtol=0, atol=0)
    assert reused.reconstruction_terms == plain.reconstruction_terms
