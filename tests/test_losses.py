"""The six-term reconstruction stack (docs/design.md section 4) against hand-worked numbers and plain loops.

The loop references here are float64 Python scalars, one example and one position at a time,
and share no code with ``losses.py`` or ``token_weighting.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disentanglement.config import PRESETS, ReconstructionLossConfig
from disentanglement.losses import (
    TERM_WEIGHT_FIELDS,
    TERMS_NEEDING_SCALE,
    TERMS_NEEDING_WEIGHTING,
    estimate_zfree_reference_scale,
    masked_token_nll_per_position,
    normalized_concentration_corrected_token_weighted_reconstruction_loss,
    normalized_inverse_surprisal_token_weighted_reconstruction_loss,
    reconstruction_loss,
    reconstruction_loss_stack,
    sequence_reconstruction_loss,
    token_weighted_masked_nll_per_example,
    token_weighted_reconstruction_loss,
    uniform_token_weights,
    zfree_relative_reconstruction_loss,
)
from disentanglement.token_weighting import token_weighting_from_base_nll
from references import ALL_TERMS, loop_masked_nll, loop_terms

#: The reconstruction weights these tests were written against (the defaults before issue 23: preset "raw",
#: term 1 at weight 1, alpha 1); a test's own weights go on top.
RAW_WEIGHTS = {k: v for k, v in PRESETS["raw"].items() if k in ReconstructionLossConfig.__dataclass_fields__}


def raw_config(**overrides) -> ReconstructionLossConfig:
    return ReconstructionLossConfig(**{**RAW_WEIGHTS, **overrides})


WEIGHT_FIELDS = {
    "reconstruction_loss": "reconstruction_weight",
    "sequence_reconstruction_loss": "sequence_reconstruction_weight",
    "token_weighted_reconstruction_loss": "token_weighted_weight",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss": (
        "normalized_concentration_corrected_token_weighted_weight"
    ),
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss": (
        "normalized_inverse_surprisal_token_weighted_weight"
    ),
    "zfree_relative_reconstruction_loss": "zfree_relative_weight",
}
NO_WEIGHTS = {field: 0.0 for field in WEIGHT_FIELDS.values()}


#: Every term against its plain-loop reference, in float64: the same tolerance for all six (terms 1 and 6
#: included: test_uniform_terms_keep_float64_precision checks their 1/n_b stays float64).
RTOL = 1e-9


# ----------------------------------------------------------------------------------------------
# Independent reference implementations
# ----------------------------------------------------------------------------------------------


def compute_terms(cond_nll: torch.Tensor, m: torch.Tensor, weighting, scale: float) -> dict[str, torch.Tensor]:
    return {
        "reconstruction_loss": reconstruction_loss(cond_nll, m),
        "sequence_reconstruction_loss": sequence_reconstruction_loss(cond_nll, m),
        "token_weighted_reconstruction_loss": token_weighted_reconstruction_loss(cond_nll, weighting),
        "normalized_concentration_corrected_token_weighted_reconstruction_loss": (
            normalized_concentration_corrected_token_weighted_reconstruction_loss(cond_nll, weighting, scale)
        ),
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss": (
            normalized_inverse_surprisal_token_weighted_reconstruction_loss(cond_nll, weighting, scale)
        ),
        "zfree_relative_reconstruction_loss": zfree_relative_reconstruction_loss(cond_nll, m, scale),
    }


def random_problem(seed: int, bsz: int = 4, n: int = 9, zero_fraction: float = 0.15):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(bsz, n, generator=g) < 0.6).long()
    m[torch.arange(bsz), torch.randint(0, n, (bsz,), generator=g)] = 1
    cond_nll = torch.rand(bsz, n, generator=g, dtype=torch.float64) * 5 * m
    b = torch.rand(bsz, n, generator=g, dtype=torch.float64) * 4
    b[torch.rand(bsz, n, generator=g) < zero_fraction] = 0.0
    return cond_nll, m, b


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# The stage-1 and stage-2 helpers
# ----------------------------------------------------------------------------------------------


def test_masked_token_nll_per_position_matches_loop():
    g = torch.Generator().manual_seed(0)
    bsz, seq, vocab = 3, 7, 11
    logits = torch.randn(bsz, seq, vocab, generator=g, dtype=torch.float64) * 3
    input_ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    token_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 0, 0, 1],
        ]
    )
    got = masked_token_nll_per_position(logits, input_ids, token_mask)
    assert got.shape == (bsz, seq - 1)
    torch.testing.assert_close(got, t64(loop_masked_nll(logits, input_ids, token_mask)), rtol=1e-12, atol=1e-12)
    # masked positions are exactly 0 (position t is token t + 1)
    assert (got[token_mask[:, 1:] == 0] == 0).all()
    assert (got[token_mask[:, 1:] == 1] > 0).all()
    # float32 logits too
    got32 = masked_token_nll_per_position(logits.float(), input_ids, token_mask)
    torch.testing.assert_close(got32.double(), got, rtol=1e-5, atol=1e-5)
    assert (got32[token_mask[:, 1:] == 0] == 0).all()


def test_masked_token_nll_hand_worked():
    # Uniform logits over V = 4: every supervised position costs log 4.
    logits = torch.zeros(1, 3, 4)
    got = masked_token_nll_per_position(logits, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 0, 1]]))
    torch.testing.assert_close(got, torch.tensor([[0.0, math.log(4)]]))


def test_masked_token_nll_shape_error():
    with pytest.raises(ValueError, match="agree"):
        masked_token_nll_per_position(torch.zeros(1, 3, 4), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3))


def test_uniform_token_weights_and_aggregation():
    m = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]])
    w = uniform_token_weights(m)
    torch.testing.assert_close(w, torch.tensor([[1 / 3, 0, 1 / 3, 1 / 3], [0, 1.0, 0, 0]]))
    cond_nll = t64([[3.0, 100.0, 6.0, 9.0], [100.0, 2.0, 100.0, 100.0]])
    torch.testing.assert_close(token_weighted_masked_nll_per_example(cond_nll, w), t64([6.0, 2.0]))
    with pytest.raises(ValueError, match="no supervised token"):
        uniform_token_weights(torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="differ"):
        token_weighted_masked_nll_per_example(cond_nll, w[:, :3])


# ----------------------------------------------------------------------------------------------
# The six terms
# ----------------------------------------------------------------------------------------------


def test_six_terms_hand_worked():
    # Example 0: cond_nll = [2, 4, 6] on b = [1, 2, 3] (alpha = 1); example 1: cond_nll = [1, 0], one token supervised.
    cond_nll = t64([[2.0, 4.0, 6.0], [5.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    b = t64([[1.0, 2.0, 3.0], [2.0, 9.0, 9.0]])
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    scale = 2.0
    got = compute_terms(cond_nll, m, w, scale)
    # example 0: uniform 4; sum 12; pi = [1,2,3]/6 -> 28/6; kappa = 7/6 -> (28/6)/(7/6) = 4;
    #            pi_inv = [6,3,2]/11 -> (12+12+12)/11 = 36/11; rho = 9/11 -> 4
    # example 1: everything is 5 (single token: pi = pi_inv = 1, kappa = rho = 1)
    expected = {
        "reconstruction_loss": (4 + 5) / 2,
        "sequence_reconstruction_loss": (12 + 5) / 2,
        "token_weighted_reconstruction_loss": (28 / 6 + 5) / 2,
        "normalized_concentration_corrected_token_weighted_reconstruction_loss": (4 + 5) / 2 / scale,
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss": (4 + 5) / 2 / scale,
        "zfree_relative_reconstruction_loss": (4 + 5) / 2 / scale,
    }
    for term in ALL_TERMS:
        torch.testing.assert_close(got[term], t64(expected[term]), msg=lambda s, term=term: f"{term}: {s}")
        assert got[term].dim() == 0


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_six_terms_match_loop_on_random(alpha, seed):
    cond_nll, m, b = random_problem(seed)
    scale = 1.7
    w = token_weighting_from_base_nll(b, m, alpha=alpha)
    got = compute_terms(cond_nll, m, w, scale)
    want = loop_terms(cond_nll.tolist(), m.tolist(), b.tolist(), alpha, scale)
    for term in ALL_TERMS:
        torch.testing.assert_close(got[term], t64(want[term]), rtol=RTOL, atol=1e-12, msg=lambda s, t=term: f"{t}: {s}")


def test_alpha_zero_collapses_token_terms():
    cond_nll, m, b = random_problem(5)
    w = token_weighting_from_base_nll(b, m, alpha=0.0)
    got = compute_terms(cond_nll, m, w, 3.0)
    torch.testing.assert_close(got["token_weighted_reconstruction_loss"], got["reconstruction_loss"])
    for term in (
        "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
    ):
        torch.testing.assert_close(got[term], got["zfree_relative_reconstruction_loss"])


# Regression: the uniform weights m_t / n_b must take token_nll's dtype, not float32.
def test_uniform_terms_keep_float64_precision():
    cond_nll = torch.ones(1, 3, dtype=torch.float64)
    m = torch.tensor([[1, 1, 1]])
    assert reconstruction_loss(cond_nll, m).item() == pytest.approx(1.0, rel=0, abs=1e-15)
    assert zfree_relative_reconstruction_loss(cond_nll, m, 1.0).item() == pytest.approx(1.0, rel=0, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_terms_match_loop(data):
    bsz = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 12))
    value = st.one_of(st.just(0.0), st.floats(0.0, 20.0))
    m = []
    for _ in range(bsz):
        row = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        row[data.draw(st.integers(0, n - 1))] = 1
        m.append(row)
    cond_nll = [[data.draw(value) if m[i][t] else 0.0 for t in range(n)] for i in range(bsz)]
    b = [[data.draw(value) for _ in range(n)] for _ in range(bsz)]
    alpha = data.draw(st.floats(0.0, 3.0))
    scale = data.draw(st.floats(0.1, 10.0))
    w = token_weighting_from_base_nll(t64(b), torch.tensor(m), alpha=alpha)
    got = compute_terms(t64(cond_nll), torch.tensor(m), w, scale)
    want = loop_terms(cond_nll, m, b, alpha, scale)
    for term in ALL_TERMS:
        torch.testing.assert_close(got[term], t64(want[term]), rtol=RTOL, atol=1e-9, msg=lambda s, t=term: f"{t}: {s}")


@pytest.mark.parametrize(
    "fn",
    [
        normalized_concentration_corrected_token_weighted_reconstruction_loss,
        normalized_inverse_surprisal_token_weighted_reconstruction_loss,
    ],
)
@pytest.mark.parametrize("scale", [None, 0.0, -1.0, float("nan"), float("inf")])
def test_weighted_scaled_terms_reject_bad_scale(fn, scale):
    cond_nll, m, b = random_problem(0)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    with pytest.raises(ValueError, match="zfree_reference_scale"):
        fn(cond_nll, w, scale)


@pytest.mark.parametrize("scale", [None, 0.0, -1.0, float("nan")])
def test_zfree_relative_rejects_bad_scale(scale):
    cond_nll, m, _ = random_problem(0)
    with pytest.raises(ValueError, match="zfree_reference_scale"):
        zfree_relative_reconstruction_loss(cond_nll, m, scale)


# ----------------------------------------------------------------------------------------------
# The stack
# ----------------------------------------------------------------------------------------------


def test_term_tables_match_design():
    assert TERM_WEIGHT_FIELDS == WEIGHT_FIELDS
    assert set(TERMS_NEEDING_WEIGHTING) == set(ALL_TERMS[2:5])
    assert set(TERMS_NEEDING_SCALE) == set(ALL_TERMS[3:6])


@pytest.mark.parametrize("scale_from", ["argument", "config"])
def test_stack_all_six_terms_and_weighted_total(scale_from):
    cond_nll, m, b = random_problem(3)
    alpha = 1.3
    weights = {
        "reconstruction_weight": 1.0,
        "sequence_reconstruction_weight": 0.01,
        "token_weighted_weight": 0.5,
        "normalized_concentration_corrected_token_weighted_weight": 2.0,
        "normalized_inverse_surprisal_token_weighted_weight": 0.25,
        "zfree_relative_weight": 3.0,
    }
    scale = 2.2
    config = raw_config(
        **weights, token_weight_alpha=alpha, zfree_reference_scale=scale if scale_from == "config" else None
    )
    w = token_weighting_from_base_nll(b, m, alpha=alpha)
    stack = reconstruction_loss_stack(cond_nll, m, w, config, scale if scale_from == "argument" else None)
    assert set(stack.terms) == set(ALL_TERMS)
    want = loop_terms(cond_nll.tolist(), m.tolist(), b.tolist(), alpha, scale)
    total = 0.0
    for term in ALL_TERMS:
        torch.testing.assert_close(stack.terms[term], t64(want[term]), rtol=RTOL, atol=1e-12)
        total += weights[WEIGHT_FIELDS[term]] * want[term]
    torch.testing.assert_close(stack.total, t64(total), rtol=1e-6, atol=1e-12)
    # the total is exactly the weighted sum of the logged terms
    hand = sum(weights[WEIGHT_FIELDS[term]] * stack.terms[term] for term in ALL_TERMS)
    torch.testing.assert_close(stack.total, hand, rtol=1e-14, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stack_values_and_gradients_equal_the_term_functions(dtype):
    # The stack contracts coefficient matrices with cond_nll; the term functions are the reference definitions.
    cond_nll, m, b = random_problem(11, bsz=5, n=12)
    cond_nll = cond_nll.to(dtype).requires_grad_()
    w = token_weighting_from_base_nll(b.to(dtype), m, alpha=0.7)
    weights = dict(zip(WEIGHT_FIELDS.values(), (1.0, 0.02, 0.5, 2.0, 0.0, 3.0), strict=True))
    stack = reconstruction_loss_stack(cond_nll, m, w, raw_config(**weights), 1.9)
    reference = compute_terms(cond_nll, m, w, 1.9)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for term in ALL_TERMS:
        torch.testing.assert_close(stack.terms[term], reference[term], **tol)
    (grad,) = torch.autograd.grad(stack.total, cond_nll, retain_graph=True)  # the terms share one graph
    expected = sum(weights[WEIGHT_FIELDS[t]] * reference[t] for t in ALL_TERMS)
    (want,) = torch.autograd.grad(expected, cond_nll)
    torch.testing.assert_close(grad, want, **tol)
    assert (grad[m == 0] == 0).all()  # nothing reaches unsupervised positions
    # one term's gradient alone, through the logged value
    (grad3,) = torch.autograd.grad(stack.terms["token_weighted_reconstruction_loss"], cond_nll)
    torch.testing.assert_close(grad3, w.token_weights / len(m), **tol)


def test_stack_total_ignores_a_disabled_term_that_overflows():
    # Term 5 divides by rho, which can underflow for near-certain tokens; disabled, it must not poison the total.
    cond_nll, m, b = random_problem(12)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    w = dataclasses.replace(w, inverse_token_base_scale_factor=torch.zeros_like(w.inverse_token_base_scale_factor))
    cond_nll = cond_nll.clone().requires_grad_()
    stack = reconstruction_loss_stack(cond_nll, m, w, raw_config(reconstruction_weight=1.0), 1.0)
    assert not torch.isfinite(stack.terms["normalized_inverse_surprisal_token_weighted_reconstruction_loss"])
    torch.testing.assert_close(stack.total, reconstruction_loss(cond_nll, m))
    (grad,) = torch.autograd.grad(stack.total, cond_nll)
    torch.testing.assert_close(grad, uniform_token_weights(m).double() / len(m))  # finite, term 1's own


def test_stack_keeps_float32_under_autocast():
    # The trainer runs the forward under bf16 autocast; the loss terms must stay in float32.
    cond_nll, m, b = random_problem(13)
    cond_nll, b = cond_nll.float(), b.float()
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    config = raw_config(token_weighted_weight=1.0, zfree_relative_weight=0.5)
    plain = reconstruction_loss_stack(cond_nll, m, w, config, 1.3)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        mixed = reconstruction_loss_stack(cond_nll, m, w, config, 1.3)
    assert mixed.total.dtype == torch.float32
    torch.testing.assert_close(mixed.total, plain.total, rtol=1e-6, atol=0)
    for term in ALL_TERMS:
        assert mixed.terms[term].dtype == torch.float32
        torch.testing.assert_close(mixed.terms[term], plain.terms[term], rtol=1e-6, atol=0)


def test_stack_argument_scale_overrides_config_scale():
    cond_nll, m, b = random_problem(4)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    config = raw_config(zfree_relative_weight=1.0, zfree_reference_scale=100.0)
    stack = reconstruction_loss_stack(cond_nll, m, w, config, 2.0)
    torch.testing.assert_close(
        stack.terms["zfree_relative_reconstruction_loss"], stack.terms["reconstruction_loss"] / 2
    )


def test_stack_logs_disabled_terms_but_total_uses_only_enabled():
    cond_nll, m, b = random_problem(6)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    config = raw_config(**{**NO_WEIGHTS, "token_weighted_weight": 1.0})
    stack = reconstruction_loss_stack(cond_nll, m, w, config, 1.5)
    assert set(stack.terms) == set(ALL_TERMS)
    torch.testing.assert_close(stack.total, stack.terms["token_weighted_reconstruction_loss"])
    # all weights zero: total is 0
    stack = reconstruction_loss_stack(cond_nll, m, w, raw_config(**NO_WEIGHTS), 1.5)
    assert stack.total.item() == 0.0


def test_stack_without_weighting():
    cond_nll, m, _ = random_problem(7)
    config = raw_config(reconstruction_weight=1.0, sequence_reconstruction_weight=0.5)
    stack = reconstruction_loss_stack(cond_nll, m, None, config)
    assert set(stack.terms) == {"reconstruction_loss", "sequence_reconstruction_loss"}
    torch.testing.assert_close(
        stack.total, stack.terms["reconstruction_loss"] + 0.5 * stack.terms["sequence_reconstruction_loss"]
    )
    # with a scale, the z-free-relative term is computable without the weighting
    config = raw_config(zfree_relative_weight=2.0, zfree_reference_scale=4.0)
    stack = reconstruction_loss_stack(cond_nll, m, None, config)
    assert set(stack.terms) == {
        "reconstruction_loss",
        "sequence_reconstruction_loss",
        "zfree_relative_reconstruction_loss",
    }
    assert not set(stack.terms) & TERMS_NEEDING_WEIGHTING
    torch.testing.assert_close(
        stack.total, stack.terms["reconstruction_loss"] + 2.0 * stack.terms["reconstruction_loss"] / 4.0
    )


@pytest.mark.parametrize("term", sorted(TERMS_NEEDING_WEIGHTING))
def test_stack_rejects_missing_weighting_for_enabled_term(term):
    cond_nll, m, _ = random_problem(8)
    config = raw_config(**{WEIGHT_FIELDS[term]: 1.0}, zfree_reference_scale=1.0)
    with pytest.raises(ValueError, match=term):
        reconstruction_loss_stack(cond_nll, m, None, config)


@pytest.mark.parametrize("term", sorted(TERMS_NEEDING_SCALE))
def test_stack_rejects_missing_scale_for_enabled_term(term):
    cond_nll, m, b = random_problem(9)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    config = raw_config(**{WEIGHT_FIELDS[term]: 1.0})
    assert config.zfree_reference_scale is None
    with pytest.raises(ValueError, match="zfree_reference_scale") as info:
        reconstruction_loss_stack(cond_nll, m, w, config)
    assert term in str(info.value)


def test_stack_without_scale_omits_scaled_disabled_terms():
    cond_nll, m, b = random_problem(10)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    stack = reconstruction_loss_stack(cond_nll, m, w, raw_config(token_weighted_weight=1.0))
    assert set(stack.terms) == set(ALL_TERMS[:3])


# ----------------------------------------------------------------------------------------------
# c_base estimation
# ----------------------------------------------------------------------------------------------


def test_estimate_zfree_reference_scale_is_mean():
    assert estimate_zfree_reference_scale([1.0, 2.0, 6.0]) == pytest.approx(3.0, rel=1e-15)
    assert estimate_zfree_reference_scale(torch.tensor([0.5, 1.5])) == pytest.approx(1.0, rel=1e-15)
    assert estimate_zfree_reference_scale(x for x in (2.0, 4.0)) == pytest.approx(3.0, rel=1e-15)
    values = torch.rand(37, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1
    assert estimate_zfree_reference_scale(values) == pytest.approx(sum(values.tolist()) / 37, rel=1e-12)
    assert isinstance(estimate_zfree_reference_scale([1.0]), float)
    # from a weighting bundle's per-example base losses
    _, m, b = random_problem(11, zero_fraction=0.0)
    w = token_weighting_from_base_nll(b, m, alpha=1.0)
    loop_means = [
        sum(bv for bv, mv in zip(br, mr, strict=True) if mv) / sum(mr)
        for br, mr in zip(b.tolist(), m.tolist(), strict=True)
    ]
    assert estimate_zfree_reference_scale(w.example_base_loss) == pytest.approx(sum(loop_means) / len(loop_means))


@pytest.mark.parametrize("empty", [[], torch.tensor([]), iter(())])
def test_estimate_zfree_reference_scale_rejects_empty(empty):
    with pytest.raises(ValueError, match="at least one"):
        estimate_zfree_reference_scale(empty)


def test_estimate_zfree_reference_scale_rejects_nonfinite_and_zero():
    with pytest.raises(ValueError, match="finite"):
        estimate_zfree_reference_scale([1.0, float("nan")])
    with pytest.raises(ValueError, match="> 0"):
        estimate_zfree_reference_scale([0.0, 0.0])


# ----------------------------------------------------------------------------------------------
# Gradients reach the conditioned logits and nothing else
# ----------------------------------------------------------------------------------------------


def test_gradients_reach_only_supervised_conditioned_logits():
    g = torch.Generator().manual_seed(21)
    bsz, seq, vocab = 3, 8, 13
    input_ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    token_mask = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 0, 1],
        ]
    )
    position_mask = token_mask[:, 1:]  # position t predicts token t + 1
    base_nll = (torch.rand(bsz, seq - 1, generator=g) * 3 + 0.1).requires_grad_(True)
    weighting = token_weighting_from_base_nll(base_nll, position_mask, alpha=1.5)
    config = raw_config(
        reconstruction_weight=1.0,
        sequence_reconstruction_weight=1.0,
        token_weighted_weight=1.0,
        normalized_concentration_corrected_token_weighted_weight=1.0,
        normalized_inverse_surprisal_token_weighted_weight=1.0,
        zfree_relative_weight=1.0,
    )
    # rows of logits whose next token is supervised; the last position predicts nothing
    expected_rows = torch.zeros(bsz, seq, dtype=torch.bool)
    expected_rows[:, :-1] = position_mask.bool()

    def check(name, make_loss):
        logits = torch.randn(bsz, seq, vocab, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        nll = masked_token_nll_per_position(logits, input_ids, token_mask)
        make_loss(nll).backward()
        row_has_grad = logits.grad.abs().sum(dim=-1) > 0
        assert torch.equal(row_has_grad, expected_rows), name
        assert base_nll.grad is None, name

    for term in ALL_TERMS:
        check(term, lambda nll, term=term: compute_terms(nll, position_mask, weighting, 1.3)[term])
    check("stack.total", lambda nll: reconstruction_loss_stack(nll, position_mask, weighting, config, 1.3).total)
    for field in dataclasses.fields(weighting):
        assert not getattr(weighting, field.name).requires_grad, field.name


# ----------------------------------------------------------------------------------------------
# Chunked NLL: same values and gradients as the plain path, bounded saved memory


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 100])
def test_chunked_nll_matches_plain_values_and_gradients(chunk_size):
    torch.manual_seed(0)
    B, T, H, V = 3, 8, 5, 11
    hidden = torch.randn(B, T, H, requires_grad=True)
    head = torch.nn.Linear(H, V)
    ids = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T)
    mask[0, 2:6] = 1
    mask[1, 5:] = 1
    mask[2, 1:3] = 1
    plain = masked_token_nll_per_position(head(hidden), ids, mask)
    grads_plain = torch.autograd.grad((plain * torch.arange(T - 1)).sum(), [hidden, head.weight])
    chunked = masked_token_nll_per_position(hidden, ids, mask, chunk_size=chunk_size, head=head)
    grads_chunked = torch.autograd.grad((chunked * torch.arange(T - 1)).sum(), [hidden, head.weight])
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(grads_chunked, grads_plain, strict=True):
        torch.testing.assert_close(a, b)
    logits = head(hidden).detach().requires_grad_(True)
    chunked_logits = masked_token_nll_per_position(logits, ids, mask, chunk_size=chunk_size)
    torch.testing.assert_close(chunked_logits, plain)
    (g,) = torch.autograd.grad(chunked_logits.sum(), logits)
    (g_plain,) = torch.autograd.grad(masked_token_nll_per_position(logits, ids, mask).sum(), logits)
    torch.testing.assert_close(g, g_plain)


def test_chunked_lm_head_never_saves_a_full_logits_block():
    B, T, H, V, chunk = 2, 16, 4, 50, 3
    hidden = torch.randn(B, T, H, requires_grad=True)
    head = torch.nn.Linear(H, V)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T)
    largest = {"plain": 0, "chunked": 0}

    def run(name, fn):
        def pack(t):
            largest[name] = max(largest[name], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        out.sum().backward()

    run("plain", lambda: masked_token_nll_per_position(head(hidden), ids, mask))
    run("chunked", lambda: masked_token_nll_per_position(hidden, ids, mask, chunk_size=chunk, head=head))
    assert largest["plain"] >= B * (T - 1) * V  # the plain path keeps [B, T-1, V] log-probabilities
    assert largest["chunked"] <= max(B * T * H, V * H)  # only inputs and weights are kept; logits are recomputed


def test_apply_head_is_the_head_on_every_position_including_an_empty_chunk():
    from disentanglement.losses import apply_head

    head = torch.nn.Linear(4, 7).double()
    window = torch.randn(3, 10, 4, dtype=torch.float64)
    chunk = window[:, 2:6]  # a strided view, as the chunked NLL passes it
    torch.testing.assert_close(apply_head(head, chunk), head(chunk), rtol=0, atol=1e-12)
    assert apply_head(head, window[:, 5:5]).shape == (3, 0, 7)  # no positions: [B, 0, V], not an error
