"""One measured slot of an ABBA round: matched warm-up, the workloads, their metrics and checks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from benchmarks.harness import stats
from benchmarks.harness.checks import overlap_check, request_checks
from benchmarks.harness.drive import Target, run_concurrent, run_sequential
from benchmarks.harness.prompts import PromptBuilder
from benchmarks.harness.results import SlotRecord
from benchmarks.harness.workload import (
    ContendedWorkload,
    PrefixReuseWorkload,
    RequestFactory,
    contended_requests,
    prefix_reuse_requests,
    warmup_requests,
)

HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=60.0)


@dataclass(frozen=True, slots=True)
class Plan:
    builder: PromptBuilder
    contended: ContendedWorkload | None
    prefix: PrefixReuseWorkload | None

    def requests_per_slot(self) -> int:
        count = 0
        if self.contended:
            count += self.contended.streams + 1 + self.contended.interactive
        if self.prefix:
            count += 1
        return count


async def warm_up(target: Target, plan: Plan, opener_offset: int) -> None:
    long_prompt = plan.contended.long_prompt if plan.contended else plan.prefix.prefix
    specs = warmup_requests(RequestFactory(plan.builder, "warmup", opener_offset), long_prompt)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        run = await run_sequential(client, target, specs)
    failed = [r for r in run.results if r.error]
    if failed:
        raise RuntimeError(f"warm-up failed on {target.base_url}: {failed[0].error}")


async def measure(target: Target, plan: Plan, slot: SlotRecord, opener_offset: int) -> None:
    factory = RequestFactory(plan.builder, slot.pair_key, opener_offset)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        if plan.contended:
            specs = contended_requests(factory, plan.contended)
            run = await run_concurrent(client, target, specs)
            slot.metrics.update(stats.contended_metrics(run.results, run.wall_s))
            slot.checks += request_checks(run.results, specs)
            slot.checks.append(overlap_check(run, specs))
            slot.outputs.update({r.name: r.output_hash for r in run.results})
        if plan.prefix:
            specs = prefix_reuse_requests(factory, plan.prefix)
            run = await run_sequential(client, target, specs)
            slot.metrics.update(stats.prefix_metrics(run.results))
            slot.checks += [replace(c, name=f"prefix_{c.name}") for c in request_checks(run.results, specs)]
            slot.outputs.update({r.name: r.output_hash for r in run.results})


def run_slot(target: Target, plan: Plan, slot: SlotRecord, opener_offset: int, warm: bool) -> None:
    async def both() -> None:
        if warm:
            await warm_up(target, plan, opener_offset)
        await measure(target, plan, slot, opener_offset + 2)

    asyncio.run(both())


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
