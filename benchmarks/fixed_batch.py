"""``python -m hybridrec.train`` with the input taken out: every training step gets the same
pre-built batch (the source's first, on the device when the run draws its batches there), so
a run's samples/s is what training alone can do.
The input benchmark (input_scaling.py) compares real input against it. 1 rank only.

    python benchmarks/fixed_batch.py +experiment=ctr [overrides]
"""

import itertools

from hybridrec.data import loader

_batches = loader.batches


def _fixed(source, split, rank, world_size, num_batches=None, start=0, **kw):
    if split != "train":
        return _batches(source, split, rank, world_size, num_batches, start, **kw)
    # drawn where the run draws its batches: on the GPU with data.device_input, so that the
    # fixed step has no host-device copy either
    first = next(_batches(source, split, rank, world_size, 1, 0, device_rows=kw.get("device_rows")))
    return itertools.repeat(first, None if num_batches is None else num_batches - start)


loader.batches = _fixed

if __name__ == "__main__":
    import runpy

    # as `python -m hybridrec.train`: Hydra finds the config package from the module
    runpy.run_module("hybridrec.train", run_name="__main__", alter_sys=True)
