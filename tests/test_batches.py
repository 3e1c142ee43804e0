"""Every source's batches, byte for byte, as recorded in ``tests/golden/batches.json`` from
the input pipeline before batches were built as contiguous arrays: the way a batch is built
(arrays, shared-memory workers, the KeyedJaggedTensor's construction) may change, its content
may not. At 1 and 2 ranks, every split, inline and with worker processes."""

import json

import pytest

from batch_sources import GOLDEN, SOURCES, digests

with open(GOLDEN) as f:
    RECORDED = json.load(f)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_sources_batches_are_the_recorded_ones(name):
    assert digests(name) == RECORDED[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_worker_processes_build_the_recorded_batches(name):
    assert digests(name, workers=2) == RECORDED[name]
