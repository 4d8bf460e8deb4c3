"""`python -m mlx_serve ane build`: builds once, then reuses the cached package for the same fingerprint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_serve.ane import cache
from mlx_serve.ane.builder import package_geometries
from mlx_serve.cli import main


def test_build_then_cache_hit(tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["ane", "build", "--model", str(tiny_qwen3), "--chunk-sizes", "16", "--max-context", "64"]
    args += ["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out.mlpackage")]
    assert main(args) == 0
    assert "cache hit" not in capsys.readouterr().out
    assert list(package_geometries(tmp_path / "out.mlpackage")) == [16]
    assert main(args) == 0
    assert "cache hit" in capsys.readouterr().out
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and (entries[0] / cache.RECORD_NAME).is_file()


def test_check_reports_errors_within_tolerance(
    tiny_qwen3: Path, qwen3_package: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["ane", "check", "--model", str(tiny_qwen3), "--package", str(qwen3_package), "--tokens", "24"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "hidden" in out and "ok: tolerance 1.00%" in out
    assert main(args + ["--tolerance", "0"]) == 1


def test_fingerprint_follows_the_weights(tiny_qwen3: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_qwen3, tmp_path / "model"))
    before = cache.model_fingerprint(copy)
    assert cache.model_fingerprint(copy) == before
    weights = cache.weight_files(copy)[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cache.model_fingerprint(copy) != before


def test_options_key_separates_builds() -> None:
    fp16 = cache.BuildOptions((16, 64), 2048, None)
    assert fp16.key() != cache.BuildOptions((16, 64), 2048, "int8").key()
    assert fp16.key() != cache.BuildOptions((64,), 2048, None).key()
    assert cache.parse_chunk_sizes("64, 16,64") == (16, 64)


def test_not_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ane", "build", "--model", str(tmp_path)]) == 1
    assert "no config.json" in capsys.readouterr().err
