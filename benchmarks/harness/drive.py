"""Run one workload against one server: arrivals by stream progress, our `/v1/status` sampled alongside."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.harness.client import RequestResult, request_body, stream_completion
from benchmarks.harness.workload import RequestSpec

STATUS_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    model: str
    salted: bool  # the server honours cache_salt
    has_status: bool  # the server has /v1/status (ours)
    logit_bias: dict = field(default_factory=dict)


@dataclass
class WorkloadRun:
    results: list[RequestResult]
    wall_s: float
    status_before: dict | None = None
    status_after: dict | None = None
    status_samples: list[dict] = field(default_factory=list)


async def fetch_status(client: httpx.AsyncClient, target: Target) -> dict | None:
    if not target.has_status:
        return None
    response = await client.get(f"{target.base_url}/v1/status")
    response.raise_for_status()
    return response.json() | {"_t": time.perf_counter()}


async def poll_status(client: httpx.AsyncClient, target: Target, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await fetch_status(client, target))
        try:
            await asyncio.wait_for(stop.wait(), STATUS_INTERVAL_S)
        except asyncio.TimeoutError:
            pass


async def run_concurrent(client: httpx.AsyncClient, target: Target, specs: list[RequestSpec]) -> WorkloadRun:
    """Start the t=0 requests, then each triggered one once every stream has that many chunks."""
    url = f"{target.base_url}/v1/completions"
    streams = [s.name for s in specs if s.role == "stream"]
    chunks = dict.fromkeys(streams, 0)
    pending = sorted((s for s in specs if s.after_chunks), key=lambda s: s.after_chunks)
    tasks: list[asyncio.Task] = []

    def start(spec: RequestSpec, on_chunk=None) -> None:
        body = request_body(spec, target.model, target.salted, target.logit_bias)
        tasks.append(asyncio.create_task(stream_completion(client, url, spec, body, on_chunk)))

    def release(progress: int) -> None:
        while pending and pending[0].after_chunks <= progress:
            start(pending.pop(0))

    def counter(name: str):
        def on_chunk() -> None:
            chunks[name] += 1
            release(min(chunks.values()))
        return on_chunk

    before = await fetch_status(client, target)
    samples: list[dict] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_status(client, target, samples, stop)) if target.has_status else None
    begin = time.perf_counter()
    for spec in specs:
        if not spec.after_chunks:
            start(spec, counter(spec.name) if spec.name in chunks else None)
    stream_tasks = list(tasks)
    await asyncio.gather(*stream_tasks)
    release(10**9)  # streams ended early: the rest still runs, and the overlap check will say so
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - begin
    stop.set()
    if poller:
        await poller
    return WorkloadRun(list(results), wall, before, await fetch_status(client, target), samples)


async def run_sequential(client: httpx.AsyncClient, target: Target, specs: list[RequestSpec]) -> WorkloadRun:
    url = f"{target.base_url}/v1/completions"
    begin = time.perf_counter()
    results = []
    for spec in specs:
        body = request_body(spec, target.model, target.salted, target.logit_bias)
        results.append(await stream_completion(client, url, spec, body))
    return WorkloadRun(results, time.perf_counter() - begin)
