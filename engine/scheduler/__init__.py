"""Continuous-batching scheduler: which sequences compute how many tokens in the next step."""

from engine.scheduler.output import ScheduledSequence, SchedulerOutput
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
