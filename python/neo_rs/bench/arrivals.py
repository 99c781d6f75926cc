"""Arrival times (seconds from the start) of a request stream: Poisson at a rate, gamma with a
burstiness factor (1 = Poisson, below 1 burstier), or all at once (rate ``inf``)."""

from __future__ import annotations

import math
import random


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    # Gamma inter-arrivals with shape k = burstiness and mean 1 / rate.
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, scale)
        out.append(t)
    return out
