"""The A/B harness: its pure parts on fakes, then the whole harness against real servers (--smoke)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.harness import stats
from benchmarks.harness.checks import overlap_check, request_checks
from benchmarks.harness.client import RequestResult, absorb
from benchmarks.harness.drive import Target, WorkloadRun, run_concurrent
from benchmarks.harness.fingerprints import model_fingerprint
from benchmarks.harness.prompts import PromptBuilder, PromptError, load_encoder
from benchmarks.harness.results import SlotRecord, arm_pairs, markdown, output_agreement, summary, verdicts
from benchmarks.harness.servers import parse_arm
from benchmarks.harness.workload import ContendedWorkload, RequestFactory, RequestSpec, contended_requests


# -- the gate ----------------------------------------------------------------------------------------------------
def test_verdict_gate_is_two_percent_when_quiet():
    quiet_a, quiet_b = [(100.0, 100.5)], [(96.0, 96.4)]  # noise ~0.5%, so the gate is the 2% floor
    v = stats.verdict("m", quiet_a, quiet_b)
    assert v.gate == pytest.approx(0.02) and v.verdict == "better"
    assert stats.verdict("m", quiet_a, [(101.0, 101.4)]).verdict == "same"
    assert stats.verdict("m", quiet_a, [(104.0, 104.4)]).verdict == "worse"


def test_verdict_gate_doubles_measured_noise():
    a, b = [(100.0, 104.0)], [(94.0, 95.0)]  # A's two runs disagree by ~3.9%: the gate is ~7.8%
    v = stats.verdict("m", a, b)
    assert v.noise == pytest.approx(4 / 102) and v.gate == pytest.approx(2 * 4 / 102)
    assert v.verdict == "same"  # -7.4% is inside the noise-derived gate


def test_noise_above_five_percent_is_inconclusive():
    assert stats.verdict("m", [(100.0, 112.0)], [(50.0, 51.0)]).verdict == "inconclusive"


def test_abba_pairs_take_each_arms_two_slots_per_round():
    slots = [SlotRecord(r, pos, arm, arm, f"r{r}p{pos // 2}", {"x": 10.0 * r + pos})
             for r in range(2) for pos, arm in enumerate("ABBA")]
    assert arm_pairs(slots, "A", "x") == [(0.0, 3.0), (10.0, 13.0)]
    assert arm_pairs(slots, "B", "x") == [(1.0, 2.0), (11.0, 12.0)]
    assert [v.metric for v in verdicts(slots)] == []  # "x" is not a harness metric


# -- prompts -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builder(tiny_qwen3) -> PromptBuilder:
    return PromptBuilder(load_encoder(tiny_qwen3), seed=1)


@pytest.mark.parametrize("tokens", [1, 2, 33, 1024, 4000])
def test_prompts_have_exact_token_counts(builder, tokens):
    assert len(builder.encode(builder.text(tokens))) == tokens


def test_openers_give_every_request_a_distinct_first_token(builder):
    firsts = [builder.encode(builder.text(16, opener=builder.opener(i)))[0] for i in range(len(builder.openers))]
    assert len(set(firsts)) == len(firsts) >= 26
    with pytest.raises(PromptError):
        builder.opener(len(builder.openers))


def test_a_tokenizer_that_merges_across_words_fails_loudly():
    def merging(text: str) -> list[int]:  # a "tokenizer" that fuses every pair of words
        words = text.split()
        return [hash(" ".join(words[i:i + 2])) for i in range(0, len(words), 2)]

    with pytest.raises(PromptError):
        PromptBuilder(merging).text(7)


def test_both_arms_of_a_pair_get_identical_prompts_and_new_pairs_do_not(builder):
    workload = ContendedWorkload(streams=2, stream_prompt=40, long_prompt=300, interactive=2)
    first = contended_requests(RequestFactory(builder, "r0p0", 2), workload)
    again = contended_requests(RequestFactory(builder, "r0p0", 2), workload)
    other = contended_requests(RequestFactory(builder, "r0p1", 2), workload)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert len({s.cache_salt for s in first + other}) == len(first) + len(other)
    assert len({builder.encode(s.prompt)[0] for s in first}) == len(first)
    assert [s.prompt_tokens for s in first] == [len(builder.encode(s.prompt)) for s in first]
    long = next(s for s in first if s.role == "long")
    assert long.after_chunks == workload.long_after_chunks


# -- the client and the checks -------------------------------------------------------------------------------
def test_sse_payloads_fold_into_a_result():
    result = RequestResult("r", "stream", 10)
    assert absorb(result, {"choices": [{"text": "ab", "finish_reason": None}]}, 1.0)
    assert not absorb(result, {"choices": [{"text": "", "finish_reason": "length"}]}, 2.0)
    absorb(result, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3,
                                             "prompt_tokens_details": {"cached_tokens": 0}}}, 3.0)
    assert (result.text, result.chunk_times, result.finish_reason) == ("ab", [1.0], "length")
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (10, 3, 0)


def spec(name: str, role: str, tokens: int = 10, expect_cached: bool = False) -> RequestSpec:
    return RequestSpec(name, role, "x", tokens, 3, f"salt-{name}", expect_cached=expect_cached)


def result(name: str, role: str, prompt: int = 10, cached: int = 0) -> RequestResult:
    return RequestResult(name, role, 10, prompt_tokens=prompt, completion_tokens=3, cached_tokens=cached)


def failed(checks) -> set[str]:
    return {c.name for c in checks if not c.passed}


def test_cached_tokens_on_a_measured_request_reject_the_run():
    checks = request_checks([result("a", "stream", cached=16)], [spec("a", "stream")])
    assert failed(checks) == {"zero_cached_tokens"}
    assert next(c for c in checks if c.name == "zero_cached_tokens").rejects


def test_a_wrong_context_length_rejects_the_run():
    assert failed(request_checks([result("a", "stream", prompt=11)], [spec("a", "stream")])) == {"exact_context"}


def test_reuse_scenarios_must_reuse():
    specs = [spec("p", "primer"), spec("f", "followup", expect_cached=True)]
    assert failed(request_checks([result("p", "primer"), result("f", "followup", cached=0)], specs)) == {
        "prefix_reused"}
    assert not failed(request_checks([result("p", "primer"), result("f", "followup", cached=16)], specs))


def status(phases: list[tuple[int, str]], contended: int) -> dict:
    return {"requests": [{"prompt_tokens": n, "phase": p} for n, p in phases],
            "counters": {"contended_prefill_rows": contended}}


def test_serialized_admission_is_rejected():
    specs = [spec("s", "stream", 100), spec("long", "long", 2000)]
    samples = [status([(100, "decoding"), (2000, "waiting")], 0), status([(2000, "prefilling")], 0)]
    run = WorkloadRun([], 1.0, status([], 0), status([], 100), samples)  # long ran alone, uncontended
    check = overlap_check(run, specs)
    assert not check.passed and check.rejects and "serialized" in check.detail


def test_a_client_that_fell_behind_is_told_apart_from_serialized_admission():
    specs = [spec("s", "stream", 100), spec("long", "long", 2000)]
    timed = [RequestResult("s", "stream", 100, sent=0.0, done=1.0), RequestResult("long", "long", 2000, sent=2.0)]
    late = overlap_check(WorkloadRun(timed, 3.0, status([], 0), status([], 100), []), specs)
    assert not late.passed and late.rejects and "client fell behind" in late.detail
    timed[0].done = 2.5  # the stream was still being read when the long request went out
    check = overlap_check(WorkloadRun(timed, 3.0, status([], 0), status([], 100), []), specs)
    assert not check.passed and "serialized" in check.detail


def test_overlap_is_proved_by_a_status_sample_or_by_contended_rows():
    specs = [spec("s", "stream", 100), spec("long", "long", 2000)]
    seen = WorkloadRun([], 1.0, status([], 0), status([], 0), [status([(100, "decoding"), (2000, "prefilling")], 0)])
    assert overlap_check(seen, specs).passed
    counted = WorkloadRun([], 1.0, status([], 0), status([], 1500), [])
    assert overlap_check(counted, specs).passed
    peer = WorkloadRun([], 1.0)
    assert overlap_check(peer, specs).passed and "not applicable" in overlap_check(peer, specs).detail


# -- arrivals follow stream progress --------------------------------------------------------------------------
def fake_server(tokens_by_prompt: dict[str, int], log: list) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        name = body["cache_salt"].rsplit("/", 1)[-1]
        log.append(("start", name))

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0)  # let other streams interleave
                log.append(("chunk", name, i))
                yield f"data: {json.dumps({'choices': [{'text': f't{i}', 'finish_reason': None}]})}\n\n".encode()
            usage = {"prompt_tokens": tokens_by_prompt[body["prompt"]], "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_the_long_request_arrives_only_after_every_stream_has_progressed(builder):
    workload = ContendedWorkload(streams=2, stream_prompt=20, stream_tokens=12, long_prompt=60, long_tokens=2,
                                 long_after_chunks=4, interactive=1, interactive_prompt=10, interactive_tokens=2,
                                 interactive_every_chunks=3)
    specs = contended_requests(RequestFactory(builder, "k", 0), workload)
    log: list = []

    async def go() -> WorkloadRun:
        transport = fake_server({s.prompt: s.prompt_tokens for s in specs}, log)
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_concurrent(client, Target("http://fake", "m", True, False), specs)

    run = asyncio.run(go())
    start_long = log.index(("start", "long"))
    for stream in ("stream-0", "stream-1"):
        assert log.index(("chunk", stream, 3)) < start_long  # both streams had 4 chunks first
    assert log.index(("chunk", "stream-0", 6)) < log.index(("start", "interactive-0"))
    assert not failed(request_checks(run.results, specs))
    assert all(r.ttft_s is not None for r in run.results)


# -- fingerprints and output ---------------------------------------------------------------------------------
def test_model_fingerprint_changes_with_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    first = model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 100)
    assert model_fingerprint(tmp_path)["sha256"] != first["sha256"]


def test_arms_parse_with_their_flags():
    arm = parse_arm("B", "ours --prefill-cost-model bucketed")
    assert (arm.kind, arm.extra_args, arm.salted, arm.has_status) == ("ours", ("--prefill-cost-model", "bucketed"),
                                                                      True, True)
    assert not parse_arm("A", "peer").salted
    with pytest.raises(ValueError):
        parse_arm("A", "vllm")


def test_summary_rejects_and_renders(tmp_path):
    from benchmarks.harness.checks import Check

    slots = [SlotRecord(0, pos, arm, arm, f"r0p{pos // 2}", {"ms_per_output_token": 10.0 + pos % 2},
                        outputs={"x": "h" if arm == "A" else "h"}) for pos, arm in enumerate("ABBA")]
    slots[1].checks.append(Check("zero_cached_tokens", False, "cached"))
    report = summary(slots, verdicts(slots), {"arms": [{"arm": "A", "label": "peer"}, {"arm": "B", "label": "ours"}],
                                              "rounds": 1, "residency": "sequential"})
    assert not report["valid"] and "zero_cached_tokens" in report["rejections"][0]
    assert output_agreement(slots) == {"identical": 2, "compared": 2}
    text = markdown(report)
    assert "REJECTED" in text and "`ms_per_output_token`" in text


# -- the whole harness: ours against mlx_lm.server on the tiny model (what CI runs) ---------------------------
@pytest.mark.slow
def test_smoke_runs_the_whole_harness_against_real_servers(tiny_qwen3, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving_regression", "--smoke", "--trace", "--model", str(tiny_qwen3),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "result.json").read_text())
    assert report["valid"] and report["rejections"] == []
    assert [s["label"] for s in report["slots"]] == ["peer", "ours", "ours", "peer"]
    assert {v["metric"] for v in report["verdicts"]} >= {
        "ttft_long_ms", "stream_gap_p95_ms", "stream_gap_max_ms", "ms_per_output_token", "peak_rss_mb"}
    assert all(v["verdict"] in ("better", "worse", "same", "inconclusive") for v in report["verdicts"])
    ours = [s for s in report["slots"] if s["label"] == "ours"]
    overlap = [c for s in ours for c in s["checks"] if c["name"] == "prefill_overlapped_decode"]
    assert overlap and all(c["passed"] and "not applicable" not in c["detail"] for c in overlap)
    assert report["outputs"]["compared"] > 0
    assert report["code"]["commit"] and report["model"]["sha256"]
    assert report["timeline"]["report_exit"] == 0
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "| metric |" in (out / "result.md").read_text()


def test_a_saved_run_can_be_regated_without_servers(tmp_path, capsys):
    from benchmarks.serving_regression import main as harness_main

    slots = [SlotRecord(r, pos, arm, arm, f"r{r}p{pos // 2}", {"ms_per_output_token": 10.0 if arm == "A" else 8.0})
             for r in range(2) for pos, arm in enumerate("ABBA")]
    meta = {"arms": [{"arm": "A", "label": "peer"}, {"arm": "B", "label": "ours"}], "rounds": 2,
            "residency": "sequential"}
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(summary(slots, [], meta), default=str))  # saved before any verdicts
    assert harness_main(["--render", str(saved)]) == 0
    (regated,) = json.loads(saved.read_text())["verdicts"]
    assert (regated["verdict"], regated["rounds_lower"], regated["rounds"]) == ("better", 2, 2)
    assert "2/2 rounds" in (tmp_path / "result.md").read_text()
