"""Sequence rankers: histories split leave-one-out, the next-item loss and metrics against
hand-computed values, padding that changes no output, the exported user encoder, and SASRec
and HSTU trained on 2 gloo ranks (the item table sharded, each block an FSDP2 unit) as on
one process."""

import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.data import DataError, loader
from hybridrec.data.sequences import ParquetSequences
from hybridrec.models.losses import NextItemSoftmax
from hybridrec.reports.metrics import next_item_metrics
from hybridrec.training.build import model_for
from shared import TOL, assert_same_training, ml_sequences


def _ratings(d, rows):
    """u.data of (user, item, rating, time) rows, in the order given."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "u.data"), "w") as f:
        f.writelines(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
    return str(d)


def _source(d, batch_size=2, max_length=3, **kw):
    return ml_sequences(d, batch_size=batch_size, max_length=max_length, **kw)


def _rows(source, split, world=1, rank=0):
    """Per row of the split's first batch: history ids, next ids, times (as lists)."""
    item = next(iter(loader.batches(source, split, rank, world, 1)))
    batch = getattr(item, "batch", item)
    features = batch.sparse_features.to_dict()
    out = []
    for r, (h, n) in enumerate(zip(features["history"].to_dense(), features["next"].to_dense())):
        out.append((h.tolist(), n.tolist(), batch.times[r, : len(h)].tolist()))
    return out, features["negatives"], getattr(item, "real", None)


@pytest.mark.unit
def test_histories_are_in_time_order_and_split_leave_one_out(tmp_path):
    # user 1: items 11..16 at times 1..6, given out of order; items 15 and 14 share time 5
    # (the file's order decides: 15 then 14); user 2: three items; user 3: two (left out)
    rows = [
        (1, 13, 4, 3),
        (1, 11, 4, 1),
        (1, 15, 4, 5),
        (1, 12, 4, 2),
        (1, 14, 4, 5),
        (1, 16, 4, 6),
        (2, 21, 3, 10),
        (2, 22, 3, 20),
        (2, 23, 3, 30),
        (3, 31, 5, 1),
        (3, 32, 5, 2),
    ]
    source = _source(_ratings(tmp_path, rows))
    assert source.users == 2 and source.report()["users_left_out"] == 1
    # user 1 in time order: 11 12 13 15 14 16 (ties keep the file's order)
    test, negatives, real = _rows(source, "eval")
    assert test[0] == ([13, 15, 14], [16], [3, 5, 5]) and test[1] == ([21, 22], [23], [10, 20])
    assert negatives.lengths().tolist() == [source.catalogue - 1, 0]  # every item, in the first row
    assert negatives.values().tolist() == list(range(1, source.catalogue))
    valid, _, _ = _rows(source, "valid")
    assert valid[0] == ([12, 13, 15], [14], [2, 3, 5]) and valid[1] == ([21], [22], [10])
    # training: items before the last two, max_length + 1 most recent: each position's target
    # is the next item; user 2 has one training item, no transition
    train, _, _ = _rows(source, "train")
    by_user = {tuple(r[0]): r for r in train}
    assert (([11, 12, 13], [12, 13, 15], [1, 2, 3]) in train) and ([], [], []) in train, by_user


@pytest.mark.unit
def test_all_windows_make_every_training_item_a_target_once_an_epoch(tmp_path):
    # user 1: 11 items (a training part of 9: 8 transitions), user 2: 3 items (one training
    # item, no transition), user 3: 6 items (4 training items: 3 transitions)
    rows = [(1, 10 + k, 4, k) for k in range(11)] + [(2, 40 + k, 4, k) for k in range(3)]
    rows += [(3, 50 + k, 4, k) for k in range(6)]
    d = _ratings(tmp_path, rows)
    last, every = _source(d, batch_size=1), _source(d, batch_size=1, train_windows="all")
    assert last.num_batches("train") == 3  # one row per user: user 1's 5 oldest transitions never trained
    # windows of max_length + 1 = 4 items from the newest: user 1 [15..18], [12..15], [10..12]
    assert every.num_batches("train") == 3 + 1 + 1
    seen = []
    for index in range(every.num_batches("train")):
        rows_ = every.read("train", 0, index, 0, 1)
        h, n = (rows_.feature(f)[0].tolist() for f in (0, 1))  # history, next
        assert len(h) == len(n) <= 3 and h[1:] == n[:-1]  # a window: each position's next item
        seen += list(zip(h, n))
    transitions = [(10 + k, 11 + k) for k in range(8)] + [(50 + k, 51 + k) for k in range(3)]
    assert sorted(seen) == transitions  # each exactly once
    # the evaluated splits are one row per user either way
    assert _rows(every, "eval")[0] == _rows(last, "eval")[0] and every.num_batches("valid") == 3


@pytest.mark.unit
@pytest.mark.parametrize("max_length", [1, 3, 4])
def test_overlapping_windows_give_every_target_half_a_window_of_context(tmp_path, max_length):
    """data.train_windows=overlap: windows of max_length + 1 every ceil(max_length / 2) items
    from the newest; a window's older targets are context only (next id 0), so each
    transition is trained exactly once an epoch and, past a history's first items, with at
    least max_length / 2 items before it in its row."""
    rows = [(1, 10 + k, 4, k) for k in range(13)] + [(2, 40 + k, 4, k) for k in range(3)]
    rows += [(3, 50 + k, 4, k) for k in range(6)]
    source = _source(_ratings(tmp_path, rows), batch_size=1, max_length=max_length, train_windows="overlap")
    stride = -(-max_length // 2)
    seen, rows_of_user_1 = [], 0
    for index in range(source.num_batches("train")):
        one = source.read("train", 0, index, 0, 1)
        h, n = (one.feature(f)[0].tolist() for f in (0, 1))  # history, next
        assert len(h) == len(n) <= max_length
        rows_of_user_1 += bool(h) and h[0] < 40
        for p, (item, target) in enumerate(zip(h, n)):
            if target:  # trained here: the window's next item, after p + 1 items of context
                assert target == item + 1
                assert p + 1 >= min(max_length - stride + 1, item - (10 if item < 40 else 50) + 1)
                seen.append((item, target))
            else:  # context only: a newer window of the same user trains it
                assert p < len(h) - stride
    transitions = [(10 + k, 11 + k) for k in range(10)] + [(50 + k, 51 + k) for k in range(3)]
    assert sorted(seen) == transitions  # each exactly once
    assert rows_of_user_1 == -(-10 // stride)  # 10 transitions, stride of them per window


@pytest.mark.unit
def test_negatives_are_drawn_per_global_batch_alike_on_every_rank(tmp_path):
    rows = [(u, 1 + (u * 7 + k) % 40, 4, k) for u in range(1, 9) for k in range(6)]
    source = _source(_ratings(tmp_path, rows), batch_size=4, train_negatives=5)
    _, one, _ = _rows(source, "train")
    for rank in (0, 1):
        _, part, _ = _rows(source, "train", world=2, rank=rank)
        assert part.lengths().tolist() == [5, 0] and part.values().tolist() == one.values().tolist()
    # by popularity: the first batch's draws, and those of 50 global batches (40 ids each, as
    # many as the catalogue has items: more are refused)
    popular = _source(tmp_path, batch_size=4, train_negatives=40, negative_sampling="popularity")
    first = _rows(popular, "train")[1].values().numpy()
    drawn = np.bincount(
        np.concatenate([first, *(popular._negatives("train", 0, i) for i in range(1, 50))]), minlength=popular.catalogue
    )
    assert drawn[0] == 0 and np.corrcoef(drawn, popular.popularity)[0, 1] > 0.8


@pytest.mark.unit
def test_next_item_metrics_by_hand():
    m = next_item_metrics(torch.tensor([1.0, 3.0, 11.0, 60.0]))
    assert m["hr@10"] == 0.5 and m["hr@50"] == 0.75 and m["hr@200"] == 1.0
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4)) / 4)
    assert m["ndcg@50"] == pytest.approx((1 + 1 / math.log2(4) + 1 / math.log2(12)) / 4)
    assert m["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 11 + 1 / 60) / 4) and m["n"] == 4


@pytest.mark.unit
def test_the_objective_of_a_next_item_run_is_its_ranking():
    from hybridrec.config import objective

    auto = objective.declared(compose_cfg(["+experiment=sequences"]))
    assert auto.name == "valid.ndcg@10" and auto.direction == "maximize"
    assert objective.declared(compose_cfg(["+experiment=sequences", "train.objective=valid.mrr"])).maximize
    with pytest.raises(
        ValueError, match="train.objective=valid.auc: it must be auto or one of valid.ndcg@10, valid.hr@10, valid.mrr"
    ):
        objective.declared(compose_cfg(["+experiment=sequences", "train.objective=valid.auc"]))


@pytest.mark.unit
def test_the_full_softmax_is_cross_entropy_over_the_catalogue():
    torch.manual_seed(0)
    items, dim = 9, 4
    table = torch.randn(items, dim)
    queries = torch.randn(5, dim)
    positive_ids = torch.tensor([3, 1, 8, 3, 2])
    user = torch.tensor([0, 0, 1, 2, 2])  # 3 users; a 4th row of the batch has no position
    catalogue = torch.arange(1, items)
    loss = NextItemSoftmax()(queries, table[positive_ids], positive_ids, table[catalogue], catalogue, user, 4)
    per_position = F.cross_entropy(queries @ table[1:].T, positive_ids - 1, reduction="none")
    expected = (per_position[:2].mean() + per_position[2] + per_position[3:].mean()) / 4
    torch.testing.assert_close(loss, expected)
    # the catalogue in another order takes the general path (positive apart, its own column
    # masked): the same loss
    shuffled = catalogue[torch.randperm(len(catalogue))]
    general = NextItemSoftmax()(queries, table[positive_ids], positive_ids, table[shuffled], shuffled, user, 4)
    torch.testing.assert_close(general, expected)
    # sampled: a negative equal to the position's positive does not count against it
    negatives = torch.tensor([3, 5])
    sampled = NextItemSoftmax()(
        queries[:1], table[3:4], torch.tensor([3]), table[negatives], negatives, torch.tensor([0]), 1
    )
    logits = torch.stack([queries[0] @ table[3], queries[0] @ table[5]])
    torch.testing.assert_close(sampled, -torch.log_softmax(logits, 0)[0])
    # by position: every position counts alike (one process: no count to all-reduce)
    by_position = NextItemSoftmax(average="position")(
        queries, table[positive_ids], positive_ids, table[catalogue], catalogue, user, 4
    )
    torch.testing.assert_close(by_position, per_position.mean())


def _tiny(model="sasrec", *extra):
    return [
        "+experiment=sequences",
        f"model={model}",
        "data.batch_size=8",
        "data.max_length=6",
        "model.max_length=6",
        "model.embedding_dim=8",
        "model.num_blocks=2",
        "model.num_heads=2",
        "model.dropout=0",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.early_stop_patience=0",
        "optimizer.sparse.lr=0.1",
        "optimizer.dense.lr=0.01",
        *extra,
    ]


def _built(tmp_path, model="sasrec", *extra):
    from hybridrec.data.fetch_movielens import write_layout
    from shared import tables

    write_layout(tables(400, seed=3), str(tmp_path))
    cfg = compose_cfg(_tiny(model, f"data.path={tmp_path}", *extra))
    from hybridrec.data import build_source

    data = build_source(cfg.data, 0)
    torch.manual_seed(0)
    m = model_for(cfg, data)
    m.items.to_empty(device="cpu")
    torch.nn.init.normal_(m.items.embeddings["t_items"].weight, std=0.3)
    return cfg, data, m.eval()


@pytest.mark.unit
def test_a_windows_context_positions_have_no_target(tmp_path):
    """data.train_windows=overlap: the training loss is the softmax of the positions whose
    next id is an item, the context's (id 0) left out, not scored against row 0."""
    cfg, data, m = _built(tmp_path, "sasrec", "data.train_windows=overlap", "loss.average=position")
    item = next(iter(loader.batches(data, "train", 0, 1, 1)))
    batch = getattr(item, "batch", item)
    targets = batch.sparse_features.to_dict()["next"]
    assert (targets.values() == 0).any() and (targets.values() > 0).any()
    m.train()
    loss = m(batch)[0]
    out = m.encode(m.items(batch.sparse_features)["history"], batch.times)
    rows = torch.repeat_interleave(torch.arange(len(targets.lengths())), targets.lengths())
    positions = torch.arange(len(rows)) - torch.repeat_interleave(targets.offsets()[:-1], targets.lengths())
    keep = targets.values() > 0
    table = m.items.embeddings["t_items"].weight
    logits = out[rows[keep], positions[keep]] @ table[1:].T
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets.values()[keep] - 1), **TOL)


@pytest.mark.unit
@pytest.mark.parametrize("model", ["sasrec", "hstu"])
def test_padding_and_the_other_rows_change_no_real_output(tmp_path, model):
    cfg, data, m = _built(tmp_path, model)
    batch = next(iter(loader.batches(data, "eval", 0, 1, 1))).batch
    history = m.items(batch.sparse_features)["history"]
    together = m.encode(history, batch.times)
    lengths = history.lengths().long()
    for row in range(3):
        from torchrec.sparse.jagged_tensor import JaggedTensor

        start = int(lengths[:row].sum())
        alone = JaggedTensor(values=history.values()[start : start + lengths[row]], lengths=lengths[row : row + 1])
        out = m.encode(alone, batch.times[row : row + 1])
        torch.testing.assert_close(out[0, : lengths[row]], together[row, : lengths[row]], **TOL)


@pytest.mark.unit
@pytest.mark.parametrize("model", ["sasrec", "hstu"])
@pytest.mark.parametrize("l2", [False, True], ids=["dot", "cosine"])
def test_the_exported_encoder_ranks_the_catalogue_as_evaluation_does(tmp_path, model, l2):
    cfg, data, m = _built(tmp_path, model, f"model.l2_normalize={l2}")
    item = next(iter(loader.batches(data, "eval", 0, 1, 1)))
    _, (_, ranks, _) = m(item.batch)
    features = item.batch.sparse_features.to_dict()
    lengths = features["history"].lengths().long()
    history = features["history"].to_padded_dense(desired_length=cfg.data.max_length, padding_value=0)
    users = m.encoder().eval()(history, lengths, item.batch.times)
    scores = users @ m.item_vectors().T
    target = features["next"].values() - 1
    expected = 1 + (scores > scores.gather(1, target[:, None])).sum(1)
    assert torch.equal(expected.float(), ranks)
    if l2:  # cosines: unit vectors on both sides
        for vectors in (users, m.item_vectors()):
            torch.testing.assert_close(vectors.norm(dim=1), torch.ones(len(vectors)))


@pytest.mark.unit
def test_masked_ranks_leave_the_history_out_beside_the_unmasked_ones(tmp_path):
    cfg, data, m = _built(tmp_path, "sasrec", "model.mask_history=true")
    item = next(iter(loader.batches(data, "eval", 0, 1, 1)))
    _, (_, ranks, masked) = m(item.batch)
    features = item.batch.sparse_features.to_dict()
    history = features["history"]
    users = m.encoder().eval()(
        history.to_padded_dense(desired_length=cfg.data.max_length, padding_value=0),
        history.lengths().long(),
        item.batch.times,
    )
    scores = users @ m.item_vectors().T
    target = features["next"].values() - 1
    start = 0
    for row, n in enumerate(history.lengths().tolist()):
        seen = set(history.values()[start : start + n].tolist()) - {int(target[row]) + 1}
        start += n
        beaten = scores[row] > scores[row, target[row]]
        keep = torch.tensor([i + 1 not in seen for i in range(len(beaten))])
        assert masked[row] == 1 + (beaten & keep).sum() and ranks[row] == 1 + beaten.sum()
    assert (masked <= ranks).all() and (masked < ranks).any()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sasrec", "hstu"])
def test_the_exported_program_takes_any_number_of_users(tmp_path, model):
    """The user encoder as ``hybridrec.export`` writes it (traced with 2 users) gives the
    encoder's vectors for 3 users and for 1."""
    from hybridrec.serving.export_sequences import write_user_encoder

    cfg, data, m = _built(tmp_path, model)
    write_user_encoder(m, str(tmp_path), {}, lambda path, save: save(path))
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    item = next(iter(loader.batches(data, "eval", 0, 1, 1)))
    history = item.batch.sparse_features.to_dict()["history"]
    inputs = (
        history.to_padded_dense(desired_length=cfg.data.max_length, padding_value=0),
        history.lengths().long(),
        item.batch.times,
    )
    assert len(inputs[1]) >= 3
    for n in (3, 1):
        some = tuple(t[:n] for t in inputs)
        torch.testing.assert_close(program(*some), m.encoder().eval()(*some), **TOL)


@pytest.mark.unit
def test_a_parquet_history_that_does_not_fit_costs_its_row(tmp_path):
    table = pa.table(
        {
            "items": pa.array(
                [[1, 2, 3, 4], None, [5, 99, 6], [7, 8, 9], [1, None, 2], [3, 4, 5]], pa.list_(pa.int64())
            ),
            "ts": pa.array([[1, 2, 3, 4], [1], [1, 2, 3], [3, 2], [1, 2, 3], [5, 6, 7]], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, tmp_path / "h.parquet")
    args = dict(
        batch_size=2,
        path=str(tmp_path / "h.parquet"),
        items_column="items",
        num_items=20,
        max_length=5,
        train_negatives=0,
        negative_sampling="uniform",
        eval_batches=None,
        seed=0,
        times_column="ts",
    )
    source = ParquetSequences(bad_rows="skip", **args)
    errors = [e.split(": ", 1)[1] for f in source.report()["files"].values() for e in f["errors"]]
    assert errors == [
        "items is null",
        "items: id 99 is outside the table's rows 1..19 (id_mapping=none)",
        "ts has 2 times for 3 ids",
        "items has a null id",
    ]
    assert source.users == 2 and source.report()["bad_rows"] == 4
    # an empty history and one of one item are no bad rows: users with nothing to hold out, counted
    pq.write_table(
        pa.table({"items": pa.array([[], [5], *([[1, 2, 3]] * 3)], pa.list_(pa.int64()))}), tmp_path / "short.parquet"
    )
    short = ParquetSequences(bad_rows="fail", **{**args, "path": str(tmp_path / "short.parquet"), "times_column": None})
    assert short.users == 3 and short.report()["users_left_out"] == 2 and short.report()["bad_rows"] == 0
    with pytest.raises(DataError, match=r"h.parquet:1: items is null \(data.bad_rows=fail\)"):
        ParquetSequences(bad_rows="fail", **args)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """SASRec and HSTU, 4 steps, on one and on two ranks (the item table row-wise over both);
    SASRec also with sampled in-batch negatives, and with the loss averaged by position over
    cosine scores, its history-masked ranks reported beside, and on overlapping windows.
    On two ranks HSTU also checkpoints every 2 steps (the run never stopped), and a second
    HSTU run stops after step 2 and resumes (``trained["resumed"]``); on one rank an HSTU run
    continues the 2-rank step-2 checkpoint (``trained["resharded"]``). One launch per world size."""
    from hybridrec.data.fetch_movielens import write_layout
    from shared import tables

    d = tmp_path_factory.mktemp("ml")
    write_layout(tables(400, seed=3), str(d))
    root = tmp_path_factory.mktemp("runs")
    a, b, c = root / "a", root / "b", root / "c"
    run = lambda m, *extra: compose_cfg(_tiny(m, f"data.path={d}", "sharding=row_wise", *extra))
    sampled = ["loss.in_batch=true", "data.train_negatives=7", "data.negative_sampling=popularity"]
    resumable = ["checkpoint.every_n_steps=2"]
    recipe = ["loss.average=position", "model.l2_normalize=true", "loss.temperature=0.1", "model.mask_history=true"]
    overlap = ["loss.average=position", "data.train_windows=overlap"]  # context-only positions: no target
    two = spawn(
        train_and_gather,
        2,
        [
            run("sasrec"),
            run("hstu", *resumable, f"checkpoint.dir={a}"),
            run("sasrec", *sampled),
            run("hstu", *resumable, f"checkpoint.dir={b}", "train.steps=2"),
            run("hstu", *resumable, f"checkpoint.dir={b}"),
            run("sasrec", *recipe),
            run("sasrec", *overlap),
        ],
        str(root / "two"),
    )
    one = spawn(
        train_and_gather,
        1,
        [
            run("sasrec"),
            run("hstu"),
            run("sasrec", *sampled),
            run("hstu", *resumable, f"checkpoint.dir={c}", f"checkpoint.resume={a / 'step_00000002'}"),
            run("sasrec", *recipe),
            run("sasrec", *overlap),
        ],
        str(root / "one"),
    )
    return {1: [*one[:3], *one[4:]], 2: [*two[:3], *two[5:]], "resumed": two[4], "resharded": one[3]}


@pytest.mark.dist
@pytest.mark.parametrize(
    "run",
    [0, 1, 2, 3, 4],
    ids=["sasrec", "hstu", "sasrec sampled in-batch", "sasrec by position, cosine", "sasrec overlapping windows"],
)
def test_two_ranks_train_a_sequence_ranker_as_one(trained, run):
    """Over 20 s for the first case: it waits for ``trained`` (11 short runs in two launches)."""
    one, two = trained[1][run], trained[2][run]
    assert one["losses"][-1] < one["losses"][0]  # it learns
    # The item table trains by row-wise Adagrad at rate 0.1: a row's step is its gradient over
    # the row's own RMS, so the float32 rounding of a small gradient (2 ranks sum in another
    # order) moves a rarely seen row's elements by up to about 1e-6 (measured: 1.2e-6 for HSTU
    # with its weight decay, 4e-7 without; the dense weights within 4e-7, the losses within
    # 3e-7). 3e-6 is under 1e-5 of the table's scale (0.4).
    assert_same_training(one, two, state_tol={"rtol": 1e-5, "atol": 3e-6})
    assert one["summary"]["eval"] == pytest.approx(two["summary"]["eval"], abs=1e-9)  # the same ranks, the same metrics
    if run == 3:  # masked beside unmasked: a user's history no longer outranks the held-out item
        e = one["summary"]["eval"]
        assert e["masked_hr@200"] >= e["hr@200"] and e["masked_mrr"] > e["mrr"]


@pytest.mark.dist
def test_a_sequence_ranker_resumes_exactly_and_reshards_from_two_ranks_to_one(trained):
    """HSTU on 2 ranks (item table row-wise, blocks as FSDP2 units): stopped after step 2 and
    resumed, it trains bit for bit as the uninterrupted run; its step-2 checkpoint continued
    on 1 rank trains as the 2-rank run does (at the suite's tolerance)."""
    uninterrupted, resumed = trained[2][1], trained["resumed"]
    assert resumed["summary"]["train"]["resumed_from_step"] == 2
    assert resumed["losses"] == uninterrupted["losses"]  # bit for bit
    for key, value in uninterrupted["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    one = trained["resharded"]
    assert one["summary"]["train"]["resumed_from_step"] == 2
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(uninterrupted["losses"]), **TOL)
    assert_same_training(one, uninterrupted)
    assert one["summary"]["eval"] == pytest.approx(uninterrupted["summary"]["eval"], abs=1e-9)
