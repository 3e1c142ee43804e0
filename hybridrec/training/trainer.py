"""The trainer: builds data, model, parallelism and optimizers once; ``train()`` is the loop.

``train_job`` is the rank job of ``python -m hybridrec.train`` (``hybridrec.run.rank.run`` runs
it on every rank).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator, Optional, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from hybridrec import checkpoint
from hybridrec.config import Logger
from hybridrec.config.objective import Selection, keeps_best
from hybridrec.config.objective import resolve as resolve_objective
from hybridrec.config.schema import TrainSchedule
from hybridrec.data import DataError, ReadReport
from hybridrec.parallel.optim import TrainOptimizer
from hybridrec.parallel.reset_rows import reset_rows
from hybridrec.reports.logs import Progress
from hybridrec.reports.metrics import format_eval
from hybridrec.reports.profiling import comm_compute_split, peak_device_mb, peak_rss_mb, step_breakdown
from hybridrec.reports.runlog import MetricsLog, evaluations, plot_report, resumes, write_json
from hybridrec.reports.summary import (
    EvalRecord,
    Metrics,
    ObjectiveBlock,
    Profile,
    RankMeasurement,
    ResumedFrom,
    RunSummary,
    format_summary,
    headline,
    provenance,
    run_summary,
)
from hybridrec.training.build import build, rank_batches
from hybridrec.training.continuous import Serving, Stream, freshness_summary, progressive_metric
from hybridrec.training.scoring import Evaluation, evaluate

log = logging.getLogger("hybridrec.trainer")  # its name before the packages: hydra.verbose keeps it


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str, device: torch.device) -> None:
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.data, self.loss, self.parallel = build(cfg, run_dir, device)
        self.model, self.plan = self.parallel.model, self.parallel.plan
        self.optimizer = TrainOptimizer(self.model, cfg.optimizer)
        self.pipeline = self.parallel.pipeline(cfg.train.pipeline, self.optimizer, device)
        tensorboard = os.path.join(run_dir, "tensorboard") if cfg.logger == Logger.tensorboard else None
        self.metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl") if self.rank == 0 else None, tensorboard)
        self.losses: list[float] = []  # global mean loss of every step
        self.logged = 0  # steps of self.losses already reported (metrics.jsonl's loss_mean window)
        self.step_times: list[float] = []  # host wall time of every step, seconds
        self.eval_history: list[EvalRecord] = []
        self.eval_seconds = 0.0  # excluded from the training throughput
        self.profile: Optional[Profile] = None
        self.start_step = 0  # > 0 when resuming: the steps (= global batches) already done
        # This run's id, after the ids of the runs it continues (rank 0's is the one saved):
        # what decides which checkpoints keep_last may delete.
        self.runs = [checkpoint.new_run_id()]
        # The objective follows the validation split; without one the run reports its train loss.
        try:
            self.objective = (
                resolve_objective(
                    cfg.train.objective, self.loss.calibrated, self.data.ranking_k, self.data.next_item, self.data.tasks
                )
                if "valid" in self.data.splits and cfg.train.schedule != TrainSchedule.continuous
                else None
            )
        except ValueError as e:  # checked before launch; under torchrun each rank checks here
            raise DataError(str(e)) from None
        ck = cfg.checkpoint
        # resolved here, where the validation split is known; the checkpointer and the saved
        # config.yaml then read true or false
        ck.keep_best = keeps_best(ck.keep_best, bool(ck.dir), bool(self.objective and cfg.train.eval_every))
        self.references = self._references()
        self.selection = Selection()
        self.stopped_early_at: Optional[int] = None
        self.last_evaluation: tuple[int, Optional[Evaluation]] = (-1, None)  # step, validation result
        self.stream_state: dict[str, Any] = {}  # train.schedule=continuous: the Stream's, saved with the run
        self.input_checks: list[Callable[[], None]] = []  # the device readers' data checks (_check_input)
        live = checkpoint.Resumable(
            self.model,
            self.optimizer,
            self.data.features,
            self.data.num_dense_features,
            self.losses,
            self.runs,
            self.selection,
            self.stream_state,
            self.metrics.records,
            data_version=self.data.version,
        )
        self.resumed_from: Optional[ResumedFrom] = None
        self.resumes: list[ResumedFrom] = []  # every resume of the training, this one last
        # Rank 0 picks the checkpoint (verifying its checksums, warning when a damaged newer
        # one is skipped, again after each restart) and every rank loads that one.
        chosen = [checkpoint.resume_path(cfg, warn=True) if self.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        if path := chosen[0]:
            state = checkpoint.load(cfg, path, live)
            self.start_step = state.step
            self.logged = len(self.losses)
            self.resumed_from = {"path": os.path.abspath(path), "step": self.start_step}
            # The outputs go on from the checkpoint's history (rank 0 writes it); every rank
            # reads it, so the summary is the same on every rank.
            self.metrics.replay(state.history, self.start_step, self.resumed_from["path"])
            self.eval_history = evaluations(state.history, self.select_split)
            self.resumes = [*resumes(state.history), self.resumed_from]
            log.info(f"resumed from {path} at step {self.start_step}")
        self.checkpointer = checkpoint.Checkpointer(cfg, live, device, path) if cfg.checkpoint.dir else None
        self.stream: Optional[Stream] = None
        if cfg.train.schedule == TrainSchedule.continuous:
            managed = cfg.data.get("managed_ids")
            reset = (
                functools.partial(reset_rows, self.model.module.sparse_module(), self.optimizer, cfg.seed)
                if managed is not None and managed.reset
                else None
            )
            self.stream = Stream(self.data, self.stream_state, self.rank, reset)
            cfg.train.steps = self.stream.start()  # the partitions' global batches
            if self.checkpointer and cfg.checkpoint.export_deltas:
                self.serving = Serving(
                    os.path.join(cfg.checkpoint.dir, "serving"), self.stream, list(cfg.checkpoint.trusted_targets)
                )
                self.checkpointer.on_commit = self.serving.commit

    def _references(self) -> list[dict[str, Any]]:
        """train.references measured on this run's data source; the others are named once."""
        source = self.cfg.data._target_
        # a list node of mappings: its container is a list of dicts
        refs = cast(list[dict[str, Any]], OmegaConf.to_container(self.cfg.train.references, resolve=True))
        if self.rank == 0:
            for ref in refs:
                if ref["data"] != source:
                    log.info(
                        f"train.references: {ref['name']} ({ref['metric']} {ref['value']}) was measured on "
                        f"{ref['data']}, this run reads {source}: not compared"
                    )
        return [ref for ref in refs if ref["data"] == source]

    def step(self, batches: Iterator, step: int) -> torch.Tensor:
        """Training step ``step`` (1-based) on the next batch of ``batches``: TorchRec's
        pipeline (forward, backward, fused sparse and dense optimizer), then parallelism's
        per-step work. Returns this rank's loss (a tensor: reading it would sync the device)."""
        loss, _logits, _labels = self.pipeline.progress(batches)
        # the last step of a partition is followed by an evaluation and a save, as the last one is
        self.parallel.after_step(
            step, last=step == self.cfg.train.steps or (self.stream is not None and self.stream.ends_partition(step))
        )
        return loss

    def train(self) -> RunSummary:
        cfg = self.cfg.train
        # Grown as steps run (doubling), not sized by train.steps: an absurd step count must
        # not allocate memory for steps that never run.
        self.local_losses = torch.zeros(max(1, min(cfg.steps, 4096)), device=self.device)
        progress = Progress(cfg.steps, self.start_step, enabled=self.rank == 0, logger=log)
        profiler = self._profiler()
        self.start = time.perf_counter()
        last = cfg.steps
        if self._patience_spent():  # an early-stopped run, resumed: nothing more to train
            self.stopped_early_at = last = self.start_step
        try:
            with progress.logging():
                first = self.start_step + 1
                while True:
                    last = self._train_steps(first, last, progress, profiler)
                    if not self.stream:
                        break
                    self.stream.score(last, self._score, self.metrics)  # partitions after the last trained
                    if self.checkpointer:  # nothing may wait uncommitted while the run waits for data
                        self.checkpointer.settle(not self._exploded_at_end())
                    if not self.stream.follow():
                        break
                    first, last = last + 1, self.data.num_batches("train")
                    assert last is not None  # a partitioned log (the stream's source) counts its batches
                    cfg.steps = progress.total = last
        finally:
            progress.close()  # the bar's last state first, then whatever reports an error
        # evaluations and a follower's waits for data are not training time
        wall = time.perf_counter() - self.start - self.eval_seconds - (self.stream.waited_s if self.stream else 0.0)
        if profiler:
            profiler.stop()
        return self._finish(wall, self._final_evaluation(last))

    def _train_steps(self, first: int, last: int, progress: Progress, profiler: Any) -> int:
        """Steps ``first`` .. ``last``: train, log, evaluate, save; returns the last step done
        (an early stop's)."""
        cfg, every = self.cfg.train, self.cfg.checkpoint.every_n_steps
        batches = self._batches("train", last, start=first - 1)
        for step in range(first, last + 1):
            if self.stream:  # progressive validation: a partition is scored before it is trained on
                self.stream.score(step - 1, self._score, self.metrics)
            tick = time.perf_counter()
            while step > len(self.local_losses):
                self.local_losses = torch.cat([self.local_losses, torch.zeros_like(self.local_losses)])
            self.local_losses[step - 1] = self.step(batches, step)
            self.step_times.append(time.perf_counter() - tick)
            progress.advance(step)
            if profiler:
                profiler.step()
            save = self.checkpointer and (
                step == cfg.steps
                or (every and step % every == 0)
                or (self.stream is not None and self.stream.ends_partition(step))
            )
            # at the last step too: the evaluation is then part of the last save's state
            evaluate = cfg.eval_every and step % cfg.eval_every == 0
            if step % cfg.log_every == 0 or step == cfg.steps or save:
                self._log(step, progress)  # also checks the losses are finite
            elif evaluate or (self.checkpointer and self.checkpointer.pending):
                # a save is committed once a later step's loss is finite; one may follow an evaluation
                self._check_losses(step)
            if self.checkpointer:
                self.checkpointer.confirm(step, self.losses)
            if evaluate:
                improved = self._evaluate_and_select(step)
                save = save or (improved and self.cfg.checkpoint.keep_best)
                if self._patience_spent():
                    self.stopped_early_at = last = step
                    save = bool(self.checkpointer)
                    if self.rank == 0:
                        assert self.objective is not None  # patience is only spent against an objective
                        log.info(
                            f"early stop at step {step}: {self.objective.name} has not improved on "
                            f"{self.selection.best_value:.4f} (step {self.selection.best_step}) for "
                            f"{cfg.early_stop_patience} evaluations"
                        )
            if save:
                assert self.checkpointer is not None  # save implies one (keep_best implies checkpoint.dir)
                if self.stream:
                    self.stream_state["position"] = self.stream.position(step)
                self.checkpointer.save(step)
            if self.stopped_early_at:
                break
        return last

    def _score(self, split: str) -> Evaluation:
        """A continuous run's progressive evaluation of one partition's split (every rank)."""
        tick = time.perf_counter()
        evaluation = self.evaluate(split)
        self.eval_seconds += time.perf_counter() - tick
        return evaluation

    def _patience_spent(self) -> bool:
        patience = self.cfg.train.early_stop_patience
        return bool(patience and self.objective and self.selection.evals_since_best >= patience)

    def _evaluate_and_select(self, step: int) -> bool:
        """Evaluate the validation split (the history's) at ``step`` and record it against the
        objective; True when it is the best so far (keep_best then saves this step)."""
        evaluation = self._evaluate_and_log(self.select_split, step)
        self.last_evaluation = (step, evaluation)
        result = evaluation.metrics
        if not self.objective:
            return False
        improved = self.selection.update(self.objective, self.objective.value(result), step)
        if improved and self.cfg.checkpoint.keep_best:
            # keep_best implies checkpoint.dir (validated before launch; auto is false without it)
            assert self.checkpointer is not None
            self.selection.best_checkpoint = self.checkpointer.path(step)  # saved now, committed if sane
        return improved

    def _final_evaluation(self, last: int) -> dict[str, Metrics]:
        """Score the splits at the end: validation (also judging the last save: committed only
        if the scores are finite) and the test split, once. With checkpoint.keep_best, both are
        scored with the best checkpoint's weights, loaded into the model."""
        has_valid = "valid" in self.data.splits
        if self.last_evaluation[0] == last:  # the last step was an evaluation step
            judged = self.last_evaluation[1]
            assert judged is not None  # recorded with its step
        else:
            judged = self._evaluate_and_log("valid" if has_valid else "eval", last)
        if self.objective and self.last_evaluation[0] != last:
            self.selection.update(self.objective, self.objective.value(judged.metrics), last)
            if self.selection.best_step == last and self.cfg.checkpoint.keep_best:
                assert self.checkpointer is not None  # keep_best implies checkpoint.dir (as above)
                self.selection.best_checkpoint = self.checkpointer.path(last)
        exploded = self._exploded_at_end()
        hint = self.checkpointer.resume_hint() if self.checkpointer else "no checkpoints are saved"
        if self.checkpointer:
            # The last save has no next step: it is committed if the final scores are finite
            # and the last losses did not explode.
            self.checkpointer.finish(judged.finite and not exploded)
        if not judged.finite:
            raise checkpoint.Diverged(
                f"non-finite scores in the final evaluation after step {last}: the model diverged (a learning "
                f"rate too high is the usual cause); its last save was not committed; {hint}"
            )
        if exploded:
            raise checkpoint.Diverged(
                f"{exploded}: the model diverged (a learning rate too high is the usual cause: "
                f"{self._learning_rates()}); its last save was not committed; {hint}"
            )
        if not has_valid:
            return {"eval": judged.metrics}
        final = {"valid": judged.metrics}
        best, weights_step = self.selection.best_checkpoint, last
        if self.cfg.checkpoint.keep_best and best and self.selection.best_step != last:
            checkpoint.load_weights(self.pipeline.detach(), best)
            # a best checkpoint is kept for the objective's best step
            assert self.objective is not None and self.selection.best_step is not None
            weights_step = self.selection.best_step
            if self.rank == 0:
                log.info(
                    f"final evaluation with the best checkpoint {best} ({self.objective.name} "
                    f"{self.selection.best_value:.4f} at step {weights_step}), not step {last}'s weights"
                )
            final["valid"] = self.evaluate("valid").metrics
        # Logged (and recorded in metrics.jsonl) at the step whose weights were scored.
        final["eval"] = self._evaluate_and_log("eval", weights_step).metrics
        return final

    def objective_block(self, final: dict[str, Metrics]) -> Optional[ObjectiveBlock]:
        """summary.json's ``objective``; None without a validation split (the train loss). A
        continuous run's is the mean progressive metric (``hybridrec.training.continuous``)."""
        if self.stream:
            return self.stream.objective(progressive_metric(self.cfg.train.objective))
        if not self.objective:
            return None
        best = self.selection.best_checkpoint if self.cfg.checkpoint.keep_best else None
        return {
            "name": self.objective.name,
            "direction": self.objective.direction,
            "value": self.objective.value(final["valid"]),
            "best_step": self.selection.best_step,
            "best_value": self.selection.best_value,
            "best_checkpoint": best and os.path.abspath(best),
            "stopped_early_at": self.stopped_early_at,
            "early_stop_patience": self.cfg.train.early_stop_patience,
        }

    def _exploded_at_end(self) -> Optional[str]:
        """Why the run ends diverged though every loss was finite, or None: the median of its
        last steps (up to 10) is over checkpoint.max_loss_ratio x its typical loss before
        them (``checkpoint.exploded``). Such a run ends with an error, whatever it scores."""
        n = len(self.losses)
        window = min(10, n // 2)
        if not window:
            return None
        last = sorted(self.losses[-window:])[window // 2]
        over = checkpoint.exploded(last, self.losses[:-window], self.cfg.checkpoint.max_loss_ratio)
        return over and f"the loss at the end of training (median {last:.4g} over steps {n - window + 1}-{n}) is {over}"

    def _learning_rates(self) -> str:
        return ", ".join(
            f"optimizer.{name}.lr={OmegaConf.select(self.cfg, f'optimizer.{name}.lr')}" for name in ("sparse", "dense")
        )

    def _check_losses(self, step: int) -> None:
        """All-reduce the losses of the steps not yet checked, up to ``step``, and stop on a
        non-finite one (one line: the step, the likely cause, where to resume)."""
        self._check_input()
        # One all-reduce per window, not per step: the reduction is a sync point.
        window = self._global_mean(self.local_losses[len(self.losses) : step])
        if bad := [i for i, x in enumerate(window) if not math.isfinite(x)]:
            hint = "no checkpoints are saved (checkpoint.dir is not set)"
            if self.checkpointer:
                self.checkpointer.discard()  # a save before this step: its next loss is not finite
                hint = self.checkpointer.resume_hint()
            raise checkpoint.Diverged(
                f"non-finite loss {window[bad[0]]} at step {len(self.losses) + bad[0] + 1}: the model diverged "
                f"(a learning rate too high is the usual cause: {self._learning_rates()}); {hint}"
            )
        self.losses += window

    def _log(self, step: int, progress: Progress) -> None:
        self._check_losses(step)
        window = self.losses[self.logged :]  # the steps since the last report
        self.logged = len(self.losses)
        elapsed = time.perf_counter() - self.start - self.eval_seconds - (self.stream.waited_s if self.stream else 0.0)
        rate = (step - self.start_step) * self.cfg.data.batch_size / elapsed
        progress.report(step, self.losses[-1], rate, elapsed)
        extra = {"grad_norm": self.optimizer.grad_norms[-1].item()} if self.optimizer.grad_norms else {}
        self.metrics.log(
            step=step,
            loss=self.losses[-1],
            loss_mean=sum(window) / len(window),
            samples_per_second=rate,
            elapsed_s=elapsed,
            lr=self.optimizer.lrs(),
            **extra,
        )

    def _global_mean(self, local: torch.Tensor) -> list[float]:
        # Each rank's loss is the mean over its equal-sized slice: the average over ranks is
        # the mean over the global batch (gloo has no AVG, so SUM then divide).
        total = local.detach().clone()
        dist.all_reduce(total)
        return (total / self.world_size).tolist()

    @property
    def select_split(self) -> str:
        """The split that evaluations during training report on: validation if there is one."""
        return "valid" if "valid" in self.data.splits else "eval"

    def _evaluate_and_log(self, split: str, step: int) -> Evaluation:
        tick = time.perf_counter()
        evaluation = self.evaluate(split)
        result = evaluation.metrics
        self.eval_seconds += time.perf_counter() - tick
        if split == self.select_split:
            self.eval_history.append({"step": step, "split": split, **result})
        self.metrics.log(step=step, split=split, eval=result)
        if self.rank == 0:
            log.info(f"{split} @ step {step}: {format_eval(result)}")
        return evaluation

    def evaluate(self, split: str = "eval", predictions: bool = False) -> Evaluation:
        """The metrics of the whole ``split`` (``eval`` = test, ``valid``) over every rank
        (``hybridrec.training.scoring.evaluate``), and its predictions on rank 0 when asked."""
        model = self.pipeline.detach()  # restores the model's own forward (no pipelining);
        # the pipeline re-attaches itself at the next progress()
        return evaluate(model, self.data, self.loss, self._batches(split), self.device, predictions)

    def _batches(self, split: str, num_batches: Optional[int] = None, start: int = 0):
        if split == "train":
            self._check_input()  # the batches of an earlier pass, before its reader is let go
            self.input_checks = []
        return rank_batches(
            self.cfg.data, self.data, split, self.device, num_batches, start, on_check=self.input_checks.append
        )

    def _check_input(self) -> None:
        """The data checks of batches converted on the device (data.device_input): a flag read
        where the losses are read, so that the step itself never waits; a bad value stops the
        run naming its file and row, before any later save is committed."""
        for check in self.input_checks:
            check()

    def _profiler(self) -> Optional[torch.profiler.profile]:
        """torch.profiler over steps start_step+1 .. start_step+steps (step start_step is the
        profiler's warm-up; none when the window starts at the first step)."""
        p = self.cfg.profile
        if not p.enabled:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace_dir = os.path.join(self.run_dir, "profile")
        os.makedirs(trace_dir, exist_ok=True)

        def on_trace_ready(prof: torch.profiler.profile) -> None:
            prof.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{self.rank}.json"))
            events = prof.events()
            self.profile = {"rank": self.rank, **comm_compute_split(events), "breakdown_ms": step_breakdown(events)}

        with warnings.catch_warnings():
            # start_step=0 asks for the first step itself, which has no step before it to warm
            # up on: torch's warning that the window has no warm-up says what was asked for.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=max(0, p.start_step - 1), warmup=min(1, p.start_step), active=p.steps, repeat=1
            )
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
        )
        profiler.start()
        return profiler

    def _finish(self, wall: float, final: dict[str, Metrics]) -> RunSummary:
        self.metrics.close()
        cfg = self.cfg
        ranks, read = self._measure_ranks(), self._read_report()  # collectives: every rank
        summary = run_summary(
            losses=self.losses,
            start_step=self.start_step,
            step_times=self.step_times,
            global_batch_size=cfg.data.batch_size,
            wall_s=wall,
            final=final,
            eval_history=self.eval_history,
            world_size=self.world_size,
            device=str(self.device),
            dense_parallel=self.parallel.dense.value,
            dense_parameters=self.parallel.dense_parameters,
            provenance=provenance(cfg, self.resumed_from),
            plan=self.plan,
            ranks=ranks,
            profiled=cfg.profile.enabled,
            objective=self.objective_block(final),
            references=self.references,
            resumes=self.resumes,
            data=read,
            freshness=freshness_summary(self.stream.records, self.stream.state.get("skipped", []))
            if self.stream
            else None,
        )
        if self.rank == 0:
            warn_read_problems(read)
            plot_report(self.metrics.records, os.path.join(self.run_dir, "report.png"), summary)
            log.info("summary\n" + format_summary(summary))
        return summary

    def _measure_ranks(self) -> list[RankMeasurement]:
        """Every rank's peak memory and profile, in rank order, on every rank (a collective)."""
        mine = RankMeasurement(round(peak_rss_mb(), 1), peak_device_mb(self.device), self.profile)
        ranks: list[Any] = [None] * self.world_size
        dist.all_gather_object(ranks, mine)
        return ranks

    def _read_report(self) -> Optional[dict[str, Any]]:
        """The source's read report, summed over ranks when each rank read its own part of
        the files (``per_rank_report``); otherwise every rank read the same and rank 0's is
        the report."""
        report = self.data.report()
        if report is None or not self.data.per_rank_report:
            return report
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, report)
        total = ReadReport()
        for part in parts:
            total.merge(ReadReport.from_dict(part))
        total.collisions = parts[0]["collisions"]  # estimated by rank 0 (shard 0)
        return total.to_dict()


def warn_read_problems(report: Optional[dict[str, Any]]) -> None:
    """The read report's skipped rows and unreadable file ends, as warnings (file sources)."""
    if report is None:
        return
    if report["bad_rows"]:
        first = next(e for f in report["files"].values() for e in f["errors"])
        log.warning(
            f"data: skipped {report['bad_rows']} bad rows of "
            f"{report['rows'] + report['bad_rows']} (first: {first}); see summary.json"
        )
    for lost in report.get("unreadable", []):
        log.warning(f"data: {lost}; the lines before it were used")
    for column, rows in report.get("null_ids", {}).items():
        log.warning(
            f"data: {rows:,} rows have a null {column}: no ids there (the feature pools to zeros); "
            f"null_ids=bad counts them as bad rows instead"
        )


def train_job(cfg: DictConfig, run_dir: str, device: torch.device) -> RunSummary:
    trainer = Trainer(cfg, run_dir, device)
    summary = trainer.train()
    if dist.get_rank() == 0:
        write_json(os.path.join(run_dir, "summary.json"), summary)
        log.info(headline(summary))
        print(f"hybridrec: outputs in {os.path.abspath(run_dir)} (summary.json, metrics.jsonl)", flush=True)
    if trainer.stream and (why := trainer.stream.stopped_before):
        raise DataError(why)  # after the outputs: what was trained is kept, the gap is the run's end
    return summary
