"""A small simulated engine that emits realistic trace event sequences, for testing the tools without MLX.

It plays one contended workload: streams decoding, a long prefill arriving mid-stream, short interactive requests,
then an idle gap and a lone request. Step times follow an affine cost (fixed + rows + attention pairs + lanes)
with seeded noise, so the prediction analysis has something real to learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tracing import events as ev


@dataclass
class SimRequest:
    request_id: str
    prompt: int
    max_tokens: int
    arrival: float
    computed: int = 0
    output: int = 0
    admitted: bool = False


@dataclass
class SimConfig:
    streams: int = 4
    stream_prompt: int = 96
    stream_tokens: int = 40
    long_prompt: int = 2048
    interactive: int = 3
    idle_gap_s: float = 0.5
    ceiling: int = 512
    floor: int = 64
    target_ms: float = 30.0
    seed: int = 0
    ane_every: int = 0  # place every n-th prefill chunk on the ANE path (0: never)


@dataclass
class Simulator:
    config: SimConfig
    events: list = field(default_factory=list)
    t: float = 0.0
    step_id: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.pending: list[SimRequest] = []
        self.active: list[SimRequest] = []
        self.prefill_chunks = 0

    def cost_ms(self, prefill: list[tuple[int, int]], decode_lanes: int) -> float:
        rows = sum(r for r, _ in prefill)
        pairs = sum(r * (h + r / 2) for r, h in prefill)
        return 1.5 + 0.02 * rows + 2e-5 * pairs + 0.25 * decode_lanes

    def arrive(self, request: SimRequest) -> None:
        self.events.append(ev.RequestArrived(self.t, request.request_id, request.prompt, request.max_tokens, 1))
        self.active.append(request)

    def plan_budget(self, decode_lanes: int, waiting: list[SimRequest]) -> tuple[int, int]:
        budget, halvings = self.config.ceiling, 0
        if decode_lanes and waiting:
            while budget > self.config.floor and self.cost_ms([(budget, waiting[0].computed)], decode_lanes) > (
                self.config.target_ms
            ):
                budget //= 2
                halvings += 1
        return budget, halvings

    def step(self) -> None:
        cfg = self.config
        decoding = [r for r in self.active if r.computed >= r.prompt]
        waiting = sorted((r for r in self.active if r.computed < r.prompt), key=lambda r: r.prompt - r.computed)
        budget, halvings = self.plan_budget(len(decoding), waiting)
        lanes, prefill, left = [], [], budget
        for req in waiting:
            if left <= 0:
                break
            rows = min(left, req.prompt - req.computed)
            self.prefill_chunks += 1
            path = "ane" if cfg.ane_every and self.prefill_chunks % cfg.ane_every == 0 else "gpu"
            lanes.append(ev.LaneInfo(req.request_id, "prefill", rows, req.computed, path))
            prefill.append((rows, req.computed, req, path))
            left -= rows
        lanes += [ev.LaneInfo(r.request_id, "decode", 1, r.prompt + r.output, "gpu") for r in decoding]
        self.step_id += 1
        sid, start = self.step_id, self.t
        self.admit([p[2] for p in prefill if not p[2].admitted])
        predicted = self.cost_ms([(r, h) for r, h, _, _ in prefill], len(decoding)) if prefill else None
        self.events.append(
            ev.StepPlanned(start, sid, tuple(lanes), budget, f"halved:{halvings}" if halvings else "contended"
                           if decoding else "uncontended", predicted, bool(decoding), halvings)
        )
        measured = self.cost_ms([(r, h) for r, h, _, _ in prefill], len(decoding)) * self.rng.lognormvariate(0, 0.08)
        self.emit_spans(sid, start, measured, [p for p in prefill if p[3] == "ane"])
        self.t = start + measured / 1000
        rows = sum(p[0] for p in prefill)
        weighted = sum(r * h for r, h, _, _ in prefill) / rows if rows else 0.0
        paths = {p[3] for p in prefill} or {"gpu"}
        self.events.append(
            ev.StepExecuted(self.t, sid, measured, rows + len(decoding), rows, len(decoding), len(prefill), weighted,
                            paths.pop() if len(paths) == 1 else "mixed", predicted)
        )
        for rows_done, _, req, _ in prefill:
            req.computed += rows_done
            if req.computed >= req.prompt:
                self.commit(req)
        for req in decoding:
            self.commit(req)
        self.t += 0.0002  # host overhead between steps

    def admit(self, requests: list[SimRequest]) -> None:
        for req in requests:
            req.admitted = True
            self.events.append(ev.RequestAdmitted(self.t, req.request_id, 0, 0))

    def emit_spans(self, sid: int, start: float, measured_ms: float, ane_lanes: list) -> None:
        phases = [("admission", 0.02), ("planning", 0.03), ("preparation", 0.1), ("submission", 0.05),
                  ("consumption", 0.7), ("application", 0.1)]
        t = start
        for name, share in phases:
            end = t + share * measured_ms / 1000
            self.events.append(ev.Span(name, t, end, sid))
            t = end
        for rows, _, req, _ in ane_lanes:
            self.events.append(ev.Span("ane_prefill", start, start + 0.6 * measured_ms / 1000, sid,
                                       {"request_id": req.request_id, "rows": rows,
                                        "timing": "host notification/report interval"}))

    def commit(self, req: SimRequest) -> None:
        self.events.append(ev.TokenCommitted(self.t, req.request_id, req.output))
        req.output += 1
        if req.output >= req.max_tokens:
            self.active.remove(req)
            self.events.append(ev.RequestFinished(self.t, req.request_id, "length", req.prompt, req.output, 0))

    def run_until_idle(self, triggers: list) -> None:
        while self.active or triggers:
            for trigger in [t for t in triggers if t[0](self)]:
                triggers.remove(trigger)
                self.arrive(trigger[1])
            if self.active:
                self.step()
            else:
                self.t += 0.001


def simulate(config: SimConfig | None = None) -> list:
    """Events of one contended workload followed by an idle gap and a lone short request."""
    cfg = config or SimConfig()
    sim = Simulator(cfg)
    for i in range(cfg.streams):
        sim.arrive(SimRequest(f"stream-{i}", cfg.stream_prompt, cfg.stream_tokens, sim.t))
    streams_progressed = lambda need: lambda s: all(  # noqa: E731
        r.output >= need for r in s.active if r.request_id.startswith("stream")
    )
    triggers = [(streams_progressed(5), SimRequest("long", cfg.long_prompt, 8, 0.0))]
    triggers += [
        (streams_progressed(8 + 4 * i), SimRequest(f"interactive-{i}", 24, 4, 0.0)) for i in range(cfg.interactive)
    ]
    sim.run_until_idle(triggers)
    sim.t += cfg.idle_gap_s
    sim.run_until_idle([(lambda s: True, SimRequest("late", 32, 6, 0.0))])
    return sim.events


def prefill_steps(count: int = 300, seed: int = 0, ane_share: float = 0.0) -> list:
    """Plan/execute pairs of contended prefill steps whose time grows with history (attention pairs), so a model
    that separates history bands should beat one global ms-per-row figure."""
    rng = random.Random(seed)
    events, t = [], 0.0
    for sid in range(1, count + 1):
        width = rng.choice((1, 1, 2, 3))
        path = "ane" if rng.random() < ane_share else "gpu"
        lanes = tuple(
            ev.LaneInfo(f"r{sid}-{i}", "prefill", rng.choice((64, 128, 256, 512)),
                        rng.choice((0, 512, 2048, 8192, 20000)), path)
            for i in range(width)
        )
        chunks = [(lane.rows, lane.history) for lane in lanes]
        measured = Simulator(SimConfig()).cost_ms(chunks, 4) * (1.6 if path == "ane" else 1.0)
        measured *= rng.lognormvariate(0, 0.05)
        rows = sum(r for r, _ in chunks)
        events.append(ev.StepPlanned(t, sid, lanes, 2048, "contended", None, True, 0))
        t += measured / 1000
        events.append(ev.StepExecuted(t, sid, measured, rows + 4, rows, 4, width,
                                      sum(r * h for r, h in chunks) / rows, path))
    return events
