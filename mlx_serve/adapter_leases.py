"""Which open requests hold which LoRA adapter, so that an adapter is never unloaded under one of them (its rows would
run on a slot whose matrices changed). Requests take leases on callers' threads; the engine thread releases them
and changes the adapter set, all under one lock."""

from __future__ import annotations

import threading
from typing import Any

from mlx_serve.errors import InvalidRequest, ModelNotFound


class AdapterLeases:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}  # adapter name -> open requests naming it
        self._held: dict[str, str] = {}  # request id -> its adapter's name

    def take(self, request_id: str, name: str | None, adapters: Any) -> int:
        """The slot in `adapters` (an `AdapterSet`, or None) of the adapter a request names, held until `release`;
        0 for the base model. ModelNotFound for an adapter not served."""
        if name is None:
            return 0
        with self._lock:
            served = adapters.names if adapters is not None else ()
            if name not in served:
                offered = f"adapters served: {', '.join(served)}" if served else "this engine serves no adapters"
                raise ModelNotFound(f"adapter {name!r} is not served; {offered}", param="model")
            self._users[name] = self._users.get(name, 0) + 1
            self._held[request_id] = name
            return adapters.slot(name)

    def release(self, request_id: str) -> None:
        if (name := self._held.pop(request_id, None)) is not None:
            with self._lock:
                self._users[name] -= 1

    def add(self, adapters: Any, adapter: Any, limit_bytes: int | None = None) -> None:
        """Serve `adapter` (read already) in `adapters`, its stacks kept within `limit_bytes`."""
        with self._lock:
            adapters.add(adapter, limit_bytes)

    def remove(self, adapters: Any, name: str) -> None:
        """Stop serving `name`; InvalidRequest while requests naming it are open."""
        with self._lock:
            if adapters is None or name not in adapters.names:
                raise ModelNotFound(f"adapter {name!r} is not served", param="lora_name")
            if users := self._users.get(name, 0):
                raise InvalidRequest(f"adapter {name!r} is in use by {users} open requests", param="lora_name")
            adapters.remove(name)
