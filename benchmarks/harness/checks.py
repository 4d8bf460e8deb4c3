"""Whether a slot measured what it claims: exact contexts, zero cached tokens (or deliberate reuse), no errors,
and, for our server, proof from `/v1/status` that the long prefill ran while other requests decoded."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.client import RequestResult
from benchmarks.harness.drive import WorkloadRun
from benchmarks.harness.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str
    rejects: bool = True  # a failed check that rejects the run (others are warnings)


def request_checks(results: list[RequestResult], specs: list[RequestSpec]) -> list[Check]:
    by_name = {s.name: s for s in specs}
    checks = []
    errors = [f"{r.name}: {r.error}" for r in results if r.error]
    checks.append(Check("no_errors", not errors, "; ".join(errors) or "all requests completed"))
    wrong = [f"{r.name}: sent {r.expected_prompt_tokens}, server counted {r.prompt_tokens}"
             for r in results if r.prompt_tokens != r.expected_prompt_tokens]
    checks.append(Check("exact_context", not wrong, "; ".join(wrong) or "every prompt had its exact token count"))
    cached = [f"{r.name}: {r.cached_tokens}" for r in results
              if not by_name[r.name].expect_cached and r.cached_tokens != 0]
    checks.append(Check("zero_cached_tokens", not cached,
                        "cached tokens on measured requests: " + ", ".join(cached) if cached
                        else "no measured request was served from a cache"))
    expected_reuse = [r for r in results if by_name[r.name].expect_cached]
    if expected_reuse:
        missing = [r.name for r in expected_reuse if not r.cached_tokens]
        checks.append(Check("prefix_reused", not missing,
                            f"no cached tokens on {', '.join(missing)}" if missing else "follow-ups reused the prefix"))
    short = [f"{r.name}: {r.completion_tokens}/{by_name[r.name].max_tokens}" for r in results
             if r.completion_tokens != by_name[r.name].max_tokens]
    checks.append(Check("full_length_outputs", not short, "; ".join(short) or "every output reached max_tokens",
                        rejects=False))
    return checks


def overlap_check(run: WorkloadRun, specs: list[RequestSpec]) -> Check:
    """Our server only (the peer has no /v1/status). Evidence: a status sample with the long request prefilling
    while another decodes, or more contended prefill rows than every other prompt could account for."""
    if run.status_before is None or run.status_after is None:
        return Check("prefill_overlapped_decode", True, "not applicable: the server has no /v1/status", rejects=False)
    long_tokens = next(s.prompt_tokens for s in specs if s.role == "long")
    others = sum(s.prompt_tokens for s in specs if s.role != "long")
    seen = sum(1 for sample in run.status_samples if long_prefilled_while_decoding(sample, long_tokens))
    delta = contended_rows(run.status_after) - contended_rows(run.status_before)
    beyond = delta - others
    proved = seen > 0 or beyond > 0
    detail = (f"{seen} status samples showed the long prefill beside decoding streams; contended prefill rows "
              f"+{delta} (other prompts account for at most {others})")
    if not proved:
        cause = "admission was serialized" if not streams_ended_first(run.results) else (
            "the streams had ended before the long request was sent (the client fell behind), so nothing contended")
        detail = f"{cause}: {detail}"
    return Check("prefill_overlapped_decode", proved, detail)


def streams_ended_first(results: list[RequestResult]) -> bool:
    """The client's own clock: every stream had been read to its end before the long request went out."""
    long_sent = [r.sent for r in results if r.role == "long"]
    stream_done = [r.done for r in results if r.role == "stream"]
    return bool(long_sent and stream_done) and min(long_sent) >= max(stream_done)


def contended_rows(status: dict) -> int:
    return int(status.get("counters", {}).get("contended_prefill_rows", 0))


def long_prefilled_while_decoding(sample: dict, long_tokens: int) -> bool:
    requests = sample.get("requests", [])
    long_prefilling = any(r.get("prompt_tokens") == long_tokens and r.get("phase") == "prefilling" for r in requests)
    return long_prefilling and any(r.get("phase") == "decoding" for r in requests)
