"""Every experiment with every model: `+experiment=E model=M` composes and validates, or is
refused before launch in one line that says why and names what fits. Experiments and models
are read from conf/, so a new one is covered without editing this file."""

import os

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_cfg
from hybridrec.run.validation import validate

pytestmark = pytest.mark.unit


def _options(group: str) -> list[str]:
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))


EXPERIMENTS, MODELS = _options("experiment"), _options("model")


def test_the_lists_are_read_from_conf():
    assert {"ctr", "movielens", "movielens_retrieval"} <= set(EXPERIMENTS)
    assert {"dlrm", "dcn", "deepfm", "two_tower"} <= set(MODELS)


@pytest.mark.parametrize("experiment,model", [(e, m) for e in EXPERIMENTS for m in MODELS])
def test_experiment_composes_with_model(experiment, model):
    cfg = compose_cfg([f"+experiment={experiment}", f"model={model}"])  # never a Hydra key error
    ranker, loss, source = (get_class(cfg[g]._target_) for g in ("model", "loss", "data"))
    # The only pairs that may be refused are those the declared contracts rule out; the
    # refusal says why and names the experiment or model that fits.
    next_item = (ranker.needs_next_item, loss.needs_next_item, source.next_item)
    labels = cfg.data.get("labels")
    # (in the order validation checks them: the first problem found is the one reported)
    if ranker.multi_task and not labels:
        expected = r"trains several tasks: set data.labels, .*\+experiment=multitask"
    elif labels and not ranker.multi_task and len(labels) > 1:
        expected = r"scores one binary label: use model=shared_bottom, mmoe or ple"
    elif loss.in_batch_negatives and not ranker.in_batch_negatives:
        expected = r"scores users against in-batch items: .*\(model=two_tower\)"
    elif any(next_item) and not all(next_item):
        expected = r"next-item training takes a sequence model .*\+experiment=sequences"
    elif ranker.needs_user_item_features and not source.user_item_features:
        expected = r"needs user and item features: .*\+experiment=movielens_retrieval"
    else:
        validate(cfg, cfg.launcher.nproc_per_node)
        return
    with pytest.raises(ValueError, match=expected) as refused:
        validate(cfg, cfg.launcher.nproc_per_node)
    assert "\n" not in str(refused.value)  # train.py prints it as one `hybridrec: ...` line


@pytest.mark.parametrize(
    "group, chosen_by", [("model", "model"), ("loss", "loss"), ("data", "model"), ("optimizer", "model")]
)
def test_every_experiment_model_loss_data_and_optimizer_file_is_used(group, chosen_by):
    """experiment_<group>/<experiment>/<option>.yaml is optional in the defaults list, so a
    file whose directory or name is misspelled would be skipped in silence: each must name a
    shipped experiment and an option of the group that chooses it (experiment_data and
    experiment_optimizer: the model), and its values must be what that pair trains."""
    root = os.path.join(CONF_DIR, f"experiment_{group}")
    options = {f[:-5] for f in os.listdir(os.path.join(CONF_DIR, chosen_by)) if f.endswith(".yaml")}
    files = [(e, f[:-5]) for e in sorted(os.listdir(root)) for f in sorted(os.listdir(os.path.join(root, e)))]
    assert files, root
    for experiment, option in files:
        where = f"experiment_{group}/{experiment}/{option}.yaml"
        assert experiment in EXPERIMENTS and option in options, where
        values = OmegaConf.load(os.path.join(root, experiment, f"{option}.yaml"))
        cfg = compose_cfg([f"+experiment={experiment}", f"{chosen_by}={option}"])
        assert OmegaConf.merge(cfg[group], values) == cfg[group], where
