"""Token weights (docs/design.md section 3) against hand-worked numbers and a plain Python loop.

The loop reference (:func:`loop_weighting`) is deliberately naive: float64 Python scalars, one
example and one position at a time, powers computed directly (not in log space), so it shares no
code path with ``token_weighting.py``. Surprisal is floored at ``eps`` only before the power;
the statistics (``example_base_loss``, the weighted base losses) use the unfloored ``b_t``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from disentanglement.cvae_base import WeightingParams
from disentanglement.features import FeatureCache
from disentanglement.token_weighting import (
    TokenWeighting,
    align_to_conditioned,
    align_token_weighting,
    compute_token_weighting,
    score_zfree_reference,
    token_weighting_from_base_nll,
    weighting_from_zfree_nll,
)
from references import WEIGHTING_FIELDS as FIELDS
from references import loop_align, loop_weighting, manual_zfree_nll

# ----------------------------------------------------------------------------------------------
# Independent reference implementation
# ----------------------------------------------------------------------------------------------


def assert_matches_loop(w: TokenWeighting, ref: dict, rtol: float = 1e-9, atol: float = 1e-12) -> None:
    for name in FIELDS:
        got = getattr(w, name).to(torch.float64)
        want = torch.tensor(ref[name], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda s, name=name: f"{name}: {s}")


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# Hand-worked examples
# ----------------------------------------------------------------------------------------------


def test_hand_worked_alpha_1():
    w = token_weighting_from_base_nll(t64([[1.0, 2.0, 3.0]]), torch.ones(1, 3), alpha=1.0)
    # pi = b / sum b
    torch.testing.assert_close(w.token_weights, t64([[1 / 6, 2 / 6, 3 / 6]]))
    # pi_inv proportional to [1, 1/2, 1/3] = [6, 3, 2] / 11
    torch.testing.assert_close(w.inverse_token_weights, t64([[6 / 11, 3 / 11, 2 / 11]]))
    torch.testing.assert_close(w.aligned_base_token_nll, t64([[1.0, 2.0, 3.0]]))
    torch.testing.assert_close(w.example_base_loss, t64([2.0]))
    # (1*1 + 2*2 + 3*3) / 6 = 14/6
    torch.testing.assert_close(w.token_weighted_base_loss, t64([14 / 6]))
    # (6*1 + 3*2 + 2*3) / 11 = 18/11
    torch.testing.assert_close(w.inverse_token_weighted_base_loss, t64([18 / 11]))
    torch.testing.assert_close(w.token_concentration_factor, t64([7 / 6]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([9 / 11]))


def test_hand_worked_alpha_2_with_mask():
    # Positions 0 and 4 are unsupervised: their values are ignored and become zero.
    b = t64([[5.0, 1.0, 2.0, 3.0, 7.0]])
    m = torch.tensor([[0, 1, 1, 1, 0]])
    w = token_weighting_from_base_nll(b, m, alpha=2.0)
    torch.testing.assert_close(w.token_weights, t64([[0.0, 1 / 14, 4 / 14, 9 / 14, 0.0]]))
    # b^-2 = [1, 1/4, 1/9] = [36, 9, 4] / 36 -> / 49
    torch.testing.assert_close(w.inverse_token_weights, t64([[0.0, 36 / 49, 9 / 49, 4 / 49, 0.0]]))
    torch.testing.assert_close(w.aligned_base_token_nll, t64([[0.0, 1.0, 2.0, 3.0, 0.0]]))
    torch.testing.assert_close(w.example_base_loss, t64([2.0]))
    torch.testing.assert_close(w.token_weighted_base_loss, t64([36 / 14]))  # (1 + 8 + 27) / 14
    torch.testing.assert_close(w.inverse_token_weighted_base_loss, t64([66 / 49]))  # (36 + 18 + 12) / 49
    torch.testing.assert_close(w.token_concentration_factor, t64([9 / 7]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([33 / 49]))


def test_hand_worked_two_examples_are_independent():
    b = t64([[1.0, 2.0, 3.0], [4.0, 4.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    torch.testing.assert_close(w.token_weights, t64([[1 / 6, 2 / 6, 3 / 6], [0.5, 0.5, 0.0]]))
    torch.testing.assert_close(w.token_concentration_factor, t64([7 / 6, 1.0]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([9 / 11, 1.0]))
    torch.testing.assert_close(w.example_base_loss, t64([2.0, 4.0]))


def test_alpha_zero_uniform_and_factors_one():
    b = t64([[0.3, 2.0, 9.0, 0.0], [1.0, 0.0, 0.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    w = token_weighting_from_base_nll(b, m, alpha=0.0)
    expected = t64([[1 / 3, 1 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 0.0, 1 / 3]])
    torch.testing.assert_close(w.token_weights, expected)
    torch.testing.assert_close(w.inverse_token_weights, expected)
    torch.testing.assert_close(w.token_concentration_factor, t64([1.0, 1.0]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([1.0, 1.0]))
    torch.testing.assert_close(w.token_weighted_base_loss, w.example_base_loss)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("b_value", [0.0, 1e-9, 0.7, 12.0])
def test_single_supervised_token(alpha, b_value):
    b = t64([[3.0, b_value, 8.0]])
    m = torch.tensor([[0, 1, 0]])
    w = token_weighting_from_base_nll(b, m, alpha=alpha)
    torch.testing.assert_close(w.token_weights, t64([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(w.inverse_token_weights, t64([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(w.token_concentration_factor, t64([1.0]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([1.0]))
    torch.testing.assert_close(w.example_base_loss, t64([b_value]))


def test_eps_floor_hand_worked():
    # b = [0, 1], alpha = 1, eps = 1e-6: the zero is floored to 1e-6 before the power only.
    eps = 1e-6
    w = token_weighting_from_base_nll(t64([[0.0, 1.0]]), torch.ones(1, 2), alpha=1.0, eps=eps)
    for name in FIELDS:
        assert torch.isfinite(getattr(w, name)).all(), name
    torch.testing.assert_close(w.token_weights, t64([[eps / (1 + eps), 1 / (1 + eps)]]))
    # inverse: proportional to [1/eps, 1] = [1e6, 1]
    torch.testing.assert_close(w.inverse_token_weights, t64([[1e6 / (1e6 + 1), 1 / (1e6 + 1)]]))
    # statistics use the unfloored b
    torch.testing.assert_close(w.aligned_base_token_nll, t64([[0.0, 1.0]]))
    torch.testing.assert_close(w.example_base_loss, t64([0.5]))
    torch.testing.assert_close(w.token_weighted_base_loss, t64([1 / (1 + eps)]))
    torch.testing.assert_close(w.inverse_token_weighted_base_loss, t64([1 / (1e6 + 1)]))
    torch.testing.assert_close(w.token_concentration_factor, t64([2 / (1 + eps)]))
    torch.testing.assert_close(w.inverse_token_base_scale_factor, t64([2 / (1e6 + 1)]))


@pytest.mark.parametrize("eps", [1e-6, 1e-3, 0.25])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 3.0])
def test_eps_floor_matches_loop(alpha, eps):
    b = [[0.0, 0.0, 1e-8, 2.0, 0.1], [0.0, 3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0]]
    m = [[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]
    w = token_weighting_from_base_nll(t64(b), torch.tensor(m), alpha=alpha, eps=eps)
    for name in FIELDS:
        assert torch.isfinite(getattr(w, name)).all(), name
    assert_matches_loop(w, loop_weighting(b, m, alpha, eps))
    # A row where every supervised surprisal is 0: uniform weights, b_base = 0 and kappa = rho = 1.
    torch.testing.assert_close(w.token_weights[2], t64([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]))
    assert w.example_base_loss[2].item() == 0.0
    assert w.token_concentration_factor[2].item() == 1.0
    assert w.inverse_token_base_scale_factor[2].item() == 1.0


def test_float32_input_keeps_dtype_and_detaches():
    b = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    w = token_weighting_from_base_nll(b, torch.ones(1, 3), alpha=1.0)
    for name in FIELDS:
        value = getattr(w, name)
        assert value.dtype == torch.float32, name
        assert not value.requires_grad, name
    torch.testing.assert_close(w.token_weights, torch.tensor([[1 / 6, 2 / 6, 3 / 6]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": 1.0, "eps": 0.0}, "eps"),
        ({"alpha": 1.0, "eps": -1e-6}, "eps"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_weighting_from_base_nll(t64([[1.0, 2.0]]), torch.ones(1, 2), **kwargs)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="no supervised token"):
        token_weighting_from_base_nll(t64([[1.0, 2.0], [1.0, 2.0]]), torch.tensor([[1, 0], [0, 0]]), alpha=1.0)
    with pytest.raises(ValueError, match="only 0 and 1"):
        token_weighting_from_base_nll(t64([[1.0, 2.0]]), torch.tensor([[1, 2]]), alpha=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        token_weighting_from_base_nll(t64([[1.0, -2.0]]), torch.ones(1, 2), alpha=1.0)
    with pytest.raises(ValueError, match="same"):
        token_weighting_from_base_nll(t64([[1.0, 2.0]]), torch.ones(1, 3), alpha=1.0)


# ----------------------------------------------------------------------------------------------
# Random tensors against the loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0, 2.5])
def test_random_matches_loop(alpha):
    g = torch.Generator().manual_seed(1234)
    bsz, n = 5, 11
    b = torch.rand(bsz, n, generator=g, dtype=torch.float64) * 6
    b[b < 0.6] = 0.0  # exact zeros among supervised tokens
    m = (torch.rand(bsz, n, generator=g) < 0.6).long()
    m[torch.arange(bsz), torch.randint(0, n, (bsz,), generator=g)] = 1
    w = token_weighting_from_base_nll(b, m, alpha=alpha)
    assert_matches_loop(w, loop_weighting(b.tolist(), m.tolist(), alpha))


def test_positive_alpha_bounds_on_random():
    g = torch.Generator().manual_seed(7)
    b = torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    m = torch.ones(6, 9, dtype=torch.long)
    for alpha in (0.1, 1.0, 3.0):
        w = token_weighting_from_base_nll(b, m, alpha=alpha)
        assert (w.token_concentration_factor >= 1 - 1e-12).all()
        assert (w.inverse_token_base_scale_factor <= 1 + 1e-12).all()
        # non-constant rows: strict inequalities
        assert (w.token_concentration_factor > 1).all()
        assert (w.inverse_token_base_scale_factor < 1).all()


# ----------------------------------------------------------------------------------------------
# Padding on either side
# ----------------------------------------------------------------------------------------------


def test_left_and_right_padding_match_unpadded_examples():
    examples = [[0.5, 2.0, 0.0, 4.0], [1.5], [3.0, 0.2, 7.0, 0.0, 1.0, 2.0]]
    n = max(len(e) for e in examples) + 2
    garbage = 123.0  # large values at padded positions must not leak into the weights
    for alpha in (0.0, 1.0, 2.0):
        singles = [token_weighting_from_base_nll(t64([e]), torch.ones(1, len(e)), alpha=alpha) for e in examples]
        for side in ("left", "right"):
            rows, masks, spans = [], [], []
            for e in examples:
                pad = n - len(e)
                if side == "left":
                    rows.append([garbage] * pad + e)
                    masks.append([0] * pad + [1] * len(e))
                    spans.append(slice(pad, n))
                else:
                    rows.append(e + [garbage] * pad)
                    masks.append([1] * len(e) + [0] * pad)
                    spans.append(slice(0, len(e)))
            w = token_weighting_from_base_nll(t64(rows), torch.tensor(masks), alpha=alpha)
            for i, (single, span) in enumerate(zip(singles, spans, strict=True)):
                for name in ("token_weights", "inverse_token_weights", "aligned_base_token_nll"):
                    full = getattr(w, name)[i]
                    torch.testing.assert_close(full[span], getattr(single, name)[0], rtol=1e-12, atol=1e-15)
                    outside = torch.ones(n, dtype=torch.bool)
                    outside[span] = False
                    assert (full[outside] == 0).all(), (side, name)
                for name in FIELDS[3:]:
                    torch.testing.assert_close(getattr(w, name)[i], getattr(single, name)[0], rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# Alignment
# ----------------------------------------------------------------------------------------------


def test_align_per_example_offsets_hand_worked():
    values = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.ones(3, 3, dtype=torch.long)
    out = align_to_conditioned(values, torch.tensor([2, 0, 1]), 5, zfree_mask=mask)
    expected = t64(
        [
            [0.0, 0.0, 1.0, 2.0, 3.0],
            [4.0, 5.0, 6.0, 0.0, 0.0],
            [0.0, 7.0, 8.0, 9.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)
    # offsets may be a plain list and negative
    out = align_to_conditioned(t64([[0.0, 1.0, 2.0]]), [-1], 2, zfree_mask=torch.tensor([[0, 1, 1]]))
    torch.testing.assert_close(out, t64([[1.0, 2.0]]))


def test_align_matches_loop_on_random():
    g = torch.Generator().manual_seed(3)
    bsz, nz, n_out = 4, 6, 11
    values = torch.rand(bsz, nz, generator=g, dtype=torch.float64) + 0.1
    mask = (torch.rand(bsz, nz, generator=g) < 0.7).long()
    offsets = [0, 5, 2, 3]
    out = align_to_conditioned(values * mask, torch.tensor(offsets), n_out, zfree_mask=mask)
    torch.testing.assert_close(out, t64(loop_align(values.tolist(), mask.tolist(), offsets, n_out)))


@pytest.mark.parametrize("offset", [0, 3])
def test_align_one_offset_for_the_batch_equals_the_loop(offset):
    # One offset for every example (both latent placements) takes a shift; it must equal the general rule.
    g = torch.Generator().manual_seed(4)
    values = torch.rand(3, 6, generator=g, dtype=torch.float64) + 0.1
    mask = (torch.rand(3, 6, generator=g) < 0.7).long()
    mask[:, 2] = 1
    n_out = 6 + offset
    out = align_to_conditioned(values * mask, torch.full((3,), offset), n_out, zfree_mask=mask)
    torch.testing.assert_close(out, t64(loop_align(values.tolist(), mask.tolist(), [offset] * 3, n_out)))
    # several values per position move together
    stacked = torch.stack([values * mask, 2 * values * mask], -1)  # [B, Nz, 2]
    moved = align_to_conditioned(stacked, torch.full((3,), offset), n_out, zfree_mask=mask)
    torch.testing.assert_close(moved, torch.stack([out, 2 * out], -1))
    # an unsupervised value past the end is dropped (general path), a supervised one is an error
    tail = torch.zeros(1, 6, dtype=torch.float64)
    tail[0, 1], tail[0, 5] = 1.0, 7.0
    tail_mask = torch.tensor([[0, 1, 0, 0, 0, 0]])
    got = align_to_conditioned(tail, torch.tensor([offset + 1]), n_out, zfree_mask=tail_mask)
    assert got[0, 2 + offset] == 1.0 and got.sum() == 1.0
    with pytest.raises(ValueError, match="outside"):
        align_to_conditioned(tail, torch.tensor([offset + 1]), n_out, zfree_mask=torch.tensor([[0, 1, 0, 0, 0, 1]]))
    with pytest.raises(ValueError, match="zfree_mask"):
        align_to_conditioned(stacked, torch.full((3,), offset), n_out)


@pytest.mark.parametrize("offsets", [[2, 2, 2], [0, 3, 1]])
def test_weighting_then_aligning_equals_aligning_then_weighting(offsets):
    g = torch.Generator().manual_seed(5)
    b = torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    b[0, 3] = 0.0  # a near-certain token
    mask = (torch.rand(3, 7, generator=g) < 0.6).long()
    mask[:, 4] = 1
    n_out = 11
    first = align_token_weighting(
        token_weighting_from_base_nll(b * mask, mask, alpha=1.5), torch.tensor(offsets), n_out, mask
    )
    aligned_mask = align_to_conditioned(mask.double(), torch.tensor(offsets), n_out, zfree_mask=mask)
    second = token_weighting_from_base_nll(
        align_to_conditioned(b * mask, torch.tensor(offsets), n_out, zfree_mask=mask), aligned_mask, alpha=1.5
    )
    for name in FIELDS:
        torch.testing.assert_close(getattr(first, name), getattr(second, name), rtol=1e-12, atol=1e-15)


def test_align_supervised_out_of_range_raises():
    values = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    # example 1, z-free position 2 lands at 2 + 3 = 5 >= 5
    with pytest.raises(ValueError, match="outside"):
        align_to_conditioned(values, torch.tensor([0, 3]), 5, zfree_mask=mask)
    # negative landing position of a supervised value
    with pytest.raises(ValueError, match="outside"):
        align_to_conditioned(values, torch.tensor([-1, 0]), 5, zfree_mask=mask)
    # without a mask, non-zero values count as supervised
    with pytest.raises(ValueError, match="outside"):
        align_to_conditioned(values, torch.tensor([0, 3]), 5)
    with pytest.raises(ValueError, match="entries"):
        align_to_conditioned(values, torch.tensor([0, 1, 2]), 5)


def test_align_unsupervised_out_of_range_dropped():
    values = t64([[9.0, 1.0, 2.0, 9.0], [3.0, 4.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    # example 0: offset -1 sends its unsupervised position 0 to -1 and position 3 to 2 (in range);
    # example 1: offset 2 sends its unsupervised positions 2, 3 to 4, 5 (out of range)
    out = align_to_conditioned(values, torch.tensor([-1, 2]), 4, zfree_mask=mask)
    # Unsupervised values that stay in range are carried; the weighting masks them out later.
    torch.testing.assert_close(out, t64([[1.0, 2.0, 9.0, 0.0], [0.0, 0.0, 3.0, 4.0]]))
    # without a mask, zero values are unsupervised and may fall out of range
    out = align_to_conditioned(t64([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([-1]), 2)
    torch.testing.assert_close(out, t64([[1.0, 0.0]]))


def test_weighting_from_zfree_nll_with_offsets_matches_manual():
    b = [[0.0, 1.0, 2.0, 0.5, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]]
    pm = [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    offsets = [3, 1]
    conditioned_length = 9
    w = weighting_from_zfree_nll(t64(b), torch.tensor(pm), torch.tensor(offsets), conditioned_length, alpha=1.5)
    aligned_b = loop_align(b, pm, offsets, conditioned_length - 1)
    aligned_m = [[int(v) for v in row] for row in loop_align(pm, pm, offsets, conditioned_length - 1)]
    assert w.token_weights.shape == (2, conditioned_length - 1)
    assert_matches_loop(w, loop_weighting(aligned_b, aligned_m, 1.5))


# ----------------------------------------------------------------------------------------------
# Property-based invariants
# ----------------------------------------------------------------------------------------------

b_value = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=30.0), st.floats(min_value=0.0, max_value=1e-5))


@st.composite
def weighting_problems(draw):
    bsz = draw(st.integers(1, 4))
    n = draw(st.integers(1, 12))
    b = [[draw(b_value) for _ in range(n)] for _ in range(bsz)]
    m = []
    for _ in range(bsz):
        row = [draw(st.integers(0, 1)) for _ in range(n)]
        row[draw(st.integers(0, n - 1))] = 1  # at least one supervised token per row
        m.append(row)
    alpha = draw(st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=3.0)))
    eps = draw(st.sampled_from([1e-6, 1e-3]))
    return b, m, alpha, eps


@settings(max_examples=100, deadline=None)
@given(weighting_problems())
def test_property_invariants_and_loop_agreement(problem):
    b, m, alpha, eps = problem
    mt = torch.tensor(m, dtype=torch.bool)
    w = token_weighting_from_base_nll(t64(b), torch.tensor(m), alpha=alpha, eps=eps)
    for name in FIELDS:
        assert torch.isfinite(getattr(w, name)).all(), name
    for weights in (w.token_weights, w.inverse_token_weights):
        torch.testing.assert_close(weights.sum(dim=1), torch.ones(len(b), dtype=torch.float64), rtol=0, atol=1e-12)
        assert (weights[~mt] == 0).all()
        assert (weights[mt] >= 0).all()
    assert (w.aligned_base_token_nll[~mt] == 0).all()
    assert (w.token_concentration_factor >= 1 - 1e-9).all()
    assert (w.inverse_token_base_scale_factor <= 1 + 1e-9).all()
    if alpha == 0.0:
        torch.testing.assert_close(w.token_concentration_factor, torch.ones(len(b), dtype=torch.float64))
        torch.testing.assert_close(w.inverse_token_base_scale_factor, torch.ones(len(b), dtype=torch.float64))
    assert_matches_loop(w, loop_weighting(b, m, alpha, eps))


@settings(max_examples=50, deadline=None)
@given(
    problem=weighting_problems(),
    offsets=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    extra=st.integers(0, 3),
)
def test_property_alignment_then_weighting(problem, offsets, extra):
    b, m, alpha, eps = problem
    offsets = offsets[: len(b)]
    n_out = len(b[0]) + max(offsets) + extra
    bm = [[v if k else 0.0 for v, k in zip(row, mrow, strict=True)] for row, mrow in zip(b, m, strict=True)]
    w = weighting_from_zfree_nll(t64(bm), torch.tensor(m), torch.tensor(offsets), n_out + 1, alpha=alpha, eps=eps)
    aligned_b = loop_align(bm, m, offsets, n_out)
    aligned_m = [[int(v) for v in row] for row in loop_align(m, m, offsets, n_out)]
    assert_matches_loop(w, loop_weighting(aligned_b, aligned_m, alpha, eps))


# ----------------------------------------------------------------------------------------------
# The frozen reference model
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _batch():
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 50, (3, 8), generator=g)
    attention_mask = torch.ones(3, 8, dtype=torch.long)
    attention_mask[1, 6:] = 0  # right padding
    target_mask = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 1, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ]
    )
    return input_ids, attention_mask, target_mask


def test_score_zfree_reference_equals_cross_entropy(tiny_llama):
    input_ids, attention_mask, target_mask = _batch()
    got = score_zfree_reference(tiny_llama, input_ids, attention_mask, target_mask)
    assert got.shape == (3, 7)
    assert got.dtype == torch.float32
    want = manual_zfree_nll(tiny_llama, input_ids, attention_mask, target_mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got[target_mask[:, 1:] == 0] == 0).all()
    assert (got[target_mask[:, 1:] == 1] > 0).all()


def test_score_zfree_reference_left_padding_matches_unpadded(tiny_llama):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 50, (1, 6), generator=g)
    tm = torch.tensor([[0, 0, 1, 1, 1, 1]])
    single = score_zfree_reference(tiny_llama, ids, torch.ones_like(ids), tm)
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    padded_am = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    padded_tm = torch.cat([torch.zeros(1, 3, dtype=torch.long), tm], dim=1)
    padded = score_zfree_reference(tiny_llama, padded_ids, padded_am, padded_tm)
    torch.testing.assert_close(padded[:, 3:], single, rtol=1e-5, atol=1e-5)
    assert (padded[:, :3] == 0).all()


@pytest.mark.parametrize("training", [True, False])
def test_score_zfree_reference_restores_mode(tiny_llama, training):
    input_ids, attention_mask, target_mask = _batch()
    tiny_llama.train(training)
    score_zfree_reference(tiny_llama, input_ids, attention_mask, target_mask)
    assert tiny_llama.training is training
    assert all(module.training is training for module in tiny_llama.modules())
    compute_token_weighting(tiny_llama, input_ids, attention_mask, target_mask, torch.tensor([1, 1, 1]), 9, alpha=1.0)
    assert tiny_llama.training is training
    assert all(module.training is training for module in tiny_llama.modules())
    tiny_llama.train(True)


def test_no_gradient_reaches_reference(tiny_llama):
    input_ids, attention_mask, target_mask = _batch()
    tiny_llama.zero_grad(set_to_none=True)
    assert all(p.requires_grad for p in tiny_llama.parameters())
    base = score_zfree_reference(tiny_llama, input_ids, attention_mask, target_mask)
    assert not base.requires_grad
    weighting = compute_token_weighting(
        tiny_llama, input_ids, attention_mask, target_mask, torch.tensor([2, 2, 2]), 10, alpha=1.0
    )
    for name in FIELDS:
        assert not getattr(weighting, name).requires_grad, name
    # something trainable downstream of the reference's outputs
    scale = torch.ones((), requires_grad=True)
    conditioned_logits = torch.randn(3, 9, 50, requires_grad=True)
    downstream = (
        (scale * base).sum()
        + (scale * weighting.token_weights * conditioned_logits.logsumexp(-1)).sum()
        + (scale * weighting.token_concentration_factor).sum()
    )
    downstream.backward()
    assert scale.grad is not None and conditioned_logits.grad is not None
    assert all(p.grad is None for p in tiny_llama.parameters())


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_compute_token_weighting_per_example_offsets(tiny_llama, alpha):
    input_ids, attention_mask, target_mask = _batch()
    offsets = [3, 0, 5]
    conditioned_length = 8 + 5
    got = compute_token_weighting(
        tiny_llama, input_ids, attention_mask, target_mask, torch.tensor(offsets), conditioned_length, alpha=alpha
    )
    # manual: independent cross-entropy, Python-loop alignment, then the pure weighting function
    base = manual_zfree_nll(tiny_llama, input_ids, attention_mask, target_mask)
    pm = target_mask[:, 1:].tolist()
    aligned_b = loop_align(base.tolist(), pm, offsets, conditioned_length - 1)
    aligned_m = [[int(v) for v in row] for row in loop_align(pm, pm, offsets, conditioned_length - 1)]
    want = token_weighting_from_base_nll(t64(aligned_b), torch.tensor(aligned_m), alpha=alpha)
    for name in FIELDS:
        torch.testing.assert_close(
            getattr(got, name).double(), getattr(want, name), rtol=1e-5, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}"
        )
    # the supervised region is where the loop put it
    assert torch.equal(got.token_weights > 0, torch.tensor(aligned_m, dtype=torch.bool))
    assert_matches_loop(got, loop_weighting(aligned_b, aligned_m, alpha), rtol=1e-5, atol=1e-6)


def test_compute_token_weighting_supervised_out_of_range(tiny_llama):
    input_ids, attention_mask, target_mask = _batch()
    # example 0 is supervised at z-free positions 2..6; offset 3 puts position 6 at 9, outside N = 9 - 1
    with pytest.raises(ValueError, match="outside"):
        compute_token_weighting(
            tiny_llama, input_ids, attention_mask, target_mask, torch.tensor([3, 0, 0]), 9, alpha=1.0
        )


# ------------------------------------------------------------------ term 5's amplification


def _plain_amplification(b: list[float], alpha: float, eps: float = 1e-6) -> float:
    """max_t pi_inv_t / rho_b by hand: pi_inv_t = b_t^-alpha / sum_s b_s^-alpha (b floored at eps),
    rho_b = (sum_t pi_inv_t b_t) / mean_t b_t."""
    floored = [max(v, eps) for v in b]
    weights = [v**-alpha for v in floored]
    pi_inv = [w / sum(weights) for w in weights]
    rho = sum(p * v for p, v in zip(pi_inv, b, strict=True)) / (sum(b) / len(b))
    return max(pi_inv) / rho


def _cache(examples) -> FeatureCache:
    """A feature cache holding only these responses' b_t (the features are placeholders)."""
    return FeatureCache(
        [torch.as_tensor(b, dtype=torch.float32) for b in examples],
        torch.zeros(len(examples), 1),
        torch.zeros(len(examples), 2),
    )


def inverse_term_amplification(examples, alpha: float, eps: float = 1e-6) -> torch.Tensor:
    return _cache(examples).inverse_term_amplification(WeightingParams("surprisal", alpha, eps, 1.0))


def test_inverse_term_amplification_by_hand():

    examples = [
        [1.0, 1e-3],
        [2.0, 2.0, 2.0],
        [3.0],
        [4.0, 0.0, 1.5],
    ]  # a nearly certain token, a flat one, one token, b = 0
    for alpha in (0.0, 0.5, 1.0, 2.0):
        got = inverse_term_amplification([torch.tensor(b) for b in examples], alpha)
        want = [_plain_amplification(b, alpha) for b in examples]
        assert got.dtype == torch.float64 and got.tolist() == pytest.approx(want, rel=1e-6)
    # alpha 0: uniform weights, rho = 1, so one token carries 1/n of the example
    assert inverse_term_amplification([torch.tensor(b) for b in examples], 0.0).tolist() == pytest.approx(
        [0.5, 1 / 3, 1, 1 / 3]
    )
    # at alpha 2 the nearly certain token of the first example weighs about 500 times its 1/2 share
    assert inverse_term_amplification([torch.tensor([1.0, 1e-3])], 2.0).item() == pytest.approx(500.5, rel=1e-3)
    assert inverse_term_amplification([], 2.0).numel() == 0
    # every token certain (b = 0): the weights are uniform and rho is 1, so each token keeps its 1/n share
    assert inverse_term_amplification([torch.zeros(4)], 2.0).tolist() == pytest.approx([0.25])


def test_the_trainer_warns_when_term5_is_ill_conditioned(caplog):
    import dataclasses
    import logging

    from disentanglement.config import RunConfig
    from disentanglement.frozen_pass import warn_term5_amplification

    def Cache() -> FeatureCache:
        return _cache([[3.0, 1e-3, 2.0]] * 5)  # max pi_inv / rho of about 1,700 each

    def config(weight: float, alpha: float, source: str = "surprisal") -> RunConfig:
        base = RunConfig()
        rec = dataclasses.replace(
            base.reconstruction,
            normalized_inverse_surprisal_token_weighted_weight=weight,
            token_weight_alpha=alpha,
            token_weight_source=source,
        )
        return dataclasses.replace(base, reconstruction=rec)

    with caplog.at_level(logging.WARNING, logger="disentanglement.frozen_pass"):
        warn_term5_amplification(config(1.0, 2.0), Cache(), 3.0)
    (record,) = caplog.records
    assert "term 5" in record.message and "token_weight_alpha 2" in record.message and "may diverge" in record.message
    expected = _plain_amplification([3.0, 1e-3, 2.0], 2.0)
    assert f"a median of {expected:.0f} times" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="disentanglement.frozen_pass"):
        warn_term5_amplification(config(0.0, 2.0), Cache(), 3.0)  # term 5 off
        warn_term5_amplification(config(1.0, 0.0), Cache(), 3.0)  # alpha 0: amplification 1/n
        warn_term5_amplification(config(1.0, 0.5), Cache(), 3.0)  # 16.6 < 100
        warn_term5_amplification(config(1.0, 2.0, "entropy"), Cache(), 3.0)  # another signal: not b_t's
        warn_term5_amplification(config(1.0, 2.0), None, 3.0)  # no frozen pass
    assert not caplog.records
