"""Shared test helpers."""

import numpy as np


def random_partition(rng: np.random.Generator, num_waves: int) -> tuple[int, ...]:
    """A random composition of ``num_waves`` into positive group sizes."""
    cuts = sorted(rng.choice(np.arange(1, num_waves), size=int(rng.integers(0, num_waves)), replace=False).tolist())
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_waves]))
