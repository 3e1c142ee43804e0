"""Multi-task rankers: one sharded embedding collection and one interaction (DLRM's dot
product or DCNv2's cross network), then per task a mixture of shared experts and a tower.

- ``SharedBottom``: one MLP over the interaction, shared by every task's tower (Caruana 1997).
- ``MMoE``: several expert MLPs and, per task, a softmax gate over them (Ma et al., KDD 2018).
- ``PLE``: per level, shared experts and each task's own experts; a task's gate mixes its own
  and the shared ones, and a shared gate mixes all of them for the next level (Tang et al.,
  RecSys 2020, Customized Gate Control stacked in extraction levels).

Each expert, gate and tower is a module of its own: an FSDP2 unit (``dense_units``), the
interaction's weights one more. The tasks come from ``data.labels`` (``hybridrec.config.tasks``);
a task ``after`` another is scored as the logit of P(parent) * P(task | parent) (ESMM), so
every binary output's sigmoid is a probability. ``score`` returns ``[B, T]``; ``TaskLoss``
weighs each task's loss. A model with one task is the single-task case.

torchrec ships the DLRM pieces used here (DenseArch, InteractionArch, InteractionDCNArch,
LowRankCrossNet, OverArch, MLP) but no expert mixtures, hence the mixers.

May import: base, config, data.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, ClassVar, Optional, Sequence, cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.mlp import MLP

from hybridrec.config.tasks import Task
from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models import Ranker, SparseArch, check_dense_arch, check_layer_sizes
from hybridrec.models.losses import Loss, _mean_per_list, _weights

# The joint probability P(parent) * P(task | parent) is kept below 1 - 1e-7 so that its logit
# (log p - log(1 - p)) stays finite in float32.
_LOG_P_MAX = -1e-7


def joint_logit(parent: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The logit of sigmoid(parent) * sigmoid(own), in log space (stable for large logits),
    in float32 whatever the model computes in."""
    log_p = (F.logsigmoid(parent.float()) + F.logsigmoid(own.float())).clamp(max=_LOG_P_MAX)
    return log_p - torch.log(-torch.expm1(log_p))


def as_tasks(tasks: Sequence[Any]) -> list[Task]:
    """Tasks as Hydra's instantiate passes them (config nodes) or as Task."""
    return [t if isinstance(t, Task) else Task(**dict(t)) for t in tasks]


def grade_probabilities(score: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """``[B, levels]``: P(grade = k) under the proportional-odds model, P(grade >= k) =
    sigmoid(score - cut_k) for the increasing ``cuts`` ``[levels - 1]``."""
    at_least = torch.sigmoid(score.float().unsqueeze(1) - cuts.float())  # [B, levels - 1], decreasing in k
    ones, zeros = at_least.new_ones(len(score), 1), at_least.new_zeros(len(score), 1)
    return torch.cat([ones, at_least], 1) - torch.cat([at_least, zeros], 1)


class TaskLoss(Loss):
    """The weighted sum of each task's loss: binary cross-entropy on a binary task's output
    (the joint logit for a dependent task), squared error on a regression task's, the
    grade's negative log-likelihood for an ordinal task (its score and ``cuts``). Each is a
    mean over the rank's rows as ``BCE``'s is (padding and sample weights by
    ``batch.weights``), so 2 ranks give 1 process's loss."""

    calibrated = True

    def __init__(self, tasks: Sequence[Task], list_size: Optional[int] = None) -> None:
        super().__init__(list_size)
        self.tasks = list(tasks)

    def forward(
        self, logits: torch.Tensor, batch: RecBatch, cuts: Optional[dict[int, torch.Tensor]] = None
    ) -> torch.Tensor:
        labels = batch.labels.view(len(logits), len(self.tasks))
        weights = _weights(batch, logits[:, 0])
        total = logits.new_zeros((), dtype=torch.float32)
        for t, task in enumerate(self.tasks):
            if task.weight == 0:
                continue
            out, label = logits[:, t].float(), labels[:, t]
            if task.kind == "binary":
                per_row = F.binary_cross_entropy_with_logits(out, label, reduction="none")
            elif task.kind == "ordinal":
                assert cuts is not None  # MultiTaskRanker.forward passes its ordinal tasks' cut-points
                p = grade_probabilities(out, cuts[t]).gather(1, label.long().unsqueeze(1)).squeeze(1)
                per_row = -torch.log(p.clamp(min=1e-12))
            else:
                per_row = (out - label) ** 2
            total = total + task.weight * _mean_per_list(per_row, weights, self.list_size)
        return total


class Cutpoints(nn.Module):
    """An ordinal task's ``levels - 1`` increasing cut-points: the first, then positive gaps
    (softplus), starting evenly spaced one apart around 0."""

    def __init__(self, levels: int) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.tensor([-(levels - 2) / 2.0]))
        # no gaps for two grades: an empty parameter would be an empty FSDP2 shard
        self.gaps = nn.Parameter(torch.full((levels - 2,), math.log(math.e - 1))) if levels > 2 else None  # softplus 1

    def forward(self) -> torch.Tensor:
        if self.gaps is None:
            return self.first
        return torch.cat([self.first, self.first + torch.cumsum(F.softplus(self.gaps), 0)])


class Gate(nn.Module):
    """A softmax over experts computed from the gate's input: ``forward(x, experts)`` with
    ``experts`` ``[B, E, d]`` gives their mixture ``[B, d]``."""

    def __init__(self, in_features: int, experts: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, experts)

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.linear(x), dim=-1)
        return torch.einsum("be,bed->bd", w, experts)


def _experts(count: int, in_features: int, sizes: list[int]) -> nn.ModuleList:
    return nn.ModuleList(MLP(in_features, list(sizes)) for _ in range(count))


class MultiTaskRanker(Ranker):
    """The shared parts (embeddings, dense arch, interaction) and the towers; a subclass mixes
    the interaction into one input per task (``mix``) and lists its mixing units."""

    pooled_tables = True

    multi_task: ClassVar[bool] = True
    """Trains ``data.labels``' tasks: validation requires them (``Ranker.multi_task``)."""

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        interaction: Any,
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        expert_layer_sizes: list[int],
        tower_layer_sizes: list[int],
        loss: Loss,
        tasks: Sequence[Any],
    ) -> None:
        self.tasks = as_tasks(tasks)
        super().__init__(TaskLoss(self.tasks, loss.list_size))
        self.sparse_arch = SparseArch(features, embedding_dim)
        n = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(num_dense_features, list(dense_arch_layer_sizes))
        self.inter_arch: nn.Module
        if str(getattr(interaction, "value", interaction)) == "dcn":
            width = (n + 1) * embedding_dim
            self.inter_arch = InteractionDCNArch(n, LowRankCrossNet(width, dcn_num_layers, dcn_low_rank_dim))
            self._inter_units: list[nn.Module] = [self.inter_arch]
        else:  # DLRM's dot interaction: no weights, no unit
            width = embedding_dim + (n + 1) * n // 2  # pairs among the dense vector and the n embeddings
            self.inter_arch = InteractionArch(n)
            self._inter_units = []
        self.width, self.expert_sizes = width, list(expert_layer_sizes)
        self.expert_out = self.expert_sizes[-1]
        self.towers = nn.ModuleList(OverArch(self.expert_out, [*tower_layer_sizes, 1]) for _ in self.tasks)
        names = [t.name for t in self.tasks]
        self._parents = [names.index(t.after) if t.after else -1 for t in self.tasks]
        self._ordinal = [t for t, task in enumerate(self.tasks) if task.kind == "ordinal"]
        self.cutpoints = nn.ModuleList(Cutpoints(cast(int, self.tasks[t].levels)) for t in self._ordinal)

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        check_dense_arch(cfg)
        check_layer_sizes(cfg, "expert_layer_sizes")
        check_layer_sizes(cfg, "tower_layer_sizes")
        for key in ("dcn_num_layers", "dcn_low_rank_dim", "num_experts", "levels"):
            if cfg.get(key, 1) < 1:
                raise ValueError(f"model.{key}={cfg[key]}: must be >= 1")
        if cfg.get("task_experts", 1) < 0:
            raise ValueError(f"model.task_experts={cfg.task_experts}: each task's own experts per level, >= 0")

    @abstractmethod
    def mix(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One input ``[B, expert_out]`` per task from the interaction's output ``x``."""

    @abstractmethod
    def mixing_units(self) -> list[nn.Module]:
        """The mixing modules (experts, gates), each an FSDP2 unit."""

    def _logits(self, batch: RecBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """What the loss reads: ``[B, T]`` (a dependent task's joint logit, an ordinal task's
        score) and each ordinal task's cut-points, by column."""
        x = self.inter_arch(self.dense_arch(batch.dense_features), self.sparse_arch(batch.sparse_features))
        own = [tower(h) for tower, h in zip(self.towers, self.mix(x))]
        out: list[torch.Tensor] = []
        for t, parent in enumerate(self._parents):
            out.append(own[t] if parent < 0 else joint_logit(out[parent], own[t]).to(own[t].dtype))
        return torch.cat(out, dim=1), {t: cuts() for t, cuts in zip(self._ordinal, self.cutpoints)}

    def _outputs(self, logits: torch.Tensor, cuts: dict[int, torch.Tensor]) -> torch.Tensor:
        """``[B, T]`` as evaluation and the export give them: an ordinal task's expected grade
        (sum over k of P(grade >= k)) in place of its score; the rest as the loss reads them."""
        if not cuts:
            return logits
        # columns by index, not by unbinding: TorchRec's pipeline traces this with torch.fx
        columns = [logits[:, t : t + 1] for t in range(len(self.tasks))]
        for t, c in cuts.items():
            grade = torch.sigmoid(logits[:, t : t + 1].float() - c.float()).sum(1, keepdim=True)
            columns[t] = grade.to(logits.dtype)
        return torch.cat(columns, 1)

    def score(self, batch: RecBatch) -> torch.Tensor:
        return self._outputs(*self._logits(batch))

    def forward(self, batch: RecBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits, cuts = self._logits(batch)
        loss = cast(TaskLoss, self.loss)(logits, batch, cuts)
        penalty = self.embedding_penalty(batch)
        if penalty is not None:
            loss = loss + penalty
        return loss, (loss.detach(), self._outputs(logits, cuts).detach(), batch.labels.detach())

    def sparse_module(self) -> nn.Module:
        return self.sparse_arch.embedding_bag_collection

    def dense_units(self) -> list[nn.Module]:
        """Dense arch, the cross network (DCN), every expert and gate, every tower, each ordinal
        task's cut-points: each an FSDP2 unit."""
        return [self.dense_arch, *self._inter_units, *self.mixing_units(), *self.towers, *self.cutpoints]


class SharedBottom(MultiTaskRanker):
    """One MLP over the interaction (``expert_layer_sizes``), every task's tower on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bottom = MLP(self.width, self.expert_sizes)

    def mix(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.bottom(x)
        return [h] * len(self.tasks)

    def mixing_units(self) -> list[nn.Module]:
        return [self.bottom]


class MMoE(MultiTaskRanker):
    """``num_experts`` expert MLPs over the interaction; each task's gate mixes them."""

    def __init__(self, *args: Any, num_experts: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.experts = _experts(num_experts, self.width, self.expert_sizes)
        self.gates = nn.ModuleList(Gate(self.width, num_experts) for _ in self.tasks)

    def mix(self, x: torch.Tensor) -> list[torch.Tensor]:
        experts = torch.stack([e(x) for e in self.experts], dim=1)
        return [gate(x, experts) for gate in self.gates]

    def mixing_units(self) -> list[nn.Module]:
        return [*self.experts, *self.gates]


class _Level(nn.Module):
    """One PLE extraction level: shared experts, each task's own experts, their gates."""

    shared: nn.ModuleList
    own: nn.ModuleList
    gates: nn.ModuleList
    shared_gate: Optional[Gate]

    def __init__(self, in_features: int, sizes: list[int], shared: int, own: int, tasks: int, last: bool) -> None:
        super().__init__()
        self.shared = _experts(shared, in_features, sizes)
        self.own = nn.ModuleList(_experts(own, in_features, sizes) for _ in range(tasks))
        self.gates = nn.ModuleList(Gate(in_features, own + shared) for _ in range(tasks))
        # the shared gate feeds the next level's shared experts: none after the last level
        self.shared_gate = None if last else Gate(in_features, tasks * own + shared)

    def units(self) -> list[nn.Module]:
        return [*self.shared, *(e for own in cast("list[nn.ModuleList]", list(self.own)) for e in own), *self.gates] + (
            [self.shared_gate] if self.shared_gate is not None else []
        )


class PLE(MultiTaskRanker):
    """``levels`` extraction levels of ``num_experts`` shared and ``task_experts`` per-task
    experts; the last level's task mixtures feed the towers."""

    def __init__(self, *args: Any, num_experts: int, task_experts: int, levels: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sizes = self.expert_sizes
        self.levels = nn.ModuleList(
            _Level(
                self.width if i == 0 else sizes[-1], sizes, num_experts, task_experts, len(self.tasks), i == levels - 1
            )
            for i in range(levels)
        )

    def mix(self, x: torch.Tensor) -> list[torch.Tensor]:
        inputs, shared_in = [x] * len(self.tasks), x
        for level in cast("list[_Level]", list(self.levels)):
            shared = [e(shared_in) for e in level.shared]
            own = [
                [e(inputs[t]) for e in experts]
                for t, experts in enumerate(cast("list[nn.ModuleList]", list(level.own)))
            ]
            outputs = [gate(inputs[t], torch.stack(own[t] + shared, dim=1)) for t, gate in enumerate(level.gates)]
            if level.shared_gate is not None:
                everything = torch.stack([e for mine in own for e in mine] + shared, dim=1)
                shared_in = level.shared_gate(shared_in, everything)
            inputs = outputs
        return inputs

    def mixing_units(self) -> list[nn.Module]:
        return [u for level in cast("list[_Level]", list(self.levels)) for u in level.units()]
