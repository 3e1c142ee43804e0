"""Sequence rankers: a user's history of items, looked up in one sharded item table, run
through a causal transformer stack; the output at each position scores the next item.

- ``SASRec`` (Kang & McAuley 2018): learned positions, causal softmax self-attention and a
  pointwise feed-forward layer per block (the original's layout: the attention's query is
  the normalized input, which is also its residual).
- ``HSTU`` (Zhai et al. 2024, "Actions Speak Louder than Words"): per block, one projection
  gives U, V, Q, K through SiLU; attention is pointwise, SiLU(QK^T + relative bias) divided by
  the sequence length, not a softmax; the relative bias is learned per relative position
  and per log-bucketed time difference; the output is Linear(LayerNorm(AV) * U), added to
  the input.

The item table is a TorchRec ``EmbeddingCollection`` (one vector per id, no pooling) that
TorchRec's planner places and shards like any table; the batch's ``history``, ``next`` and
``negatives`` features all look it up, so inputs and outputs share it. The blocks are the
model's dense units: FSDP2 wraps each (``mesh.units=arch``, the default of the sequence
experiments), then the root; ``model.activation_checkpointing`` recomputes each block's
activations in the backward instead of keeping them.

Histories are jagged in the batch and padded to ``max_length`` inside the model, right of
the history: with causal attention a real position never attends a padded one, so the
padding changes no output, and every rank pads alike (the shapes do not depend on the world
size). Training: every position's output against its next item and the batch's negatives
(``loss=next_item``). Evaluation: the last position's output ranks every item of the
catalogue for the user's held-out item; the model returns that item's rank (1 = first).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models import Ranker
from hybridrec.models.losses import Loss

FEATURES = ("history", "next", "negatives")


def item_table(features: list[SparseFeature], embedding_dim: int) -> EmbeddingCollection:
    """The one item table every feature looks up, on ``meta`` (the planner places it)."""
    f = features if isinstance(features[0], SparseFeature) else [SparseFeature(**x) for x in features]
    names = [x.name for x in f]
    if sorted(names) != sorted(FEATURES) or len({x.table_name for x in f}) != 1:
        raise ValueError(
            f"a sequence ranker takes the features {', '.join(FEATURES)} of one item table "
            f"(data=movielens_seq or data=parquet_seq), got {names}"
        )
    return EmbeddingCollection(
        [
            EmbeddingConfig(
                name=f[0].table_name,
                embedding_dim=embedding_dim,
                num_embeddings=f[0].num_embeddings,
                feature_names=names,
            )
        ],
        device=torch.device("meta"),
    )


def padded(jt: JaggedTensor, length: int) -> torch.Tensor:
    """A jagged ``[sum(lengths), *]`` as ``[B, length, *]``, each row's values first (its
    lengths are at most ``length``), zeros after."""
    lengths = jt.lengths().long()
    values = jt.values()
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(len(values), device=values.device) - torch.repeat_interleave(starts, lengths)
    out = values.new_zeros(len(lengths), length, *values.shape[1:])
    return out.index_put((rows, position), values)


class Stack(nn.Module):
    """The dense side of a sequence ranker: padded history embeddings ``[B, L, D]`` in, every
    position's output out (padded positions zeros). Its blocks are the model's FSDP2 units;
    training, scoring and the exported user encoder run the same stack."""

    def __init__(
        self,
        dim: int,
        max_length: int,
        blocks: Sequence[nn.Module],
        dropout: float,
        positions: bool,
        activation_checkpointing: bool,
    ) -> None:
        super().__init__()
        self.dim, self.max_length, self.activation_checkpointing = dim, max_length, activation_checkpointing
        self.positions = nn.Embedding(max_length, dim) if positions else None
        if self.positions is not None:
            # N(0, 0.02), as BERT's and GPT-2's positions: nn.Embedding's N(0, 1) is about 9x the
            # scaled item vectors (uniform +-sqrt(1/N) times sqrt(D): std 0.11 at 1,682 x 64),
            # so SASRec first learned where an item sits more than which it is (MovieLens-100k,
            # seed 0: validation NDCG@10 0.0632 at N(0, 1), 0.0651 at std 0.1, 0.0663 at 0.02)
            nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(blocks)
        self.dropout = nn.Dropout(dropout)
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, embedded: torch.Tensor, lengths: torch.Tensor, times: Optional[torch.Tensor]) -> torch.Tensor:
        real = torch.arange(self.max_length, device=embedded.device)[None, :] < lengths[:, None]
        x = embedded * math.sqrt(self.dim)  # the item embedding's scale, as SASRec's
        if self.positions is not None:
            x = x + self.positions.weight[None, : x.shape[1]]
        x = self.dropout(x) * real[..., None]
        if times is None:
            times = torch.zeros(real.shape, dtype=torch.int64, device=x.device)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, times, use_reentrant=False)
            else:
                x = block(x, times)
            x = x * real[..., None]
        return self.final_norm(x) * real[..., None]


class SequenceRanker(Ranker):
    """What SASRec and HSTU share: the item table, the padding, the loss and the ranking. A
    subclass gives the stack's blocks (each ``block(x, times)`` -> x, ``[B, L, D]``) and
    whether it adds learned positions."""

    needs_next_item = True

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        for key in ("num_blocks", "num_heads", "max_length"):
            if cfg[key] < 1:
                raise ValueError(f"model.{key}={cfg[key]}: must be >= 1")
        if not 0 <= cfg.dropout < 1:
            raise ValueError(f"model.dropout={cfg.dropout}: must be in [0, 1)")

    def __init__(
        self,
        features: list[SparseFeature],
        embedding_dim: int,
        max_length: int,
        blocks: Sequence[nn.Module],
        positions: bool,
        dropout: float,
        activation_checkpointing: bool,
        mask_history: bool,
        loss: Loss,
        l2_normalize: bool = False,
    ) -> None:
        super().__init__(loss)
        self.items = item_table(features, embedding_dim)
        self.max_length, self.mask_history, self.l2_normalize = max_length, mask_history, l2_normalize
        self.stack = Stack(embedding_dim, max_length, blocks, dropout, positions, activation_checkpointing)

    def unit(self, x: torch.Tensor) -> torch.Tensor:
        """A user's output or an item's vector as it is scored: with ``l2_normalize``, scaled to
        length 1 (the score is then a cosine, and the loss's temperature sets its sharpness,
        as generative-recommenders trains); else as it is."""
        return F.normalize(x, dim=-1) if self.l2_normalize else x

    def encode(self, history: JaggedTensor, times: Optional[torch.Tensor]) -> torch.Tensor:
        """Every position's output ``[B, L, D]`` for the histories (padded positions: zeros)."""
        return self.stack(padded(history, self.max_length), history.lengths().long(), times)

    # -- the Ranker contract -----------------------------------------------------------------
    def forward(self, batch: RecBatch):
        # TorchRec's pipeline traces forward with torch.fx to find the sharded table's input;
        # what follows the lookup (jagged padding, data-dependent shapes) is one opaque call.
        return _after_lookup(self, self.items(batch.sparse_features), batch)

    def after_lookup(self, looked_up: dict[str, JaggedTensor], batch: RecBatch):
        """Training: the loss; evaluation: each row's held-out item's rank (see forward)."""
        history, nxt, negatives = (looked_up[name] for name in FEATURES)
        out = self.encode(history, batch.times)
        if self.training:
            loss = self._loss(out, history, nxt, negatives, batch)
            zeros = batch.labels.new_zeros(batch.labels.shape)
            return loss, (loss.detach(), zeros, zeros)
        ranks, masked = self._ranks(out, history, nxt, negatives, batch)
        loss = ranks.new_zeros(())
        # the labels' slot of a next-item row (it has no label) carries the ranks with the
        # history masked, when asked: evaluation reports them beside the unmasked ones
        return loss, (loss, ranks, batch.labels.detach() if masked is None else masked)

    def _loss(
        self, out: torch.Tensor, history: JaggedTensor, nxt: JaggedTensor, negatives: JaggedTensor, batch: RecBatch
    ) -> torch.Tensor:
        """Every real position's output against its next item (``nxt``, aligned with the
        history) and the negatives the batch carries (in its first row). A position whose
        next id is 0 has no target (a window's context, data.train_windows=overlap)."""
        lengths = history.lengths().long()
        features = batch.sparse_features.to_dict()
        # (row, position) of every position with a target, row by row: the jagged order
        ids = padded(features["next"], self.max_length)
        row, position = torch.nonzero(ids > 0).unbind(1)
        first = int(negatives.lengths()[0]) if len(negatives.lengths()) else 0
        return self.loss(
            self.unit(out[row, position]),
            self.unit(padded(nxt, self.max_length)[row, position]),
            ids[row, position],
            self.unit(negatives.values()[:first]),
            features["negatives"].values()[:first],
            row,
            len(lengths),
            getattr(self, "sampler_log_q", None),
            getattr(self, "sampled_by_popularity", False),
        )

    @torch.no_grad()
    def _ranks(
        self, out: torch.Tensor, history: JaggedTensor, nxt: JaggedTensor, negatives: JaggedTensor, batch: RecBatch
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The rank (1 = first) of each row's held-out item among every item of the catalogue
        (the negatives of an evaluated batch, in its first row), by the last position's
        output; ties count against it. With ``mask_history``, also its rank when the items
        of the user's history are not ranked (the held-out item always is); else None."""
        lengths = history.lengths().long()
        last = self.unit(out[torch.arange(len(lengths), device=out.device), (lengths - 1).clamp(min=0)])
        first = int(negatives.lengths()[0]) if len(negatives.lengths()) else 0
        catalogue = self.unit(negatives.values()[:first])  # [N - 1, D]: items 1..N-1, in id order
        scores = last @ catalogue.T  # [B, N - 1]
        # the held-out item's own score, from the same product: compared with itself, a
        # separately computed dot product could differ in the last bit and beat it
        target_ids = batch.sparse_features.to_dict()["next"].values()
        target = scores.gather(1, (target_ids - 1).clamp(0, first - 1)[:, None])[:, 0]
        beaten = scores > target[:, None]
        # a diverged model's NaN scores beat nothing: say NaN, not rank 1 (evaluation's finite check)
        finite = torch.isfinite(target) & torch.isfinite(scores).all(1)
        nan = torch.full((len(lengths),), float("nan"), dtype=out.dtype, device=out.device)
        ranks = torch.where(finite, 1.0 + beaten.sum(1).to(out.dtype), nan)
        if not self.mask_history:
            return ranks, None
        ids = batch.sparse_features.to_dict()["history"].values()
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=out.device), lengths)
        seen = torch.zeros_like(beaten)
        keep = (ids >= 1) & (ids <= first) & (ids != target_ids[rows])
        seen[rows[keep], ids[keep] - 1] = True
        return ranks, torch.where(finite, 1.0 + (beaten & ~seen).sum(1).to(out.dtype), nan)

    def score(self, batch: RecBatch) -> torch.Tensor:  # the Ranker contract: one score per row
        """The last position's score of each row's ``next`` item (the held-out one)."""
        looked_up = self.items(batch.sparse_features)
        out = self.encode(looked_up["history"], batch.times)
        lengths = looked_up["history"].lengths().long()
        last = self.unit(out[torch.arange(len(lengths), device=out.device), (lengths - 1).clamp(min=0)])
        return (last * self.unit(looked_up["next"].values()[: len(lengths)])).sum(1)

    def use_sampler(self, log_q: Optional[torch.Tensor], by_popularity: bool) -> None:
        """Each item's log training popularity, for the loss's log-q correction of in-batch
        negatives and of negatives ``by_popularity`` (None: uniform sampling, no correction).
        Not part of the checkpoint: the data's, and scoring needs none."""
        self.register_buffer("sampler_log_q", None if log_q is None else log_q.to(torch.float32), persistent=False)
        self.sampled_by_popularity = by_popularity

    def encoder(self) -> "UserEncoder":
        """The user side alone, for export: padded histories in, the last position's output
        out, the item table a plain ``nn.Embedding`` (its weights, unsharded)."""
        return UserEncoder(self)

    def item_vectors(self, with_row_0: bool = False) -> torch.Tensor:
        """``[N - 1, D]``: every item's vector as it is scored (``unit``), rows 1..N-1 of the
        (unsharded) table; with ``with_row_0``, the whole table as histories look it up (row
        0: no item, what padding looks up)."""
        weight = self.items.embeddings[next(iter(self.items.embeddings))].weight.detach()
        return weight if with_row_0 else self.unit(weight[1:])

    def sparse_module(self) -> nn.Module:
        return self.items

    def dense_units(self) -> list[nn.Module]:
        return list(self.stack.blocks)


class UserEncoder(nn.Module):
    """``forward(history, lengths, times) -> [B, D]``: ``history`` int64 ``[B, max_length]``,
    each row's items oldest first and 0 after them, ``lengths`` int64 ``[B]`` (>= 1), ``times``
    int64 ``[B, max_length]`` (HSTU's time bias; zeros do for SASRec). Scores are
    ``user @ item_vectors.T``: the catalogue's top k is ``torch.topk`` of them."""

    def __init__(self, model: SequenceRanker) -> None:
        super().__init__()
        self.table = nn.Embedding.from_pretrained(model.item_vectors(with_row_0=True).clone(), freeze=True)
        self.stack, self.l2_normalize = model.stack, model.l2_normalize

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        out = self.stack(self.table(history), lengths, times)
        # out.size(0), not len(): len() is a Python int, which would fix the exported batch size
        last = out[torch.arange(out.size(0), device=out.device), lengths - 1]
        return F.normalize(last, dim=-1) if self.l2_normalize else last


@torch.fx.wrap
def _after_lookup(model: SequenceRanker, looked_up: dict[str, JaggedTensor], batch: RecBatch):
    return model.after_lookup(looked_up, batch)


class SASRecBlock(nn.Module):
    """One SASRec block: causal multi-head self-attention whose query is the normalized input
    (and its residual), then a pointwise two-layer feed-forward with its own residual.

    Written over ``F.scaled_dot_product_attention`` rather than ``nn.MultiheadAttention``, whose
    packed input projection gives the keys a bias: a key bias adds ``q . b`` to every score of
    a query's row, which the softmax cancels, so its gradient is zero up to rounding, and an
    adaptive optimizer (Adam, Adagrad) turns that rounding into full-size steps of a parameter
    that does nothing, different on every world size. The keys here have no bias."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attn_norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        heads = lambda t: t.view(B, L, self.heads, D // self.heads).transpose(1, 2)  # [B, H, L, D/H]
        q = self.attn_norm(x)
        # histories are right-padded, so the causal mask alone keeps every real position off
        # the padding after it (what padding's own positions compute is never read)
        attended = F.scaled_dot_product_attention(
            heads(self.q(q)),
            heads(self.k(x)),
            heads(self.v(x)),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
        x = self.ffn_norm(q + self.out(attended.transpose(1, 2).reshape(B, L, D)))
        return x + self.ffn(x)


class SASRec(SequenceRanker):
    """model=sasrec: item embedding (scaled by sqrt(D)) plus a learned position embedding,
    ``num_blocks`` SASRec blocks, a final LayerNorm."""

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        super().check_config(cfg)
        if cfg.embedding_dim % cfg.num_heads:  # each head attends over embedding_dim / num_heads
            raise ValueError(
                f"model.embedding_dim={cfg.embedding_dim} must be divisible by model.num_heads="
                f"{cfg.num_heads} (SASRec's heads split the embedding)"
            )

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        max_length: int,
        num_blocks: int,
        num_heads: int,
        dropout: float,
        activation_checkpointing: bool,
        mask_history: bool,
        loss: Loss,
        l2_normalize: bool = False,
    ) -> None:
        blocks = [SASRecBlock(embedding_dim, num_heads, dropout) for _ in range(num_blocks)]
        super().__init__(
            features,
            embedding_dim,
            max_length,
            blocks,
            True,
            dropout,
            activation_checkpointing,
            mask_history,
            loss,
            l2_normalize,
        )


class RelativeBias(nn.Module):
    """HSTU's relative attention bias: a learned value per relative position (j - i) and per
    bucket of |t_i - t_j| (log buckets: floor(ln(max(dt, 1)) / 0.301), as generative-recommenders
    buckets seconds), summed."""

    def __init__(self, max_length: int, time_buckets: int) -> None:
        super().__init__()
        self.max_length, self.time_buckets = max_length, time_buckets
        self.position = nn.Parameter(torch.zeros(2 * max_length - 1))
        self.time = nn.Parameter(torch.zeros(time_buckets + 1))

    def forward(self, times: torch.Tensor) -> torch.Tensor:
        length = times.shape[1]
        idx = torch.arange(length, device=times.device)
        position = self.position[idx[None, :] - idx[:, None] + self.max_length - 1]  # [L, L]
        dt = (times[:, :, None] - times[:, None, :]).abs().clamp(min=1).to(torch.float32)
        bucket = (torch.log(dt) / 0.301).long().clamp(max=self.time_buckets)
        return position[None] + self.time[bucket]  # [B, L, L]


class HSTUBlock(nn.Module):
    """One HSTU layer: U, V, Q, K = split(SiLU(Linear(LayerNorm(x)))); A = SiLU(QK^T + rab) / n
    under the causal mask; x + Linear(Dropout(LayerNorm(AV) * U))."""

    def __init__(
        self,
        dim: int,
        heads: int,
        attention_dim: int,
        linear_dim: int,
        dropout: float,
        max_length: int,
        time_buckets: int,
    ) -> None:
        super().__init__()
        self.heads, self.attention_dim, self.linear_dim, self.max_length = heads, attention_dim, linear_dim, max_length
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, heads * (2 * linear_dim + 2 * attention_dim))
        self.out_norm = nn.LayerNorm(heads * linear_dim)
        self.out = nn.Linear(heads * linear_dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.bias = RelativeBias(max_length, time_buckets)

    def forward(self, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        H, a, d = self.heads, self.attention_dim, self.linear_dim
        u, v, q, k = torch.split(F.silu(self.uvqk(self.norm(x))), [H * d, H * d, H * a, H * a], dim=-1)
        q, k, v = q.view(B, L, H, a), k.view(B, L, H, a), v.view(B, L, H, d)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) + self.bias(times)[:, None]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        attention = F.silu(scores) * causal / self.max_length
        av = torch.einsum("bhij,bjhd->bihd", attention, v).reshape(B, L, H * d)
        return x + self.out(self.dropout(self.out_norm(av) * u))


class HSTU(SequenceRanker):
    """model=hstu: item embeddings (no position embedding: the relative bias carries position
    and time), ``num_blocks`` HSTU layers, a final LayerNorm."""

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        max_length: int,
        num_blocks: int,
        num_heads: int,
        dropout: float,
        activation_checkpointing: bool,
        mask_history: bool,
        attention_dim: int,
        linear_dim: int,
        time_buckets: int,
        loss: Loss,
        l2_normalize: bool = False,
    ) -> None:
        blocks = [
            HSTUBlock(embedding_dim, num_heads, attention_dim, linear_dim, dropout, max_length, time_buckets)
            for _ in range(num_blocks)
        ]
        super().__init__(
            features,
            embedding_dim,
            max_length,
            blocks,
            False,
            dropout,
            activation_checkpointing,
            mask_history,
            loss,
            l2_normalize,
        )
