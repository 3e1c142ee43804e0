"""What several test modules share: a benchmark script imported by name, Criteo and MovieLens files written on the fly, the tiny
training run and the comparison of two trainings. A plain module, so that no test module
imports another (each stays runnable alone, and its tests are collected once)."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import re
import sys
import tempfile

import blake3
import numpy as np
import torch

from hybridrec.checkpoint import STATE_JSON
from hybridrec.data.criteo import CriteoTSV
from hybridrec.data.movielens import MovieLens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def benchmark_script(name: str):
    """benchmarks/<name>.py as the module ``name``: the name the scripts import it by (their
    own directory comes first on their import path; it is not on the tests')."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


# ---------------------------------------------------------------------------- Criteo TSV rows
SIZES = [1000] * 26


def row(label=1, ints=None, cats=None):
    ints = [1] * 13 if ints is None else ints
    cats = ["0000000a"] * 26 if cats is None else cats
    return "\t".join([str(label)] + [str(i) for i in ints] + cats)


def rand_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cats = [f"{v:08x}" for v in rng.integers(0, 2**32, 26)]
        cats[3] = ""  # missing
        out.append(row(int(rng.integers(0, 2)), list(rng.integers(-2, 50, 13)), cats))
    return out


def write(path, rows, gz=False):
    text = "\n".join(rows) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
    return str(path)


def reader(path, batch=4, split="eval", **kw):
    """A CriteoTSV whose ``split`` files are ``path``; the other split gets a file of its own
    (splits may not share a file)."""
    other = write(os.path.join(tempfile.mkdtemp(), "other.tsv"), [row()] * batch)
    args = dict(
        batch_size=batch,
        train_path=other,
        eval_path=other,
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="skip",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
    )
    args[f"{split}_path"] = str(path)
    args.update(kw)
    return CriteoTSV(**args)


# ------------------------------------------------------------------------- MovieLens layout
GENRE_NAMES = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
]


def tables(n_ratings=300, seed=0):
    rng = np.random.default_rng(seed)
    users = [
        {
            "user_id": u,
            "age": int(rng.integers(10, 70)),
            "gender": "MF"[u % 2],
            "occupation": ["writer", "engineer", "student"][u % 3],
            "zip_code": f"{rng.integers(10000, 99999)}",
        }
        for u in range(1, 21)
    ]
    items = []
    for i in range(1, 31):
        genres = {g: int(rng.random() < 0.2) for g in GENRE_NAMES}
        items.append(
            {
                "movie_id": i,
                "movie_title": f"Film {i} (199{i % 10})",
                "release_date": f"01-Jan-199{i % 10}",
                "video_release_date": None,
                "IMDb_URL": "http://x",
                **genres,
            }
        )
    data = [
        {
            "user_id": int(rng.integers(1, 21)),
            "movie_id": int(rng.integers(1, 31)),
            "rating": int(rng.integers(1, 6)),
            "timestamp": 880000000 + k,
        }
        for k in range(n_ratings)
    ]
    return {"data": data, "users": users, "items": items}


def ml_sequences(path, **kw):
    """MovieLensSequences over ``path`` (a u.data there): 4 users a batch, histories of 5, a
    full softmax, bad rows failing; ``kw`` overrides any of them."""
    from hybridrec.data.sequences import MovieLensSequences

    args = dict(
        batch_size=4,
        path=str(path),
        max_length=5,
        train_negatives=0,
        negative_sampling="uniform",
        bad_rows="fail",
        eval_batches=None,
        seed=0,
    )
    return MovieLensSequences(**{**args, **kw})


def ml(path, **kw):
    args = dict(
        batch_size=20,
        path=str(path),
        label_threshold=4,
        split="random",
        eval_fraction=0.2,
        side_features=True,
        bad_rows="skip",
        eval_batches=None,
        seed=0,
    )
    args.update(kw)
    return MovieLens(**args)


# ------------------------------------------------------------------------ the tiny training run
# Small enough to run in seconds, big enough that every plan spreads tables over both ranks.
BASE = [
    "data.batch_size=64",
    "data.num_embeddings_per_feature=[300,200,100,50]",
    "data.ids_per_feature=2",
    "data.eval_batches=2",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
    "train.steps=8",
    "train.log_every=4",
    # The suite is the CPU suite even on a GPU machine; `make test-gpu` sets cuda (2 GPUs or more).
    f"launcher.device={os.environ.get('HYBRIDREC_TEST_DEVICE', 'cpu')}",
]
# fp32 tolerance: 2 ranks reduce partial gradients in a different order than one process.
TOL = dict(rtol=1e-5, atol=1e-6)


def assert_same_training(a, b, state_tol=TOL):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **TOL)
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        torch.testing.assert_close(a["state"][key], b["state"][key], **state_tol, msg=lambda m, key=key: f"{key}: {m}")


# --------------------------------------------------------------------- multi-node launches
# ctr's model on three small tables, each step's loss logged: two nodes of one rank each
# (torchrun --nnodes 2, faked Slurm nodes) must train it with the losses of one 2-rank node.
TWO_NODE_RUN = [
    "+experiment=ctr",
    "data.num_embeddings_per_feature=[500,200,100]",
    "data.batch_size=128",
    "data.eval_batches=1",
    "train.steps=6",
    "train.log_every=1",
    "sharding=table_row_wise",
]


def global_batch(source, split: str, index: int):
    """The ``index``-th global batch of ``split``, whole (what every rank's slices make up)."""
    return source.read(split, 0, index, 0, source.batch_size).batch(source.keys)


# ------------------------------------------------------------------------------ what a run prints
# A line of hybridrec's in the console and in <run dir>/train.log: Hydra's job-logging format
# (hydra/job_logging), for one rank in the Hydra process and for ranks of their own alike.
TRAINER_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[hybridrec\.trainer\]\[INFO\] - (.*)")


def trainer_log(run_dir) -> list[str]:
    """The first line of every message hybridrec.training.trainer wrote into the run's train.log."""
    with open(os.path.join(run_dir, "train.log")) as f:
        return [m.group(1) for line in f if (m := TRAINER_LINE.fullmatch(line.rstrip("\n")))]


def assert_readable(console: str, run_dir, steps: int, log_every: int) -> None:
    """A run's console output (no terminal) and train.log, as a person reads them: short lines
    (no progress bar redrawn with carriage returns), none of TorchRec's planner INFO lines,
    and train.log holding the progress, the evaluations and the summary."""
    long = [line[:80] for line in console.splitlines() if len(line) > 300]
    assert not long and "\r" not in console, long
    assert "GreedyPerfPartitioner" not in console and "torchrec.distributed.planner" not in console
    logged = trainer_log(run_dir)
    progress = [m for m in logged if m.startswith("step ")]
    assert [m.split()[1] for m in progress] == [f"{s}/{steps}" for s in range(log_every, steps + 1, log_every)]
    assert all(re.fullmatch(r"step \d+/\d+  loss \d\.\d{4}  [\d,]+ samples/s  ETA \d\d:\d\d", m) for m in progress)
    assert any(m.startswith(f"eval @ step {steps}: AUC ") for m in logged), logged
    assert "summary" in logged and any(m.startswith(f"{steps} steps, ") for m in logged), logged


def rehash(step_dir) -> None:
    """Fix a checkpoint's checksums up after an edit, as an attacker who knows the format would
    (so what is tested is the check that follows the checksums, not the checksums)."""
    fields = json.load(open(os.path.join(step_dir, STATE_JSON)))
    fields.pop("state_blake3", None)
    for name in fields.get("files", {}):
        with open(os.path.join(step_dir, name), "rb") as f:
            fields["files"][name] = blake3.blake3(f.read()).hexdigest()
    fields["state_blake3"] = blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    with open(os.path.join(step_dir, STATE_JSON), "w") as f:
        json.dump(fields, f)


def ctr_raw_rows(source):
    """The synthetic click log's test split as raw rows, the columns a serving team's log has:
    ``dense_<j>`` (float) and, per feature, a list of its ids."""
    import pyarrow as pa

    parts = [source.read("eval", 0, k, 0, source.batch_size) for k in range(source.num_batches("eval"))]
    columns = {
        f"dense_{j}": np.concatenate([p.dense[:, j].numpy() for p in parts]) for j in range(source.num_dense_features)
    }
    for i, f in enumerate(source.features):
        per_row = []
        for p in parts:
            values, lengths, _ = p.feature(i)
            per_row += np.split(values.numpy(), np.cumsum(lengths.numpy())[:-1])
        columns[f.name] = pa.array([a.tolist() for a in per_row], pa.list_(pa.int64()))
    return pa.table(columns)


def docs_snippet(guide: str, marker: str) -> str:
    """The one ```python block of docs/<guide> that contains ``marker``."""
    text = open(os.path.join(ROOT, "docs", guide)).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"docs/{guide}: {len(blocks)} python blocks contain {marker!r}"
    return blocks[0]


def same_rows(a, b) -> None:
    """Rows ``b`` (a device path's) are rows ``a`` (the CPU reader's): every array, dtype and shape."""
    assert a.features == b.features
    for name in ("dense", "values", "lengths", "labels", "real", "id_weights"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {x.numel()} differ"
    assert a.extra.keys() == b.extra.keys()
    for key, x in a.extra.items():
        y = b.extra[key]
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), key
    assert b.totals == a.feature_totals().tolist()  # the sizes the host knew without reading the device


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
"""The Tensor methods that read a value back on the host (on a GPU, each waits for the device)."""


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Within it, any of ``HOST_READS`` fails the test, naming the method."""

    def refused(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back")

        return read

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, refused(name))
        yield
