"""Each family's latent space (``model.latent_space``): what the consumers ask of it, on tiny in-process models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disentanglement.config import build_config
from disentanglement.latent_file import CONTINUOUS_KEYS, DISCRETE_KEYS, row_latent
from disentanglement.latent_space import (
    LATENT_SPACES,
    ContinuousLatentSpace,
    DiscreteLatentSpace,
    latent_space_of,
    latent_space_of_latents,
)
from disentanglement.models import LATENT_FAMILIES, build_cvae
from helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def models():
    tokenizer = tiny_tokenizer()
    out = {}
    for family in ("discrete", "continuous"):
        config = build_config({"latent": family, "num_slots": 2, "codebook_size": 3, "latent_dim": 4})
        out[family] = build_cvae(config, tiny_llama(len(tokenizer)))
    return out


def test_every_family_exposes_its_latent_space(models):
    assert set(LATENT_FAMILIES) == {space.kind for space in LATENT_SPACES}
    for family, model in models.items():
        space = model.latent_space
        assert space.kind == family and space.model is model
        assert type(space) is type(latent_space_of(family))
    assert DiscreteLatentSpace.row_keys == DISCRETE_KEYS and ContinuousLatentSpace.row_keys == CONTINUOUS_KEYS
    assert type(latent_space_of_latents({"codes": np.zeros((2, 1))})) is DiscreteLatentSpace
    assert type(latent_space_of_latents({"mu": np.zeros((2, 4))})) is ContinuousLatentSpace


def test_what_a_family_cannot_do_is_refused_with_its_message():
    with pytest.raises(ValueError, match=r"^--attribute needs a continuous model"):
        latent_space_of("discrete").require("attribute")
    with pytest.raises(ValueError, match=r"^--codes, --slot: options of a discrete model \(codes\)"):
        latent_space_of("continuous").require("codes options", flags="--codes, --slot", count="options")
    latent_space_of("continuous").require("attribute")  # supported: no error
    assert latent_space_of("discrete").supports("mode codes") and not latent_space_of("continuous").supports(
        "mode codes"
    )
    assert latent_space_of("discrete").default_mode(row=0) == "codes"
    assert latent_space_of("continuous").default_mode(row=0) == "row"
    assert latent_space_of("continuous").default_mode(row=None) == "prior"


def test_a_row_of_the_other_family_is_named(models):
    with pytest.raises(ValueError, match=r"has 'mu', not 'codes': it is an encode file of a continuous model"):
        row_latent(models["discrete"], [{"mu": [0.0] * 4}], 0)
    with pytest.raises(ValueError, match=r"has 'codes', not 'mu': it is an encode file of a discrete model"):
        row_latent(models["continuous"], [{"codes": [0, 1]}], 0)
    assert row_latent(models["discrete"], [{"codes": [2, 0]}], 0) == [2, 0]
    assert row_latent(models["continuous"], [{"mu": [1, 2, 3, 4]}], 0) == [1.0, 2.0, 3.0, 4.0]


def test_forced_codes_are_the_codebook_entries(models):
    model = models["discrete"]
    vector = model.latent_space.forced_vector(torch.tensor([2, 0]))
    torch.testing.assert_close(vector, torch.cat([model.codebook[2], model.codebook[0]]))
    assert model.latent_space.forced_vector(torch.tensor([0.5, 0.5])) is None  # numbers: a latent vector
    assert models["continuous"].latent_space.forced_vector(torch.tensor([1, 2])) is None


def test_assignments_are_codes_or_kmeans():
    codes = np.array([[0, 1], [0, 1], [2, 1]])
    space = latent_space_of("discrete")
    ids = space.assignments({"codes": codes}, num_clusters=2, seed=0)
    assert ids[0] == ids[1] != ids[2]
    assert [list(slot) for slot in space.slot_assignments({"codes": codes})] == [[0, 0, 2], [1, 1, 1]]
    assert space.slot_assignments({"codes": codes[:, :1]}) == []
    mu = np.array([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0]])
    clusters = latent_space_of("continuous").assignments({"mu": mu}, num_clusters=2, seed=0)
    assert clusters[0] == clusters[1] != clusters[2] == clusters[3]
