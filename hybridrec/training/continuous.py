"""Continuous training (``train.schedule=continuous``): a model that follows the days of a
partitioned log (``data.partitions``: ``hybridrec.data.parquet.partitions``).

The train split is the partitions in time order, each in global batches of its own (its last
one padded with rows of weight 0, so no batch mixes two days; ``ParquetSource.set_partitions``),
so a global step names one partition and a row in it, the same for every world size. Before the model trains on a partition it scores all of it
(progressive validation: every row is judged by a model that has not seen it), and after the
partition's last step the trainer saves a checkpoint. The checkpoint's ``stream`` state holds
the partitions trained so far (names, files and rows), the position and the progressive
scores: a resumed run continues at the next unread global batch, with the same partitions,
or refuses to if one of them changed.

Partitions that are not trained (after ``data.partitions.train_until``) are scored by the
model as it was at the end of training: the "trained once" comparison. With ``follow``, the
run then waits for new partitions (rank 0 looks every ``poll_s``; all ranks take what it
saw) and trains on each as it completes. A partition that arrives with a time before one
already trained is left out with a warning: training on it would not be in time order, and
scoring it would not be progressive.

The freshness report is a ``progressive`` record per partition in metrics.jsonl, a panel of
report.png, ``freshness`` in summary.json, and the objective: the mean progressive metric
over the partitions after the first (the first is scored by an untrained model).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import pyarrow.compute as pc
import torch.distributed as dist

from hybridrec.data import DataError
from hybridrec.data.parquet.partitions import Partition, list_partitions
from hybridrec.data.parquet.source import PARTITION, ParquetSource
from hybridrec.reports.metrics import format_eval

if TYPE_CHECKING:
    from hybridrec.data.source import Source
    from hybridrec.reports.summary import ObjectiveBlock

log = logging.getLogger("hybridrec.continuous")  # its name before the packages: hydra.verbose keeps it

OBJECTIVE_PREFIX = "progressive."
METRICS = ("auc", "logloss", "ne")
"""What a progressive objective can be: the pointwise metrics every partition's score has."""


def progressive_metric(objective: str) -> str:
    """The metric of ``train.objective`` under the continuous schedule: ``auto`` is AUC (what
    a team compares across days: NE and log loss move with each day's click rate), else
    ``progressive.<metric>``; anything else is a ValueError naming the key."""
    if objective == "auto":
        return "auc"
    metric = objective[len(OBJECTIVE_PREFIX) :] if objective.startswith(OBJECTIVE_PREFIX) else None
    if metric not in METRICS:
        raise ValueError(
            f"train.objective={objective}: a continuous run is judged by its progressive validation; "
            f"use auto (progressive.auc) or one of " + ", ".join(OBJECTIVE_PREFIX + m for m in METRICS)
        )
    return metric


class Stream:
    """The continuous schedule of one rank: which partitions the train split holds, which are
    scored, and what a checkpoint records. ``state`` is the dict the checkpoint saves (the
    trainer's ``Resumable.stream``): filled on resume before ``start``. ``reset(rows)``, when
    given, sets the managed tables' rows that change hands back to their initial state: every
    rank calls it before scoring the partition whose version gives them (so a resume from the
    previous partition's checkpoint resets them again, from the same state)."""

    def __init__(
        self,
        source: Source,
        state: dict[str, Any],
        rank: int,
        reset: Optional[Callable[[dict[str, np.ndarray]], int]] = None,
    ) -> None:
        if not isinstance(source, ParquetSource) or not source.partitioning:
            raise DataError("train.schedule=continuous needs a partitioned log: data=parquet with data.partitions")
        self.source, self.state, self.rank, self.reset = source, state, rank, reset
        self.spec = source.partitioning
        self.root = source.train_root
        self._warned: set[str] = set()
        self.waited_s = 0.0  # following: time spent waiting for partitions (not training time)
        self._seen_ids: dict[str, set] = {}  # rank 0: raw ids of the partitions before _folded, per feature
        self._folded = 0
        self._digest: dict[str, Any] = {}  # each laid-out partition's content digest (rank 0's, for every rank)

    # -- the partitions ------------------------------------------------------------------
    @property
    def records(self) -> list[dict[str, Any]]:
        """The progressive evaluation of each partition scored so far, in order."""
        return self.state.setdefault("freshness", [])

    def start(self) -> int:
        """Agree on the partitions (rank 0 lists, every rank takes its list), check them
        against a resumed checkpoint's, and lay out the train split; returns its global batches."""
        chosen: list[Any] = [self._choose(strict=True) if self.rank == 0 else None]  # rank 0's, on every rank
        dist.broadcast_object_list(chosen, src=0)
        if isinstance(chosen[0], str):  # rank 0's refusal, raised on every rank
            raise DataError(chosen[0])
        self._take(chosen[0])
        if not self.source.partitions and (gap := self.state.get("held_back")):
            raise DataError(
                f"partition {gap['partition']} of {self.root}, the first, has no {gap['missing']} (still "
                f"being written, or lost) and later partitions are complete: nothing can be trained "
                f"before it. Start the run once it is complete, or set data.partitions.skip_unready=true "
                f"to train past it for good"
            )
        reached = self._reached()
        saved = [p for p in self.state.get("partitions", []) if p["name"] in reached]
        for old, new in zip(saved, self.source.partitions):
            if (old["name"], old["rows"], old["batches"]) != (new["name"], new["rows"], new["batches"]):
                raise DataError(
                    f"partition {old['name']} of {self.root} changed since the checkpoint was saved ({old['rows']:,} "
                    f"rows then, {new['rows']:,} now): a resumed run must read the partitions it trained on. "
                    f"Restore it, or start a new run in another checkpoint.dir"
                )
        self._record_partitions()
        return self.source.num_batches("train")

    @property
    def stopped_before(self) -> Optional[str]:
        """Why the run ended before the newest complete partition (a partition in between is
        not complete), as the one line the run stops with; None when nothing was held back."""
        gap = self.state.get("held_back")
        if not gap:
            return None
        trained = self.source.partitions[-1]["name"] if self.source.partitions else "none"
        wait = (
            "it did not arrive within data.partitions.stop_after_idle_s"
            if self.spec.get("follow")
            else "data.partitions.follow=true waits for it"
        )
        return (
            f"partition {gap['partition']} of {self.root} has no {gap['missing']} (still being written, or lost) "
            f"and later partitions are complete: the run stopped before it, after {trained} (its checkpoint "
            f"is kept). {wait}; data.partitions.skip_unready=true trains past it for good"
        )

    def _choose(self, strict: bool) -> Any:
        """Rank 0: the partitions to lay out, with their content digests, and what was held
        back or skipped (``_reconcile``); a string: why the run cannot go on."""
        unready: list[Partition] = []
        try:  # rank 0's error goes to every rank (the broadcast), not only to rank 0
            listed = list_partitions(
                self.root,
                self.spec["pattern"],
                self.spec.get("ready_marker"),
                strict=strict,
                warned=self._warned,
                unready=unready,
            )
            kept = self._reconcile(listed)
            if isinstance(kept, str):
                return kept
            kept, held_back, skipped = self._in_order(kept, unready)
            digests, changed = self._digests(kept)
        except DataError as e:
            return str(e)
        except OSError as e:  # a file that went away or cannot be read while the listing was hashed
            return f"{self.root}: {e.strerror or e} ({e.filename}) while reading the partitions"
        if changed:
            return changed
        return kept, digests, held_back, skipped

    def _take(self, chosen: tuple) -> None:
        """Every rank: lay out what rank 0 chose."""
        kept, self._digest, held_back, skipped = chosen
        self.state["held_back"] = held_back
        for s in skipped:
            if s not in self.state.setdefault("skipped", []):
                self.state["skipped"].append(s)
                if self.rank == 0:
                    log.warning(
                        f"data: partition {s['partition']} has no {s['missing']}: trained past it "
                        f"(data.partitions.skip_unready=true); it is left out for good"
                    )
        self.source.set_partitions(kept)

    def _in_order(self, kept: list[Partition], unready: list[Partition]) -> tuple[list[Partition], Any, list]:
        """The partitions that can be trained in time order now: a partition without its
        ready marker, before a complete one, holds back every later one (training them now
        would leave it out for good), unless ``skip_unready`` (then it is skipped, recorded)."""
        reached = self._reached()
        saved = sum(p["name"] in reached for p in self.state.get("partitions", []))  # kept's first ones
        last = kept[saved - 1].time if saved else None
        newest = kept[-1].time if kept else None
        marker = self.spec.get("ready_marker")
        skipped = []
        for gap in unready:
            if (last is not None and gap.time <= last) or newest is None or gap.time >= newest:
                continue  # before what was trained (left out as out of order), or the newest: not a gap
            if gap.name in {s["partition"] for s in self.state.get("skipped", [])}:
                continue
            if self.spec.get("skip_unready"):
                skipped.append({"partition": gap.name, "missing": marker})
                continue
            return [p for p in kept if p.time < gap.time], {"partition": gap.name, "missing": marker}, skipped
        return kept, None, skipped

    def _reconcile(self, listed: list[Partition]) -> Any:
        """The partitions to lay out: a resumed run's own, in their order, then the listed
        ones after the last of them; those that arrived out of order are left out (warned).
        A string: why the run cannot go on (a partition it trained on is gone)."""
        reached = self._reached()
        saved = [p for p in self.state.get("partitions", []) if p["name"] in reached]
        by_name = {p.name: p for p in listed}
        kept = []
        for old in saved:
            if old["name"] not in by_name:
                return (
                    f"partition {old['name']} of {self.root}, trained on before the checkpoint, is gone: a "
                    f"resumed run must read the partitions it trained on. Restore it, or start a new run in "
                    f"another checkpoint.dir"
                )
            kept.append(by_name[old["name"]])
        last = kept[-1].time if kept else None
        for p in listed:
            if p.name in {k.name for k in kept}:
                continue
            if last is not None and p.time <= last:
                if p.name not in self._warned:
                    self._warned.add(p.name)
                    log.warning(
                        f"data: partition {p.name} arrived after {kept[-1].name} was read: it is before "
                        f"that in time, so it is left out (training on it now would not be in time order)"
                    )
                continue
            kept.append(p)
        return kept

    def _reached(self) -> set[str]:
        """The partitions a resumed run has read from (each is scored when it is reached):
        they must be as they were. Those laid out after them, not yet read, are listed again
        (one republished since, or gone, is taken as it is now)."""
        return {r["partition"] for r in self.records}

    def _digests(self, kept: list[Partition]) -> tuple[dict[str, Any], Optional[str]]:
        """Rank 0: each partition's content digest (``partition_digest``), and the refusal
        when one that was trained on (its digest recorded in the checkpoint) changed since."""
        reached = self._reached()
        recorded = {p["name"]: p.get("digest") for p in self.state.get("partitions", []) if p["name"] in reached}
        digests = {}
        for p in kept:
            # hashed once per process: a following run hashes only the partitions that arrived
            digests[p.name] = digest = self._digest.get(p.name) or partition_digest(p)
            was = recorded.get(p.name)
            if was and was != digest:
                return digests, (
                    f"partition {p.name} of {self.root} changed since it was trained on ({_what_changed(was, digest)}): "
                    f"a resumed run must read the partitions it trained on, as they were. Restore it, or start a "
                    f"new run in another checkpoint.dir"
                )
        return digests, None

    def _record_partitions(self) -> None:
        parts = self.source.partitions
        self.state["partitions"] = [
            {**{k: p[k] for k in ("name", "rows", "batches", "trained")}, "digest": self._digest.get(p["name"])}
            for p in parts
        ]
        # looked up at every step: sets, not a walk over every partition of a long log
        self._starts = {p["first_batch"] for p in parts}
        self._ends = {p["first_batch"] + p["batches"] for p in parts if p["batches"]}

    def follow(self) -> bool:
        """Wait for partitions after the last one (``data.partitions.follow``); True when some
        arrived and the train split was extended (every rank), False when the run should end:
        not following, or no partition for ``stop_after_idle_s``."""
        if not self.spec.get("follow"):
            return False
        tick = time.perf_counter()
        try:
            return self._wait()
        finally:
            self.waited_s += time.perf_counter() - tick

    def _wait(self) -> bool:
        """``follow``'s loop: rank 0 looks, every rank takes what it saw."""
        poll, idle_limit = float(self.spec["poll_s"]), self.spec.get("stop_after_idle_s")
        waited = 0.0
        if self.rank == 0:
            after = self.source.partitions[-1]["name"] if self.source.partitions else "none yet"
            log.info(
                f"following {self.root}: looking for partitions after {after} every "
                f"{poll:g} s" + (f", stopping after {idle_limit:g} s without one" if idle_limit else "")
            )
        while True:
            fresh = None
            if self.rank == 0:
                time.sleep(poll)
                waited += poll
                chosen = self._choose(strict=False)
                if isinstance(chosen, str):
                    fresh = chosen
                elif len(chosen[0]) > len(self.source.partitions):
                    fresh = chosen
                if fresh is None and idle_limit is not None and waited >= idle_limit:
                    fresh = "stop"
            box = [fresh]
            dist.broadcast_object_list(box, src=0)
            if box[0] == "stop":
                if self.rank == 0:
                    log.info(f"following: no new partition for {waited:g} s (data.partitions.stop_after_idle_s): done")
                return False
            if isinstance(box[0], str):  # a partition trained on changed or went away: rank 0's refusal
                raise DataError(box[0])
            if box[0] is not None:
                self._take(box[0])
                self._record_partitions()
                return True

    # -- where a step is ---------------------------------------------------------------------
    def position(self, step: int) -> dict[str, Any]:
        """The next row to read after ``step`` steps: the partition and the row in it (a
        partition's last global batch is padded: the next one starts a partition)."""
        B = self.source.batch_size
        for p in self.source.partitions:
            if p["batches"] and step < p["first_batch"] + p["batches"]:
                return {"partition": p["name"], "row": (step - p["first_batch"]) * B}
        return {"partition": None, "row": 0}

    def ends_partition(self, step: int) -> bool:
        """``step`` is the last step of a partition: its checkpoint is the partition's."""
        return step in self._ends

    def due(self, done: int) -> list[dict[str, Any]]:
        """The partitions to score now, after ``done`` steps: those not yet scored whose first
        step is the next one (or, training none of it, whose place has been reached)."""
        scored = {r["partition"] for r in self.records}
        return [
            p
            for p in self.source.partitions
            if p["name"] not in scored
            and p["first_batch"] <= done
            and (not p["batches"] or p["first_batch"] + p["batches"] > done)
        ]

    def score(self, done: int, evaluate: Callable[[str], Any], metrics_log: Any) -> None:
        """Progressive validation: score each partition ``due`` after ``done`` steps with the
        current model (every rank), record it (the checkpoint's state) and log it (rank 0)."""
        if done not in self._starts and done < self.source.num_batches("train"):
            return  # not a partition's first step: nothing is due
        for p in self.due(done):
            new_ids = self._new_ids(p) if self.rank == 0 else {}
            record: dict[str, Any] = {
                "partition": p["name"],
                "step": done,
                "rows": p["rows"],
                "steps": p["batches"],
                "trained": p["trained"],
                "new_ids": new_ids,
            }
            reused = self.source.reused_rows(p["index"]) if self.reset else {}
            if any(len(r) for r in reused.values()):
                assert self.reset is not None
                self.reset(reused)
            if self.source.managed and self.rank == 0:  # each managed table's lookups of the partition
                record["managed_ids"] = self.source.managed_stats(p["index"])
                for table, r in reused.items():
                    record["managed_ids"][table]["reset"] = len(r)
            if p["rows"]:
                record["eval"] = evaluate(PARTITION + p["name"]).metrics
            self.records.append(record)
            metrics_log.log(step=done, split="progressive", **{k: v for k, v in record.items() if k != "step"})
            if self.rank == 0:
                what = format_eval(record["eval"]) if p["rows"] else "no rows"
                log.info(
                    f"progressive {p['name']} @ step {done}: {what}  ({p['rows']:,} rows"
                    + ("" if p["trained"] else ", scored only: after data.partitions.train_until")
                    + (", new ids " + ", ".join(f"{k} {v:,}" for k, v in new_ids.items()) if new_ids else "")
                    + "".join(
                        f"; {t}: {m['rows_used']:,}/{m['rows']:,} rows used, {m['hits']:,} hits, "
                        f"{m['misses']:,} misses, {m['admitted']:,} admitted, {m['evicted']:,} evicted"
                        + (f", {m['reset']:,} rows reset" if m.get("reset") else "")
                        for t, m in record.get("managed_ids", {}).items()
                    )
                    + ")"
                )

    def _new_ids(self, p: dict[str, Any]) -> dict[str, int]:
        """Distinct raw ids of each sparse feature in partition ``p`` that no partition before
        it had (its first partition: all of them). Exact: the raw ids seen are kept in memory,
        which grows with the distinct ids of the log; a resumed run reads the partitions
        before its position again to know them."""
        parts = self.source.partitions
        at = next(i for i, q in enumerate(parts) if q["name"] == p["name"])
        for q in parts[self._folded : at]:
            self._fold(q)
        out = {name: len(ids - self._seen_ids.get(name, set())) for name, ids in self._ids(p).items()}
        self._fold(p)
        self._folded = at + 1
        return out

    def _ids(self, p: dict[str, Any]) -> dict[str, set]:
        """Partition p's distinct raw ids per feature (whole lists: every id the log shows)."""
        return {
            f.name: {
                i for ids in self.source.partition_ids(p["index"], f, as_read=False) for i in pc.unique(ids).to_pylist()
            }
            for f in self.source.sparse
        }

    def _fold(self, p: dict[str, Any]) -> None:
        for name, ids in self._ids(p).items():
            self._seen_ids.setdefault(name, set()).update(ids)

    # -- the report ----------------------------------------------------------------------------
    def objective(self, metric: str) -> ObjectiveBlock:
        """summary.json's objective: the mean progressive ``metric`` over the partitions after
        the first that have rows (the first is scored by an untrained model)."""
        values = [r["eval"][metric] for r in self.records[1:] if "eval" in r and metric in r["eval"]]
        value = float(np.mean(values)) if values else math.nan
        maximize = metric not in ("logloss", "ne")
        return {
            "name": OBJECTIVE_PREFIX + metric,
            "direction": "maximize" if maximize else "minimize",
            "value": value,
            "best_step": None,
            "best_value": None,
            "best_checkpoint": None,
            "stopped_early_at": None,
            "early_stop_patience": 0,
        }


def partition_digest(p: Partition) -> dict[str, Any]:
    """What a partition's rows are: its files' names and sizes, and a BLAKE3 hash of their
    bytes (a day whose ids were rewritten keeps its row count, not its hash). Recorded when a
    partition is laid out, checked when a resumed run lays it out again."""
    import blake3

    h = blake3.blake3()
    files = {}
    for path in p.files:
        name = os.path.basename(path)
        files[name] = os.path.getsize(path)
        h.update(f"{name}\0{files[name]}\0".encode())
        if files[name]:  # (an empty file cannot be mapped)
            h.update_mmap(path)
    return {"files": files, "blake3": h.hexdigest()}


def _what_changed(was: dict[str, Any], now: dict[str, Any]) -> str:
    """The first difference between two partition digests, in words."""
    a, b = was.get("files", {}), now.get("files", {})
    if gone := sorted(set(a) - set(b)):
        return f"{gone[0]} is gone"
    if new := sorted(set(b) - set(a)):
        return f"{new[0]} is new"
    if resized := [n for n in sorted(a) if a[n] != b[n]]:
        return f"{resized[0]} was {a[resized[0]]:,} bytes, now {b[resized[0]]:,}"
    return "its files' bytes differ from the digest recorded then"


def freshness_summary(records: list[dict[str, Any]], skipped: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """summary.json's ``freshness``: per partition, its progressive scores and counts, the
    means over the partitions after the first, trained and scored-only apart, and the
    partitions trained past without their ready marker (``skip_unready``)."""

    def mean(rs: list[dict[str, Any]], key: str) -> Optional[float]:
        xs = [r["eval"][key] for r in rs if "eval" in r and key in r["eval"]]
        return float(np.mean(xs)) if xs else None

    later = records[1:]
    keys = ("auc", "ne", "logloss")
    return {
        "partitions": records,
        "mean_after_first": {k: mean(later, k) for k in keys},
        "mean_trained": {k: mean([r for r in later if r["trained"]], k) for k in keys},
        "mean_scored_only": {k: mean([r for r in later if not r["trained"]], k) for k in keys},
        "skipped": list(skipped),
    }


class Serving:
    """``checkpoint.export_deltas``: keeps ``<checkpoint.dir>/serving`` current as partitions
    are trained (rank 0, after each commit at a partition's end): a full export the first time,
    then a delta per partition (``hybridrec.serving.delta``). The weights the export and its deltas
    hold are kept in memory, so a delta costs reading one checkpoint, not the whole history."""

    def __init__(self, folder: str, stream: Stream, trusted: list[str]) -> None:
        self.folder, self.stream, self.trusted = folder, stream, trusted
        self.weights: Optional[tuple[dict[str, Any], int]] = None

    def commit(self, step: int, checkpoint: str) -> None:
        from hybridrec.serving import delta
        from hybridrec.serving.export import PROGRAM, export

        if not self.stream.ends_partition(step):
            return  # checkpoint.every_n_steps inside a partition: serving follows whole partitions
        tick = time.perf_counter()
        if not os.path.isfile(os.path.join(self.folder, PROGRAM)):
            export(checkpoint, self.folder, self.trusted)
            log.info(f"serving: exported step {step} to {self.folder} ({time.perf_counter() - tick:.1f} s)")
            return
        try:
            path, weights = delta.write(checkpoint, self.folder, self.trusted, base=self.weights)
        except delta.DeltaError as e:
            if "nothing changed" in str(e):
                return
            raise
        self.weights = (weights, step)
        log.info(
            f"serving: {os.path.relpath(path, self.folder)} (step {step}, {os.path.getsize(path) / 2**20:.2f} MB, "
            f"{time.perf_counter() - tick:.1f} s)"
        )
