"""The scheduler: pure Python (never imports mlx). See core.py and ../shared/design/SCHEDULER.md."""

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.errors import QueueFull, RequestTooLarge
from scheduler.kv_blocks import BlockManager
from scheduler.plan import Lane, LaneKind, Path, StepOutcome, StepPlan
from scheduler.request import FinishReason, Priority, Request, RequestState
from scheduler.stats import SchedulerStats

__all__ = [
    "BlockManager",
    "FinishReason",
    "Lane",
    "LaneKind",
    "Path",
    "Priority",
    "QueueFull",
    "Request",
    "RequestState",
    "RequestTooLarge",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepOutcome",
    "StepPlan",
]
