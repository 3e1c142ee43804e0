"""The retrieval baseline beside two-tower: rank every unseen movie by its number of positive
training ratings, on exactly the eval lists of ``+experiment=movielens_retrieval``.

    make data-movielens && .venv/bin/python benchmarks/popularity_baseline.py
"""

import os

import numpy as np
from hydra import compose, initialize_config_dir

from hybridrec.config import register_configs
from hybridrec.data import build_source
from hybridrec.reports.metrics import ranking_metrics

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hybridrec", "conf")


def main() -> None:
    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=movielens_retrieval"])
    data = build_source(cfg.data, cfg.seed)
    train = data.split_rows["train"]
    popularity = np.bincount(data.item[train][data.label[train] > 0], minlength=data.features[1].num_embeddings)
    e = data.eval_rows["eval"]
    # ties (equally popular movies) broken at random, not by id order
    scores = popularity[e["item"]] + np.random.default_rng(0).random(len(e["item"])) * 1e-3
    print(ranking_metrics(scores, e["rating"], e["user"], data.threshold, data.ranking_k))


if __name__ == "__main__":
    main()
