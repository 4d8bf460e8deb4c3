"""The device calls' kernel-cache carry (benchmarks/gpu/ptx_cache.sh), run here under bash.

MLX loads a cached module without a check; a truncated one crashed every 8B 4-bit run of session 47, so a cut-short
archive must not be used, a half-written module must be dropped, and a pack cut midway must keep the last archive.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "ptx_cache.sh"
pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash, tar"
)


def call(function: str, *args: Path) -> subprocess.CompletedProcess:
    command = f'source "{SCRIPT}" && {function} ' + " ".join(f'"{a}"' for a in args)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)


def module(
    directory: Path, name: str, parts: tuple[str, ...] = (".ptx", ".txt", ".cu"), size: int = 4096
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in parts:
        (directory / f"{name}{suffix}").write_bytes(bytes(range(256)) * (size // 256))


def archive(source: Path, tarball: Path) -> None:
    with tarfile.open(tarball, "w:gz") as tar:
        for path in sorted(source.iterdir()):
            tar.add(path, arcname=path.name)


def test_a_whole_archive_is_restored_and_a_module_cut_mid_write_is_dropped(tmp_path):
    source = tmp_path / "source"
    module(source, "qmm_m16")
    module(source, "qmm_m32", parts=(".ptx", ".txt"))  # MLX writes .cu last: this one was cut before it
    archive(source, tmp_path / "ptx.tgz")
    cache = tmp_path / "cache"
    done = call("restore_ptx_cache", tmp_path / "ptx.tgz", cache)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in cache.iterdir()) == ["qmm_m16.cu", "qmm_m16.ptx", "qmm_m16.txt"]
    assert "dropping qmm_m32" in done.stderr


def test_a_cut_short_archive_is_not_used(tmp_path):
    source = tmp_path / "source"
    for i in range(4):
        module(source, f"kernel{i}", size=1 << 16)
    archive(source, tmp_path / "whole.tgz")
    whole = (tmp_path / "whole.tgz").read_bytes()
    (tmp_path / "cut.tgz").write_bytes(whole[: len(whole) // 2])  # a pack stopped halfway
    cache = tmp_path / "cache"
    done = call("restore_ptx_cache", tmp_path / "cut.tgz", cache)
    assert done.returncode == 0 and "cut short" in done.stderr
    assert cache.is_dir() and not any(cache.iterdir())


def test_no_archive_is_an_empty_cache(tmp_path):
    done = call("restore_ptx_cache", tmp_path / "absent.tgz", tmp_path / "cache")
    assert done.returncode == 0 and (tmp_path / "cache").is_dir()


def test_pack_replaces_the_archive_only_when_whole(tmp_path):
    cache = tmp_path / "cache"
    module(cache, "kernel")
    out = tmp_path / "out" / "ptx.tgz"
    out.parent.mkdir()
    out.write_bytes(b"the last whole archive")
    failed = call("pack_dir", tmp_path / "missing", out)  # tar fails: the old archive stays
    assert failed.returncode != 0 and out.read_bytes() == b"the last whole archive"
    done = call("pack_dir", cache, out)
    assert done.returncode == 0
    with tarfile.open(out) as tar:
        assert sorted(Path(n).name for n in tar.getnames() if n != ".") == [
            "kernel.cu",
            "kernel.ptx",
            "kernel.txt",
        ]
    assert [p.name for p in out.parent.iterdir()] == ["ptx.tgz"]  # no partial file left beside it
