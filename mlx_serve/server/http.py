"""Running the app under hypercorn: in the foreground with signal-driven drain (`serve`), or on a
background thread over an already-bound socket (tests, `chat`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config

log = logging.getLogger("mlx_serve.server")


def hypercorn_config(bind: str, graceful_timeout_s: float = 10.0, access_log: bool = False,
                     certfile: str | None = None, keyfile: str | None = None) -> Config:  # fmt: skip
    config = Config()
    config.certfile, config.keyfile = certfile, keyfile  # both given: HTTPS
    config.bind = [bind]
    config.graceful_timeout = graceful_timeout_s
    config.accesslog = "-" if access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


def serve_until_signalled(app: Any, config: Config) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting and let open requests finish within the grace period.

    A second signal stops at once.
    """

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                raise SystemExit(130)
            log.info("%s: draining (up to %.0fs); signal again to stop now", signal.Signals(signum).name,
                     config.graceful_timeout)
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        await serve(app, config, shutdown_trigger=stop.wait)

    asyncio.run(main())


class BackgroundServer:
    """The app served by hypercorn on its own thread and event loop, on a socket bound before it starts,
    so clients can connect as soon as this object exists (the kernel queues them until hypercorn accepts)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, graceful_timeout_s: float = 5.0,
                 certfile: str | None = None, keyfile: str | None = None) -> None:  # fmt: skip
        self.socket = socket.create_server((host, port))
        self.host, self.port = self.socket.getsockname()[:2]
        self.url = f"{'https' if certfile else 'http'}://{self.host}:{self.port}"
        # hypercorn closes the socket it is given: hand it a duplicate so this object can close its own
        self._config = hypercorn_config(f"fd://{os.dup(self.socket.fileno())}", graceful_timeout_s, certfile=certfile,
                                        keyfile=keyfile)  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, args=(app,), name="mlx-serve-http", daemon=True)
        self._thread.start()

    def _run(self, app: Any) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(serve(app, self._config, shutdown_trigger=self._stop.wait))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, drain open requests (bounded by the grace period), join the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self.socket.close()
