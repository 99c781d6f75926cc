"""Fault injection, the seam tests use to reach the engine's error paths: with
``NEO_RS_FAIL_STEPS`` set (e.g. ``5`` or ``5,9-12``), those 1-based calls of the model runner's
``execute`` raise ``InjectedFault`` instead of running, on tensor-parallel rank
``NEO_RS_FAIL_RANK`` (default 0, the engine's own)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from neo_rs.environment import fail_rank, fail_steps
from neo_rs.errors import InvalidArgumentError


class InjectedFault(RuntimeError):
    """Raised in place of a model run that ``NEO_RS_FAIL_STEPS`` names."""


def parse_calls(spec: str) -> frozenset[int]:
    """``"5,9-12"`` -> {5, 9, 10, 11, 12}."""
    calls: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            first, _, last = part.partition("-")
            calls.update(range(int(first), int(last or first) + 1))
    except ValueError as e:
        raise InvalidArgumentError(f"NEO_RS_FAIL_STEPS must look like 5 or 5,9-12, got {spec!r}") from e
    return frozenset(calls)


def failing(fn: Callable[..., Any], calls: frozenset[int]) -> Callable[..., Any]:
    """``fn``, except that its calls numbered in ``calls`` raise ``InjectedFault``."""
    counter = itertools.count(1)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        n = next(counter)
        if n in calls:
            raise InjectedFault(f"injected fault on model run {n} (NEO_RS_FAIL_STEPS)")
        return fn(*args, **kwargs)

    return wrapper


def inject(runner: Any, rank: int) -> None:
    """Make ``runner.execute`` fail as the environment says, if this is the rank it names."""
    if rank == fail_rank() and (calls := parse_calls(fail_steps())):
        runner.execute = failing(runner.execute, calls)
