"""The JSONL capture format: a header line, one line per event (with its `kind`), a footer line.

The footer records the capacity, how many events were dropped and whether the capture ended cleanly; a file
without a footer was cut short. The report tools refuse any capture that overflowed or did not end cleanly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tracing import events as ev

FORMAT = "mlx_serve.trace"
VERSION = 1
HEADER_KIND = "capture_header"
FOOTER_KIND = "capture_footer"

EVENT_TYPES: dict[str, type] = {
    cls.kind: cls
    for cls in (
        ev.RequestArrived,
        ev.RequestAdmitted,
        ev.StepPlanned,
        ev.StepExecuted,
        ev.Span,
        ev.TokenCommitted,
        ev.RequestFinished,
    )
}


class CaptureError(Exception):
    """A capture that cannot be trusted (overflowed, incomplete, malformed)."""


@dataclass(frozen=True, slots=True)
class Capture:
    events: list[object]
    capacity: int
    dropped: int
    complete: bool  # the footer says the capture ended cleanly
    has_footer: bool
    unknown_kinds: tuple[str, ...] = ()

    def refusal(self) -> str | None:
        """Why a report must not be drawn from this capture, or None if it is trustworthy."""
        if not self.has_footer:
            return "incomplete capture: no footer line (the process stopped before the trace was closed)"
        if self.dropped > 0:
            return (
                f"overflowed capture: {self.dropped} events dropped at capacity {self.capacity}; "
                "raise MLX_SERVE_TRACE_CAPACITY or capture a shorter workload"
            )
        if not self.complete:
            return "incomplete capture: the footer says the engine did not shut down cleanly"
        return None


def event_to_dict(event: object) -> dict:
    record = {"kind": type(event).kind}
    record.update(dataclasses.asdict(event))
    return record


def event_from_dict(record: dict) -> object | None:
    cls = EVENT_TYPES.get(record.get("kind", ""))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in record.items() if k in names}
    if cls is ev.StepPlanned:
        values["lanes"] = tuple(ev.LaneInfo(**lane) for lane in values.get("lanes", ()))
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(value)
    return cls(**values)


def dump(sink: object, path: str | Path, complete: bool = True) -> Path:
    """Write a sink's events (a `MemorySink` or anything with events/capacity/dropped) as JSONL."""
    return write_events(sink.events, path, capacity=sink.capacity, dropped=sink.dropped, complete=complete)


def write_events(
    events: Iterable[object], path: str | Path, capacity: int, dropped: int = 0, complete: bool = True
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w") as out:
        header = {"kind": HEADER_KIND, "format": FORMAT, "version": VERSION, "capacity": capacity}
        out.write(json.dumps(header) + "\n")
        for event in events:
            out.write(json.dumps(event_to_dict(event)) + "\n")
            count += 1
        footer = {"kind": FOOTER_KIND, "events": count, "capacity": capacity, "dropped": dropped, "complete": complete}
        out.write(json.dumps(footer) + "\n")
    return path


def load(path: str | Path) -> Capture:
    """Read a capture. Raises CaptureError if it is not a trace at all; trust is decided by `refusal()`."""
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise CaptureError(f"{path}: empty file, not a trace capture")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise CaptureError(f"{path}: first line is not JSON ({exc})") from exc
    if header.get("kind") != HEADER_KIND or header.get("format") != FORMAT:
        raise CaptureError(f"{path}: missing '{HEADER_KIND}' line, not an mlx_serve trace capture")
    events: list[object] = []
    unknown: set[str] = set()
    footer: dict | None = None
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a torn last line: the capture was cut short, and the missing footer says so
        if record.get("kind") == FOOTER_KIND:
            footer = record
            break
        event = event_from_dict(record)
        if event is None:
            unknown.add(str(record.get("kind")))
        else:
            events.append(event)
    return Capture(
        events=events,
        capacity=int(header.get("capacity", 0)),
        dropped=int(footer.get("dropped", 0)) if footer else 0,
        complete=bool(footer.get("complete", False)) if footer else False,
        has_footer=footer is not None,
        unknown_kinds=tuple(sorted(unknown)),
    )
