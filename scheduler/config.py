"""The scheduler's configuration: one frozen, slotted dataclass (every field is a CLI flag upstream)."""

from __future__ import annotations

import os
from dataclasses import dataclass

COST_MODEL_ENV = "MLX_SERVE_PREFILL_COST_MODEL"
COST_MODELS = ("ema", "bucketed", "affine")
CHECKED_FILL = ("off", "untraced", "on")  # `SchedulerConfig.checked_fill`


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int  # KV pool size in blocks
    block_size: int = 16
    max_running: int = 64  # requests holding KV at once
    queue_limit: int = 1024  # waiting requests; past it add() raises QueueFull
    max_model_len: int = 32768  # a request finishes LENGTH when its tokens reach this
    row_ceiling: int = 2048
    row_floor: int = 64
    # a contended step the cost model cannot price yet takes at most this many prefill rows (at least `row_floor`
    # and the fewest a step trains on, `cost_models.MIN_TRAINING_ROWS`, so the model learns its way out of the cap):
    # a fresh engine's first steps are each a shape's first run, which trains nothing, and at the ceiling they ran
    # 68-132 ms beside 25-30 ms decode steps (H100, sixty-third run, four a run). 0 (default until measured): ceiling
    untrained_rows: int = 0
    # a contended step's rows (decode lanes + prefill) grow to fill their last tile of this many rows, past the
    # prediction: where GEMMs run in row tiles (MLX's CUDA quantized GEMM: 64) the rows that fill a paid-for tile are
    # the cheapest a step can add (8B 4-bit: 8 lanes + 120 rows 32 ms, 8 + 64 rows 25 ms, 8 + 56 rows 23 ms). 1: off
    row_quantum: int = 1
    # the engine pads each prefill lane's rows to a `buckets.query_bucket` and its KV to a `buckets.history_bucket`
    # of this many tokens (CUDA: MLX builds a graph per shape); 0: exact shapes. Nonzero: budgets grow to the
    # query bucket their chunk is padded to (those rows are paid for) and the affine cost model counts padded work
    kv_bucket: int = 0
    # with `kv_bucket`: whether a chunk's attention also runs over its padded history (a gathered copy, cuDNN or
    # matmuls under a mask) or reads exactly the KV each row sees (the paged chunk kernel); the affine model counts
    # the attention work either way
    pads_history: bool = True
    # the row-tile fill (`row_quantum`) that carries a budget past its own query bucket: "off" keeps it; "on" only
    # where the grown step is predicted within what it may take; "untraced" also where it does not lose the budget's
    # compiled trace (`budget.fill_paid_rows`). "on" since the H200's thirtieth run: with the floor slack at 1.75, 8B
    # 4-bit ran 512-row chunks every time (16k TTFT 1.31-1.38x solo), where the unchecked fill flipped between 384 and
    # 768 rows (1.22-1.61x, gap ratio up to 5.5)
    checked_fill: str = "on"
    # a halved budget grows by half again (1,024 -> 1,536, 256 -> 384) where that is still predicted within the
    # target: halving alone leaves up to half of the target unused. False: the seed's plain halving
    budget_midpoints: bool = True
    # a contended budget whose shape has not run in the form it would run, and would overrun the target by what such
    # first runs measured over their prices (`first_runs.py`), gives way to the largest smaller budget whose shape has
    # run and fits (H100, 0.6B at an 11 ms target: first eager runs up to 7.2 ms over held the longest gap; 43rd run)
    price_first_runs: bool = False
    # a contended step whose shape has no trace but would replay a larger one in its place (a stand-in, which costs
    # the same whatever rows it carries) grows to that trace's rows (`budget.fill_stand_in`; H100, 0.6B: a 16k prompt
    # read in 64-128-row chunks that stood in for 384-512-row traces, TTFT 3.85x solo; fifty-first run)
    fill_stand_ins: bool = True
    # a contended budget whose step would replay a larger trace in its place is priced at that trace's last run, not
    # at its own shape's (`TracedShapes.stand_in_run_ms`; H100, 30B-A3B: 1,024-row steps priced eager at 58-66 ms
    # against a 67 ms limit stood in for a 68-72 ms trace and held every missed gap; fifty-seventh run). Fifty-eighth
    # run, six pairs beside 8 streams: gap 2.51-2.80 on (6 of 6 met), 2.74-3.45 off (5 of 6), TTFT 1.31-1.45 / 1.34-1.47
    price_stand_in_runs: bool = True
    # contended budgets are planned to this fraction of the step target, so a step's ordinary spread stays under it
    # (H100, 30B-A3B planned to exactly 3 decode steps: 768-row steps ran 77-94 ms against 67-77 predicted; gap met
    # in 0 of 6 runs at 1.0, 3 of 3 at 0.9, forty-eighth run). Steps planned to the floor slack keep their allowance
    plan_headroom: float = 0.9
    # a contended step may take this multiple of the floor step's predicted time where that is more than the target
    # (a step whose fixed cost fills the target: H200 8B 4-bit, ~21 ms at 128 rows against a 20.4 ms target; TTFT
    # 2.98x solo at 1.25, 1.65x at 1.5), decode debt counting from it too (`budget.slack_allowance_ms`). 1: off
    floor_slack: float = 1.5
    # the floor slack only where a step of this many prefill rows (in its cheaper form: compiled where the engine
    # compiles prefill) is predicted over the target: where the target admits such a step, the fixed cost does not
    # fill it and halving buys rows (`budget.slack_allowance_ms`), and the slack allows at most that step's price.
    # 0: off (the slack wherever its floor step allows, as far as it allows)
    slack_guard_rows: int = 512
    # a contended chunk grows, one query bucket at a time and to at most `budget.RATE_GROWTH_CAP` x what the step
    # may take, until its predicted cost a row is within this multiple of a ceiling-sized uncontended chunk's at the
    # same history: a long prompt's prefill then runs at least 1/x of its solo speed (`budget.grow_for_rate`). 0: off
    max_prefill_slowdown: float = 0.0
    # 500 ms is the seed's Apple-GPU value; a fast GPU (H200) wants tens of ms. With a factor > 0 the target is
    # that many measured decode-only steps (at least step_target_floor_ms), this value only until one is measured
    step_target_ms: float = 500.0
    step_target_factor: float = 0.0
    step_target_floor_ms: float = 11.0  # mlx_serve's AUTO_STEP_FLOOR_MS (RESULTS: forty-fourth run)
    cost_model: str = "ema"  # "ema" | "bucketed" | "affine" (env MLX_SERVE_PREFILL_COST_MODEL overrides)
    # the affine model prices a step of more than this many times the rows of its largest recent step at least at
    # that step's cost per row (`affine_cost.TrustRegion`: a fit extrapolated 2x ran 1.5x over); 0: off
    cost_trust_factor: float = 1.5
    # the affine model corrects a price by what it recently missed by on steps of the same rows bucket, this weight
    # a sample (`affine_cost.ResidualCorrection`; H100, 8B 4-bit: 16k TTFT 1.36-1.39x on, 1.45-1.49x off); 0: off
    cost_residual_weight: float = 0.3
    max_overtakes: int = 4
    decode_debt: bool = True
    # a stream is in decode debt only past this multiple of what a contended step may take: a debt step cannot
    # shorten the gap already suffered, so an overrun within the cost model's ordinary error costs the prompt a step
    debt_tolerance: float = 1.25
    enable_prefix_cache: bool = True
    # a waiting request waits for a running prefill that is computing at least this many of its next prompt tokens
    # (the same tokens and salt), then takes them from the prefix cache (prefill.py's rules); 0: off
    shared_prefill_tokens: int = 256
    # tokens of recently finished requests' block-hash chains kept so that a prompt repeating one (a chat's next turn)
    # takes its hashes by comparing tokens instead of hashing every block again (`chain_memo.py`); 0: off
    recent_chain_tokens: int = 1 << 18
    ane_lane: bool = False  # whether prefill chunks may be placed on Path.ANE
    # speculative decoding's drafts (`speculation.NgramIndex`) match a request's last `speculative_ngram` tokens, down
    # to 2 (or 1 where this is 1), against its earlier tokens; how many a step drafts is each request's `speculate`
    speculative_ngram: int = 3
    # sliding-window layers' KV in a block space of their own, `window_blocks` blocks (0: none, every layer's KV in the
    # one space): a request holds there only the blocks within `window_tokens` (the widest window) of its next row,
    # its older ones freed (or kept as cached prefix blocks) as it goes on (see core.py, "window space")
    window_tokens: int = 0
    window_blocks: int = 0
    # the model has recurrent layers (a state per request, not paged): a prefix hit must end where a snapshot of the
    # state is kept, `state_snapshots` of them at most (0: none, so no hits); see state_snapshots.py
    recurrent_state: bool = False
    state_snapshots: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not 1 <= self.row_floor <= self.row_ceiling:
            raise ValueError(f"need 1 <= row_floor <= row_ceiling, got {self.row_floor}, {self.row_ceiling}")
        if self.row_quantum < 1:
            raise ValueError(f"row_quantum must be >= 1, got {self.row_quantum}")
        if self.kv_bucket < 0:
            raise ValueError(f"kv_bucket must be >= 0, got {self.kv_bucket}")
        if self.shared_prefill_tokens < 0:
            raise ValueError(f"shared_prefill_tokens must be >= 0, got {self.shared_prefill_tokens}")
        if self.recent_chain_tokens < 0:
            raise ValueError(f"recent_chain_tokens must be >= 0, got {self.recent_chain_tokens}")
        if self.max_running < 1 or self.queue_limit < 0 or self.max_overtakes < 0:
            raise ValueError("max_running must be >= 1; queue_limit and max_overtakes >= 0")
        if not self.step_target_ms > 0:
            raise ValueError(f"step_target_ms must be > 0, got {self.step_target_ms}")
        if not (self.step_target_factor >= 0 and self.step_target_floor_ms >= 0):
            raise ValueError("step_target_factor and step_target_floor_ms must be >= 0")
        if self.checked_fill not in CHECKED_FILL:
            raise ValueError(f"checked_fill must be one of {CHECKED_FILL}, got {self.checked_fill!r}")
        if not self.floor_slack >= 1:
            raise ValueError(f"floor_slack must be >= 1, got {self.floor_slack}")
        if self.untrained_rows < 0:
            raise ValueError(f"untrained_rows must be >= 0, got {self.untrained_rows}")
        if self.slack_guard_rows < 0:
            raise ValueError(f"slack_guard_rows must be >= 0, got {self.slack_guard_rows}")
        if not (self.max_prefill_slowdown == 0 or self.max_prefill_slowdown >= 1):
            raise ValueError(f"max_prefill_slowdown must be 0 (off) or >= 1, got {self.max_prefill_slowdown}")
        if not self.debt_tolerance >= 1:
            raise ValueError(f"debt_tolerance must be >= 1, got {self.debt_tolerance}")
        if not 0 < self.plan_headroom <= 1:
            raise ValueError(f"plan_headroom must be in (0, 1], got {self.plan_headroom}")
        if not (self.cost_trust_factor == 0 or self.cost_trust_factor >= 1):
            raise ValueError(f"cost_trust_factor must be 0 (off) or >= 1, got {self.cost_trust_factor}")
        if not 0 <= self.cost_residual_weight <= 1:
            raise ValueError(f"cost_residual_weight must be in [0, 1], got {self.cost_residual_weight}")
        if self.speculative_ngram < 1:
            raise ValueError(f"speculative_ngram must be >= 1, got {self.speculative_ngram}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {self.cost_model!r}")
        if self.state_snapshots < 0 or (self.state_snapshots and not self.recurrent_state):
            raise ValueError("state_snapshots must be >= 0, and 0 for a model without recurrent state")
        if self.window_blocks < 0 or self.window_tokens < 0 or (self.window_blocks > 0) != (self.window_tokens > 0):
            raise ValueError("window_blocks and window_tokens are both 0 (no window space) or both > 0")
        if self.window_blocks and self.window_blocks < self.window_span_blocks:
            raise ValueError(
                f"a window space of {self.window_blocks} blocks cannot hold one request's window of "
                f"{self.window_tokens} tokens: it needs at least {self.window_span_blocks} blocks of {self.block_size}"
            )

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def window_span_blocks(self) -> int:
        """Blocks the window space gives one row: those holding its window (itself and the `window_tokens` - 1
        positions before it) at most."""
        return -(-(self.window_tokens - 1) // self.block_size) + 1 if self.window_tokens else 0

    def resolved_cost_model(self, environ: dict[str, str] | None = None) -> str:
        """The cost model to use: the environment variable, when set, overrides the field."""
        env = os.environ if environ is None else environ
        name = env.get(COST_MODEL_ENV, "").strip().lower() or self.cost_model
        if name not in COST_MODELS:
            raise ValueError(f"{COST_MODEL_ENV} must be one of {COST_MODELS}, got {name!r}")
        return name
