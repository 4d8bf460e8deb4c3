"""Resolving a model spec to a directory, the supported-architecture check and weight sizes."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_serve.errors import ModelNotFound, UnsupportedModel
from mlx_serve.model_source import SUPPORTED_MODEL_TYPES, check_supported, resolve_model, weight_bytes

REVISION = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache_dir: Path, repo_id: str, checkpoint: Path) -> Path:
    """Lay out `checkpoint` as the Hugging Face hub cache stores a downloaded snapshot."""
    repo_dir = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / REVISION
    shutil.copytree(checkpoint, snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)


def test_a_local_directory_resolves_to_itself(tiny_qwen3: Path) -> None:
    assert resolve_model(str(tiny_qwen3)) == tiny_qwen3


def test_a_directory_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=f"{tmp_path} has no config.json"):
        resolve_model(str(tmp_path))


def test_a_missing_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFound, match=f"{missing} is not a directory"):
        resolve_model(str(missing))


def test_hub_id_resolves_through_the_offline_cache(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    cache = tmp_path / "hub"
    snapshot = build_hub_cache(cache, "acme/tiny-qwen3", tiny_qwen3)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    path = resolve_model("acme/tiny-qwen3")
    assert path.resolve() == snapshot.resolve()
    model, tokenizer = mlx_lm.load(str(path))
    assert mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)


def test_hub_cache_is_found_under_hf_home(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    snapshot = build_hub_cache(tmp_path / "hf_home" / "hub", "acme/tiny", tiny_qwen3)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    assert resolve_model("acme/tiny").resolve() == snapshot.resolve()


def test_missing_hub_id_offline_names_the_id_and_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    cache = tmp_path / "empty-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelNotFound) as caught:
        resolve_model("acme/absent-model")
    message = caught.value.message
    assert "'acme/absent-model'" in message
    assert str(cache) in message
    assert "HF_HUB_OFFLINE" in message
    assert caught.value.status_code == 404


def test_online_download_failure_is_model_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fake_snapshot_download(repo_id: str, *, local_files_only: bool = False, **kwargs) -> str:
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        raise OSError("network unreachable")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(ModelNotFound, match="downloading it failed: network unreachable"):
        resolve_model("acme/remote-only")


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_supported_architectures_pass(model_type: str) -> None:
    check_supported({"model_type": model_type})


@pytest.mark.parametrize("config", [{"model_type": "bloom"}, {}])
def test_unsupported_architectures_are_named(config: dict) -> None:
    with pytest.raises(UnsupportedModel) as caught:
        check_supported(config)
    message = caught.value.message
    assert repr(config.get("model_type")) in message
    assert "llama, qwen2, qwen3, qwen3_moe, mistral" in message


def test_weight_bytes_counts_float_and_quantized_parameters(tiny_qwen3: Path, tiny_qwen3_4bit: Path) -> None:
    float_model, _ = mlx_lm.load(str(tiny_qwen3))
    params = sum(v.size for _, v in tree_flatten(float_model.parameters()))
    assert weight_bytes(float_model) == 4 * params
    quant_model, _ = mlx_lm.load(str(tiny_qwen3_4bit))
    on_disk = sum(v.nbytes for f in tiny_qwen3_4bit.glob("*.safetensors") for v in mx.load(str(f)).values())
    assert weight_bytes(quant_model) == on_disk
    assert weight_bytes(quant_model) < weight_bytes(float_model) / 4
