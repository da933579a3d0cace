"""``disentangle export`` and ``disentanglement.load``: an export loads to the same model as its checkpoint
(bit-identical eval report and latents), in every subcommand; a different base model, a missing file and a
missing token are refused with a clear error; the hub upload's arguments; the base-model hash against an
independent computation of its documented definition."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch

import disentanglement
from conftest import model_and_tokenizer
from disentanglement import export as export_module
from disentanglement.checkpoints import load_trained
from disentanglement.cli import main
from disentanglement.commands import run_eval
from disentanglement.encode import run_encode
from disentanglement.export import (
    HASH_FORMAT,
    BaseModelMismatch,
    ExportError,
    export_run,
    push_to_hub,
    state_dict_sha256,
)

EVAL = dict(iw_samples=2, prior_samples=4, batch_size=16, max_examples=24, seed=3, progress=False)


@pytest.fixture(scope="module")
def discrete_export(discrete_run, tmp_path_factory):
    # an eval report of the checkpoint first, so that the model card has metrics and baselines
    run_eval(discrete_run.checkpoint, model_and_tokenizer=model_and_tokenizer(), **EVAL)
    out = tmp_path_factory.mktemp("export") / "discrete-export"
    return export_run(discrete_run.run_dir, out, model_and_tokenizer=model_and_tokenizer())


@pytest.fixture(scope="module")
def continuous_export(continuous_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "continuous-export"
    return export_run(continuous_run.checkpoint, out, model_and_tokenizer=model_and_tokenizer())


def _without_paths(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("title", "checkpoint")}


def test_export_directory_holds_the_weights_config_hash_and_card(discrete_run, discrete_export):
    names = sorted(p.name for p in discrete_export.iterdir())
    assert names == ["README.md", "config.yaml", "eval", "export.json", "model.safetensors", "trainer_state.json"]
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in discrete_export.rglob("*"))
    assert (discrete_export / "model.safetensors").read_bytes() == (
        discrete_run.checkpoint / "model.safetensors"
    ).read_bytes()
    manifest = json.loads((discrete_export / "export.json").read_text())
    decoder, _ = model_and_tokenizer()
    assert manifest["base_model"]["hash_format"] == HASH_FORMAT
    assert manifest["base_model"]["sha256"] == {
        "bfloat16": state_dict_sha256(decoder.state_dict(), "bfloat16"),
        "float32": state_dict_sha256(decoder.state_dict(), "float32"),
    }
    assert manifest["data"]["sha256"] == hashlib.sha256(discrete_run.data_path.read_bytes()).hexdigest()
    assert manifest["data"]["lines"] == 200
    card = (discrete_export / "README.md").read_text()
    report = json.loads(next((discrete_export / "eval").glob("*.json")).read_text())
    factor = next(iter(report["factors"]))
    entry = report["factors"][factor]
    # the factor's NMI beside its three baselines, as the report has them
    row = (
        f"| {factor} | {entry['latent']['nmi']:.3f} | {entry['encoder_kmeans']['nmi']:.3f} | "
        f"{entry['prior_kmeans']['nmi']:.3f} | {entry['random']['nmi']:.3f} |"
    )
    assert row in card
    assert f"{report['latent_gain_nats_per_token']:.4f}" in card
    assert str(discrete_run.data_path) in card
    assert "disentangle train --config config.yaml" in card  # the run recorded no command: the equivalent one
    assert "disentangle export " in card


def test_load_gives_the_checkpoints_model_and_eval_bit_for_bit(discrete_run, discrete_export, tmp_path):
    model, tokenizer, config = disentanglement.load(discrete_export, model_and_tokenizer=model_and_tokenizer())
    reference, _, reference_config, _ = load_trained(discrete_run.checkpoint, model_and_tokenizer())
    assert config == reference_config
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert model.zfree_reference_scale == reference.zfree_reference_scale
    exported, _, _ = run_eval(
        discrete_export, output=tmp_path / "a.json", model_and_tokenizer=model_and_tokenizer(), **EVAL
    )
    original, _, _ = run_eval(
        discrete_run.checkpoint, output=tmp_path / "b.json", model_and_tokenizer=model_and_tokenizer(), **EVAL
    )
    assert _without_paths(exported) == _without_paths(original)


def test_export_gives_the_same_latents(continuous_run, continuous_export, tmp_path):
    a = run_encode(
        continuous_export, output=tmp_path / "a.jsonl", progress=False, model_and_tokenizer=model_and_tokenizer()
    )
    b = run_encode(
        continuous_run.checkpoint,
        output=tmp_path / "b.jsonl",
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    rows_a = [json.loads(line) for line in a.read_text().splitlines()]
    rows_b = [json.loads(line) for line in b.read_text().splitlines()]
    assert len(rows_a) == len(rows_b) > 0
    assert rows_a == rows_b  # mu, posterior, KL, gains: identical floats


def test_a_different_base_model_is_refused_naming_both_hashes(discrete_export):
    decoder, tokenizer = model_and_tokenizer()
    with torch.no_grad():
        decoder.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    recorded = json.loads((discrete_export / "export.json").read_text())["base_model"]["sha256"]["float32"]
    found = state_dict_sha256(decoder.state_dict(), "float32")
    with pytest.raises(BaseModelMismatch) as caught:
        disentanglement.load(discrete_export, model_and_tokenizer=(decoder, tokenizer))
    assert recorded in str(caught.value) and found in str(caught.value) and recorded != found


def test_a_bfloat16_base_is_checked_against_the_bfloat16_hash(discrete_export):
    decoder, tokenizer = model_and_tokenizer()
    export_module.verify_base_model(discrete_export, decoder.to(torch.bfloat16))  # the same base, rounded: accepted
    with torch.no_grad():
        decoder.lm_head.weight[3, 1] += 1.0
    with pytest.raises(BaseModelMismatch, match="bfloat16"):
        export_module.verify_base_model(discrete_export, decoder)


@pytest.mark.parametrize("missing", ["model.safetensors", "export.json", "config.yaml"])
def test_missing_files_are_a_clear_error(discrete_export, tmp_path, missing):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(discrete_export, broken)
    (broken / missing).unlink()
    with pytest.raises(ExportError, match=f"incomplete: missing {missing}"):
        disentanglement.load(broken, model_and_tokenizer=model_and_tokenizer())


def test_cli_subcommands_accept_an_export(discrete_export, discrete_run, injected_loader, tmp_path, capsys):
    assert main(["eval", str(discrete_export), "--output", str(tmp_path / "e.json"), "--max-examples", "8",
                 "--iw-samples", "2", "--prior-samples", "2", "--no-progress"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "e.json").read_text())["checkpoint"] == str(discrete_export)
    assert main(["encode", str(discrete_export), "--output", str(tmp_path / "z.jsonl"), "--max-examples", "8",
                 "--iw-samples", "2", "--prior-samples", "2", "--no-progress"]) == 0  # fmt: skip
    assert len((tmp_path / "z.jsonl").read_text().splitlines()) == 8
    assert main(["generate", str(discrete_export), "--prompt", "red cat 1", "--max-new-tokens", "4", "--greedy"]) == 0
    assert "red cat 1" in capsys.readouterr().out
    assert main(["inspect", str(discrete_export), "--output-dir", str(tmp_path / "i"), "--no-plots",
                 "--max-examples", "4"]) == 0  # fmt: skip
    assert (tmp_path / "i" / "inspect_0.html").is_file()


def test_cli_refuses_a_tampered_base_with_exit_2(discrete_export, monkeypatch, capsys):
    from disentanglement import trainer

    def tampered(checkpoint, _=None, **kwargs):
        decoder, tokenizer = model_and_tokenizer()
        with torch.no_grad():
            decoder.model.embed_tokens.weight[5, 0] = 0.0
        return load_trained(checkpoint, (decoder, tokenizer), **kwargs)

    monkeypatch.setattr(trainer, "load_trained", tampered)
    assert main(["generate", str(discrete_export), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "refusing to load" in err and err.count("hashes") == 1 and len(err.strip().splitlines()) == 1


def test_cli_export_writes_and_refuses_a_non_empty_output(discrete_run, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(export_module, "load_base_decoder", lambda config: model_and_tokenizer())
    out = tmp_path / "x"
    assert main(["export", str(discrete_run.run_dir), "--output", str(out)]) == 0
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["commands"]["export"] == f"disentangle export {discrete_run.run_dir} --output {out}"
    assert "disentanglement.load" in capsys.readouterr().out
    assert main(["export", str(discrete_run.run_dir), "--output", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", str(out), "--output", str(tmp_path / "y")]) == 2  # an export of an export
    assert "already an export" in capsys.readouterr().err


def test_push_to_hub_calls_create_repo_and_upload_folder(discrete_export, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda self, repo_id, **kw: (
            calls.append(("create_repo", self.token, repo_id, kw)) or f"https://hf.co/{repo_id}"
        ),
    )
    monkeypatch.setattr(
        huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload_folder", self.token, kw))
    )
    url = push_to_hub(discrete_export, "me/cvae", private=True)
    assert url == "https://hf.co/me/cvae"
    assert calls == [
        ("create_repo", "hf_test", "me/cvae", {"repo_type": "model", "private": True, "exist_ok": True}),
        (
            "upload_folder",
            "hf_test",
            {
                "repo_id": "me/cvae",
                "folder_path": str(discrete_export),
                "repo_type": "model",
                "commit_message": f"disentangle export {discrete_export.name}",
            },
        ),
    ]


def test_push_to_hub_without_a_token_fails_before_exporting(discrete_run, monkeypatch, tmp_path, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("must not be called"))
    monkeypatch.setattr(export_module, "load_base_decoder", lambda config: pytest.fail("must not load"))
    out = tmp_path / "x"
    assert main(["export", str(discrete_run.run_dir), "--output", str(out), "--push-to-hub", "me/cvae"]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face token" in err and "HF_TOKEN" in err
    assert not out.exists()


def _reference_hash(state: dict[str, torch.Tensor]) -> str:
    """The documented hash, written independently: numpy bytes, struct for the length."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        array = t.numpy()
        data = array.astype(array.dtype.newbyteorder("<")).tobytes(order="C")
        digest.update(name.encode("utf-8") + b"\x00" + str(t.dtype)[6:].encode() + b"\x00")
        digest.update(("[" + ", ".join(map(str, t.shape)) + "]").encode() + b"\x00")
        digest.update(struct.pack("<Q", len(data)) + data)
    return digest.hexdigest()


def test_state_dict_hash_matches_its_definition():
    state = {
        "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
        "a.count": torch.tensor([3, -1], dtype=torch.int64),
        "c.scalar": torch.tensor(2.5),
    }
    assert state_dict_sha256(state, "float32") == _reference_hash(state)
    assert state_dict_sha256(state) == _reference_hash(state)
    # bfloat16: the float32 values rounded to bfloat16 (the top 16 bits, round to nearest even), ints unchanged
    bits = torch.from_numpy(state["b.weight"].numpy().view(np.uint32).astype(np.int64))
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(torch.int16)
    as_bf16 = {
        "b.weight": rounded.view(torch.bfloat16),
        "a.count": state["a.count"],
        "c.scalar": torch.tensor(2.5).bfloat16(),
    }
    expected = hashlib.sha256()
    for name in sorted(as_bf16):
        t = as_bf16[name]
        data = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        expected.update(name.encode() + b"\0" + str(t.dtype)[6:].encode() + b"\0")
        expected.update(json.dumps(list(t.shape)).encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    assert state_dict_sha256(state, "bfloat16") == expected.hexdigest()
    # any change of a value, a name or a dtype changes the hash
    assert state_dict_sha256({**state, "a.count": torch.tensor([3, 0])}) != state_dict_sha256(state)
    assert state_dict_sha256({"z": state["b.weight"]}) != state_dict_sha256({"y": state["b.weight"]})
    assert state_dict_sha256({"z": state["b.weight"].double()}) != state_dict_sha256({"z": state["b.weight"]})


def test_train_records_its_command_and_the_card_shows_it(discrete_run, monkeypatch, tmp_path):
    import shutil
    import types

    from disentanglement import trainer

    run = tmp_path / "run"
    shutil.copytree(discrete_run.run_dir, run, ignore=shutil.ignore_patterns("feature_cache"))
    fake = types.SimpleNamespace(
        output_dir=run, checkpoint=None, zfree_reference_scale=1.0, last_metrics={}, final_step=0
    )
    monkeypatch.setattr(trainer, "train", lambda config: fake)
    argv = ["train", "--output-dir", str(run), "--token-weighted-weight", "1", "--max-steps", "3"]
    assert main(argv) == 0
    assert main(argv[:3]) == 0  # a second invocation (a resume) is appended
    recorded = (run / "command.txt").read_text().splitlines()
    assert recorded == [
        f"disentangle train --output-dir {run} --token-weighted-weight 1 --max-steps 3",
        f"disentangle train --output-dir {run}",
    ]
    out = export_run(run, tmp_path / "export", model_and_tokenizer=model_and_tokenizer())
    assert json.loads((out / "export.json").read_text())["commands"]["train"] == recorded
    card = (out / "README.md").read_text()
    assert f"```sh\n{recorded[0]}\n{recorded[1]}\ndisentangle export " in card


def test_a_run_with_its_command_record_can_be_overwritten(discrete_run, tmp_path):
    """command.txt is a run's own file: --overwrite removes it with the rest (it refused the run before)."""
    import shutil

    from disentanglement.run_dir import check_run_directory

    run = tmp_path / "run"
    shutil.copytree(discrete_run.run_dir, run, ignore=shutil.ignore_patterns("feature_cache"))
    (run / "command.txt").write_text("disentangle train --output-dir run\n")
    removed = check_run_directory(run, None, None, overwrite=True)  # no "files that are not a run's"
    assert run / "command.txt" in removed
