"""Data sources (one module each). Every source yields torchrec ``Batch`` objects."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature; the model gives each one its own embedding table."""

    name: str
    num_embeddings: int
    pooling_factor: float = 1.0
    """Expected ids per sample: the planner's estimate of lookup and communication cost."""
