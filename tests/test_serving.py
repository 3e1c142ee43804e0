"""Raw rows into an export's program inputs (``hybridrec.serving``): for the synthetic click
log, MovieLens and the feature log (multi-hot, weighted, hashed and vocabulary ids), raw rows
through the Preprocessor and the exported program score as ``python -m hybridrec.evaluate``
scores the same rows; unseen ids map as training maps them; a missing or damaged file of the
export, a missing column and a wrong type are one ``hybridrec: ...`` error each."""

import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

import commands
from conftest import compose_cfg
from hybridrec.data import build_source, loader
from hybridrec.data.example import generate
from hybridrec.data.fetch_movielens import write_layout
from hybridrec.serving.export import PREPROCESSING, export, write_preprocessing
from hybridrec.serving.preprocess import Preprocessor, inputs
from shared import ctr_raw_rows, docs_snippet, rand_rows, reader, tables, write

SMALL_DLRM = [
    "model=dlrm",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
]
TINY_RUN = ["train.steps=3", "train.eval_every=0", "train.early_stop_patience=0", "launcher.device=cpu"]


def _run(module, args, cwd=None):
    proc = commands.run(module, *args, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _train_export_evaluate(tmp, overrides):
    """A tiny checkpoint of ``overrides`` (3 steps), its export, and the probabilities
    ``hybridrec.evaluate`` gives its test split, in the split's row order."""
    _run("hybridrec.train", [*overrides, *TINY_RUN, f"checkpoint.dir={tmp / 'ckpt'}", f"hydra.run.dir={tmp / 'run'}"])
    (step,) = sorted((tmp / "ckpt").glob("step_*"))
    export(str(step), str(tmp / "export"))
    _run(
        "hybridrec.evaluate",
        [f"checkpoint={step}", "predictions=true", "launcher.device=cpu", f"hydra.run.dir={tmp / 'eval'}"],
    )
    predictions = pq.read_table(tmp / "eval" / "predictions.parquet").to_pydict()
    assert predictions["row"] == sorted(predictions["row"])
    return tmp / "export", torch.tensor(predictions["probability"])


def _scores(export_dir, rows):
    program = torch.export.load(os.path.join(export_dir, "model.pt2")).module()
    with torch.no_grad():
        return program(*Preprocessor.load(str(export_dir))(rows))


# ------------------------------------------------------------------------- a feature log
def _feature_log(out):
    """A small example log (2,000 training rows) and its item vocabulary."""
    generate(str(out), rows=2000, seed=3)
    _run(
        "hybridrec.data.vocab",
        [str(out / "train"), "--column", "item_id", "--min-count", "1", "--out", str(out / "vocab")],
    )
    vocab = out / "vocab" / "item_id.parquet"
    return [
        "+experiment=feature_log",
        f"data.train_path={out / 'train'}",
        f"data.valid_path={out / 'valid'}",
        f"data.eval_path={out / 'eval'}",
        f"data.sparse.1.vocabulary={vocab}",
        f"data.sparse.2.vocabulary={vocab}",
    ]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving") / "log"
    return out, _feature_log(out)


@pytest.fixture(scope="module")
def log_export(tmp_path_factory, log):
    """The feature log's checkpoint, exported, and evaluate's test-split probabilities."""
    _, overrides = log
    tmp = tmp_path_factory.mktemp("feature_log")
    return _train_export_evaluate(tmp, [*overrides, "data.batch_size=128", *SMALL_DLRM])


def _log_rows(log_dir, split="eval"):
    return pa.concat_tables([pq.read_table(p) for p in sorted((log_dir / split).glob("*.parquet"))])


@pytest.mark.slow
def test_a_feature_log_scores_from_raw_rows_as_evaluate_does(log, log_export):
    """The first reader of ``log_export``: its setup writes the log and its vocabulary, trains,
    exports and evaluates, once for the module's four feature-log tests."""
    export_dir, expected = log_export
    spec = json.load(open(export_dir / PREPROCESSING))
    assert spec["program_inputs"] == ["dense", "values", "lengths", "weights"]  # categories is weighted
    assert json.load(open(export_dir / "model.json"))["preprocessing"] == PREPROCESSING
    assert (export_dir / "vocabulary_item_table.parquet").is_file()
    steps = {d["column"]: d["steps"] for d in spec["dense"]}
    assert steps["price"] == [{"op": "clamp", "min": 0.0}, {"op": "log1p"}] and steps["position"] == []
    assert steps["tenure_days"][0]["op"] == "standardize" and steps["tenure_days"][0]["std"] > 0
    rows = _log_rows(log[0])
    got = _scores(export_dir, rows)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the same rows as a Parquet file and as {column: values}, through the one-call form
    pq.write_table(rows, export_dir.parent / "rows.parquet")
    program = torch.export.load(export_dir / "model.pt2").module()
    with torch.no_grad():
        from_file = program(*inputs(str(export_dir), str(export_dir.parent / "rows.parquet")))
        from_dict = program(*inputs(str(export_dir), rows.slice(0, 5).to_pydict()))
    torch.testing.assert_close(from_file, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_dict, expected[:5], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_unseen_ids_map_as_training_maps_them(log, log_export, tmp_path):
    """A row with a user never seen (hashed) and items outside the vocabulary (row 0): the
    inputs equal the batch the training source reads from the same row."""
    log_dir, overrides = log
    export_dir, _ = log_export
    rows = _log_rows(log_dir).slice(0, 2).to_pylist()
    known = pq.read_table(export_dir / "vocabulary_item_table.parquet").column("id")[0].as_py()
    rows[0] |= {"user_id": "someone-new", "item_id": 987_654_321, "clicked_items": [987_654_322, known]}
    rows[1] |= {"item_id": known}
    (tmp_path / "eval").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=_log_rows(log_dir).schema), tmp_path / "eval" / "part.parquet")
    source = build_source(compose_cfg([*overrides, f"data.eval_path={tmp_path / 'eval'}"]).data, 0)
    read = source.read("eval", 0, 0, 0, 2)
    dense, values, lengths, weights = Preprocessor.load(str(export_dir))(tmp_path / "eval" / "part.parquet")
    torch.testing.assert_close(dense, read.dense, rtol=0, atol=0)
    assert values.tolist() == read.values.tolist() and lengths.tolist() == read.lengths.reshape(-1).tolist()
    assert weights.tolist() == read.id_weights.tolist()
    assert values[2:6].tolist() == [0, 1, 0, 1]  # item_id, then clicked_items: unseen row 0, the first id row 1


@pytest.mark.slow
def test_a_missing_or_damaged_vocabulary_is_one_error(log_export, tmp_path):
    export_dir, _ = log_export
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    vocab = copy / "vocabulary_item_table.parquet"
    data = bytearray(vocab.read_bytes())
    data[len(data) // 2] ^= 0xFF
    vocab.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^hybridrec: .*vocabulary_item_table.parquet is damaged .* copy the export"):
        Preprocessor.load(str(copy))
    vocab.unlink()
    with pytest.raises(ValueError, match=r"^hybridrec: .*vocabulary_item_table.parquet is missing: .* copy the whole"):
        Preprocessor.load(str(copy))


@pytest.mark.slow
def test_a_missing_column_or_a_wrong_type_names_the_column(log, log_export):
    export_dir, _ = log_export
    prep = Preprocessor.load(str(export_dir))
    rows = _log_rows(log[0]).slice(0, 3)
    with pytest.raises(ValueError, match=r"^hybridrec: the rows have no column 'cat_weights'; this export reads .*"):
        prep(rows.drop_columns(["cat_weights"]))
    with pytest.raises(ValueError, match=r"^hybridrec: column 'price' \(a dense feature\) is string: give numbers"):
        prep(rows.set_column(rows.schema.get_field_index("price"), "price", pa.array(["1", "2", "3"])))
    with pytest.raises(ValueError, match=r"^hybridrec: column 'tenure_days' \(a dense feature\) is null in row 1"):
        prep(rows.set_column(rows.schema.get_field_index("tenure_days"), "tenure_days", pa.array([1.0, None, 2.0])))


@pytest.mark.slow
def test_numbers_as_embeddings_score_from_raw_rows_as_evaluate_does(log, tmp_path):
    """price bucketized and tenure_days piecewise-linear, their knots fitted on the train
    split: the checkpoint's config and the export carry the same knots, raw rows score as
    evaluate scores them, and a number training would have refused is refused."""
    log_dir, overrides = log
    encodings = ["data.dense.0.encoding=bucketized", "data.dense.1.encoding=piecewise_linear", "data.dense.1.buckets=8"]
    export_dir, expected = _train_export_evaluate(
        tmp_path, [*overrides, "data.batch_size=128", *SMALL_DLRM, *encodings]
    )
    spec = json.load(open(export_dir / PREPROCESSING))
    assert [d["column"] for d in spec["dense"]] == ["position"]
    encoded = {f["name"]: f for f in spec["sparse"] if f["ids"]["kind"] == "numeric"}
    assert list(encoded) == ["num_price", "num_tenure_days"]
    (step,) = sorted((tmp_path / "ckpt").glob("step_*"))
    saved = OmegaConf.load(step / "config.yaml").data.dense
    for d, name in zip(saved[:2], encoded, strict=True):
        assert list(d.knots) == encoded[name]["ids"]["knots"] and d.encoding == encoded[name]["ids"]["encoding"]
    assert 2 <= len(saved[1].knots) <= 9 and encoded["num_tenure_days"]["num_embeddings"] == len(saved[1].knots)
    rows = _log_rows(log_dir)
    torch.testing.assert_close(_scores(export_dir, rows), expected, rtol=0, atol=1e-5)
    prep = Preprocessor.load(str(export_dir))
    price = rows.schema.get_field_index("price")
    with pytest.raises(ValueError, match=r"^hybridrec: column 'price' \(feature num_price\) is nan in row 1: training"):
        prep(rows.slice(0, 3).set_column(price, "price", pa.array([1.0, float("nan"), 2.0])))
    # knots that do not size the table: the description was edited
    spec["sparse"][-1]["ids"]["knots"] = spec["sparse"][-1]["ids"]["knots"][:-1]
    json.dump(spec, open(export_dir / PREPROCESSING, "w"))
    with pytest.raises(ValueError, match=r"damaged or was edited: field sparse\[\d\]\.num_embeddings"):
        Preprocessor.load(str(export_dir))


# ------------------------------------------------------------------- ctr and MovieLens
@pytest.mark.slow
def test_the_ctr_experiment_scores_from_raw_rows_as_evaluate_does(tmp_path):
    """The ctr experiment's 26 features (small tables, some multi-hot), and the serving
    guide's snippet run as printed, on this export. Three commands (train, evaluate, the
    snippet) on 26 tables: the module's slowest test."""
    sizes = [300, 200, 100, 50] * 6 + [20, 10]
    overrides = [
        "+experiment=ctr",
        "data.batch_size=64",
        f"data.num_embeddings_per_feature=[{','.join(map(str, sizes))}]",
        f"data.multi_hot_sizes=[{','.join(['1', '3', '1', '2'] * 6 + ['1', '1'])}]",
        "data.eval_batches=2",
        *SMALL_DLRM,
    ]
    export_dir, expected = _train_export_evaluate(tmp_path, overrides)
    cfg = compose_cfg(overrides)
    torch.testing.assert_close(
        _scores(export_dir, ctr_raw_rows(build_source(cfg.data, cfg.seed))), expected, rtol=0, atol=1e-5
    )
    snippet = docs_snippet("serving.md", "from hybridrec.serving import Preprocessor")
    assert 'export = "outputs/demo/export"' in snippet  # the demo's export, which the guide's reader has
    # run as a script of its own (a module in an empty directory: what the reader pastes into a file)
    (tmp_path / "snippet").mkdir()
    (tmp_path / "snippet" / "guide_snippet.py").write_text(snippet.replace("outputs/demo/export", str(export_dir)))
    proc = commands.run("guide_snippet", cwd=tmp_path / "snippet", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"tensor\(\[0\.\d+\]\)\n", proc.stdout), proc.stdout


@pytest.mark.slow
def test_movielens_scores_from_user_and_item_ids_as_evaluate_does(tmp_path):
    write_layout(tables(n_ratings=400), str(tmp_path / "ml"))
    overrides = ["+experiment=movielens", f"data.path={tmp_path / 'ml'}", "data.batch_size=64", *SMALL_DLRM]
    export_dir, expected = _train_export_evaluate(tmp_path, overrides)
    spec = json.load(open(export_dir / PREPROCESSING))
    assert [j["name"] for j in spec["joins"]] == ["users", "items"]
    cfg = compose_cfg(overrides)
    source = build_source(cfg.data, cfg.seed)
    rows = source.split_rows["eval"]
    raw = {"user_id": source.user[rows].tolist(), "item_id": source.item[rows].tolist()}
    torch.testing.assert_close(_scores(export_dir, raw), expected, rtol=0, atol=1e-5)
    # a user and a movie the data never had: rows 0, no side values, as the two-tower exports' input
    dense, values, lengths = Preprocessor.load(str(export_dir))({"user_id": [10_000], "item_id": [20_000]})
    assert values[:2].tolist() == [0, 0] and lengths[-1].item() == 0  # no genres
    assert dense.tolist() == [[0.0, np.float32((1990.0 - 1900.0) / 100.0)]]


@pytest.mark.unit
def test_a_source_without_raw_rows_writes_no_preprocessing(tmp_path):
    class Opaque:
        def raw_inputs(self):
            return None

    assert write_preprocessing(Opaque(), False, str(tmp_path)) is None and not os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"^hybridrec: .*preprocessing.json is missing: .* export the checkpoint"):
        Preprocessor.load(str(tmp_path))


@pytest.mark.unit
def test_export_help_names_the_preprocessing_and_its_reader(capsys):
    from hybridrec.export import main

    main(["--help"])
    out = capsys.readouterr().out
    assert "preprocessing.json" in out and "hybridrec.serving" in out and "Preprocessor.load" in out


@pytest.mark.unit
@pytest.mark.parametrize("mapping", ["modulo", "hash"])
def test_criteo_fields_map_as_the_tsv_reader_maps_them(tmp_path, mapping):
    """Integers (negative, missing) and hex ids (upper case, empty, null) of a Criteo log:
    the Preprocessor's inputs are the batch the TSV reader reads from the same lines."""
    lines = rand_rows(8, seed=1)
    fields = [line.split("\t") for line in lines]
    fields[1][1], fields[2][14] = "", fields[2][14].upper()  # a missing integer, upper-case hex
    source = reader(write(tmp_path / "day.tsv", ["\t".join(f) for f in fields]), batch=8, id_mapping=mapping)
    batch = next(loader.batches(source, "eval", 0, 1, 1)).batch
    write_preprocessing(source, False, str(tmp_path))
    raw = {f"int_{j}": [int(f[1 + j]) if f[1 + j] else None for f in fields] for j in range(13)}
    raw |= {f"cat_{j}": [f[14 + j] for f in fields] for j in range(26)}
    raw["cat_3"] = [None] * 8  # rand_rows leaves cat_3 empty: null reads the same
    dense, values, lengths = Preprocessor.load(str(tmp_path))(raw)
    torch.testing.assert_close(dense, batch.dense_features, rtol=0, atol=0)
    assert values.tolist() == batch.sparse_features.values().tolist() and lengths.eq(1).all()
    with pytest.raises(ValueError, match=r"^hybridrec: column 'cat_0' \(feature cat_0\): 'xyz' in row 0 is not a hex"):
        Preprocessor.load(str(tmp_path))(raw | {"cat_0": ["xyz"] + raw["cat_0"][1:]})
