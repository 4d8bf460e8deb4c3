"""Prefill order: priority class, then requests overtaken K times (oldest first), then shortest remaining.

A request is *overtaken* in a step when it got no prefill rows although it could have (it was eligible),
while a later-arriving request of the same class did. Past `max_overtakes` it goes to the front of its class,
so no request starves behind a stream of shorter ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from scheduler.request import Request


def prefill_order_key(request: Request, max_overtakes: int) -> tuple[int, int, int, int]:
    forced = request.times_overtaken >= max_overtakes
    return (
        int(request.priority),
        0 if forced else 1,
        0 if forced else request.num_remaining,
        request.arrival_seq,
    )


def order_prefill_candidates(candidates: Iterable[Request], max_overtakes: int) -> list[Request]:
    return sorted(candidates, key=lambda request: prefill_order_key(request, max_overtakes))


def count_overtakes(eligible: Iterable[Request], served_ids: Collection[str]) -> list[Request]:
    """Bump `times_overtaken` of each eligible, unserved request that a later same-class arrival passed."""
    eligible = list(eligible)
    latest_served: dict[int, int] = {}
    for request in eligible:
        if request.request_id in served_ids:
            klass = int(request.priority)
            latest_served[klass] = max(latest_served.get(klass, -1), request.arrival_seq)
    overtaken = []
    for request in eligible:
        if request.request_id in served_ids:
            continue
        if latest_served.get(int(request.priority), -1) > request.arrival_seq:
            request.times_overtaken += 1
            overtaken.append(request)
    return overtaken
