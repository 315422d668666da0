from __future__ import annotations

import os
from pathlib import Path

import pytest

from optkit.testing.tiny import save_tiny_checkpoint, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
_IGNORED = {".venv", ".git", "__pycache__", ".pytest_cache", "artifacts"}


def _repo_files() -> set[str]:
    out = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _IGNORED and not d.endswith(".egg-info")]
        out.update(os.path.relpath(os.path.join(root, f), REPO) for f in files)
    return out


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test runs in its own temp dir, offline, with its own cache; a test that leaves
    files in the repository fails."""
    before = _repo_files()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    if "OPTKIT_TEST_CACHE" not in os.environ:  # real-model tests share one converted cache
        monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "optkit-cache"))
    yield
    leaked = _repo_files() - before
    assert not leaked, f"test left files in the repository: {sorted(leaked)}"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, tied embeddings) saved as bf16 safetensors."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def small_calib(tmp_path) -> Path:
    """A .txt calibration file large enough for a few short windows of the byte tokenizer."""
    p = tmp_path / "calib.txt"
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex junk".split()
    p.write_text(" ".join(words[(i * 7) % len(words)] for i in range(3000)))
    return p


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory):
    """One converted copy of the embedded model for every real-model test of the session."""
    try:
        from optkit.checkpoint.default import find_default_gguf

        find_default_gguf()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"embedded model unavailable: {err}")
    return tmp_path_factory.mktemp("optkit-cache")


@pytest.fixture
def real_env(default_cache, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE", str(default_cache))
