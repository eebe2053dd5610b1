"""TEMPORARY: the scheduler API's names until runtime/scheduler.py lands (then deleted)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    eos_token_id: list[int] | None = None


class QueueFull(Exception):
    pass


class SchedulerClosed(Exception):
    pass
