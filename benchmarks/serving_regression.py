"""Serving A/B harness: ABBA rounds between two server arms over HTTP, with a verdict per latency metric.

    python -m benchmarks.serving_regression --model DIR --a peer --b ours --rounds 3
    python -m benchmarks.serving_regression --smoke          # tiny dummy model on CPU, one round, < 5 min

Arms are `ours` (python -m mlx_serve serve) or `peer` (python -m mlx_lm server), optionally followed by server
flags: `--b "ours --prefill-cost-model bucketed"`. A is the baseline, B the candidate.

Residency `sequential` (default): only one server is resident at a time; every slot of every ABBA round starts
a fresh server of its arm, gives it the same warm-up, measures, and stops it (peak RSS comes from the exit).
`concurrent`: both servers stay up for the whole run (warmed once each; peak memory is then not a per-slot metric).

Honesty rules: prompts are built to exact token counts and the servers' counts are checked; every measured
request gets a unique first token (and a unique `cache_salt` on our server) and must report zero cached tokens,
except the prefix-reuse workload, which must report reuse; our server's `/v1/status` must prove that the long
prefill ran while other requests decoded (the peer has no status endpoint, so this applies to our arm only).
A failed check rejects the run (exit 3). Verdicts use the gate max(2%, 2x measured noise); noise above 5% is
inconclusive. Writes result.json and result.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from benchmarks.harness import fingerprints
from benchmarks.harness.drive import Target
from benchmarks.harness.prompts import PromptBuilder, load_encoder, vocabulary_words
from benchmarks.harness.results import SlotRecord, markdown, slots_from_json, summary, verdicts
from benchmarks.harness.servers import ArmSpec, ServerProcess, parse_arm
from benchmarks.harness.slots import Plan, run_slot, write_json
from benchmarks.harness.workload import ContendedWorkload, PrefixReuseWorkload

REPO = Path(__file__).resolve().parent.parent
ABBA = ("A", "B", "B", "A")
# Streams of 128 tokens still decode long after the long request arrives, even when a busy CI box slows the client.
SMOKE = dict(streams=2, stream_prompt=64, stream_tokens=128, long_prompt=1024, long_tokens=4, long_after=4,
             interactive=2, interactive_prompt=32, interactive_tokens=6, interactive_every=4, prefix_tokens=256,
             followups=2, followup_tokens=4, rounds=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_regression", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", help="model directory (both arms load it; the harness reads its tokenizer); "
                   "default: the built-in tiny dummy model")
    p.add_argument("--a", default="peer", help="baseline arm: 'ours' or 'peer' [flags] (default: %(default)s)")
    p.add_argument("--b", default="ours", help="candidate arm (default: %(default)s)")
    p.add_argument("--a-label"), p.add_argument("--b-label")
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (default: %(default)s)")
    p.add_argument("--residency", choices=["sequential", "concurrent"], default="sequential")
    p.add_argument("--workloads", default="contended,prefix_reuse", help="comma list: contended, prefix_reuse")
    w = p.add_argument_group("contended workload")
    w.add_argument("--streams", type=int, default=4)
    w.add_argument("--stream-prompt", type=int, default=256)
    w.add_argument("--stream-tokens", type=int, default=128)
    w.add_argument("--long-prompt", type=int, default=2048, help="long prefill tokens, e.g. 2048, 8192, 32768")
    w.add_argument("--long-tokens", type=int, default=16)
    w.add_argument("--long-after", type=int, default=8, help="the long request arrives when every stream has "
                   "received this many chunks")
    w.add_argument("--interactive", type=int, default=3)
    w.add_argument("--interactive-prompt", type=int, default=64)
    w.add_argument("--interactive-tokens", type=int, default=16)
    w.add_argument("--interactive-every", type=int, default=8)
    r = p.add_argument_group("prefix-reuse workload")
    r.add_argument("--prefix-tokens", type=int, default=1024)
    r.add_argument("--followups", type=int, default=3)
    r.add_argument("--followup-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/out/serving-<utc time>)")
    p.add_argument("--trace", action="store_true", help="capture our server's trace in each slot and draw the "
                   "timeline of the first one (out/timeline.png)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to become healthy")
    p.add_argument("--smoke", action="store_true", help="tiny dummy model, small workload, one round (CI)")
    p.add_argument("--render", type=Path, metavar="RESULT_JSON",
                   help="recompute verdicts and the markdown of a saved run (no servers are started)")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(Path(args.model).expanduser().resolve()) if Path(args.model).expanduser().exists() else args.model
    from mlx_serve.checkpoints import default_model_path

    return str(default_model_path())


def eos_bias(model_dir: Path) -> dict[int, float]:
    """Strongly discourage end-of-sequence in both arms, so every output runs to max_tokens."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return dict.fromkeys(sorted(ids), -100.0)


def build_plan(args: argparse.Namespace, model_dir: Path) -> Plan:
    names = {name.strip() for name in args.workloads.split(",") if name.strip()}
    unknown = names - {"contended", "prefix_reuse"}
    if unknown:
        raise SystemExit(f"error: unknown workloads {sorted(unknown)}")
    extra = vocabulary_words(model_dir) if args.residency == "concurrent" else []
    builder = PromptBuilder(load_encoder(model_dir), seed=0, extra_words=extra)
    contended = ContendedWorkload(
        args.streams, args.stream_prompt, args.stream_tokens, args.long_prompt, args.long_tokens, args.long_after,
        args.interactive, args.interactive_prompt, args.interactive_tokens, args.interactive_every,
    ) if "contended" in names else None
    prefix = PrefixReuseWorkload(args.prefix_tokens, 32, args.followups, args.followup_tokens) \
        if "prefix_reuse" in names else None
    return Plan(builder, contended, prefix)


def target_for(server: ServerProcess, model: str, bias: dict) -> Target:
    return Target(server.base_url, model, server.arm.salted, server.arm.has_status, bias)


def run_rounds(args, arms: dict[str, ArmSpec], model: str, plan: Plan, out: Path) -> list[SlotRecord]:
    bias = eos_bias(Path(model)) if Path(model).exists() else {}
    per_slot = plan.requests_per_slot()
    resident: dict[str, ServerProcess] = {}
    if args.residency == "concurrent":
        for key, arm in arms.items():
            resident[key] = server_for(arm, model, out, f"resident-{key}", args)
            resident[key].start(args.ready_timeout)
            run_slot_warm_only(resident[key], model, bias, plan)
    slots = []
    try:
        for round_index in range(args.rounds):
            for position, key in enumerate(ABBA):
                slot = SlotRecord(round_index, position, key, arms[key].label, f"r{round_index}p{position // 2}")
                print(f"round {round_index} slot {position}: {key} ({arms[key].label})", file=sys.stderr, flush=True)
                if args.residency == "concurrent":
                    offset = 2 + (2 * round_index + position // 2) * per_slot
                    run_slot(target_for(resident[key], model, bias), plan, slot, offset, warm=False)
                else:
                    server = server_for(arms[key], model, out, f"r{round_index}-s{position}-{key}", args)
                    server.start(args.ready_timeout)
                    try:
                        run_slot(target_for(server, model, bias), plan, slot, 0, warm=True)
                    finally:
                        server.stop()
                    slot.metrics["peak_rss_mb"] = server.peak_rss_mb
                    slot.trace = server.env.get("MLX_SERVE_TRACE")
                slots.append(slot)
    finally:
        for server in resident.values():
            server.stop()
    return slots


def run_slot_warm_only(server: ServerProcess, model: str, bias: dict, plan: Plan) -> None:
    import asyncio

    from benchmarks.harness.slots import warm_up

    asyncio.run(warm_up(target_for(server, model, bias), plan, 0))


def server_for(arm: ArmSpec, model: str, out: Path, name: str, args) -> ServerProcess:
    env = {}
    if args.trace and arm.kind == "ours":
        env["MLX_SERVE_TRACE"] = str(out / "traces" / f"{name}.jsonl")
    return ServerProcess(arm, model, out / "logs" / f"{name}.log", env)


def draw_first_timeline(slots: list[SlotRecord], out: Path) -> dict | None:
    traced = next((s for s in slots if s.trace and Path(s.trace).exists()), None)
    if traced is None:
        return None
    from tracing.report import main as report_main

    code = report_main([traced.trace, "--png", str(out / "timeline.png"), "--json", str(out / "trace-report.json")])
    return {"trace": traced.trace, "report_exit": code, "png": str(out / "timeline.png") if code == 0 else None}


def render_saved(path: Path) -> int:
    saved = json.loads(path.read_text())
    slots = slots_from_json(saved.pop("slots"))
    meta = {k: v for k, v in saved.items() if k not in ("valid", "rejections", "verdicts", "outputs", "timeline")}
    report = summary(slots, verdicts(slots), meta) | {"timeline": saved.get("timeline")}
    write_json(path, report)
    table = markdown(report)
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0 if report["valid"] else 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render_saved(args.render)
    started = time.time()
    model = resolve_model(args)
    out = args.out or REPO / "benchmarks" / "out" / f"serving-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    out.mkdir(parents=True, exist_ok=True)
    if out.parent == REPO / "benchmarks" / "out":
        (out.parent / ".gitignore").write_text("*\n")  # run outputs are not source; RESULTS.md quotes what matters
    arms = {"A": parse_arm(args.a_label or args.a, args.a), "B": parse_arm(args.b_label or args.b, args.b)}
    plan = build_plan(args, Path(model))
    slots = run_rounds(args, arms, model, plan, out)
    meta = {
        "command": " ".join(["python -m benchmarks.serving_regression", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.time() - started, 1),
        "machine": fingerprints.machine(),
        "model": fingerprints.model_fingerprint(model) if Path(model).exists() else {"id": model},
        "code": fingerprints.code_fingerprint(REPO),
        "arms": [{"arm": k, "label": a.label, "kind": a.kind, "flags": list(a.extra_args)} for k, a in arms.items()],
        "rounds": args.rounds, "residency": args.residency,
        "workloads": {"contended": plan.contended and vars_of(plan.contended),
                      "prefix_reuse": plan.prefix and vars_of(plan.prefix)},
    }
    report = summary(slots, verdicts(slots), meta)
    report["timeline"] = draw_first_timeline(slots, out) if args.trace else None
    write_json(out / "result.json", report)
    table = markdown(report)
    (out / "result.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / 'result.json'} and {out / 'result.md'}", file=sys.stderr)
    return 0 if report["valid"] else 3


def vars_of(spec: object) -> dict:
    return {name: getattr(spec, name) for name in spec.__slots__}


if __name__ == "__main__":
    sys.exit(main())
