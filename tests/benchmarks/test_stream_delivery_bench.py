"""`benchmarks/stream_delivery.py` on a few streams: every token is read, and the engine's event handling is split
into the step's `application` phase and the `delivery` of the step's events to the reading loop."""

from __future__ import annotations

import json

from benchmarks.stream_delivery import main


def test_every_token_is_read_and_the_delivery_is_timed_apart(capsys):
    assert main(["--streams", "2,4", "--max-tokens", "12", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["streams"] for row in rows] == [2, 4]
    for row in rows:
        assert row["tokens"] == 12 * row["streams"] and row["steps"] > 0
        assert row["application_ms_p50"] > 0 and row["delivery_ms_per_step"] > 0  # the loop got its events in batches
