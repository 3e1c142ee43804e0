"""The exported model: a torch.export program over plain tensors that scores as the model
does, for every model, at any batch size; its archive holds no pickle; the serving guide's
example runs as printed, without hybridrec or TorchRec."""

import json
import subprocess
import sys
import zipfile

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import compose_cfg
from hybridrec.data import RecBatch, build_source, loader
from hybridrec.models import build_model
from hybridrec.serving.export import PROGRAM, SPEC, _check_archive, write_program
from shared import docs_snippet

pytestmark = pytest.mark.slow  # a torch.export trace takes seconds

DLRM = ["model.embedding_dim=8", "model.dense_arch_layer_sizes=[16,8]", "model.over_arch_layer_sizes=[16,1]"]
MODELS = {
    "dlrm": ["data.num_embeddings_per_feature=[300,200,100,50]", "data.ids_per_feature=2", *DLRM],
    "dcn": [
        "model=dcn",
        "data.num_embeddings_per_feature=[300,200,100,50]",
        *DLRM,
        "model.dcn_num_layers=2",
        "model.dcn_low_rank_dim=4",
    ],
    # multi-hot genres (some rows without any), and a ranking objective: raw scores
    "deepfm": [
        "+experiment=movielens_rank",
        "model=deepfm",
        "loss=listwise",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "model.deep_layer_sizes=[16]",
    ],
    "two_tower": ["+experiment=movielens_retrieval", "model.embedding_dim=8", "model.tower_layer_sizes=[16,8]"],
}


def _model(name, path):
    """An untrained model of ``name`` with random tables (values of a trained one's scale)."""
    cfg = compose_cfg([*MODELS[name], f"data.path={path}"] if "experiment" in MODELS[name][0] else MODELS[name])
    data = build_source(cfg.data, cfg.seed)
    torch.manual_seed(0)
    model = build_model(cfg, data.features, data.num_dense_features, data.list_size)
    model.sparse_module().to_empty(device="cpu")
    with torch.no_grad():
        for p in model.sparse_module().parameters():
            p.uniform_(-0.3, 0.3)
    return model.eval(), data


def _first_rows(sparse, n):
    """values and lengths of the first ``n`` rows of a KeyedJaggedTensor, feature-major."""
    lengths = sparse.lengths().view(len(sparse.keys()), -1)
    values = [v[: int(n_.sum())] for v, n_ in zip(sparse.values().split(lengths.sum(1).tolist()), lengths[:, :n])]
    return torch.cat(values), lengths[:, :n].reshape(-1).contiguous()


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_exports_to_a_program_that_scores_as_it_does(name, ml400, tmp_path):
    model, data = _model(name, ml400)
    spec = write_program(model, data.features, data.num_dense_features, str(tmp_path), {})
    program = torch.export.load(tmp_path / PROGRAM)
    # aten operators only (and Python's arithmetic on symbolic sizes): nothing of TorchRec's or fbgemm's
    calls = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert all(str(t).startswith("aten.") or getattr(t, "__module__", None) == "_operator" for t in calls), calls
    run = program.module()
    batch = next(loader.batches(data, "eval", 0, 1, 1)).batch
    with torch.no_grad():
        logits = model.score(batch)
        expected = torch.sigmoid(logits) if model.loss.calibrated else logits
        sparse = batch.sparse_features
        got = run(batch.dense_features, sparse.values(), sparse.lengths())
        one = run(batch.dense_features[:1], *_first_rows(sparse, 1))  # a batch of one row
        three = run(batch.dense_features[:3], *_first_rows(sparse, 3))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one, expected[:1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(three, expected[:3], rtol=1e-6, atol=1e-6)
    assert spec["output"] == ("probability" if model.loss.calibrated else "score")
    assert [f["name"] for f in spec["features"]] == sparse.keys() == data.keys
    assert json.load(open(tmp_path / SPEC)) == spec


def test_an_archive_with_a_pickled_payload_is_refused(tmp_path):
    program = torch.export.export(torch.nn.Linear(3, 1), (torch.zeros(2, 3),))
    torch.export.save(program, tmp_path / "ok.pt2")
    _check_archive(str(tmp_path / "ok.pt2"))  # raw tensor bytes: accepted
    with zipfile.ZipFile(tmp_path / "ok.pt2") as src, zipfile.ZipFile(tmp_path / "bad.pt2", "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("_weights_config.json"):
                data = data.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
            dst.writestr(item, data)
    with pytest.raises(RuntimeError, match="is stored as a pickled object"):
        _check_archive(str(tmp_path / "bad.pt2"))


def test_the_guides_example_scores_a_row_with_torch_alone(ml400, tmp_path):
    model, data = _model("dlrm", ml400)
    export = tmp_path / "outputs" / "demo" / "checkpoints" / "step_00000400" / "export"  # the path the example names
    export.mkdir(parents=True)
    write_program(model, data.features, data.num_dense_features, str(export), {})
    example = docs_snippet("serving.md", 'print(spec["output"]')  # the torch-only example, as printed
    assert "hybridrec" not in example and len(example.strip().splitlines()) <= 12
    # After the example: neither hybridrec nor TorchRec (nor fbgemm) was imported to run it. What a
    # new interpreter imports is the subject: a plain subprocess, not a command forked from a
    # server that has imported them all already.
    check = "\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('hybridrec', 'torchrec', 'fbgemm_gpu')))\n"
    proc = subprocess.run(
        [sys.executable, "-c", example + check],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed, imported = proc.stdout.strip().splitlines()
    assert imported == "[]"
    ids = torch.tensor([f.num_embeddings // 2 for f in data.features])
    row = RecBatch(
        torch.zeros(1, data.num_dense_features),
        KeyedJaggedTensor(keys=data.keys, values=ids, lengths=torch.ones(len(ids), dtype=torch.int32)),
        torch.zeros(1),
    )
    with torch.no_grad():
        expected = torch.sigmoid(model.score(row))
    assert printed.startswith("probability tensor([") and f"{expected.item():.4f}" in printed


def test_export_help_says_how_and_exits_zero(capsys):
    from hybridrec.export import main

    main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hybridrec.export checkpoint=<dir> [out=<dir> | delta=<export dir>]")
    assert "delta=<export dir>" in out and "model.json" in out
    with pytest.raises(SystemExit, match=r"usage: .* \(unknown: \['chekpoint'\]; --help says more\)"):
        main(["chekpoint=x"])


def test_an_export_goes_to_a_new_or_empty_directory_or_replaces_an_export_when_asked(tmp_path):
    """out= never writes a program among other files (a run's outputs, a source tree)."""
    from hybridrec.checkpoint import CheckpointError
    from hybridrec.export import check_out

    check_out(str(tmp_path / "new"), overwrite=False)
    (tmp_path / "empty").mkdir()
    check_out(str(tmp_path / "empty"), overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"out=.*file is a file: give a directory"):
        check_out(str(tmp_path / "file"), overwrite=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("x")
    with pytest.raises(CheckpointError, match=r"out=.*run holds 1 entries and no export \(model.json\): give a new"):
        check_out(str(run), overwrite=True)
    (run / "model.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds an export already: overwrite=true replaces it"):
        check_out(str(run), overwrite=False)
    check_out(str(run), overwrite=True)
