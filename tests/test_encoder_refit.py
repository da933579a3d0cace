"""``refit-encoder``: the decoder's exact posterior of every pair by brute force, a fit that moves the encoder alone and
keeps its best held-out epoch, an encoder rebuilt from the decoder alone (the factor and the latent gain back), and the
command's run directory (a checkpoint eval reads, the prior NLL unchanged, resumable) and refusals."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sklearn.metrics import normalized_mutual_info_score

from conftest import NUM_FACTORS
from disentanglement.checkpoints import read_checkpoint, read_trainer_state
from disentanglement.cli import main
from disentanglement.commands import run_eval
from disentanglement.config import build_config
from disentanglement.data import collate
from disentanglement.encoder_refit import (
    POSTERIOR_FILE,
    REPORT_FILE,
    agreement,
    check_refittable_config,
    combination_index,
    decoder_posteriors,
    encoder_codes,
    encoder_parameters,
    expected_regret,
    fit_encoder,
    widened_optimizer_state,
    widening,
)
from disentanglement.features import build_feature_cache
from disentanglement.metrics import kmeans_assignments
from disentanglement.runs import load_examples
from test_decoder_posterior import brute_force_posterior, every_combination
from test_evaluation import untrained


@pytest.mark.parametrize("slots, size", [(1, 4), (2, 3)])
def test_decoder_posteriors_are_the_exact_posterior_in_example_order(slots, size):
    model, tok, examples, cache = untrained(num_slots=slots, codebook_size=size, latent_placement="between")
    examples = examples[:7]
    # batches of 3 in length order: rows of several lengths in a batch, and the result back in example order
    log_r, regret = decoder_posteriors(model, examples, cache, tok.pad_token_id, batch_size=3)
    batch = collate(examples, tok.pad_token_id, indices=range(7))
    with torch.no_grad():
        expected = brute_force_posterior(model, batch, cache.features(batch))
        combos, _, nlls = every_combination(model, batch, cache.features(batch))  # [B, S], product order
    assert log_r.shape == (7, slots, size) and log_r.dtype == torch.float64
    torch.testing.assert_close(log_r, expected, rtol=1e-4, atol=1e-5)
    assert combos == list(itertools.product(range(size), repeat=slots)) and regret.shape == (7, size**slots)
    torch.testing.assert_close(regret, nlls - nlls.min(-1, keepdim=True).values, rtol=1e-4, atol=1e-4)
    assert (regret.min(-1).values == 0).all()


def _scrambled(discrete_run, count: int = 96):
    """The trained run with a fresh encoder (its decoder, codebook and prior as trained), ``count`` training pairs,
    their cache and labels."""
    model, tok, config, _ = discrete_run.load()
    examples, _ = load_examples("train", config, tok)
    examples = examples[:count]
    cache = build_feature_cache(model.eval(), examples, tok.pad_token_id, progress=False)
    torch.manual_seed(1)
    for layer in model.encoder:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    return model, tok, config, examples, cache


def test_the_fit_moves_the_encoder_alone_and_keeps_its_best_held_out_epoch(discrete_run):
    model, tok, _, examples, cache = _scrambled(discrete_run)
    pad = tok.pad_token_id
    before = {k: v.clone() for k, v in model.state_dict().items()}
    log_r, regret = decoder_posteriors(model, examples, cache, pad)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "computing r changes nothing"
    trained = {id(p) for p in encoder_parameters(model)}
    names = {n for n, p in model.named_parameters() if id(p) in trained}
    assert names and all(n.startswith("encoder.") for n in names), names
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    fitted = fit_encoder(model, examples, cache, log_r, pad, regret=regret, epochs=6, lr=3e-3, holdout=0.25, seed=0)
    after = model.state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= names, f"only the encoder moves: {sorted(changed - names)}"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    history = fitted["history"]
    assert [h["epoch"] for h in history] == list(range(7)) and history[0]["loss"] is None
    assert fitted["holdout_examples"] == 24 and fitted["fit_examples"] == 72
    kept = history[fitted["kept_epoch"]]
    assert kept["holdout_regret"] == min(h["holdout_regret"] for h in history)
    # the weights left on the model are the kept epoch's: its agreements, measured again
    held = sorted(torch.randperm(96, generator=torch.Generator().manual_seed(0))[:24].tolist())
    assert agreement(model, examples, cache, log_r, held, pad) == kept["holdout_agreement"]
    codes = encoder_codes(model, examples, cache, held, pad)
    index = combination_index(codes, NUM_FACTORS)
    regret_per_token = regret[held, index].sum() / sum(len(examples[i].response_ids) for i in held)
    assert float(regret_per_token) == pytest.approx(kept["holdout_regret"], rel=1e-12)
    # epoch 0 is the encoder as given: held-out targets that are its own codes and fit targets that are not make every
    # later epoch agree less on the held-out pairs, so epoch 0 is kept, weights and all
    model2, _, _, _, _ = _scrambled(discrete_run)
    start = {n: p.clone() for n, p in model2.named_parameters()}
    own = encoder_codes(model2, examples, cache, range(96), pad)  # [E, M]
    targets = torch.nn.functional.one_hot((own + 1) % NUM_FACTORS, NUM_FACTORS).double()
    targets[held] = torch.nn.functional.one_hot(own[held], NUM_FACTORS).double()
    fitted2 = fit_encoder(
        model2, examples, cache, targets.clamp_min(1e-9).log(), pad, objective="target", epochs=3, lr=3e-2, holdout=0.25
    )
    assert fitted2["history"][0]["holdout_agreement"] == 1.0 and fitted2["history"][0]["fit_agreement"] == 0.0
    assert fitted2["history"][1]["fit_agreement"] > 0.5, "the fit moved the encoder"
    assert fitted2["kept_epoch"] == 0 and fitted2["stopped"] is None
    assert all(torch.equal(start[n], p) for n, p in model2.named_parameters())
    # a fit that blows up stops, unrecorded, and keeps the best finite epoch
    blown = fit_encoder(model2, examples, cache, log_r, pad, regret=regret, epochs=3, lr=1e30, holdout=0.25)
    assert blown["stopped"] is not None and "not finite" in blown["stopped"]
    assert all(torch.isfinite(p).all() for p in model2.parameters())
    with pytest.raises(ValueError, match="holdout must be in"):
        fit_encoder(model, examples, cache, log_r, pad, regret=regret, holdout=1.0)
    with pytest.raises(ValueError, match="objective 'nll' needs the regret"):
        fit_encoder(model, examples, cache, log_r, pad)


def test_a_refit_rebuilds_an_encoder_from_the_decoder_alone(discrete_run):
    """A fresh encoder on the trained run's decoder gives codes the decoder does not find likeliest; fit to the
    decoder's posterior of 96 training pairs it gives them back on the validation split, and with them the factor
    (beyond k-means of its view) and the latent gain."""
    model, tok, config, examples, cache = _scrambled(discrete_run)
    pad = tok.pad_token_id
    validation, _ = load_examples("validation", config, tok)
    val_cache = build_feature_cache(model, validation, pad, progress=False)
    val_r, _ = decoder_posteriors(model, validation, val_cache, pad)
    every = range(len(validation))
    labels = [int(ex.label) for ex in validation]

    def gain() -> float:
        """Prior-mixture minus posterior NLL per token on the validation split (the decoder's r gives the first)."""
        batch = collate(validation, pad, indices=every)
        with torch.no_grad():
            features = val_cache.features(batch)
            mixture = model.prior_mixture(features, exact_limit=64)
            per = torch.stack([model.conditioned_token_nll(batch, v)[0].double().sum(-1) for v in mixture.vectors])
            prior = -(mixture.log_weights.double() - per).logsumexp(0)  # [B]
            posterior = per[encoder_codes(model, validation, val_cache, every, pad)[:, 0]].diagonal()
        return float((prior - posterior).sum() / batch.target_mask.sum())

    start_agreement, start_gain = agreement(model, validation, val_cache, val_r, every, pad), gain()
    log_r, regret = decoder_posteriors(model, examples, cache, pad)
    # "target": a fresh encoder's confident wrong codes leave the expected regret ("nll") little gradient (0.75 here)
    fit_encoder(model, examples, cache, log_r, pad, regret=regret, objective="target", epochs=40, lr=3e-3, holdout=0)
    codes = encoder_codes(model, validation, val_cache, every, pad)[:, 0].tolist()
    end_agreement, end_gain = agreement(model, validation, val_cache, val_r, every, pad), gain()
    batch = collate(validation, pad, indices=every)
    view = model.encoder_input(val_cache.features(batch)).detach()
    view_nmi = normalized_mutual_info_score(labels, kmeans_assignments(view, NUM_FACTORS))
    nmi = normalized_mutual_info_score(labels, codes)
    # measured: agreement 0.43 -> 1.00, latent gain -0.157 -> +0.045 nats per token, NMI 1.000 (k-means of the view 0.75)
    assert start_agreement < 0.6, f"the fresh encoder does not know the decoder's codes ({start_agreement:.2f})"
    assert end_agreement > 0.95, (start_agreement, end_agreement)
    assert end_gain > start_gain + 0.05 and end_gain > 0, (start_gain, end_gain)
    assert nmi > 0.95 and nmi > view_nmi + 0.1, (nmi, view_nmi)


def test_cli_refit_encoder_writes_a_run_that_eval_reads(discrete_run, tmp_path, injected_loader, capsys):
    out = tmp_path / "refit"
    code = main(
        ["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(out), "--epochs", "3", "--no-progress"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "likeliest on" in printed and "epoch" in printed and str(out / REPORT_FILE) in printed
    report = json.loads((out / REPORT_FILE).read_text())
    source = read_checkpoint(discrete_run.checkpoint)
    refit_checkpoint = out / "checkpoints" / discrete_run.checkpoint.name
    assert report["checkpoint"] == str(refit_checkpoint)
    assert report["source"] == str(discrete_run.checkpoint) and report["target"] == "hard"
    assert report["fit_examples"] + report["holdout_examples"] == report["examples"]
    assert len(report["history"]) == 4 and sum(report["target_code_counts"][0]) == report["examples"]
    # a resumable checkpoint at the source's step: every tensor the source's but the encoder's
    refit = read_checkpoint(refit_checkpoint, for_resume=True)
    assert refit.step == source.step and refit.optimizer_state is not None
    assert set(refit.model_state) == set(source.model_state)
    for name, tensor in refit.model_state.items():
        if not name.startswith("encoder."):
            assert torch.equal(tensor, source.model_state[name]), name
    state = read_trainer_state(refit_checkpoint)
    assert state["encoder_refit"]["kept_epoch"] == report["kept_epoch"]
    assert state["zfree_reference_scale"] == source.trainer_state["zfree_reference_scale"]
    assert (out / "config.yaml").read_bytes() == (discrete_run.run_dir / "config.yaml").read_bytes()
    saved = load_file(out / POSTERIOR_FILE)
    log_r = saved["log_r"]
    assert saved["regret"].shape == (report["examples"], NUM_FACTORS) and (saved["regret"] >= 0).all()
    assert log_r.shape == (report["examples"], 1, NUM_FACTORS)
    torch.testing.assert_close(log_r.exp().sum(-1), torch.ones(report["examples"], 1, dtype=torch.float64))
    # a second refit takes that posterior (no decodes): the same targets; on other data it is refused
    again = tmp_path / "again"
    args = ["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(again), "--epochs", "1", "--no-progress"]
    assert main([*args, "--posterior", str(out / POSTERIOR_FILE)]) == 0
    torch.testing.assert_close(load_file(again / POSTERIOR_FILE)["log_r"], log_r, rtol=0, atol=0)
    assert json.loads((again / REPORT_FILE).read_text())["posterior"] == str(out / POSTERIOR_FILE)
    capsys.readouterr()
    other = tmp_path / "other"
    assert (
        main([*args[:3], str(other), *args[4:], "--posterior", str(out / POSTERIOR_FILE), "--max-examples", "9"]) == 2
    )
    assert "its data is" in capsys.readouterr().err and not other.exists()
    # eval reads it; the prior side is the source's, number for number
    reports = [
        run_eval(path, data="validation", output=str(tmp_path / f"{name}.json"), progress=False)[0]
        for name, path in (("source", discrete_run.checkpoint), ("refit", out))
    ]
    assert reports[1]["prior_nll_nats_per_token"] == pytest.approx(reports[0]["prior_nll_nats_per_token"], abs=1e-9)
    before, after = report["before"], report["after"]
    assert after["holdout_regret"] <= before["holdout_regret"] and report["objective"] == "nll"


def test_cli_refit_encoder_refusals(discrete_run, continuous_run, tmp_path, injected_loader, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    assert main(["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(full)]) == 2
    assert f"--output-dir {full} exists and is not an empty directory" in capsys.readouterr().err
    assert main(["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(discrete_run.run_dir)]) == 2
    assert "is the source run" in capsys.readouterr().err
    out = tmp_path / "continuous"
    assert main(["refit-encoder", str(continuous_run.run_dir), "--output-dir", str(out), "--no-progress"]) == 2
    assert "refit-encoder needs a discrete model" in capsys.readouterr().err
    assert main(["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(out), "--data", "nope.jsonl"]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert not out.exists(), "nothing written for a run it refuses"
    assert main(["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(out), "--holdout", "0.9"]) == 2
    assert "--holdout must be a finite number in [0, 0.5]" in capsys.readouterr().err


def test_too_many_code_combinations_are_refused_from_the_config(tmp_path):
    config = build_config({"latent": "discrete", "codebook_size": 9, "num_slots": 2, "data": "x.jsonl"})
    with pytest.raises(ValueError, match=r"has 81 \(codebook_size 9, num_slots 2\), more than 64"):
        check_refittable_config(config, tmp_path / "config.yaml")
    check_refittable_config(
        dataclasses.replace(config, latent=dataclasses.replace(config.latent, num_slots=1)), tmp_path
    )


@pytest.mark.parametrize("view, block", [("token_weighted_attention", "transformer"), ("attention", "none")])
def test_the_fit_trains_the_attention_pool_and_block_too(view, block):
    """Every weight between the frozen features and ``e`` moves (the pool's query, the block), nothing else."""
    model, tok, examples, cache = untrained(codebook_size=3, encoder_view=view, encoder_block=block)
    names = {n for n, p in model.named_parameters() if id(p) in {id(q) for q in encoder_parameters(model)}}
    assert any(n.startswith("encoder_pool.") for n in names)
    assert any(n.startswith("encoder_block.") for n in names) == (block != "none")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    log_r, regret = decoder_posteriors(model, examples, cache, tok.pad_token_id)
    fit_encoder(model, examples, cache, log_r, tok.pad_token_id, regret=regret, epochs=3, lr=1e-2, holdout=0.0)
    changed = {n for n, v in model.state_dict().items() if not torch.equal(v, before[n])}
    assert changed <= names and any(n.startswith("encoder_pool.") for n in changed), changed


def test_expected_regret_and_the_combination_index_by_hand():
    model, _, _, _ = untrained(num_slots=2, codebook_size=3, posterior_temperature=2.0)
    e = torch.randn(4, 2, model.latent_cfg.code_dim, generator=torch.Generator().manual_seed(0))
    regret = torch.rand(4, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        q = torch.softmax(-((e.unsqueeze(2) - model.codebook) ** 2).sum(-1) / 2.0, -1)  # [B, M, K]
    expected = sum(
        q[:, 0, a] * q[:, 1, b] * regret[:, i] for i, (a, b) in enumerate(itertools.product(range(3), repeat=2))
    ).mean()
    torch.testing.assert_close(expected_regret(model, e, regret).double(), expected.double(), rtol=1e-5, atol=1e-6)
    codes = torch.tensor(list(itertools.product(range(3), repeat=2)))
    assert combination_index(codes, 3).tolist() == list(range(9))


def test_a_widened_encoder_starts_as_the_trained_one_and_its_refit_run_loads_and_resumes(
    discrete_run, tmp_path, injected_loader, capsys
):
    """``--encoder-view attention --encoder-block transformer`` on a ``mean_last`` run: the pool's query at zero and the
    block the identity give the trained encoder's outputs exactly; the fit moves them; the refit run records the
    widened encoder (a load builds it with the fitted weights) and its optimizer state fits a resume's optimizer,
    every old parameter's Adam moments where they were."""
    from disentanglement.checkpoints import check_optimizer_state
    from disentanglement.runs import load_checkpoint
    from disentanglement.trainer import make_optimizer

    assert discrete_run.config.latent.encoder_view == "mean_last"
    widen = {"encoder_view": "attention", "encoder_block": "transformer"}
    source, tok, config, _, _, _ = load_checkpoint(discrete_run.checkpoint, device="cpu")
    wide, _, wide_config, _, _, _ = load_checkpoint(discrete_run.checkpoint, device="cpu", latent_overrides=widen)
    assert wide.encoder_pool is not None and wide.encoder_block is not None
    assert wide_config.latent.encoder_view == "attention" and source.encoder_pool is None
    examples, _ = load_examples("train", config, tok)
    batch = collate(examples[:24], tok.pad_token_id, indices=range(24))
    with torch.no_grad():
        e = source.encoder_outputs(build_feature_cache(source, examples[:24], tok.pad_token_id).features(batch))
        wide_cache = build_feature_cache(wide, examples[:24], tok.pad_token_id)
        e_wide = wide.encoder_outputs(wide_cache.features(batch))
    torch.testing.assert_close(e_wide, e, rtol=1e-5, atol=1e-5)

    plain, out = tmp_path / "plain", tmp_path / "wide"
    args = ["refit-encoder", str(discrete_run.run_dir), "--epochs", "3", "--no-progress"]
    assert main([*args, "--output-dir", str(plain)]) == 0
    posterior = ["--posterior", str(plain / POSTERIOR_FILE)]
    flags = ["--encoder-view", "attention", "--encoder-block", "transformer"]
    assert main([*args, "--output-dir", str(out), *posterior, *flags]) == 0
    assert "the encoder widened: encoder_view attention, encoder_block transformer" in (capsys.readouterr().out)
    reports = [json.loads((d / REPORT_FILE).read_text()) for d in (plain, out)]
    assert reports[1]["widened"] == widen and reports[0]["widened"] == {}
    for key in ("fit_agreement", "holdout_agreement", "fit_regret", "holdout_regret"):  # epoch 0: the same encoder
        assert reports[1]["history"][0][key] == pytest.approx(reports[0]["history"][0][key], abs=1e-9), key
    assert reports[1]["after"]["holdout_regret"] <= reports[1]["before"]["holdout_regret"]
    # the run: its config widened, the source's weights but the encoder's, the new modules' fitted weights loaded
    checkpoint = out / "checkpoints" / discrete_run.checkpoint.name
    saved = read_checkpoint(checkpoint, for_resume=True)
    original = read_checkpoint(discrete_run.checkpoint, for_resume=True)
    assert saved.config.latent == wide_config.latent and "encoder_view: attention" in (out / "config.yaml").read_text()
    assert {k for k in saved.model_state if k not in original.model_state} == {
        k for k in wide.trainable_state_dict() if k.startswith(("encoder_pool.", "encoder_block."))
    }
    for name, tensor in original.model_state.items():
        if not name.startswith("encoder"):
            assert torch.equal(saved.model_state[name], tensor), name
    loaded, _, loaded_config, _, _, _ = load_checkpoint(out, device="cpu")
    assert loaded_config.latent.encoder_block == "transformer"
    torch.testing.assert_close(loaded.encoder_pool.query, saved.model_state["encoder_pool.query"])
    # a resume's optimizer takes the state: the old parameters' moments carried over by name, the new ones empty
    optimizer = make_optimizer(loaded, loaded_config)
    check_optimizer_state(saved.optimizer_state, optimizer, checkpoint / "optimizer.pt")
    optimizer.load_state_dict(saved.optimizer_state)
    before = make_optimizer(source, config)
    before.load_state_dict(original.optimizer_state)
    by_name = {n: p for n, p in source.named_parameters()}
    for name, param in loaded.named_parameters():
        if not param.requires_grad:
            continue
        state = optimizer.state.get(param, {})
        if name.startswith(("encoder_pool.", "encoder_block.")):
            assert not state, name
        else:
            torch.testing.assert_close(state["exp_avg_sq"], before.state[by_name[name]]["exp_avg_sq"], msg=name)


def test_widening_refusals(discrete_run, tmp_path, injected_loader, capsys):
    out = tmp_path / "wide"
    args = ["refit-encoder", str(discrete_run.run_dir), "--output-dir", str(out), "--no-progress"]
    assert main([*args, "--encoder-view", "token_weighted_attention"]) == 2
    assert "can only widen a pool to the attention view that starts as it (attention)" in capsys.readouterr().err
    assert main([*args, "--encoder-block", "mlp"]) == 2
    assert "add --encoder-view attention" in capsys.readouterr().err
    assert not out.exists()


def test_widening_maps_each_pool_to_the_attention_view_that_starts_as_it():
    latent = build_config({"latent": "discrete", "encoder_view": "token_weighted", "data": "x.jsonl"}).latent
    assert widening(latent, None, None, "run") == {}
    assert widening(latent, "token_weighted", None, "run") == {}  # the run's own view: nothing to widen
    assert widening(latent, "token_weighted_attention", "mlp", "run") == {
        "encoder_view": "token_weighted_attention",
        "encoder_block": "mlp",
    }
    with pytest.raises(ValueError, match=r"run has encoder_view 'token_weighted'.*\(token_weighted_attention\)"):
        widening(latent, "attention", None, "run")
    attention = dataclasses.replace(latent, encoder_view="attention", encoder_block="mlp")
    assert widening(attention, None, "mlp", "run") == {}
    with pytest.raises(ValueError, match="it is an attention view already"):
        widening(attention, "token_weighted_attention", None, "run")
    with pytest.raises(ValueError, match="the refit adds a block where there is none, it does not replace one"):
        widening(attention, None, "transformer", "run")


def test_a_block_added_over_a_trained_attention_pool_keeps_the_pools_optimizer_state():
    """Only the modules an override adds start without Adam moments: a block added to a run whose attention pool
    trained keeps the pool's (and every other parameter's) moments, renumbered into the widened optimizer's order."""
    from disentanglement.checkpoints import apply_trainable_weights
    from disentanglement.trainer import make_optimizer

    source, tok, examples, cache = untrained(codebook_size=3, encoder_view="attention")
    config = build_config({"latent": "discrete", "codebook_size": 3, "encoder_view": "attention", "data": "x.jsonl"})
    optimizer = make_optimizer(source, config)
    batch = collate(examples[:6], tok.pad_token_id, indices=range(6))
    source.encoder_outputs(cache.features(batch)).square().sum().backward()  # moments for the encoder's weights
    optimizer.step()
    overrides = widening(config.latent, None, "mlp", "run")
    assert overrides == {"encoder_block": "mlp"}
    wide_config = dataclasses.replace(config, latent=dataclasses.replace(config.latent, **overrides))
    wide, *_ = untrained(codebook_size=3, encoder_view="attention", encoder_block="mlp")
    apply_trainable_weights(wide, source.trainable_state_dict(), Path("source"), ("encoder_block.",))
    state = widened_optimizer_state(optimizer.state_dict(), wide, wide_config, overrides)
    widened = make_optimizer(wide, wide_config)
    widened.load_state_dict(state)
    by_name = dict(source.named_parameters())
    for name, param in wide.named_parameters():
        if not param.requires_grad:
            continue
        if name.startswith("encoder_block."):
            assert param not in widened.state, name
        elif by_name[name] in optimizer.state:
            torch.testing.assert_close(
                widened.state[param]["exp_avg"], optimizer.state[by_name[name]]["exp_avg"], msg=name
            )
    assert widened.state[wide.encoder_pool.query]["exp_avg"].abs().sum() > 0, "the pool's moments carried over"


@pytest.mark.parametrize(
    ("nll_regret", "target_regret", "chosen"), [(0.3, 0.1, "target"), (0.1, 0.3, "nll"), (0.2, 0.2, "nll")]
)
def test_both_objectives_keep_the_fit_of_the_lower_held_out_regret(
    discrete_run, monkeypatch, nll_regret, target_regret, chosen
):
    """``fit_both`` with a stand-in for each fit (it sets the encoder to a value of its own and reports a held-out
    regret): each fit starts from the encoder as given, the kept one is the lower regret's (a tie: nll), and its
    weights are left on the model."""
    import disentanglement.encoder_refit as module
    from disentanglement.options import RefitOptions

    model, tok, _, examples, cache = _scrambled(discrete_run, count=8)
    params = encoder_parameters(model)
    start = [p.detach().clone() for p in params]
    regrets = {"nll": nll_regret, "target": target_regret}
    seen = []

    def fake_fit(model_, examples_, cache_, log_r, pad, *, objective, lr, **kwargs):
        assert all(torch.equal(p, s) for p, s in zip(params, start, strict=True)), "each fit starts as given"
        seen.append((objective, lr, kwargs["seed"], kwargs["holdout"]))
        with torch.no_grad():
            for p in params:
                p.fill_(1.0 if objective == "nll" else 2.0)
        entry = {"epoch": 1, "holdout_regret": regrets[objective]}
        return {"history": [{"epoch": 0, "holdout_regret": 0.5}, entry], "kept_epoch": 1, "stopped": None}

    monkeypatch.setattr(module, "fit_encoder", fake_fit)
    options = RefitOptions(output_dir="y", objective="both", lr=1e-4, target_lr=2e-3, seed=5)
    fitted = module.fit_both(model, examples, cache, torch.zeros(8, 1, 4), torch.zeros(8, 4), 0, options)
    assert seen == [("nll", 1e-4, 5, 0.1), ("target", 2e-3, 5, 0.1)]
    assert fitted["chosen"] == chosen and fitted["kept_epoch"] == 1
    assert fitted["fits"]["target"]["lr"] == 2e-3 and fitted["fits"]["nll"]["after"]["holdout_regret"] == nll_regret
    assert all(bool((p == (1.0 if chosen == "nll" else 2.0)).all()) for p in params)


def test_cli_refit_encoder_both_objectives(discrete_run, tmp_path, injected_loader, capsys):
    """``--objective both`` on the tiny run: the kept fit's weights are those of a refit with that objective alone
    (same seed, same rate), the other fit's figures beside them; refused without held-out pairs."""
    out = tmp_path / "both"
    args = ["refit-encoder", str(discrete_run.run_dir), "--epochs", "3", "--no-progress", "--target-lr", "3e-3"]
    assert main([*args, "--output-dir", str(out), "--objective", "both"]) == 0
    assert "kept the " in capsys.readouterr().out
    report = json.loads((out / REPORT_FILE).read_text())
    chosen = report["chosen"]
    regrets = {name: fit["after"]["holdout_regret"] for name, fit in report["fits"].items()}
    assert set(regrets) == {"nll", "target"} and regrets[chosen] == min(regrets.values())
    assert report["after"]["holdout_regret"] == regrets[chosen] and report["target_lr"] == 3e-3
    alone = tmp_path / "alone"
    rate = ["--lr", "3e-3"] if chosen == "target" else []
    posterior = ["--posterior", str(out / POSTERIOR_FILE)]
    assert main([*args, "--output-dir", str(alone), "--objective", chosen, *rate, *posterior]) == 0
    step = discrete_run.checkpoint.name
    kept = read_checkpoint(out / "checkpoints" / step).model_state
    single = read_checkpoint(alone / "checkpoints" / step).model_state
    assert all(torch.equal(kept[name], single[name]) for name in kept)
    assert "fits" not in read_trainer_state(out / "checkpoints" / step)["encoder_refit"]
    capsys.readouterr()
    none = tmp_path / "none"
    assert main([*args, "--output-dir", str(none), "--objective", "both", "--holdout", "0"]) == 2
    assert "--objective both keeps the fit of the lower held-out regret" in capsys.readouterr().err
    assert not none.exists()
