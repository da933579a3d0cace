"""Whether a generation ended or was cut at the token cap (``generation.generate_responses``' ``ended``,
``generate``'s ``ended`` and ``truncated_share``): by hand on token rows, and in every decoding loop
(transformers' ``generate``, the memory placement's loop, the guided loop) against the same loop run with no end
token, where a row ends exactly when its tokens hold one."""

from __future__ import annotations

import pytest

from disentanglement.generation import (
    SamplingOptions,
    _text_and_end,
    format_generations,
    generate,
    generate_responses,
)
from disentanglement.guidance import Guidance, guided_generate
from test_guidance import PLACEMENTS, sets_of, setup


def test_text_and_end_by_hand(tokenizer):
    ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert _text_and_end(tokenizer, [*ids, eos, eos], {eos}) == (tokenizer.decode(ids), True)
    assert _text_and_end(tokenizer, ids, {eos}) == (tokenizer.decode(ids), False)  # ran to the cap
    assert _text_and_end(tokenizer, [eos, *ids], {eos}) == ("", True)  # ended at once: the empty response
    assert _text_and_end(tokenizer, [*ids[:1], ids[1]], {ids[1]}) == (tokenizer.decode(ids[:1]), True)


def an_end_token(rows: list[list[int]], never: int) -> int:
    """A token some rows hold and others do not (so some rows end and some run on), not ``never``."""
    for token in sorted({t for row in rows for t in row} - {never}):
        holders = sum(token in row for row in rows)
        if 0 < holders < len(rows):
            return token
    raise AssertionError("every token is in every row or in none: the check needs rows that differ")


@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize(("arch", "training", "placement"), PLACEMENTS)
def test_a_row_ends_exactly_when_its_tokens_hold_an_end_token(tokenizer, arch, training, placement, guided):
    """The rows decoded with no end token (the guided loop; at scale 0 it gives transformers' ``generate`` and the
    memory loop's tokens, test_guidance.py); one of their tokens made the decoder's end token: the rows holding it
    end there (``ended`` True, the text their tokens before it), the others run to the cap (False, all their text)."""
    model, rows, vectors, keys = setup(tokenizer, arch, training, placement)
    steps, pad = 8, tokenizer.pad_token_id
    _, latent_sets, own = sets_of(vectors, keys)
    guidance = Guidance(2.0, 0.05) if guided else Guidance(0.0)
    greedy = SamplingOptions(greedy=True, max_new_tokens=steps)
    free = guided_generate(model, rows, latent_sets, own, greedy, guidance, set(), pad).tolist()
    assert all(len(row) == steps for row in free)
    end = an_end_token(free, tokenizer.eos_token_id)
    config = model.decoder.generation_config
    before = config.eos_token_id
    config.eos_token_id = end  # generation's end tokens: the tokenizer's and the decoder's own
    try:
        options = dict(guidance=guidance, contrast_keys=keys) if guided else {}
        texts, ended = generate_responses(model, tokenizer, rows, vectors, greedy, **options)
    finally:
        config.eos_token_id = before
    eos = {end, tokenizer.eos_token_id}
    assert ended == [any(t in eos for t in row) for row in free]
    assert 0 < sum(ended) < len(rows)
    for text, row in zip(texts, free, strict=True):
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        assert text == tokenizer.decode(row[:cut], skip_special_tokens=True)


def test_generate_records_each_response_end_and_the_share_cut(tokenizer):
    """``generate``: each record's ``ended`` is ``generate_responses``' own, ``truncated_share`` their share, and
    the text table marks the responses cut at the cap."""
    from test_memory import memory_model

    model, config = memory_model(tokenizer, "llama", "frozen", latent_placement="prefix")
    sampling = SamplingOptions(greedy=True, max_new_tokens=6)
    result = generate(model, tokenizer, config, ["ab", "a longer prompt"], mode="codes", sampling=sampling)
    ended = [g["ended"] for g in result["generations"]]
    assert result["truncated_share"] == pytest.approx(sum(not e for e in ended) / len(ended))
    table = format_generations(result)
    assert table.count("[cut at 6 tokens]") == sum(not e for e in ended) > 0
    assert f"cut at the token cap {result['truncated_share']:.3f}" in table
