"""The synthetic log drawn by torch (``data.device_input``) is the NumPy generator's, byte for
byte: the rows, and the batches the loader makes of them for one rank and for each of two.
On the CPU here; the gpu tier draws the same rows on a GPU (tests/test_gpu.py)."""

import pytest
import torch

from conftest import compose_cfg
from hybridrec.config import DenseDistribution
from hybridrec.data import DataError, loader
from hybridrec.data.synthetic import _SCATTER, SyntheticClickLog
from hybridrec.data.synthetic_device import DeviceGenerator, GraphedDraw
from hybridrec.run.validation import check_device, validate

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _log(distribution: DenseDistribution, sizes: list[int], zipf: float, batch: int = 512) -> SyntheticClickLog:
    tables = [1000, 2**31 - 1, 77][: len(sizes) or 3]
    return SyntheticClickLog(batch, 5, tables, 1, sizes, zipf, 2, 7, distribution)


def _same(a, b) -> None:
    for name in ("dense", "values", "lengths", "labels"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {x.numel()} differ"


@pytest.mark.parametrize("distribution", list(DenseDistribution))
@pytest.mark.parametrize("sizes", [[], [1, 3, 2]], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("zipf", [1.0, 1.2])
def test_torch_draws_the_numpy_rows(distribution, sizes, zipf):
    log = _log(distribution, sizes, zipf)
    draw = log.device_rows(CPU)
    for split, index, lo, hi in (("train", 0, 0, 512), ("train", 5, 256, 512), ("eval", 1, 100, 300)):
        _same(log.rows(split, index, lo, hi), draw(split, index, lo, hi))


def test_extreme_uniforms_draw_the_same_rows():
    """A large batch reaches the tails of the Zipf law and of Box-Muller's normals (uniforms
    near 0 and 1, where the tables' interpolation and the square root's rounding matter most)."""
    log = _log(DenseDistribution.normal, [], 1.05, batch=1 << 15)
    _same(log.rows("train", 3, 0, 1 << 15), log.device_rows(CPU)("train", 3, 0, 1 << 15))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sizes", [[], [2, 1, 3]], ids=["one-hot", "multi-hot"])
def test_the_loader_gives_the_same_batches_on_the_device_path(world, sizes):
    log = _log(DenseDistribution.lognormal, sizes, 1.05)
    for rank in range(world):
        host = loader.batches(log, "train", rank, world, num_batches=3, start=1)
        device = loader.batches(log, "train", rank, world, num_batches=3, start=1, device_rows=log.device_rows(CPU))
        pairs = list(zip(host, device, strict=True))
        assert len(pairs) == 2
        for a, b in pairs:
            for name in ("dense_features", "labels"):
                assert torch.equal(getattr(a, name), getattr(b, name))
            x, y = a.sparse_features, b.sparse_features
            assert x.keys() == y.keys() and x.length_per_key() == y.length_per_key()
            assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())


def test_rows_drawn_on_the_device_are_drawn_by_the_training_thread():
    log = _log(DenseDistribution.normal, [], 1.05)
    with pytest.raises(ValueError, match="no workers, no input thread"):
        loader.batches(log, "train", 0, 1, thread=True, device_rows=log.device_rows(CPU))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["+experiment=movielens_rank", "data.device_input=true"],
            "data.device_input=true: MovieLensRank reads its rows on the CPU .*leave data.device_input unset",
        ),
        (
            ["+experiment=ctr", "data.device_input=true", "data.num_workers=2"],
            "data.device_input=true draws the batches on the device, not in workers: set data.num_workers=0",
        ),
        (
            ["+experiment=sequences", "data.device_graph=true"],
            "data.device_graph=true: .* has no draw to capture in a CUDA graph",
        ),
        (
            ["+experiment=ctr", "data.device_graph=true", "data.device_input=false"],
            "data.device_graph=true replays the batches' draw on the GPU: leave data.device_input unset",
        ),
        (
            ["+experiment=ctr", "data.device_graph=true", "data.input_thread=true"],
            "data.device_graph=true replays .* data.input_thread unset",
        ),
    ],
)
def test_device_input_a_source_cannot_honour_is_refused_before_launch(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(overrides), 1)


def test_a_cuda_graph_of_the_draw_is_refused_on_cpu_ranks():
    with pytest.raises(ValueError, match=r"data.device_graph=true captures .* it needs a GPU"):
        check_device(compose_cfg(["+experiment=ctr", "data.device_graph=true"]), "cpu")


def test_the_draw_takes_its_batch_and_first_row_as_device_tensors():
    """What a CUDA graph of the draw replays: the key and the first row as tensors the replay
    reads (here on the CPU, eagerly), the rows the same as NumPy's."""
    log = _log(DenseDistribution.normal, [1, 3, 2], 1.05)
    gen = DeviceGenerator(log, CPU, _SCATTER)
    key, lo = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    for split, index, first in (("train", 2, 0), ("train", 7, 128)):
        key.fill_(int(log._key(split, index)))
        lo.fill_(first)
        dense, ids, labels = gen.draw(key, lo, 256)
        want = log.rows(split, index, first, first + 256)
        assert torch.equal(dense, want.dense) and torch.equal(labels, want.labels)
        assert torch.equal(gen.rows(split, index, first, first + 256).values, want.values)


class _Replayed:
    """A stand-in for torch.cuda's graph API on the CPU: capturing runs the draw once into the
    graph's outputs, a replay runs it again into the same tensors (as a CUDA graph rewrites
    its outputs), so that GraphedDraw's inputs, copies out and graphs per size are tested here."""

    def __init__(self) -> None:
        self.fn = None  # (draw, key, first row, n, outputs), set once captured

    def replay(self) -> None:
        draw, key, lo, n, out = self.fn
        for mine, new in zip(out, draw(key, lo, n)):
            mine.copy_(new)


def _fake_cuda(monkeypatch, fail: str = ""):
    import contextlib

    class Stream:
        def __init__(self, *_):
            pass

        def wait_stream(self, _):
            pass

    graphs = []

    @contextlib.contextmanager
    def graph(g, capture_error_mode):
        assert capture_error_mode == "thread_local"
        if fail:
            raise RuntimeError(fail)
        graphs.append(g)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Replayed)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return graphs


def test_the_graphed_draw_feeds_each_replay_its_batch_and_copies_it_out(monkeypatch):
    """GraphedDraw: one capture per batch size; per batch the key and first row written into
    the graph's inputs, a replay, and outputs copied out (a later replay rewrites the graph's
    outputs, never a batch already handed out); the rows are NumPy's."""
    graphs = _fake_cuda(monkeypatch)
    log = _log(DenseDistribution.normal, [], 1.05)
    gen = DeviceGenerator(log, CPU, _SCATTER, graph=True)
    assert isinstance(gen._draw, GraphedDraw)
    real_capture = GraphedDraw._capture

    def capture(self, n):  # the fake graph replays the eager draw of its inputs
        g, key_in, lo_in, out = real_capture(self, n)
        g.fn = (self.draw, key_in, lo_in, n, out)
        return g, key_in, lo_in, out

    monkeypatch.setattr(GraphedDraw, "_capture", capture)
    batches = [("train", 0, 0, 512), ("train", 4, 0, 512), ("eval", 2, 0, 512), ("train", 1, 256, 512)]
    drawn = [gen.rows(*b) for b in batches]
    assert len(graphs) == 2  # 512 rows and 256 rows
    for b, rows in zip(batches, drawn):  # each batch intact after the replays that followed it
        _same(log.rows(*b), rows)


def test_a_draw_that_cannot_be_captured_stops_the_run_in_one_line(monkeypatch):
    _fake_cuda(monkeypatch, fail="operation not permitted when stream is capturing\nmore detail")
    log = _log(DenseDistribution.normal, [], 1.05)
    draw = log.device_rows(CPU, graph=True)
    with pytest.raises(DataError) as e:
        draw("train", 0, 0, 512)
    assert str(e.value) == (
        "data.device_graph=true: the synthetic log's draw of 512 rows could not be captured in a CUDA graph "
        "on cpu (operation not permitted when stream is capturing); leave data.device_graph unset (the eager draw)"
    )
