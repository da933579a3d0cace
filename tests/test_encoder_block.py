"""encoder_block (a trainable block over the cached per-token states before the attention views' pool),
against independent computations on a tiny model: the identity at the start (so the pool starts at its
view), the gated MLP and the transformer layer by hand, padding that changes nothing, and training that
moves it and reads back from its checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disentanglement.config import ConfigError, build_config
from disentanglement.data import collate
from disentanglement.trainer import load_trained
from helpers import tiny_cvae, tiny_llama, train_and_read_metrics, view_pairs

TOL = dict(rtol=1e-5, atol=1e-5)
KINDS = ("mlp", "transformer")


@pytest.fixture(scope="module")
def pairs():
    return view_pairs()


def setup(tokenizer, pairs, **overrides):
    return tiny_cvae(tokenizer, pairs, **overrides)[:2]


def randomise(block: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


@pytest.mark.parametrize("view", ["token_weighted_attention", "attention"])
@pytest.mark.parametrize("kind", KINDS)
def test_at_the_start_the_block_is_the_identity(tokenizer, pairs, kind, view):
    model, examples = setup(tokenizer, pairs, encoder_view=view, encoder_block=kind)
    plain, _ = setup(tokenizer, pairs, encoder_view=view)
    batch = collate(examples[:6], 2)
    features = model.frozen_pass(batch)
    assert model.encoder_block is not None and plain.encoder_block is None
    torch.testing.assert_close(model.encoder_input(features), plain.encoder_input(features), rtol=0, atol=0)
    out = model.encoder_block(features.response_hidden, features.response_mask)
    torch.testing.assert_close(out, features.response_hidden, rtol=0, atol=0)


def by_hand(block, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's response positions alone (no padding at all), the layer written out."""
    out = torch.zeros_like(hidden)
    H = hidden.shape[-1]

    def mlp(h):
        m = block.mlp
        x = F.layer_norm(h, (H,), m.norm.weight, m.norm.bias, m.norm.eps)
        return (
            h
            + (F.silu(x @ m.gate.weight.T + m.gate.bias) * (x @ m.up.weight.T + m.up.bias)) @ m.out.weight.T
            + (m.out.bias)
        )

    for b in range(hidden.shape[0]):
        rows = mask[b].nonzero().flatten()
        h = hidden[b, rows]  # [n, H]
        if block.attention is not None:
            a = block.attention
            n_heads, d = a.num_heads, H // a.num_heads
            x = F.layer_norm(h, (H,), block.attention_norm.weight, block.attention_norm.bias, block.attention_norm.eps)
            q, k, v = (x @ a.in_proj_weight.T + a.in_proj_bias).split(H, dim=-1)
            heads = []
            for i in range(n_heads):
                s = slice(i * d, (i + 1) * d)
                weights = torch.softmax(q[:, s] @ k[:, s].T / math.sqrt(d), dim=-1)  # [n, n], no causal mask
                heads.append(weights @ v[:, s])
            h = h + torch.cat(heads, dim=-1) @ a.out_proj.weight.T + a.out_proj.bias
        out[b, rows] = mlp(h)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_block_by_hand_and_padding_changes_nothing(tokenizer, pairs, kind):
    model, examples = setup(tokenizer, pairs, encoder_view="token_weighted_attention", encoder_block=kind)
    block = model.encoder_block
    randomise(block)
    features = model.frozen_pass(collate(examples[:6], 2))
    hidden, mask = features.response_hidden, features.response_mask
    got = block(hidden, mask)
    torch.testing.assert_close(got, by_hand(block, hidden, mask), **TOL)
    assert torch.equal(got[~mask.bool()], torch.zeros_like(got[~mask.bool()]))  # zero off the response
    # eight more padding positions, holding junk: the same states on the response
    wider = torch.cat([hidden, torch.randn(hidden.shape[0], 8, hidden.shape[2])], dim=1)
    wider_mask = F.pad(mask, (0, 8), value=False)
    torch.testing.assert_close(block(wider, wider_mask)[:, : hidden.shape[1]], got, **TOL)
    # and the encoder reads the block's states: its input moves away from the plain view's
    plain, _ = setup(tokenizer, pairs, encoder_view="token_weighted_attention")
    assert not torch.allclose(model.encoder_input(features), plain.encoder_input(features))


@pytest.mark.parametrize("kind", KINDS)
def test_training_moves_the_block_and_it_reads_back(tokenizer, pairs, tmp_path, kind):
    records = train_and_read_metrics(
        tmp_path / kind,
        tiny_llama(len(tokenizer)),
        tokenizer,
        pairs,
        encoder_view="token_weighted_attention",
        encoder_block=kind,
        latent="discrete",
        encoder_lr=0.05,
        save_every=4,
    )
    assert all(math.isfinite(r["loss"]) for r in records)
    checkpoint = next((tmp_path / kind / "checkpoints").glob("step-*"))
    model, _, config, _ = load_trained(checkpoint, (tiny_llama(len(tokenizer)), tokenizer))
    assert config.latent.encoder_block == kind
    assert model.encoder_block.mlp.out.weight.abs().sum() > 0  # it left its zero start, and was saved
    groups = model.parameter_groups()
    assert any(p is model.encoder_block.mlp.out.weight for p in groups["encoder"])  # trains at encoder_lr


def test_the_block_needs_an_attention_view():
    assert build_config({"encoder_view": "attention", "encoder_block": "mlp"}).latent.encoder_block == "mlp"
    assert build_config({}).latent.encoder_block == "none"
    with pytest.raises(
        ConfigError, match=r"encoder_block 'mlp' works on the per-token states (.|\n)* \(got 'token_weighted'\)"
    ):
        build_config({"encoder_block": "mlp"})
    with pytest.raises(ConfigError, match=r"LatentConfig\.encoder_block must be one of"):
        build_config({"encoder_view": "attention", "encoder_block": "lstm"})
