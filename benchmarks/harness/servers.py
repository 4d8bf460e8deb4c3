"""The two arms as server subprocesses: start, wait until healthy, stop gracefully, report peak memory."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

KINDS = ("ours", "peer")  # ours: python -m mlx_serve serve; peer: mlx-lm's own server


@dataclass(frozen=True, slots=True)
class ArmSpec:
    label: str
    kind: str
    extra_args: tuple[str, ...] = ()

    @property
    def salted(self) -> bool:
        return self.kind == "ours"

    @property
    def has_status(self) -> bool:
        return self.kind == "ours"

    def command(self, model: str, port: int) -> list[str]:
        if self.kind == "ours":
            base = [sys.executable, "-m", "mlx_serve", "serve", "--no-progress"]
        elif self.kind == "peer":
            base = [sys.executable, "-m", "mlx_lm", "server"]  # mlx-lm 0.32: `python -m mlx_lm.server` is deprecated
        else:
            raise ValueError(f"unknown arm kind {self.kind!r}: expected one of {KINDS}")
        return [*base, "--model", model, "--port", str(port), *self.extra_args]


def parse_arm(label: str, text: str) -> ArmSpec:
    """`ours`, `peer`, or either followed by server flags: `ours --prefill-cost-model bucketed`."""
    words = shlex.split(text)
    if not words or words[0] not in KINDS:
        raise ValueError(f"arm {label}: expected 'ours' or 'peer' first, got {text!r}")
    return ArmSpec(label, words[0], tuple(words[1:]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    arm: ArmSpec
    model: str
    log_path: Path
    env: dict = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None
    peak_rss_mb: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 300.0) -> None:
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            self.arm.command(self.model, self.port), stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env}, start_new_session=True,
        )
        log.close()
        self._wait_healthy(ready_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.arm.label} server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # polling a starting process; nothing to wait on instead
        self.stop()
        raise RuntimeError(f"{self.arm.label} server not healthy after {timeout_s}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT (both servers shut down cleanly on it, and ours then writes its trace), SIGKILL past the bound."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
            if pid:
                self._reaped(status, usage)
                return
            time.sleep(0.1)
        self.process.kill()
        _, status, usage = os.wait4(self.process.pid, 0)
        self._reaped(status, usage)

    def _reaped(self, status: int, usage) -> None:
        self.process.returncode = os.waitstatus_to_exitcode(status)
        scale = 1 / 1024 if sys.platform != "darwin" else 1 / (1024 * 1024)  # ru_maxrss: KiB on Linux, bytes on macOS
        self.peak_rss_mb = usage.ru_maxrss * scale

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
