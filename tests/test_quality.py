"""What the shipped experiments train: no loss spike after the first step, at 1 and 2 ranks,
and bf16 dense compute that learns what fp32 learns (long enough to catch a constant
predictor, which a loss bound over a few steps does not)."""

import os

import pytest
from conftest import compose_cfg
from dist_helpers import spawn, train_and_summarize

pytestmark = pytest.mark.dist  # every test reads runs of launched ranks

MOVIELENS = os.path.join(os.path.dirname(__file__), "..", "data", "ml-100k", "u.data")
STEPS = 30
# CPU-sized versions of the experiments: their optimizers, models and data, fewer steps and
# smaller eval sets; dcnv2_criteo1tb with its tables capped at 20k rows and a CPU batch (its
# 220 lookups per sample and 128-wide DCN cost ~1.5 s per step at batch 2048 on 2 cores).
FAST = ["train.log_every=1", f"train.steps={STEPS}", "data.eval_batches=2"]
DCNV2_TABLES = "[" + ",".join(str(min(n, 20_000)) for n in [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
    976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]) + "]"
EXPERIMENTS = {
    "ctr": ["data.valid_batches=1"],
    "dcnv2_criteo1tb": ["data.valid_batches=1", "data.batch_size=512", f"data.num_embeddings_per_feature={DCNV2_TABLES}",
                        "topology.compute_device=auto"],
    "movielens": ["data.eval_batches=4"],
    "movielens_rank": [],
    "movielens_retrieval": [],
    "sequences": [],  # SASRec, a full softmax over MovieLens' catalogue
}


# ctr's model and optimizer on 8 smaller tables: learns the planted signal in 120 steps.
CTR_SMALL = ["+experiment=ctr", "data.num_embeddings_per_feature=[20000,10000,5000,2000,1000,500,100,20]",
             "data.batch_size=1024", "train.steps=120", "train.log_every=20", "data.eval_batches=4",
             "data.valid_batches=1"]
BF16 = ["mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"]
MIXED_PRECISION = {"fp32": CTR_SMALL, "bf16 root": [*CTR_SMALL, *BF16, "mesh.units=root"],
                   "bf16 arch": [*CTR_SMALL, *BF16, "mesh.units=arch"]}


def _experiments():
    names = list(EXPERIMENTS)
    if not os.path.isfile(MOVIELENS):  # `make test` fetches it first (make data-movielens)
        names = [n for n in names if not n.startswith("movielens") and n != "sequences"]
    return names


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """world size -> run name -> per-step losses and summary. One launch per world size
    trains every experiment (the 2-rank one also the mixed-precision runs): process start-up
    is paid once per world size."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            runs = {n: [f"+experiment={n}", *FAST, *EXPERIMENTS[n]] for n in _experiments()}
            if world_size == 2:
                runs.update(MIXED_PRECISION)
            cfgs = [compose_cfg(overrides) for overrides in runs.values()]
            out = str(tmp_path_factory.mktemp(f"world{world_size}"))
            cache[world_size] = dict(zip(runs, spawn(train_and_summarize, world_size, cfgs, out)))
        return cache[world_size]

    return get


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_no_loss_spike_after_the_first_step(trained, name, world_size):
    """Every shipped experiment: no step's global loss after step 1 exceeds 1.5x step 1's."""
    if name not in _experiments():  # a shipped experiment left unchecked is a failure, not a skip
        pytest.fail(f"{MOVIELENS} is missing: `make data-movielens` writes it (`make test` does first)")
    losses = trained(world_size)[name]["losses"]
    assert len(losses) == STEPS, name
    assert max(losses[1:]) <= 1.5 * losses[0], f"{name}: step 1 {losses[0]:.4f}, max later {max(losses[1:]):.4f}"


def test_bf16_dense_compute_learns_what_fp32_learns(trained):
    """FSDP2 mixed precision (bf16 compute, fp32 reduction) with one root unit (ctr's
    default) and with a unit per block learns the planted signal: far above a constant
    predictor's 0.5, and near fp32. 120 steps is mid-learning, where bf16 rounding shifts the
    curve a little (measured: 0.819 vs 0.836); the full 400-step ctr run ends within 1e-4 of
    fp32 (README, mixed precision)."""
    fp32, root, arch = (trained(2)[name]["summary"]["eval"]["auc"] for name in MIXED_PRECISION)
    assert fp32 > 0.75 and root > 0.75 and arch > 0.75
    assert root == pytest.approx(fp32, abs=0.03) and arch == pytest.approx(fp32, abs=0.03)


def test_bf16_on_one_rank_is_autocast_and_learns_what_fp32_learns(tmp_path):
    """One rank: mesh.param_dtype runs the dense blocks under autocast, without FSDP2 (no
    peer to shard with), and learns the planted signal as fp32 does. (On a CPU without bf16
    instructions it is slower than fp32: the run says so; the numbers are what is checked.)"""
    base = ["+experiment=ctr", "data.num_embeddings_per_feature=[2000,1000,500,100]", "data.batch_size=256",
            "train.steps=80", "train.log_every=20", "data.eval_batches=4", "data.valid_batches=1"]
    fp32, bf16 = (r["summary"] for r in spawn(train_and_summarize, 1, [compose_cfg(base), compose_cfg(
        [*base, *BF16])], str(tmp_path)))
    assert bf16["dense_parallel"] == "single"  # autocast, not FSDP2's per-step work
    assert fp32["eval"]["auc"] > 0.7 and bf16["eval"]["auc"] == pytest.approx(fp32["eval"]["auc"], abs=0.03)
