"""Next-item recommendation on MovieLens-100k: hybridrec's SASRec and HSTU beside two
baselines on the same leave-one-out split, and beside a plain single-process PyTorch SASRec
on the same batches (the speed reference).

- popularity: every user gets the items most interacted with in training, in that order;
- item-to-item transitions: an item's score is how often it followed the user's last item in
  the training sequences (popularity breaks ties);
- hybridrec: ``python -m hybridrec.train +experiment=sequences model=<sasrec|hstu>`` with
  the settings below, its test metrics (the checkpoint of the best validation NDCG@10);
- plain PyTorch SASRec: the same architecture written with torch.nn alone (``nn.Embedding``
  for the items, no TorchRec, no sharding, no pipeline), trained on the batches hybridrec's
  loader gives, with the same full softmax and optimizers; its steps/s against hybridrec's
  at one rank, measured alternately.

Every item of the catalogue is ranked for each user's held-out item (nothing masked): HR and
NDCG at 10 and 50, MRR; and HR and NDCG at 10 with the user's history left out of the ranking
(``model.mask_history``), as most public recipes report. The published MovieLens-1M figures (generative-recommenders' README)
are quoted as the field's reference points, not as comparable numbers: another dataset.

    python benchmarks/sequences.py [--steps 1500] [--reps 2]

Writes benchmarks/results/SEQUENCES.md and sequences.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common import compose_config, machine, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
# generative-recommenders' README, MovieLens-1M, full ranking: (HR@10, NDCG@10)
PUBLISHED_ML1M = {"SASRec": (0.2853, 0.1603), "HSTU": (0.3097, 0.1720), "HSTU-large": (0.3294, 0.1893)}
# on top of +experiment=sequences; mask_history also ranks with the history left out, beside
# (training and the objective are unchanged)
SETTINGS = ["checkpoint.keep_best=true", "model.mask_history=true"]


def _metrics(ranks: np.ndarray) -> dict[str, float]:
    from hybridrec.reports.metrics import next_item_metrics

    return next_item_metrics(torch.from_numpy(ranks.astype(np.float64)))


def _targets(source, split: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each user's held-out item of ``split`` and the history before it."""
    cut = {"valid": 2, "eval": 1}[split]
    targets = source.items[source.ends - cut]
    histories = [source.items[s : e - cut] for s, e in zip(source.starts, source.ends)]
    return targets, histories


def _rank_of(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """1 + the items scored above each row's target (ties count against it, as evaluation's)."""
    own = scores[np.arange(len(targets)), targets]
    return 1 + (scores > own[:, None]).sum(1)


def _masked(scores: np.ndarray, histories: list[np.ndarray], targets: np.ndarray) -> np.ndarray:
    """The scores with each user's history left out (its held-out item always ranked), as
    hybridrec's ``model.mask_history`` ranks."""
    out = scores.copy()
    for r, history in enumerate(histories):
        out[r, history[history != targets[r]]] = -np.inf
    return out


def _both(scores: np.ndarray, histories: list[np.ndarray], targets: np.ndarray) -> dict[str, float]:
    """The metrics of ``scores``, and those with the history masked as ``masked_<metric>``."""
    masked = _metrics(_rank_of(_masked(scores, histories, targets), targets))
    return _metrics(_rank_of(scores, targets)) | {f"masked_{k}": v for k, v in masked.items() if k != "n"}


def baselines(source) -> dict[str, dict[str, float]]:
    """Popularity and item-to-item transitions on the test split, also with the history masked."""
    targets, histories = _targets(source, "eval")
    popularity = source.popularity.copy()
    popularity[0] = -1  # row 0 is no item: never ranked
    pop_scores = np.broadcast_to(popularity, (len(targets), len(popularity)))
    transitions = np.zeros((source.catalogue, source.catalogue))
    for s, e in zip(source.starts, source.ends):
        train = source.items[s : e - 2]
        np.add.at(transitions, (train[:-1], train[1:]), 1.0)
    last = np.array([h[-1] for h in histories])
    tie = popularity / (popularity.max() + 1)  # below one count: breaks ties only
    transition_scores = transitions[last] + tie[None, :]
    transition_scores[:, 0] = -1
    return {
        "popularity": _both(np.array(pop_scores), histories, targets),
        "item-to-item transitions": _both(transition_scores, histories, targets),
    }


class PlainSASRec(nn.Module):
    """SASRec in plain PyTorch: what a team would write without hybridrec (the speed reference),
    with hybridrec's dropout (on the input, the attention weights and the feed-forward)."""

    def __init__(self, items: int, dim: int, length: int, blocks: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.items, self.positions = nn.Embedding(items, dim), nn.Embedding(length, dim)
        self.dim, self.length = dim, length
        self.attn_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(blocks))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True) for _ in range(blocks)
        )
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(blocks))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim), nn.Dropout(dropout))
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        real = torch.arange(self.length)[None, :] < lengths[:, None]
        x = self.dropout(self.items(history) * math.sqrt(self.dim) + self.positions.weight[None]) * real[..., None]
        causal = torch.ones(self.length, self.length, dtype=torch.bool).triu(1)
        for attn_norm, attn, ffn_norm, ffn in zip(self.attn_norms, self.attns, self.ffn_norms, self.ffns):
            q = attn_norm(x)
            x = ffn_norm(q + attn(q, x, x, attn_mask=causal, need_weights=False)[0])
            x = (x + ffn(x)) * real[..., None]
        out = self.norm(x)[real]
        logits = out @ self.items.weight[1:].T
        per_position = F.cross_entropy(logits, targets - 1, reduction="none")
        user = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        per_user = torch.zeros(len(lengths)).index_add_(0, user, per_position)
        return (per_user / lengths.clamp(min=1)).sum() / len(lengths)


def plain_rate(cfg, steps: int) -> float:
    """Steps/s of the plain PyTorch SASRec on hybridrec's batches (after 10 warm-up steps)."""
    from hybridrec.data import build_source, loader

    torch.manual_seed(0)
    data = build_source(cfg.data, 0)
    m = cfg.model
    model = PlainSASRec(data.catalogue, m.embedding_dim, cfg.data.max_length, m.num_blocks, m.num_heads, m.dropout)
    sparse = torch.optim.Adagrad(model.items.parameters(), lr=cfg.optimizer.sparse.lr)
    dense = torch.optim.Adam(
        [p for n, p in model.named_parameters() if not n.startswith("items.")], lr=cfg.optimizer.dense.lr
    )
    tick = None
    for step, batch in enumerate(loader.batches(data, "train", 0, 1, steps), 1):
        features = batch.sparse_features.to_dict()
        history = features["history"].to_padded_dense(desired_length=cfg.data.max_length, padding_value=0)
        loss = model(history, features["history"].lengths().long(), features["next"].values())
        sparse.zero_grad(), dense.zero_grad()
        loss.backward()
        sparse.step(), dense.step()
        if step == 10:
            tick = time.perf_counter()
    return (steps - 10) / (time.perf_counter() - tick)


def hybridrec_run(model: str, steps: int, out: str) -> dict:
    summary = train_summary(
        ["+experiment=sequences", f"model={model}", f"train.steps={steps}", f"checkpoint.dir={out}/ckpt", *SETTINGS],
        out,
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=1500, help="the most (the experiment's); early stopping may end sooner"
    )
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions of the speed comparison")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    from hybridrec.data import build_source

    cfg = compose_config(["+experiment=sequences", *SETTINGS])
    source = build_source(cfg.data, 0)
    res: dict = {"baselines": baselines(source), "steps": args.steps, "settings": SETTINGS, "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        res["hybridrec"] = {}
        for model in ("sasrec", "hstu"):
            summary = hybridrec_run(model, args.steps, os.path.join(tmp, model))
            res["hybridrec"][model] = {
                "eval": summary["eval"],
                "samples_per_second": summary["samples_per_second"],
                "steady": summary["train"]["steady_samples_per_second"],
                "best_step": summary["objective"]["best_step"],
            }
        # speed: hybridrec's SASRec (steps/s from its summary) against the plain loop, alternating
        rates = {"hybridrec": [], "plain PyTorch": []}
        speed_steps = 60
        for rep in range(args.reps):
            order = ["hybridrec", "plain PyTorch"] if rep % 2 == 0 else ["plain PyTorch", "hybridrec"]
            for name in order:
                if name == "hybridrec":
                    s = train_summary(
                        [
                            "+experiment=sequences",
                            f"train.steps={speed_steps}",
                            "train.log_every=10",
                            "train.eval_every=0",
                            "train.early_stop_patience=0",
                        ],
                        os.path.join(tmp, f"speed{rep}"),
                    )
                    rates[name].append(s["train"]["steady_samples_per_second"] / cfg.data.batch_size)
                else:
                    rates[name].append(plain_rate(cfg, speed_steps))
        res["speed"] = {k: v for k, v in rates.items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sequences.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(os.path.join(args.out, "SEQUENCES.md"), report(res), "sequences")


def report(res: dict) -> list[str]:
    m = res["machine"]
    row = lambda name, e: (
        f"| {name} | {e['hr@10']:.4f} | {e['ndcg@10']:.4f} | {e['hr@50']:.4f} | {e['ndcg@50']:.4f} | {e['mrr']:.4f} | "
        f"{e['masked_hr@10']:.4f} | {e['masked_ndcg@10']:.4f} |"
    )
    L = [
        "# Next-item recommendation: MovieLens-100k",
        "",
        f"`python benchmarks/sequences.py --steps {res['steps']}` on {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}. Test split (each user's last item), every item of the catalogue ranked, nothing masked "
        f"(the last two columns: ranked with the user's history left out, as most public recipes report); "
        f"hybridrec's runs: `+experiment=sequences {' '.join(res['settings'])}`, up to {res['steps']} steps of 128 "
        f"training rows with the experiment's early stopping, scored with the checkpoint of the best validation NDCG@10.",
        "",
        "| model | HR@10 | NDCG@10 | HR@50 | NDCG@50 | MRR | HR@10, history masked | NDCG@10, history masked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in res["baselines"].items():
        L.append(row(name, e))
    for model, r in res["hybridrec"].items():
        L.append(
            row(f"hybridrec {model.upper() if model == 'hstu' else 'SASRec'} (best step {r['best_step']})", r["eval"])
        )
    L += [
        "",
        "The field's reference points, MovieLens-1M (generative-recommenders' README; another dataset, "
        "6,040 users and 3,706 items against 943 and 1,682 here, not comparable numbers):",
        "",
        "| model | HR@10 | NDCG@10 |",
        "|---|---:|---:|",
    ]
    L += [f"| {name} (ML-1M) | {hr:.4f} | {ndcg:.4f} |" for name, (hr, ndcg) in PUBLISHED_ML1M.items()]
    speed = res["speed"]
    h, p = statistics.median(speed["hybridrec"]), statistics.median(speed["plain PyTorch"])
    ratios = sorted(a / b for a, b in zip(speed["hybridrec"], speed["plain PyTorch"]))
    L += [
        "",
        "## Speed",
        "",
        f"One process, SASRec, the same batches (steps/s after 10 warm-up steps, median of {len(ratios)} "
        f"alternating repetitions, ratio per repetition):",
        "",
        "| hybridrec steps/s | plain PyTorch steps/s | hybridrec / plain |",
        "|---:|---:|---:|",
        f"| {h:.2f} | {p:.2f} | {statistics.median(ratios):.2f} ({ratios[0]:.2f} - {ratios[-1]:.2f}) |",
    ]
    return L


if __name__ == "__main__":
    main()
