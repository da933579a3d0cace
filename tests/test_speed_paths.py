"""The step's and the scorer's fast paths compute what the plain computation does, each against a second
straightforward implementation on a tiny model: the decoder's rows in length groups (values and
gradients) against one pass over the padded batch, the LM head at the supervised positions only against
the head over the whole window, decodes reused in scoring against scoring without reuse, the frozen pass
with its shared prefix run once against the plain pass, the between placement's prompt run apart (once for
every code in scoring) against one pass over ``[x][z][y]``, and ``length_groups`` against every split by brute
force."""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from disentanglement import cvae_base, reference
from disentanglement.config import build_config
from disentanglement.data import collate, length_groups, tokenize_pairs
from disentanglement.evaluation import score_batch
from disentanglement.losses import masked_token_nll_per_position
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from helpers import tiny_gpt2, tiny_llama, tiny_tokenizer

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


def one_decoder_pass():
    """The decoder's rows in one call, not in length groups."""
    return mock.patch.object(cvae_base, "DECODER_CALL_POSITIONS", float("inf"))


def one_pass_over_the_prompt():
    """The between placement's prompt and ``[z][y]`` in one pass over ``[x][z][y]``."""
    return mock.patch.object(cvae_base, "SPLIT_PROMPT", False)


@contextlib.contextmanager
def count_decoder_calls(model, kinds=None):
    """Inside, the decoder's forward records the ``[B, T]`` of each call (by ``input_ids`` or by
    ``inputs_embeds``) in the list it yields; with a ``kinds`` list, "ids" or "embeds" for each call."""
    calls = []
    original = model.decoder.forward

    def counted(*args, **kwargs):
        inputs = kwargs.get("input_ids")
        if kinds is not None:
            kinds.append("ids" if inputs is not None else "embeds")
        inputs = kwargs["inputs_embeds"] if inputs is None else inputs
        calls.append(tuple(inputs.shape[:2]))
        return original(*args, **kwargs)

    model.decoder.forward = counted
    try:
        yield calls
    finally:
        del model.decoder.forward


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
    with count_decoder_calls(model) as calls:
        grouped = model.decode(batch, vector)
        nll = grouped.token_nll()
        (grad,) = torch.autograd.grad(nll.sum(), vector)
        grouped_calls = len(calls)
        with one_decoder_pass():
            plain = model.decode(batch, vector)
            plain_nll = plain.token_nll()
            (plain_grad,) = torch.autograd.grad(plain_nll.sum(), vector)
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
    with count_decoder_calls(model) as calls:
        torch.manual_seed(0)
        reused = score_batch(model, batch, features)
        reused_calls = len(calls)
        calls.clear()
        with mock.patch.object(type(model), "reusing_decodes", lambda self, batch: contextlib.nullcontext()):
            torch.manual_seed(0)
            plain = score_batch(model, batch, features)
    groups = len(length_groups(batch.attention_mask.sum(1).add(model.num_latent_tokens).tolist(), 64))
    assert reused_calls == 4 * groups and len(calls) == 6 * groups  # 4 codes; not the posterior and the bound again
    for name in ("posterior_nll", "prior_nll", "zfree_nll", "iw_log_weights", "iw_sequence_nll"):
        torch.testing.assert_close(getattr(reused, name), getattr(plain, name), rtol=0, atol=0)
    assert reused.reconstruction_terms == plain.reconstruction_terms


def test_shared_prefix_length_by_hand():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 1, 0, 0], [5, 6, 7, 8, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert reference.shared_prefix_length(ids, mask) == 3
    assert reference.shared_prefix_length(ids[[0, 2]], mask[[0, 2]]) == 4  # 5 6 7 8, and rows of 5 and 6 tokens
    # one short of the shortest row: every row keeps a token of its own
    same = torch.tensor([[4, 4, 4, 0], [4, 4, 4, 4]])
    assert reference.shared_prefix_length(same, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])) == 2
    assert reference.shared_prefix_length(ids[:1], mask[:1]) == 0  # one row: nothing to share
    # left padding: the first positions are not every row's own, so nothing is shared
    left = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8]])
    assert reference.shared_prefix_length(left, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])) == 0


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_frozen_pass_runs_the_shared_prefix_once_and_gives_the_plain_pass(build):
    tokenizer = tiny_tokenizer()
    # ChatML, "<|im_start|>user\nwhat about the ": 21 tokens every row shares, then prompts of different lengths
    prompts = [f"what about the {'item ' * (1 + i % 4)}{i}" for i in range(6)]
    pairs = make_hidden_factor_pairs(prompts, kind="clean")
    config = build_config(dict(codebook_size=4, encoder_view="token_weighted_attention"))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(0)
    model = build_cvae(config, build(len(tokenizer))).eval()
    batch = collate(examples, tokenizer.pad_token_id)
    shared = reference.shared_prefix_length(batch.input_ids, batch.attention_mask)
    assert shared >= max(reference.MIN_SHARED_PREFIX, 21)
    with count_decoder_calls(model) as calls:
        fast = model.frozen_pass(batch)
        fast_calls = list(calls)
        with mock.patch.object(reference, "MIN_SHARED_PREFIX", 10**9):
            plain = model.frozen_pass(batch)
    B, T = batch.input_ids.shape
    assert fast_calls == [(1, shared), (B, T - shared)] and calls[len(fast_calls) :] == [(B, T)]
    torch.testing.assert_close(fast.zfree_token_nll, plain.zfree_token_nll, **TOL)
    torch.testing.assert_close(fast.prior_features, plain.prior_features, **TOL)
    torch.testing.assert_close(fast.encoder_features, plain.encoder_features, **TOL)
    torch.testing.assert_close(fast.response_hidden, plain.response_hidden, **TOL)


def test_the_positions_a_shared_prefix_saves_counted_by_hand():
    from disentanglement.data import Example
    from disentanglement.features import shared_prefix_positions

    def example(prompt, response):
        return Example(prompt_ids=prompt, response_ids=response, label=None, source="by hand")

    common = list(range(10, 20))  # 10 tokens every prompt begins with
    examples = [example(common + [1] * i, [2, 3]) for i in range(1, 6)]  # 13 .. 17 tokens, in that order
    # batches of 2 in length order: [0, 1] share common + [1] (11), [2, 3] common + [1, 1, 1] (13), one row
    # each fewer; the lone [4] shares nothing
    assert shared_prefix_positions(examples, 0, batch_size=2) == 11 + 13
    assert shared_prefix_positions(examples, 0, batch_size=5) == 4 * 11
    short = [example([7] * 3 + [i], [2]) for i in range(4)]  # 3 shared tokens: below MIN_SHARED_PREFIX
    assert shared_prefix_positions(short, 0, batch_size=4) == 0
    # copies are passed once: two more copies of example 4 and one of example 0 change nothing
    assert shared_prefix_positions([*examples, examples[4], examples[0], examples[4]], 0, batch_size=2) == 11 + 13


def test_copies_of_an_example_are_passed_once_and_share_its_row(monkeypatch):
    """build_feature_cache without the store: each distinct (prompt, response) is passed once, in the same batches
    as the distinct examples alone, and every copy holds its row (the same values in the same order as the
    examples)."""
    from disentanglement.features import build_feature_cache, first_copies, frozen_pass_batches

    tokenizer = tiny_tokenizer()
    pairs = make_hidden_factor_pairs([f"what about the {'item ' * (1 + i % 4)}{i}" for i in range(6)], kind="clean")
    config = build_config(dict(codebook_size=4, encoder_view="token_weighted_attention"))
    distinct, _ = tokenize_pairs(pairs, tokenizer, config.data)
    order = [0, 3, 0, 1, 2, 3, 4, 5, 3, 3]  # copies of 0 and 3, the first copy not always first in length order
    examples = [distinct[i] for i in order]
    assert first_copies(examples) == [0, 1, 0, 3, 4, 1, 6, 7, 1, 1]
    assert sorted(i for b in frozen_pass_batches(examples, 4) for i in b) == [0, 1, 3, 4, 6, 7]
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer))).eval()
    rows = []
    original = cvae_base.CVAEBase.frozen_pass
    monkeypatch.setattr(
        cvae_base.CVAEBase,
        "frozen_pass",
        lambda self, batch: rows.append(len(batch.input_ids)) or original(self, batch),
    )
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 4, progress=False)
    alone = build_feature_cache(model, distinct, tokenizer.pad_token_id, 4, progress=False)
    assert rows == [4, 2, 4, 2]  # 6 distinct examples in batches of 4, twice
    for i, j in enumerate(order):
        assert torch.equal(cache.response_nll[i], alone.response_nll[j])
        assert torch.equal(cache.prior_features[i], alone.prior_features[j])
        assert torch.equal(cache.encoder_features[i], alone.encoder_features[j])
    starts = [0, *itertools.accumulate(len(e.response_ids) for e in examples)]
    starts_alone = [0, *itertools.accumulate(len(e.response_ids) for e in distinct)]
    for i, j in enumerate(order):
        assert torch.equal(
            cache.response_hidden[starts[i] : starts[i + 1]],
            alone.response_hidden[starts_alone[j] : starts_alone[j + 1]],
        )


@pytest.fixture(scope="module")
def between_batch():
    tokenizer = tiny_tokenizer()
    # prompts of different lengths that begin alike (ChatML's "<|im_start|>user\nwhat about ": a shared prefix)
    prompts = [f"what about {'item ' * (1 + (i * 3) % 5)}{i}" for i in range(7)]
    pairs = make_hidden_factor_pairs(prompts, kind="clean")
    config = build_config(dict(codebook_size=4, latent_placement="between"))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    return tokenizer, collate(examples, tokenizer.pad_token_id)


@pytest.mark.parametrize("groups", ["one group", "length groups"])
@pytest.mark.parametrize(
    "training, build",
    [("frozen", tiny_llama), ("lora", tiny_llama), ("frozen", tiny_gpt2)],  # GPT-2: learned absolute positions
    ids=["frozen-llama", "lora-llama", "frozen-gpt2"],
)
def test_the_between_placements_prompt_apart_is_one_pass_over_the_sequence(
    between_batch, training, build, groups, monkeypatch
):
    tokenizer, batch = between_batch
    if groups == "length groups":  # every split that saves a position: prompts and [z][y] in several calls
        monkeypatch.setattr(cvae_base, "DECODER_CALL_POSITIONS", 0)
    config = build_config(dict(codebook_size=4, latent_placement="between", decoder_training=training))
    torch.manual_seed(0)
    model = build_cvae(config, build(len(tokenizer))).train()
    # a frozen decoder's prompt builds no graph; a trained one's carries the adapters' gradients
    layers, _ = model._prompt_keys_values(batch)
    assert all((keys.requires_grad or values.requires_grad) == (training == "lora") for keys, values in layers)
    if training == "lora":  # adapters away from their zero start, so that their gradients are not trivial
        with torch.no_grad():
            for name, p in model.decoder.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    vector = torch.randn(len(batch), model.latent_vector_dim, requires_grad=True)
    inputs = [vector] + [p for p in model.decoder.parameters() if p.requires_grad]
    assert len(inputs) == (1 if training == "frozen" else 9)  # the latent; with LoRA 2 layers x q, v x A, B too
    kinds = []
    with count_decoder_calls(model, kinds) as calls:
        apart = model.decode(batch, vector)
        nll = apart.token_nll()
        grads = torch.autograd.grad(nll.sum(), inputs)
        apart_calls = list(calls)
        with one_pass_over_the_prompt():
            plain = model.decode(batch, vector)
            plain_nll = plain.token_nll()
            plain_grads = torch.autograd.grad(plain_nll.sum(), inputs)
    B, X = len(batch), int(batch.prompt_lengths.max())
    shared = reference.shared_prefix_length(batch.input_ids[:, :X], batch.attention_mask[:, :X])
    P, R = model.num_latent_tokens, int(batch.response_lengths.max())
    if groups == "one group" and training == "frozen":  # the prompts' shared prefix once, their rest, [z][y]
        assert apart_calls == [(1, shared), (B, X - shared), (B, P + R)]
    elif groups == "one group":  # trained with dropout: every row's prompt its own, then [z][y]
        assert apart_calls == [(B, X), (B, P + R)]
    else:  # groups of prompts (frozen: each its shared prefix, then the rest), then groups of [z][y]
        suffix_calls = [shape for shape, kind in zip(apart_calls, kinds, strict=False) if kind == "embeds"]
        assert len(suffix_calls) >= 2 and sum(rows for rows, _ in suffix_calls) == B
        assert max(width for _, width in suffix_calls) == P + R and kinds.count("ids") >= 2
    assert calls[len(apart_calls) :][0][1] > P + R  # the plain pass: the whole [x][z][y]
    torch.testing.assert_close(nll, plain_nll, **TOL)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-5)
    # every supervised position's state is the one-pass state
    supervised = F.pad(apart.target_mask[:, apart.start + 1 :].bool(), (0, 1))
    torch.testing.assert_close(apart.hidden[supervised], plain.hidden[supervised], **TOL)


def test_the_between_decode_stays_inside_the_models_positions():
    """Rows of opposite lengths (a long prompt with a short response, a short prompt with a long one): the
    suffix's padding positions stop at the one pass's last position, so GPT-2 with exactly that many learned
    positions decodes apart as in one pass (padding at ``p_b + j`` went past them: an index error)."""
    tokenizer = tiny_tokenizer()
    prompts = ["what about " + "item " * 12 + "now", "hi"]
    responses = ["ok", "well " * 12 + "that is all"]
    pairs = make_hidden_factor_pairs(prompts, kind="marked", responses=responses)
    config = build_config(dict(codebook_size=4, latent_placement="between"))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    batch = collate(examples, tokenizer.pad_token_id)
    P = build_cvae(config, tiny_gpt2(len(tokenizer))).num_latent_tokens
    Tc = int((batch.prompt_lengths + batch.response_lengths).max()) + P  # one pass's [x][z][y] width
    longest_suffix = int(batch.prompt_lengths.max() + batch.response_lengths.max()) + P
    assert longest_suffix > Tc  # the case: the longest prompt and the longest response are in different rows
    torch.manual_seed(0)
    model = build_cvae(config, tiny_gpt2(len(tokenizer), n_positions=Tc)).eval()
    vector = torch.randn(len(batch), model.latent_vector_dim)
    with torch.no_grad():
        apart = model.decode(batch, vector).token_nll()
        with one_pass_over_the_prompt():
            plain = model.decode(batch, vector).token_nll()
    torch.testing.assert_close(apart, plain, **TOL)


def test_scoring_runs_the_between_placements_prompt_once_for_every_code(between_batch):
    tokenizer, batch = between_batch
    config = build_config(dict(codebook_size=4, latent_placement="between"))
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer))).eval()
    features = model.frozen_pass(batch)
    with count_decoder_calls(model) as calls:
        torch.manual_seed(0)
        apart = score_batch(model, batch, features)
        apart_calls = list(calls)
        calls.clear()
        with one_pass_over_the_prompt():
            torch.manual_seed(0)
            plain = score_batch(model, batch, features)
    # the prompt (its shared prefix and the rest: two calls) once, then [z][y] under each of the 4 codes
    assert len(apart_calls) == 2 + 4 and all(shape[1] < batch.input_ids.shape[1] for shape in apart_calls)
    for name in ("posterior_nll", "prior_nll", "zfree_nll", "iw_log_weights", "iw_sequence_nll"):
        torch.testing.assert_close(getattr(apart, name), getattr(plain, name), rtol=1e-5, atol=1e-5)


def test_plain_cache_is_asked_once_per_decoder(monkeypatch):
    """``memory.plain_cache`` builds a cache to answer; it answers each decoder once (asked on every batch)."""
    from disentanglement import memory

    asked = []
    geometry = memory.memory_geometry
    monkeypatch.setattr(memory, "memory_geometry", lambda decoder: asked.append(decoder) or geometry(decoder))
    first, second = tiny_llama(64), tiny_gpt2(64)
    assert [memory.plain_cache(m) for m in (first, first, second, second, first)] == [True] * 5
    assert asked == [first, second]
