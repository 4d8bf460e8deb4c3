"""Verdicts across ABBA slots, output comparison between arms, and the JSON/markdown the harness writes."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from benchmarks.harness.checks import Check
from benchmarks.harness.stats import METRICS, Verdict, verdict


@dataclass
class SlotRecord:
    round: int
    position: int  # 0..3 within the ABBA round
    arm: str  # "A" | "B"
    label: str
    pair_key: str
    metrics: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)  # request name -> output hash
    trace: str | None = None

    @property
    def rejected(self) -> list[Check]:
        return [c for c in self.checks if c.rejects and not c.passed]


def slots_from_json(records: list[dict]) -> list[SlotRecord]:
    slots = []
    for record in records:
        checks = [Check(**c) for c in record.get("checks", [])]
        slots.append(SlotRecord(**{**record, "checks": checks}))
    return slots


def arm_pairs(slots: list[SlotRecord], arm: str, metric: str) -> list[tuple[float, float]]:
    """Each round's two measurements of one arm (ABBA: A at 0 and 3, B at 1 and 2)."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for slot in sorted(slots, key=lambda s: (s.round, s.position)):
        if slot.arm == arm and metric in slot.metrics:
            by_round[slot.round].append(slot.metrics[metric])
    return [(values[0], values[1]) for values in by_round.values() if len(values) == 2]


def verdicts(slots: list[SlotRecord]) -> list[Verdict]:
    found = []
    for metric in METRICS:
        a_pairs, b_pairs = arm_pairs(slots, "A", metric), arm_pairs(slots, "B", metric)
        if a_pairs and b_pairs and not any(math.isnan(v) for p in a_pairs + b_pairs for v in p):
            found.append(verdict(metric, a_pairs, b_pairs))
    return found


def output_agreement(slots: list[SlotRecord]) -> dict:
    """Both arms of a pair ran identical prompts greedily: how many outputs match token for token (as text)."""
    by_pair: dict[str, dict[str, dict[str, str]]] = defaultdict(dict)
    for slot in slots:
        by_pair[slot.pair_key][slot.arm] = slot.outputs
    same = total = 0
    for arms in by_pair.values():
        if "A" in arms and "B" in arms:
            for name, digest in arms["A"].items():
                total += 1
                same += arms["B"].get(name) == digest
    return {"identical": same, "compared": total}


def fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(found: list[Verdict], labels: dict[str, str]) -> str:
    lines = [f"| metric | A: {labels['A']} | B: {labels['B']} | B vs A | B lower in | noise | gate | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for v in found:
        lines.append(f"| {METRICS[v.metric]} (`{v.metric}`) | {fmt(v.baseline)} | {fmt(v.candidate)} | "
                     f"{fmt(100 * v.delta, 1)}% | {v.rounds_lower}/{v.rounds} rounds | {fmt(100 * v.noise, 1)}% | "
                     f"{fmt(100 * v.gate, 1)}% | {v.verdict} |")
    return "\n".join(lines)


def summary(slots: list[SlotRecord], found: list[Verdict], meta: dict) -> dict:
    rejections = [f"round {s.round} slot {s.position} ({s.label}): {c.name}: {c.detail}"
                  for s in slots for c in s.rejected]
    return {
        **meta,
        "valid": not rejections,
        "rejections": rejections,
        "verdicts": [asdict(v) for v in found],
        "outputs": output_agreement(slots),
        "slots": [asdict(s) for s in slots],
    }


def markdown(report: dict) -> str:
    labels = {arm["arm"]: arm["label"] for arm in report["arms"]}
    from benchmarks.harness.stats import Verdict as V

    found = [V(**v) for v in report["verdicts"]]
    status = "VALID" if report["valid"] else "REJECTED: " + "; ".join(report["rejections"][:5])
    outputs = report["outputs"]
    return "\n".join([
        f"Run: {status}",
        f"Rounds: {report['rounds']} ABBA, residency {report['residency']}; outputs identical between arms: "
        f"{outputs['identical']}/{outputs['compared']}",
        "",
        markdown_table(found, labels),
        "",
        "Lower is better for every metric. Gate = max(2%, 2x noise); noise (mean spread of an arm's two runs per "
        "round) above 5% is inconclusive. 'B lower in' counts rounds where B's mean was below A's, for direction "
        "only: it does not override the gate.",
    ])
