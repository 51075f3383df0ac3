"""Continuous-batching scheduler: which requests compute how many tokens in the next step."""

from engine.scheduler.output import ScheduledRequest, SchedulerOutput
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
