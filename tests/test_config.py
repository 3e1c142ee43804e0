"""Config composition and validation: every option composes and builds; bad input fails
fast, before any rank starts, naming the key and the valid choices."""

import os
import re
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

import commands
from conftest import compose_cfg
from hybridrec.data import build_source
from hybridrec.models import build_model
from hybridrec.run.validation import validate

GROUPS = {
    "model": ["dlrm", "dcn", "deepfm", "two_tower", "sasrec", "hstu", "shared_bottom", "mmoe", "ple"],
    "loss": ["pointwise", "mse", "pairwise", "listwise", "approx_ndcg", "sampled_softmax", "next_item"],
    "data": [
        "synthetic",
        "synthetic_criteo",
        "criteo",
        "criteo_binary",
        "movielens",
        "movielens_rank",
        "parquet",
        "example_log",
        "example_days",
        "movielens_seq",
        "parquet_seq",
        "adult",
    ],
    "sharding": [
        "auto",
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "table_column_wise",
        "data_parallel",
        "grid",
    ],
    "optimizer": ["adagrad", "sgd", "adam"],
    "mesh": ["fsdp", "hsdp", "ddp", "single"],
    "topology": ["detect"],
}


@pytest.mark.unit
def test_every_group_option_is_shipped():
    conf = os.path.join(os.path.dirname(__file__), "..", "conf")
    for group, options in GROUPS.items():
        shipped = sorted(f[:-5] for f in os.listdir(os.path.join(conf, group)) if f.endswith(".yaml"))
        if group == "optimizer":  # and the sub-groups optimizer/sparse, optimizer/dense
            assert sorted(os.listdir(os.path.join(conf, group, "sparse"))) == [
                "adagrad.yaml",
                "adam.yaml",
                "rowwise_adagrad.yaml",
                "sgd.yaml",
            ]
            assert sorted(os.listdir(os.path.join(conf, group, "dense"))) == [
                "adagrad.yaml",
                "adagrad_zero.yaml",
                "adam.yaml",
                "adamw.yaml",
                "sgd.yaml",
            ]
        assert shipped == sorted(options), group


@pytest.mark.unit
@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group, option):
    paths = ["data.train_path=x", "data.eval_path=x"] if option.startswith("criteo") else []
    if option == "parquet_seq":
        paths = ["data.path=x", "data.items_column=items", "data.num_items=100"]
    experiment = {"movielens": "movielens", "sampled_softmax": "movielens_retrieval"}.get(option, "ctr")
    if option in ("movielens_rank", "two_tower", "mse", "pairwise", "listwise", "approx_ndcg"):
        experiment = "movielens_rank"  # ctr is Criteo-shaped: no ratings, no lists, no user/item
    if option in ("sasrec", "hstu", "next_item", "movielens_seq", "parquet_seq"):
        experiment = "sequences"  # next-item training: a sequence model, source and loss together
    if option == "example_days":
        experiment = "continuous"  # managed ids: the continuous schedule reads them
    if option in ("shared_bottom", "mmoe", "ple"):
        experiment = "multitask"  # several tasks: data.labels
    cfg = compose_cfg([f"+experiment={experiment}", f"{group}={option}", *paths])
    validate(cfg, world_size=1 if option == "single" else 2)


@pytest.mark.unit
@pytest.mark.parametrize(
    "part,option",
    [("sparse", o) for o in ["rowwise_adagrad", "adagrad", "adam", "sgd"]]
    + [("dense", o) for o in ["adagrad", "adam", "adamw", "sgd"]],
)
def test_every_optimizer_sub_option_composes(part, option):
    cfg = compose_cfg([f"optimizer/{part}={option}"])
    validate(cfg, world_size=1)
    if part == "dense":  # a dense optimizer is instantiated from its node, learning rate included
        opt = instantiate(cfg.optimizer.dense, [torch.nn.Parameter(torch.zeros(2))])
        assert opt.param_groups[0]["lr"] == cfg.optimizer.dense.lr


@pytest.mark.unit
@pytest.mark.parametrize("model", ["dlrm", "dcn", "deepfm"])
def test_ctr_experiment_builds_data_and_model(model):
    cfg = compose_cfg(["+experiment=ctr", f"model={model}"])  # the experiment's sizes for each model
    data = build_source(cfg.data, cfg.seed)
    model = build_model(cfg, data.features, data.num_dense_features)
    assert len(data.features) == len(cfg.data.num_embeddings_per_feature)
    assert [t.num_embeddings for t in model.sparse_module().embedding_bag_configs()] == list(
        cfg.data.num_embeddings_per_feature
    )
    assert len(model.dense_units()) == {"dlrm": 2, "dcn": 3, "deepfm": 2}[cfg.model._target_.split(".")[-2]]
    # summary.json's dense_parameters: every parameter but the tables, by hand for DLRM
    units = sum(p.numel() for u in model.dense_units() for p in u.parameters())
    if cfg.model._target_.endswith("DLRMRanker"):
        bottom = (13 * 512 + 512) + (512 * 256 + 256) + (256 * 64 + 64)
        top_in = 64 + 27 * 26 // 2  # the dense vector and one dot product per pair of the 27 vectors
        assert model.dense_parameter_count() == units == bottom + (top_in * 512 + 512) + (512 * 256 + 256) + (256 + 1)
    else:  # DeepFM's first-order linear layer over the dense features is in the root unit
        assert model.dense_parameter_count() == units + (14 if "deepfm" in cfg.model._target_ else 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.dense.lrr=0.1", "Key 'lrr' not in 'DenseAdagradConfig'"),
        ("data.batch_size=big", "full_key: data.batch_size"),
        ("sharding.types=[diagonal]", "expected one of .*table_wise, row_wise, column_wise"),
        ("mesh.dense=zero3", "expected one of \\[fsdp, hsdp, ddp, single\\]"),
        ("launcher.device=tpu", "expected one of \\[auto, cpu, cuda\\]"),
    ],
)
def test_bad_value_is_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([override])
    assert re.search(message, str(e.value.__cause__)), str(e.value.__cause__)


@pytest.mark.unit
@pytest.mark.parametrize(
    "override,line",
    [
        ("mesh.dense=zero3", "mesh.dense=zero3: invalid value 'zero3', expected one of [fsdp, hsdp, ddp, single]"),
        ("data.batch_size=big", "data.batch_size=big: value 'big' of type 'str' could not be converted to Integer"),
    ],
)
def test_a_value_the_schema_refuses_is_one_line_before_launch(override, line):
    """What the entry points print (``hybridrec.config.overrides.check``), in place of Hydra's
    several lines of OmegaConf's error with the schema's class names."""
    from hybridrec.config import overrides

    with pytest.raises(ValueError) as e:
        overrides.check([override])
    assert str(e.value) == line


@pytest.mark.unit
def test_a_group_option_on_the_search_path_is_accepted_and_suggested(tmp_path):
    """``hydra.searchpath=[file://DIR]`` adds DIR/data/*.yaml to the data options (a converted
    dataset's config): the pre-launch check accepts them and suggests them for a typo."""
    from hybridrec.config import overrides

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my_log.yaml").write_text("defaults:\n  - parquet\n  - _self_\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    overrides.check([search, "data=my_log"])
    with pytest.raises(ValueError, match=r"data=my_lgo is not an option of data \(did you mean data=my_log\?\)"):
        overrides.check([search, "data=my_lgo"])


@pytest.mark.unit
def test_bad_group_option_lists_only_real_choices():
    with pytest.raises(Exception) as e:
        compose_cfg(["sharding=diagonal"])
    text = str(e.value)
    assert "Available options in 'sharding'" in text and "table_row_wise" in text
    assert "schema" not in text.split("Available options")[1].split("Config search path")[0]


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,world_size,message",
    [
        (["data.batch_size=1000"], 3, "data.batch_size=1000 .* world_size=3"),
        (["model.embedding_dim=32"], 1, "dense_arch_layer_sizes must end with model.embedding_dim=32"),
        (["model.over_arch_layer_sizes=[8,2]"], 1, "over_arch_layer_sizes must end with 1"),
        (["train.steps=0"], 1, "train.steps"),
        (["optimizer.sparse._target_=torch.optim.RMSprop"], 1, "cannot be fused.*RowWiseAdagrad"),
        (["+optimizer.dense.momentum=0.9"], 1, "optimizer.dense"),
    ],
)
def test_cross_field_validation(overrides, world_size, message):
    cfg = compose_cfg(overrides)
    with pytest.raises(ValueError, match=message):
        validate(cfg, world_size)


def _cli(*args, timeout=60):
    return commands.run("hybridrec.train", *args, timeout=timeout)


@pytest.mark.slow
def test_cli_bad_group_option_fails_fast_with_choices(tmp_path):
    proc = _cli("+experiment=ctr", "optimizer=adamx", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "optimizer" in proc.stderr and "adagrad" in proc.stderr and "sgd" in proc.stderr
    assert "[rank" not in proc.stderr  # failed while composing: no rank was started


@pytest.mark.slow
def test_cli_bad_world_size_fails_before_any_rank_starts(tmp_path):
    proc = _cli("+experiment=ctr", "launcher.nproc_per_node=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "data.batch_size=2048" in proc.stderr and "world_size=3" in proc.stderr
    assert "[rank" not in proc.stderr  # no rank was started


@pytest.mark.unit
def test_lr_schedule_formula():
    from hybridrec.parallel.optim import lr_multiplier

    f = lr_multiplier(
        compose_cfg(
            [
                "optimizer.dense_schedule.name=linear",
                "optimizer.dense_schedule.warmup_steps=4",
                "optimizer.dense_schedule.decay_start=6",
                "optimizer.dense_schedule.decay_steps=4",
                "optimizer.dense_schedule.end_factor=0.1",
            ]
        ).optimizer.dense_schedule
    )
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # warmup
    assert f(5) == 1.0 and f(6) == 1.0  # constant until decay_start
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5) and f(10) == pytest.approx(0.1) and f(99) == pytest.approx(0.1)
    cos = lr_multiplier(
        compose_cfg(
            ["optimizer.sparse_schedule.name=cosine", "optimizer.sparse_schedule.decay_steps=10"]
        ).optimizer.sparse_schedule
    )
    assert cos(0) == 1.0 and cos(5) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0)
    poly = lr_multiplier(
        compose_cfg(
            ["optimizer.dense_schedule.name=polynomial", "optimizer.dense_schedule.decay_steps=10"]
        ).optimizer.dense_schedule
    )
    assert poly(5) == pytest.approx(0.25) and poly(10) == pytest.approx(0.0)  # (1 - p)^2
    assert lr_multiplier(compose_cfg([]).optimizer.dense_schedule)(1000) == 1.0


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,world_size,message",
    [
        (["mesh=hsdp", "mesh.replicate=2", "mesh.shard=2"], 2, r"replicate=2 x shard=2 = 4 but world_size=2"),
        (["mesh=single"], 2, "mesh=single .* needs 1 rank"),
        (["mesh.reshard_after_forward=0"], 2, "reshard_after_forward"),
        (["optimizer.dense_schedule.name=cosine"], 1, "needs decay_steps >= 1"),
        (["optimizer.clip_grad_norm=-1"], 1, "clip_grad_norm"),
        (["launcher.threads_per_rank=0"], 1, "threads_per_rank must be >= 1"),
    ],
)
def test_mesh_and_optimizer_validation(overrides, world_size, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(overrides), world_size)


@pytest.mark.unit
def test_hsdp_degrees_default_to_ranks_per_node():
    from hybridrec.parallel.parallel_dims import ParallelDims

    degrees = lambda overrides: (lambda d: (d.replicate, d.shard))(
        ParallelDims.build(compose_cfg(overrides).mesh, 16, 8, "cuda")
    )
    assert degrees(["mesh=hsdp"]) == (2, 8)
    assert degrees(["mesh=hsdp", "mesh.replicate=4"]) == (4, 4)
    assert degrees(["mesh=fsdp"]) == (1, 16)


@pytest.mark.unit
def test_fused_adam_is_refused_on_cpu_before_launch():
    from hybridrec.run.validation import check_device

    cfg = compose_cfg(["optimizer=adam"])
    with pytest.raises(ValueError, match="no fused CPU kernel"):
        check_device(cfg, "cpu")
    check_device(cfg, "cuda")  # fine on GPUs
    # data-parallel tables are not fused: plain torch.optim.Adam trains them on any device
    check_device(compose_cfg(["optimizer=adam", "sharding=data_parallel"]), "cpu")
    mixed = "sharding.tables=[{match:t_cat_0,sharding_types:[row_wise]}]"
    with pytest.raises(ValueError, match="no fused CPU kernel"):
        check_device(compose_cfg(["optimizer=adam", "sharding=data_parallel", mixed]), "cpu")


@pytest.mark.unit
def test_sparse_weight_decay_is_refused_not_ignored():
    with pytest.raises(ValueError, match="not applied by TorchRec"):
        validate(compose_cfg(["optimizer.sparse.weight_decay=0.1"]), world_size=1)


@pytest.mark.slow
def test_readme_result_blocks_are_current():
    """README.md quotes benchmarks/results/*.md through marked blocks, never typed by hand."""
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "readme_numbers.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.batch_size=0"], r"^data.batch_size must be >= 1, got 0$"),
        (["data.batch_size=-64"], r"^data.batch_size must be >= 1, got -64$"),
        # -1 x -2 = 2 ranks: the product alone would pass
        (["mesh=hsdp", "mesh.replicate=-1", "mesh.shard=-2"], r"^mesh.replicate must be >= 1 \(or unset\), got -1$"),
        (["mesh=hsdp", "mesh.replicate=0", "mesh.shard=0"], r"^mesh.replicate must be >= 1 \(or unset\), got 0$"),
        (["model.embedding_dim=0"], r"^model.embedding_dim must be >= 1, got 0$"),
        (
            ["+train.stepz=30"],
            r"^unknown key train.stepz \(did you mean train.steps\?\): the keys of train are steps, ",
        ),
        (["+seeed=1"], r"^unknown key seeed \(did you mean seed\?\): the keys of the top level are model, "),
        (
            ["sharding.tables=[{match:t_cat_0}]", "+sharding.tables.0.min_partitions=4"],
            r"^unknown key sharding.tables.0.min_partitions \(did you mean sharding.tables.0.min_partition\?\)",
        ),
        (
            ["data=criteo"],
            r"^data.train_path and data.eval_path are not set: give data.train_path=\.\.\. "
            r"data.eval_path=\.\.\. on the command line or in an experiment$",
        ),
        (["data=criteo", "data.train_path=x"], r"^data.eval_path is not set"),
        (["topology.world_size=0"], r"^topology.world_size must be >= 1 \(or unset\), got 0$"),
        (["topology.world_size=-4"], r"^topology.world_size must be >= 1 \(or unset\), got -4$"),
        (["topology.local_world_size=0"], r"^topology.local_world_size must be >= 1 \(or unset\), got 0$"),
        (
            ["topology.device_memory_gb=-1"],
            r"^topology.device_memory_gb must be > 0 \(or unset to detect it\), got -1.0$",
        ),
        (["topology.host_memory_gb=-1"], r"^topology.host_memory_gb must be > 0 \(or unset to detect it\), got -1.0$"),
    ],
)
def test_bad_sizes_unknown_keys_and_unset_paths_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(overrides), world_size=2)


@pytest.mark.unit
def test_optimizer_keyword_arguments_may_be_added():
    # optimizer.sparse / optimizer.dense are the optimizer's own arguments, checked by its signature
    validate(compose_cfg(["optimizer/dense=adam", "+optimizer.dense.amsgrad=true"]), world_size=1)


@pytest.mark.unit
def test_collective_timeout_fails_a_hung_rank_within_minutes():
    # a stopped rank holds the others for this long; planning and checkpoint writes must fit in it
    assert 120 <= compose_cfg([]).launcher.collective_timeout_s <= 300


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
    for args, line in [
        (["data.batch_size=0"], "hybridrec: invalid config: data.batch_size must be >= 1, got 0"),
        (["checkpoint.resume=/nonexistent"], "hybridrec: checkpoint.resume=/nonexistent: no such checkpoint directory"),
    ]:
        proc = _cli(*args, f"hydra.run.dir={tmp_path}")
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == line
    if torch.version.cuda is None:  # asking for CUDA where torch has none: no silent CPU run
        proc = _cli("launcher.device=cuda", f"hydra.run.dir={tmp_path}")
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert (
            proc.stderr.strip()
            .splitlines()[-1]
            .startswith(
                f"hybridrec: invalid config: launcher.device=cuda but torch {torch.__version__} is a CPU-only build"
            )
        )


@pytest.mark.unit
def test_the_help_lists_every_group_option_and_no_internal_group():
    """`python -m hybridrec.train --help` (conf/hydra/help/hybridrec.yaml) names every option
    of every group a user picks, and no internal group (schema/*, experiment_model/*,
    experiment_loss/*, experiment_data/*, experiment_optimizer/*)."""
    import re

    import yaml

    conf = os.path.join(os.path.dirname(__file__), "..", "conf")
    with open(os.path.join(conf, "hydra", "help", "hybridrec.yaml")) as f:
        help_text = yaml.safe_load(f)["template"]
    section = lambda title: help_text.split(title, 1)[1].split("\n", 1)[1].split("\n==", 1)[0]
    experiments = section("== Experiments")
    for name in os.listdir(os.path.join(conf, "experiment")):
        assert re.search(rf"^\s+{name[:-5]}\s", experiments, re.M), name
    groups = section("== Config groups")
    lines = {}
    for line in groups.splitlines():  # a group's line and its continuations
        if m := re.match(r"\s{2}(\w+)\s+(.*)", line):
            current = m.group(1)
            lines[current] = m.group(2)
        elif line.strip() and lines:
            lines[current] += " " + line.strip()
    for group, options in GROUPS.items():
        for option in options:
            assert re.search(rf"\b{option}\b", lines[group]), f"{group}={option} is not in the help"
    for sub in ("sparse", "dense"):
        for f in os.listdir(os.path.join(conf, "optimizer", sub)):
            assert f[:-5] in lines["optimizer"], f"optimizer/{sub}={f[:-5]}"
    internal = ("schema", "experiment_model", "experiment_loss", "experiment_data", "experiment_optimizer")
    assert not [g for g in internal if g in help_text]
