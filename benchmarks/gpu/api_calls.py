"""The reader of `api_calls.c`: every CUDA driver and runtime API call of this process, timed through CUPTI.

`ApiCalls.load()` builds the shim (with `cc`, when it is older than its source) against the CUPTI it finds (the
`nvidia-cuda-cupti` wheel's `nvidia/cu13`, or a CUDA toolkit), loads it and CUPTI into this process, and returns
None, with the reason, where there is none. Times come back in `time.perf_counter()` seconds (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("api_calls.c")
DOMAINS = {1: "driver", 2: "runtime"}  # CUpti_CallbackDomain
CUPTI_LIBRARY = "libcupti.so.13"


@dataclass(frozen=True, slots=True)
class ApiCall:
    name: str
    domain: str  # "driver" or "runtime"
    start: float  # perf_counter seconds
    end: float
    tid: int  # the native thread's id (threading.get_native_id())


def cupti_dirs() -> list[Path]:
    """Directories holding CUPTI's `lib/libcupti.so.13`: the pip wheel's, then toolkits'. The shim declares the few
    CUPTI functions it calls itself, so no headers are needed (the lent machine's wheels lack the runtime's)."""
    found = []
    for entry in sys.path:
        found.append(Path(entry) / "nvidia" / "cu13")
    found += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")), *sorted(Path("/usr/local").glob("cuda-1*"))]
    return [d for d in found if (d / "lib" / CUPTI_LIBRARY).exists()]


def build(cupti: Path, target: Path) -> Path:
    """The shim built against `cupti` at `target` (again only when its source is newer)."""
    if not target.exists() or target.stat().st_mtime < SOURCE.stat().st_mtime:
        command = ["cc", "-O2", "-shared", "-fPIC", "-o", str(target), str(SOURCE), f"-L{cupti / 'lib'}",
                   f"-l:{CUPTI_LIBRARY}"]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True)
    return target


class ApiCalls:
    """The shim's records in this process, read through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.api_calls_start.restype = ctypes.c_int
        lib.api_calls_start.argtypes = [ctypes.c_longlong]
        lib.api_calls_count.restype = lib.api_calls_read.restype = lib.api_calls_dropped.restype = ctypes.c_long
        lib.api_calls_read.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_char_p),
                                       ctypes.c_long]  # fmt: skip
        lib.api_calls_stop.restype = lib.api_calls_clear.restype = None

    @classmethod
    def load(cls, target: Path = Path("/tmp/mlx_serve_api_calls.so")) -> tuple[ApiCalls | None, str]:
        """The reader with the shim loaded, or None and why not."""
        dirs = cupti_dirs()
        if not dirs:
            return None, f"no CUPTI found (lib/{CUPTI_LIBRARY}: pip's nvidia-cuda-cupti)"
        try:
            ctypes.CDLL(str(dirs[0] / "lib" / CUPTI_LIBRARY), mode=ctypes.RTLD_GLOBAL)
            return cls(ctypes.CDLL(str(build(dirs[0], target)))), ""
        except (OSError, subprocess.CalledProcessError) as error:
            return None, f"the CUPTI shim did not build or load: {getattr(error, 'stderr', None) or error}"

    def start(self, min_duration_us: float = 0.0) -> int:
        """Time every call of at least that long from now on; CUPTI's result (0: timing)."""
        return int(self._lib.api_calls_start(int(min_duration_us * 1e3)))

    def stop(self) -> None:
        self._lib.api_calls_stop()

    def clear(self) -> None:
        self._lib.api_calls_clear()

    def dropped(self) -> int:
        """Calls not recorded since the last clear: the shim's array was full."""
        return int(self._lib.api_calls_dropped())

    def read(self) -> list[ApiCall]:
        n = int(self._lib.api_calls_count())
        times, names = (ctypes.c_longlong * (4 * n))(), (ctypes.c_char_p * n)()
        n = int(self._lib.api_calls_read(times, names, n))
        calls = []
        for i in range(n):
            start, end, tid, domain = times[4 * i : 4 * i + 4]
            if start and names[i]:  # start 0: a record still being written
                calls.append(ApiCall(names[i].decode(), DOMAINS.get(domain, str(domain)), start / 1e9, end / 1e9, tid))
        return calls
