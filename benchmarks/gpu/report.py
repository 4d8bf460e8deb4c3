"""Targets of issue 7 checked against one run's numbers, as a markdown table."""

from __future__ import annotations

BANDWIDTH = 4.3e12  # bytes/s: the device-to-device copy rate measured on this H200 (KINDS.md)
MET = {True: "yes", False: "**no**", None: ""}
LEVERS = (  # the same engine with one lever off, measured in the same run
    ("decode_reference_attention", "pure-MLX reference attention", "kernel / reference (info)"),
    ("decode_compile_off", "compile off", "compiled / eager (info)"),
    ("decode_unfused", "fused forward off", "fused / unfused (info)"),
    ("decode_gathered_experts", "dense experts off", "dense / gathered (info)"),
    ("decode_quantized_matmul", "dequantized rows off", "dequantized / quantized (info)"),
    ("decode_unsplit", "split over K off", "split / whole (info)"),
    ("decode_split_all", "fused projections split too", "standalone / all split (info)"),
)


def step_bytes(r: dict, streams: int) -> float:
    """Weight bytes a decode step of `streams` rows must read: all dense weights, and of the experts the
    expected share that at least one row chooses (uniform routing: 1 - (1 - k/E)^rows)."""
    experts, k = r.get("experts", 0), r.get("experts_per_token", 0)
    if not experts or not k:
        return r["weight_bytes"]
    chosen = 1.0 - (1.0 - k / experts) ** streams
    return r["weight_bytes"] - r["expert_bytes"] * (1.0 - chosen)


def _ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours and peer else None


def rows_for_shape(r: dict) -> list[dict]:
    """One row per figure: (metric, mlx-lm, ours, ratio, target, met)."""
    peer, ours, rows = r["peer"], r["ours"], []

    def add(
        metric: str, p: float | None, o: float | None, ratio: float | None, target: str, met: bool | None
    ):
        rows.append({"metric": metric, "mlx_lm": p, "ours": o, "ratio": ratio, "target": target, "met": met})

    for n in r["stream_counts"]:
        p, o = peer["decode"][str(n)]["tok_s"], ours["decode"][str(n)]["tok_s"]
        limit = n * BANDWIDTH / step_bytes(r, n)
        frac = f" ({o / limit:.0%} of weight-bandwidth limit)" if o else ""
        ratio = _ratio(o, p)
        if n == 1:
            g = peer["generate_step"]["tok_s"]
            add(
                f"decode tok/s, 1 stream vs generate_step{frac}",
                g,
                o,
                _ratio(o, g),
                ">= 1.0x",
                _ok(_ratio(o, g), 1.0),
            )
        else:
            add(f"decode tok/s, {n} streams{frac}", p, o, ratio, ">= 1.5x", _ok(ratio, 1.5))
    rounds_p, rounds_o = peer.get("decode_rounds", {}), ours.get("decode_rounds", {})
    if any(len(v) > 1 for v in rounds_o.values()):
        spread = "; ".join(
            f"{n}: " + " / ".join(_fmt(_ratio(o.get("tok_s"), q.get("tok_s"))) for q, o in zip(rounds_p[n], rounds_o[n]))
            for n in rounds_o
        )
        add("decode ratio of each round, by streams (noise check)", None, spread, None, "(info)", None)
    for key, label, meaning in LEVERS:
        for n, off in ours.get(key, {}).items():
            on = ours["decode"][n]["tok_s"]
            add(f"decode tok/s, {n} streams, {label} (lever off)", None, off["tok_s"], _ratio(on, off["tok_s"]), meaning, None)
    for length in r["prefill_lengths"]:
        p, o = peer["prefill"][str(length)]["tok_s"], ours["prefill"][str(length)]["tok_s"]
        add(f"prefill tok/s, {length} tokens", p, o, _ratio(o, p), ">= 0.95x", _ok(_ratio(o, p), 0.95))
    pc, oc = peer["contended"], ours["contended"]
    add(
        "contended: max gap / median gap (window)",
        pc["gap_ratio"],
        oc["gap_ratio"],
        None,
        "<= 3",
        _ok_le(oc["gap_ratio"], 3),
    )
    add(
        "contended: max gap / calm median",
        pc.get("gap_ratio_vs_calm"),
        oc.get("gap_ratio_vs_calm"),
        None,
        "(info)",
        None,
    )
    add("contended: gap p50 / max", _ms(pc), _ms(oc), None, "(info)", None)
    add("contended: max gap before / from the long prompt's arrival", _phases(pc), _phases(oc), None, "(info)", None)
    long = str(r["contended_long"])
    p_solo, o_solo = peer["prefill"][long]["ttft_s"], ours["prefill"][long]["ttft_s"]
    p_x, o_x = pc["long_ttft_s"] / p_solo, oc["long_ttft_s"] / o_solo
    add(f"contended: {long}-token TTFT / its solo TTFT", p_x, o_x, None, "<= 1.5", _ok_le(o_x, 1.5))
    for metric, cell in _step_cells(oc.get("steps")):
        add(metric, None, cell, None, "(info)", None)
    sp = ours["shared_prefix"]
    add("shared prefix: warm TTFT / cold TTFT", None, sp["ratio"], None, "<= 0.10", _ok_le(sp["ratio"], 0.10))
    return rows


def _step_cells(st: dict | None) -> list[tuple[str, str]]:
    """What our scheduler did in the contended phase, as (metric, cell) rows of information."""
    if not st:
        return []
    cells = [(
        "contended: our steps with prefill (count, rows p50, ms p50 / predicted p50); decode-only (count, ms p50)",
        f"{st['mixed_steps']}, {_fmt(st['mixed_rows_p50'])}, {_fmt(st['mixed_ms_p50'])} / "
        f"{_fmt(st['mixed_predicted_ms_p50'])}; {st['decode_only_steps']}, {_fmt(st['decode_only_ms_p50'])}",
    )]  # fmt: skip
    host = st.get("mixed_host_ms_p50") or {}
    if host:
        phases = ", ".join(f"{name} {_fmt(ms)}" for name, ms in host.items())
        cells.append(("contended: host ms of a step with prefill (p50)", phases))
    return cells


def _phases(c: dict) -> str:
    before, after = c.get("gap_max_before_ms"), c.get("gap_max_from_arrival_ms")
    return f"{before:.0f} / {after:.0f} ms" if before is not None and after is not None else "-"


def _ms(c: dict) -> str:
    return f"{c['gap_p50_ms']:.1f} / {c['gap_max_ms']:.0f} ms" if c.get("gap_p50_ms") else "-"


def _ok(value: float | None, floor: float) -> bool | None:
    return None if value is None else value >= floor


def _ok_le(value: float | None, ceiling: float) -> bool | None:
    return None if value is None else value <= ceiling


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def markdown(results: list[dict], header: str) -> str:
    lines = [header, ""]
    for r in results:
        lines += [
            f"### {r['shape']} ({r['weight_bytes'] / 1e9:.1f} GB of weights, step target {r['step_target_ms']:.0f} ms)",
            "",
            "| figure | mlx-lm | ours | ours / mlx-lm | target | met |",
            "|---|---|---|---|---|---|",
        ]
        if "error" in r or "wall_s" not in r:
            lines += [f"| not finished | {r.get('error', 'cut short')} | | | | |", ""]
            continue
        if r.get("decode_only"):
            for n in r["stream_counts"]:
                p, o = r["peer"]["decode"][str(n)]["tok_s"], r["ours"]["decode"][str(n)]["tok_s"]
                ratio, floor = _ratio(o, p), 1.0 if n == 1 else 1.5  # one stream is against generate_step
                figure = "1 stream vs generate_step" if n == 1 else f"{n} streams"
                rounds = " / ".join(
                    _fmt(_ratio(b.get("tok_s"), a.get("tok_s")))
                    for a, b in zip(r["peer"].get("decode_rounds", {}).get(str(n), []),
                                    r["ours"].get("decode_rounds", {}).get(str(n), []))
                )  # fmt: skip
                lines.append(f"| decode tok/s, {figure} (rounds: {rounds}) | {_fmt(p)} | {_fmt(o)} | "
                             f"{f'{ratio:.2f}x' if ratio else ''} | >= {floor}x | {MET[_ok(ratio, floor)]} |")  # fmt: skip
                for key, label, _ in LEVERS:
                    if str(n) in r["ours"].get(key, {}):
                        off = r["ours"][key][str(n)]["tok_s"]
                        lines.append(f"| decode tok/s, {n} streams, {label} (lever off) | | {_fmt(off)} | | (info) | |")
            lines.append("")
            continue
        if r.get("contended_only"):
            c, solo = r["ours"]["contended"], r["ours"]["prefill"][str(r["contended_long"])]["ttft_s"]
            ttft, prefix = c["long_ttft_s"] / solo, r["ours"]["shared_prefix"]["ratio"]
            for metric, value, target, ceiling in (
                ("contended: max gap / median gap (window)", c["gap_ratio"], "<= 3", 3),
                (f"contended: {r['contended_long']}-token TTFT / its solo TTFT", ttft, "<= 1.5", 1.5),
                ("shared prefix: warm TTFT / cold TTFT", prefix, "<= 0.10", 0.1),
            ):
                lines.append(f"| {metric} | | {value:.2f} | | {target} | {MET[_ok_le(value, ceiling)]} |")
            arrival = "contended: max gap before / from the long prompt's arrival"
            lines.append(f"| {arrival} | | {_phases(c)} | | (info) | |")
            lines += [f"| {metric} | | {cell} | | (info) | |" for metric, cell in _step_cells(c.get("steps"))]
            lines.append("")
            continue
        for row in rows_for_shape(r):
            met = MET[row["met"]]
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] else ""
            lines.append(
                f"| {row['metric']} | {_fmt(row['mlx_lm'])} | {_fmt(row['ours'])} | {ratio} | {row['target']} | {met} |"
            )
        lines += ["", *profile(r), ""]
    return "\n".join(lines)


def profile(r: dict) -> list[str]:
    """Decode step time of both, and where our step's time goes (engine phases, median ms per step)."""
    phases = ("planning", "preparation", "submission", "consumption", "application")
    lines = [
        "| streams | mlx-lm step ms | ours step ms | " + " | ".join(phases) + " |",
        "|---|---|---|" + "---|" * len(phases),
    ]
    for n in r["stream_counts"]:
        p, o = r["peer"]["decode"][str(n)], r["ours"]["decode"][str(n)]
        host = o.get("host_ms", {})
        cells = " | ".join(_fmt(host.get(name)) for name in phases)
        lines.append(f"| {n} | {_fmt(p['step_ms'])} | {_fmt(o['step_ms'])} | {cells} |")
    return lines
