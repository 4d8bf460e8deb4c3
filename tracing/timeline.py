"""A PNG timeline of one capture: steps (rows, prefill vs decode) above, request streams below.

A stall is easier to see as a gap in a picture than as a number in a table.
"""

from __future__ import annotations

from pathlib import Path

from tracing import events as ev
from tracing.analysis import RequestTimeline


def draw_timeline(events: list[object], timelines: dict[str, RequestTimeline], path: str | Path,
                  title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e for e in events if isinstance(e, ev.StepExecuted)]
    lines = sorted((line for line in timelines.values() if line.arrival is not None), key=lambda x: x.arrival)
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(12, 3 + 0.28 * max(len(lines), 4)),
        gridspec_kw={"height_ratios": [1, max(1.0, len(lines) / 8)]},
    )
    draw_steps(top, steps)
    draw_streams(bottom, lines)
    bottom.set_xlabel("time since capture start (s)")
    fig.suptitle(title or "engine steps and request streams")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_steps(axis, steps: list[ev.StepExecuted]) -> None:
    starts = [s.t - s.measured_ms / 1000 for s in steps]
    widths = [s.measured_ms / 1000 for s in steps]
    decode = [s.rows - s.prefill_rows for s in steps]
    prefill = [s.prefill_rows for s in steps]
    axis.bar(starts, decode, width=widths, align="edge", color="tab:blue", label="decode rows")
    axis.bar(starts, prefill, width=widths, bottom=decode, align="edge", color="tab:orange", label="prefill rows")
    ane = [s for s in steps if s.path in ("ane", "mixed")]
    if ane:
        axis.scatter([s.t for s in ane], [s.rows for s in ane], marker="v", color="tab:green", s=12,
                     label="ANE lane (host notification/report)")
    axis.set_ylabel("rows per step")
    axis.legend(loc="upper right", fontsize="small")


def draw_streams(axis, lines: list[RequestTimeline]) -> None:
    for row, line in enumerate(lines):
        end = line.finish if line.finish is not None else (line.token_times[-1] if line.token_times else line.arrival)
        first = line.token_times[0] if line.token_times else end
        axis.plot([line.arrival, first], [row, row], color="lightgray", linewidth=3)  # waiting + prefill
        axis.plot([first, end], [row, row], color="tab:blue", linewidth=1)
        axis.scatter(line.token_times, [row] * len(line.token_times), marker="|", color="tab:blue", s=30)
        gaps = line.gaps_s
        if gaps:
            worst = max(range(len(gaps)), key=gaps.__getitem__)
            axis.plot(line.token_times[worst:worst + 2], [row, row], color="tab:red", linewidth=3)
    axis.set_yticks(range(len(lines)))
    axis.set_yticklabels([line.request_id[:24] for line in lines], fontsize="small")
    axis.invert_yaxis()
    axis.set_ylabel("requests")
    axis.set_title("gray: waiting or prefilling; ticks: committed tokens; red: longest gap", fontsize="small")
