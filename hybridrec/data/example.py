"""``python -m hybridrec.data.example``: a small click log shaped like a team's feature log,
for ``data=parquet`` (``+experiment=feature_log``).

    python -m hybridrec.data.example --out data/example

Writes ``<out>/{train,valid,eval}/part-NNNNN.parquet`` (200,000 / 20,000 / 20,000 rows by
default, in 4 / 2 / 2 files, row groups of 16,384 rows), one impression per row, in time
order: fourteen days of training, then a day of validation, then a day of test. Columns:

- ``ts`` int64: the impression's time (seconds); no feature reads it;
- ``user_id`` string (``u000123``), ``item_id`` int64 (raw ids, sparse: 10,000,000 and up);
- ``click`` int8 0/1: the label; ``weight`` float32: a recency weight in (0.3, 1];
- ``purchase`` int8 0/1: a purchase, only ever after a click (a second task, ``data.labels``:
  its own hidden model, given the click, rewards the same user-item affinity and penalizes
  the price more; drawn from a stream of its own, so every other column is as without it);
- ``price`` float32 (heavy-tailed: log1p), ``tenure_days`` int32 (standardize),
  ``position`` int32 (0..9, the slot the item was shown in);
- ``clicked_items`` list<int64>: the user's recent clicks, most recent first, 0..30 of them
  (one row in eight has more than 20);
- ``cat_ids`` list<int64> and ``cat_weights`` list<float32>: the item's categories (ids
  below 1,000) and how much it belongs to each (summing to 1; 2% of items have none).

Clicks come from a hidden logistic model: users, items and categories belong to 32 latent
clusters and have embeddings near their cluster's; the logit rewards a user close to the
item, to its categories, and a history close to it, with biases per user and item, a
position bias, and price and tenure effects. Users and items are Zipf-popular and half of
the impressions show an item of the user's own cluster, as a recommender would, so the
features carry real signal: AUC well above 0.5 after a short training run.

With ``--layout days`` the log is the one continuous training reads (``data=example_days``,
``+experiment=continuous``): ``<out>/train/day=YYYY-MM-DD/part-00000.parquet`` and a
``_SUCCESS`` marker per day for the fourteen days, then ``valid/`` and ``eval/`` (one day
each), and the world drifts: 30% of the items are new, appearing on days 1 to 15 with a
novelty boost (popularity and click bias) that fades over about three days, and every item's
popularity and click bias follow a trend of their own. A model trained once falls behind; one
trained day by day follows.

Everything comes from ``--seed`` through NumPy's seeded generators, and every exp, log and
power of the hidden model through ``hybridrec.data.portable`` (NumPy's own differ by a few
ulps between CPUs): the same seed writes the same bytes on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hybridrec.base.atomic import fresh
from hybridrec.data import portable

SPLITS = (("train", 4, 0, 14), ("valid", 2, 14, 1), ("eval", 2, 15, 1))  # name, files, first day, days
ROW_GROUP_SIZE = 16384
DIM, CLUSTERS = 8, 32
USERS, ITEMS, CATEGORIES, CATEGORY_IDS = 20_000, 5_000, 300, 1_000
ITEM_BASE = 10_000_000
MAX_HISTORY, MEAN_HISTORY = 30, 10.0
DAY = 86_400
START = 1_700_000_000  # the first day's midnight, seconds: a date in 2023
# The hidden model's weights: the scale of each interaction (dot products divided by DIM),
# chosen so that about a quarter of the impressions are clicked and the signal is clearly
# learnable (the hidden model itself scores AUC 0.88).
BIAS, W_USER_ITEM, W_USER_CATEGORY, W_HISTORY_ITEM = -2.4, 1.2, 0.8, 1.2
W_POSITION, W_PRICE, W_TENURE = -0.12, -0.35, 0.15
# The purchase given a click: about one click in six (4% of the impressions).
PURCHASE_BIAS, W_PURCHASE_USER_ITEM, W_PURCHASE_PRICE, W_PURCHASE_ITEM = -4.0, 1.5, -0.9, 0.5

SCHEMA = pa.schema(
    [
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("click", pa.int8(), nullable=False),
        pa.field("weight", pa.float32(), nullable=False),
        pa.field("price", pa.float32(), nullable=False),
        pa.field("tenure_days", pa.int32(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("clicked_items", pa.list_(pa.int64()), nullable=False),
        pa.field("cat_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("cat_weights", pa.list_(pa.float32()), nullable=False),
        pa.field("purchase", pa.int8(), nullable=False),
    ]
)
_PARTIAL = ".partial"


class Refused(Exception):
    """An output the generator will not write (exit code 2)."""


@dataclass
class World:
    """The hidden population every split samples from: users, items, categories, their
    clusters and embeddings, and what the model's logit adds per user and per item."""

    user_cluster: np.ndarray
    user_vec: np.ndarray
    user_bias: np.ndarray
    user_pop: np.ndarray
    user_tenure: np.ndarray  # days at the log's start
    item_ids: np.ndarray
    item_cluster: np.ndarray
    item_vec: np.ndarray
    item_bias: np.ndarray
    item_pop: np.ndarray
    item_price: np.ndarray
    cat_offsets: np.ndarray  # item i's categories: cat_ids[cat_offsets[i]:cat_offsets[i + 1]]
    cat_ids: np.ndarray
    cat_weights: np.ndarray
    item_cat_vec: np.ndarray  # the weighted sum of the item's category embeddings
    cluster_items: list[tuple[np.ndarray, np.ndarray]]  # per cluster: its items, their in-cluster popularity

    @staticmethod
    def build(rng: np.random.Generator) -> "World":
        centers = rng.normal(size=(CLUSTERS, DIM))
        near = lambda clusters: (centers[clusters] + 0.6 * rng.normal(size=(len(clusters), DIM))).astype(np.float32)
        zipf = lambda n, a: (lambda p: p / p.sum())(rng.permutation(portable.power(np.arange(1, n + 1.0), -a)))

        user_cluster = rng.integers(0, CLUSTERS, USERS)
        item_cluster = rng.integers(0, CLUSTERS, ITEMS)
        # Sparse raw ids, as a catalogue's: sorted so that an item's id grows with its index.
        item_ids = ITEM_BASE + np.sort(rng.choice(5_000_000, ITEMS, replace=False)).astype(np.int64)
        item_pop = zipf(ITEMS, 0.8)

        category_ids = np.sort(rng.choice(CATEGORY_IDS, CATEGORIES, replace=False)).astype(np.int64)
        category_cluster = rng.integers(0, CLUSTERS, CATEGORIES)
        category_vec = near(category_cluster)
        by_cluster = [np.flatnonzero(category_cluster == k) for k in range(CLUSTERS)]
        # 1..4 categories per item (2% none), mostly of the item's own cluster.
        counts = np.where(rng.random(ITEMS) < 0.02, 0, rng.integers(1, 5, ITEMS))
        cat_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        owner = np.repeat(np.arange(ITEMS), counts)
        own = rng.random(len(owner)) < 0.7
        picks = rng.integers(0, CATEGORIES, len(owner))
        for k in range(CLUSTERS):
            rows = np.flatnonzero(own & (item_cluster[owner] == k))
            if len(by_cluster[k]):
                picks[rows] = rng.choice(by_cluster[k], len(rows))
        raw_w = rng.gamma(2.0, 1.0, len(owner))
        totals = np.bincount(owner, weights=raw_w, minlength=ITEMS)
        cat_weights = (raw_w / totals[owner]).astype(np.float32)
        item_cat_vec = np.zeros((ITEMS, DIM), dtype=np.float64)
        for d in range(DIM):
            item_cat_vec[:, d] = np.bincount(owner, weights=cat_weights * category_vec[picks, d], minlength=ITEMS)

        cluster_items = []
        for k in range(CLUSTERS):
            items = np.flatnonzero(item_cluster == k)
            cluster_items.append((items, item_pop[items] / item_pop[items].sum()))
        return World(
            user_cluster=user_cluster,
            user_vec=near(user_cluster),
            user_bias=rng.normal(0, 0.4, USERS),
            user_pop=zipf(USERS, 0.8),
            user_tenure=rng.gamma(1.5, 200.0, USERS).astype(np.int64),
            item_ids=item_ids,
            item_cluster=item_cluster,
            item_vec=near(item_cluster),
            item_bias=rng.normal(0, 0.4, ITEMS),
            item_pop=item_pop,
            item_price=portable.exp(rng.normal(3.0, 1.2, ITEMS)),
            cat_offsets=cat_offsets,
            cat_ids=category_ids[picks],
            cat_weights=cat_weights,
            item_cat_vec=item_cat_vec,
            cluster_items=cluster_items,
        )

    def items_like(self, rng: np.random.Generator, clusters: np.ndarray, own_share: float) -> np.ndarray:
        """One item per entry of ``clusters``: of that cluster (by popularity there) with
        probability ``own_share``, else any item by popularity."""
        out = rng.choice(ITEMS, len(clusters), p=self.item_pop)
        own = rng.random(len(clusters)) < own_share
        for k, (items, pop) in enumerate(self.cluster_items):
            rows = np.flatnonzero(own & (clusters == k))
            if len(rows) and len(items):
                out[rows] = rng.choice(items, len(rows), p=pop)
        return out


@dataclass
class Drift:
    """How the world changes from day to day in the ``days`` layout."""

    birth: np.ndarray  # the day each item appears (0: from the start)
    pop_trend: np.ndarray  # log-popularity change per day
    bias_trend: np.ndarray  # click-bias change per day

    NEW_SHARE, NEW_DAYS = 0.3, 15  # items appearing on days 1 .. NEW_DAYS
    NOVELTY_POP, NOVELTY_BIAS, NOVELTY_DAYS = 3.0, 0.8, 3.0

    @staticmethod
    def build(rng: np.random.Generator) -> "Drift":
        birth = np.where(rng.random(ITEMS) < Drift.NEW_SHARE, rng.integers(1, Drift.NEW_DAYS + 1, ITEMS), 0)
        return Drift(birth, rng.normal(0, 0.15, ITEMS), rng.normal(0, 0.06, ITEMS))

    def on_day(self, world: World, day: int) -> World:
        """The world of ``day``: unborn items never shown, new ones boosted, trends applied."""
        age = day - self.birth
        fresh = np.where(age >= 0, portable.exp(-np.maximum(age, 0) / self.NOVELTY_DAYS), 0.0)
        pop = np.where(
            age >= 0, world.item_pop * portable.exp(self.pop_trend * day + portable.log1p(self.NOVELTY_POP) * fresh), 0
        )
        pop /= pop.sum()
        cluster_items = []
        for k in range(CLUSTERS):
            items = np.flatnonzero((world.item_cluster == k) & (age >= 0))
            cluster_items.append((items, pop[items] / pop[items].sum() if len(items) else pop[items]))
        bias = world.item_bias + self.bias_trend * day + self.NOVELTY_BIAS * fresh
        return dataclasses.replace(world, item_pop=pop, item_bias=bias, cluster_items=cluster_items)


def day_name(day: int) -> str:
    """The partition directory of ``day`` (Hive's day=YYYY-MM-DD; day 0 is START's date)."""
    return "day=" + time.strftime("%Y-%m-%d", time.gmtime(START + day * DAY))


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def split_table(world: World, rng: np.random.Generator, rows: int, first_day: int, days: int) -> pa.Table:
    """``rows`` impressions over ``days`` days from ``first_day``, in time order."""
    (buy,) = rng.spawn(1)  # the purchases' stream: spawning leaves ``rng``'s own draws as they were
    ts = np.sort(START + first_day * DAY + rng.integers(0, days * DAY, rows))
    user = rng.choice(USERS, rows, p=world.user_pop)
    item = world.items_like(rng, world.user_cluster[user], own_share=0.5)
    position = rng.integers(0, 10, rows).astype(np.int32)
    price = np.round(world.item_price[item] * portable.exp(rng.normal(0, 0.1, rows)), 2).astype(np.float32)
    tenure = (world.user_tenure[user] + (ts - START) // DAY).astype(np.int32)

    lengths = np.minimum(MAX_HISTORY, np.floor(rng.exponential(MEAN_HISTORY, rows))).astype(np.int64)
    hist_offsets = np.concatenate([[0], np.cumsum(lengths)])
    slot_row = np.repeat(np.arange(rows), lengths)
    history = world.items_like(rng, world.user_cluster[user][slot_row], own_share=0.75)
    hist_mean = np.zeros((rows, DIM))
    for d in range(DIM):
        hist_mean[:, d] = np.bincount(slot_row, weights=world.item_vec[history, d], minlength=rows)
    hist_mean /= np.maximum(lengths, 1)[:, None]

    u, v = world.user_vec[user].astype(np.float64), world.item_vec[item].astype(np.float64)
    log_price = portable.log1p(price.astype(np.float64))
    logit = (
        BIAS
        + world.user_bias[user]
        + world.item_bias[item]
        + W_USER_ITEM * (u * v).sum(1) / DIM
        + W_USER_CATEGORY * (u * world.item_cat_vec[item]).sum(1) / DIM
        + W_HISTORY_ITEM * (hist_mean * v).sum(1) / DIM
        + W_POSITION * position
        + W_PRICE * (log_price - 3.0) / 1.2
        + W_TENURE * (tenure - 300.0) / 250.0
    )
    click = (rng.random(rows) < portable.sigmoid(logit)).astype(np.int8)
    bought = (
        PURCHASE_BIAS
        + W_PURCHASE_ITEM * world.item_bias[item]
        + W_PURCHASE_USER_ITEM * (u * v).sum(1) / DIM
        + W_PURCHASE_PRICE * (log_price - 3.0) / 1.2
    )
    purchase = (click & (buy.random(rows) < portable.sigmoid(bought))).astype(np.int8)
    age_days = (START + (first_day + days) * DAY - ts) / DAY
    weight = np.round(0.3 + 0.7 * portable.exp(-age_days / 7.0), 3).astype(np.float32)

    # Each row's categories are its item's: the item's slice of the flat lists, gathered.
    starts, ends = world.cat_offsets[item], world.cat_offsets[item + 1]
    cat_lengths = (ends - starts).astype(np.int64)
    cat_offsets = np.concatenate([[0], np.cumsum(cat_lengths)])
    take = np.repeat(starts - cat_offsets[:-1], cat_lengths) + np.arange(cat_offsets[-1])
    columns = [
        pa.array(ts.astype(np.int64)),
        pa.array(np.char.mod("u%06d", user).astype(object), pa.string()),
        pa.array(world.item_ids[item]),
        pa.array(click),
        pa.array(weight),
        pa.array(price),
        pa.array(tenure),
        pa.array(position),
        _list_array(hist_offsets, world.item_ids[history]),
        _list_array(cat_offsets, world.cat_ids[take]),
        _list_array(cat_offsets, world.cat_weights[take]),
        pa.array(purchase),
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def outputs(out: str, rows: int) -> dict[str, list[tuple[str, int, int]]]:
    """Per split: (file, first row, row count) of each of its files."""
    plan = {}
    for name, files, _, _ in SPLITS:
        n = split_rows(rows, name)
        bounds = [n * f // files for f in range(files + 1)]
        plan[name] = [
            (os.path.join(out, name, f"part-{f:05d}.parquet"), bounds[f], bounds[f + 1] - bounds[f])
            for f in range(files)
        ]
    return plan


def split_rows(rows: int, split: str) -> int:
    return rows if split == "train" else max(1, rows // 10)


def _write(table: pa.Table, path: str) -> None:
    # Written under another name and renamed whole: a glob of *.parquet never picks up a file
    # still being written.
    pq.write_table(table, fresh(path + _PARTIAL), row_group_size=ROW_GROUP_SIZE)
    os.replace(path + _PARTIAL, path)


def day_outputs(out: str) -> dict[str, list[tuple[str, int]]]:
    """The ``days`` layout: per split, (file, day) of each file."""
    train = [(os.path.join(out, "train", day_name(d), "part-00000.parquet"), d) for d in range(14)]
    return {
        "train": train,
        "valid": [(os.path.join(out, "valid", "part-00000.parquet"), 14)],
        "eval": [(os.path.join(out, "eval", "part-00000.parquet"), 15)],
    }


def generate_days(out: str, rows: int = 200_000, seed: int = 0, overwrite: bool = False) -> dict[str, int]:
    """Write the drifting log, one partition per day (``--layout days``); returns rows per split."""
    plan = day_outputs(out)
    existing = [path for files in plan.values() for path, _ in files if os.path.exists(path)]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise Refused(f"{existing[0]} exists{more}: pass --overwrite to replace")
    streams = np.random.SeedSequence(seed).spawn(3)
    world = World.build(np.random.default_rng(streams[0]))
    drift = Drift.build(np.random.default_rng(streams[1]))
    days = np.random.default_rng(streams[2]).spawn(16)
    per_day = max(1, rows // 14)
    counts: dict[str, int] = {}
    for split, files in plan.items():
        for path, day in files:
            table = split_table(drift.on_day(world, day), days[day], per_day, day, 1)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write(table, path)
            if split == "train":  # the day is complete: a follower may read it
                with open(fresh(os.path.join(os.path.dirname(path), "_SUCCESS")), "w"):
                    pass
            counts[split] = counts.get(split, 0) + table.num_rows
    return counts


def generate(out: str, rows: int = 200_000, seed: int = 0, overwrite: bool = False) -> dict[str, int]:
    """Write the log into ``out``; returns the rows of each split."""
    plan = outputs(out, rows)
    existing = [path for files in plan.values() for path, _, _ in files if os.path.exists(path)]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise Refused(f"{existing[0]} exists{more}: pass --overwrite to replace")
    streams = np.random.SeedSequence(seed).spawn(1 + len(SPLITS))
    world = World.build(np.random.default_rng(streams[0]))
    counts = {}
    for (name, _, first_day, days), stream in zip(SPLITS, streams[1:]):
        table = split_table(world, np.random.default_rng(stream), split_rows(rows, name), first_day, days)
        os.makedirs(os.path.join(out, name), exist_ok=True)
        for path, first, n in plan[name]:
            _write(table.slice(first, n), path)
        counts[name] = table.num_rows
    return counts


def _positive(text: str) -> int:
    value = int(text)
    if value < 10:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 10 (validation and test get a tenth each)")
    return value


def _stop(message: str, code: int) -> NoReturn:
    print(f"hybridrec: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hybridrec.data.example",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="directory of the train/, valid/ and eval/ files (created)")
    parser.add_argument(
        "--rows",
        type=_positive,
        default=200_000,
        help="training rows (default: 200,000); validation and test get a tenth each",
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of everything generated (default: 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace files that exist")
    parser.add_argument(
        "--layout",
        choices=("splits", "days"),
        default="splits",
        help="splits: train/valid/eval files (default); days: one partition per day, a drifting "
        "world (continuous training)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise Refused(f"--out {args.out}: exists and is not a directory")
        counts = (generate_days if args.layout == "days" else generate)(args.out, args.rows, args.seed, args.overwrite)
    except Refused as e:
        _stop(str(e), 2)
    except OSError as e:
        _stop(f"--out {args.out}: {e.strerror or e}", 2)
    rows = ", ".join(f"{name} {n:,}" for name, n in counts.items())
    print(f"hybridrec: wrote {rows} rows into {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
