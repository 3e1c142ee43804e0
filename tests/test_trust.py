"""Checkpoints that are safe to open and verified: nothing in a checkpoint runs code, a
changed byte is a damaged checkpoint, one run per directory, no diverged state committed,
pruning keeps what loads, and storage faults are one line. Each planted payload is what an
attacker who knows the format would write: the checksums are fixed up after planting, so
the safety checks themselves are what refuses it."""

import copy
import errno
import functools
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import commands
from conftest import compose_cfg
from hybridrec import export
from hybridrec.checkpoint import (
    STATE_JSON,
    CheckpointError,
    DirLock,
    UnsafeCheckpoint,
    check_complete,
    latest,
    read_metadata,
    saved_config,
)
from hybridrec.run.errors import user_message
from hybridrec.train import check_before_launch
from shared import rehash
from trained import once

TINY = [
    "+experiment=ctr",
    "data.batch_size=64",
    "data.num_embeddings_per_feature=[300,200,100,50]",
    "data.ids_per_feature=2",
    "data.eval_batches=2",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
    "train.log_every=4",
]


def _train(*args, timeout=180):
    return commands.run("hybridrec.train", *TINY, *args, timeout=timeout)


@functools.lru_cache(maxsize=None)
def _composed(*overrides):
    return compose_cfg(list(overrides))


def _resume_cfg(path, checkpoint_dir=None):
    """The config `python -m hybridrec.train <TINY> train.steps=6 checkpoint.resume=<path>
    [checkpoint.dir=<checkpoint_dir>]` composes. Composed once and copied, the paths set
    after: they are plain strings, and Hydra's compose is most of a refusal checked in-process."""
    cfg = copy.deepcopy(_composed(*TINY, "train.steps=6"))
    cfg.checkpoint.resume = str(path)
    if checkpoint_dir is not None:
        cfg.checkpoint.dir = str(checkpoint_dir)
    return cfg


def _last_line(proc, prefix="hybridrec: ") -> str:
    """The one error line of a failed command, after checking it printed no traceback."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith(prefix), proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run's checkpoints at steps 2 and 4, trained once per test run: every test
    works on a copy of what it changes."""

    def build(path):
        proc = _train(
            "train.steps=4",
            f"checkpoint.dir={path / 'ckpt'}",
            "checkpoint.every_n_steps=2",
            f"hydra.run.dir={path / 'run'}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    return once(tmp_path_factory, "trust-tiny-ckpt", build) / "ckpt"


# ------------------------------------------------------------------ planted payloads
class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(kind, step_dir, marker):
    config = step_dir / "config.yaml"
    if kind == "nested_target":  # the eval-in-a-layer-list payload
        text = config.read_text().replace(
            "dense_arch_layer_sizes:",
            "dense_arch_layer_sizes: {_target_: builtins.eval, _args_: "
            f"[\"__import__('os').system('touch {marker}') or [16, 8]\"]}}\n  unused:",
            1,
        )
        config.write_text(text)
    elif kind == "loss_target":
        config.write_text(
            config.read_text().replace(
                "loss:\n", f"loss:\n  hook: {{_target_: os.system, command: touch {marker}}}\n", 1
            )
        )
    elif kind == "data_target":  # a top-level target naming another class
        config.write_text(
            config.read_text().replace("_target_: hybridrec.data.synthetic.SyntheticClickLog", "_target_: os.system", 1)
        )
    elif kind == "yaml_tag":
        config.write_text(f"x: !!python/object/apply:os.system ['touch {marker}']\n" + config.read_text())
    elif kind == "metadata_pickle":  # a pickle that calls os.system, then DCP's real metadata
        metadata = step_dir / ".metadata"
        metadata.write_bytes(pickle.dumps(_Payload(marker), protocol=2)[:-1] + b"0" + metadata.read_bytes())
    elif kind == "distcp_pickle":  # a pickled object where a tensor's bytes belong
        info = next(iter(read_metadata(str(step_dir)).storage_data.values()))
        buf = io.BytesIO()
        torch.save(_Payload(marker), buf, _use_new_zipfile_serialization=False)
        with open(step_dir / info.relative_path, "r+b") as f:
            f.seek(info.offset)
            f.write(buf.getvalue())
    rehash(step_dir)


PAYLOADS = ["nested_target", "loss_target", "data_target", "yaml_tag", "metadata_pickle", "distcp_pickle"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", PAYLOADS)
def test_a_planted_payload_is_refused_by_export_evaluate_and_resume(trained, tmp_path, kind):
    """Two commands a case (three for a .distcp pickle); the first case also sets up ``trained``
    (a training command, after the command server's start): the module's slowest."""
    ckpt, marker = tmp_path / "step_00000004", tmp_path / "ran"
    shutil.copytree(trained / "step_00000004", ckpt)
    _plant(kind, ckpt, marker)
    unsafe = "is not safe to open" if kind != "distcp_pickle" else "holds a pickled object that would call posix.system"
    # export and evaluate in a process of their own, as a user runs them
    for cmd, prefix in (
        (["hybridrec.export", f"checkpoint={ckpt}"], "hybridrec.export: "),
        (["hybridrec.evaluate", f"checkpoint={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"], "hybridrec: "),
    ):
        line = _last_line(commands.run(*cmd, timeout=120), prefix)
        assert unsafe in line and "refused, nothing in it was run" in line, line
        assert "does not fit" not in line and "weights_only" not in line
        assert not marker.exists()
    # resume: the checks before launch refuse it, except a .distcp pickle, which only DCP's
    # load reaches: that one through a real (single-rank) resume
    if kind == "distcp_pickle":
        line = _last_line(
            _train(
                "train.steps=6",
                f"checkpoint.dir={tmp_path / 'new'}",
                f"checkpoint.resume={ckpt}",
                f"hydra.run.dir={tmp_path / 'run'}",
            )
        )
    else:
        with pytest.raises(UnsafeCheckpoint) as refused:
            check_before_launch(_resume_cfg(ckpt, tmp_path / "new"))
        line = user_message(refused.value)
    assert line.startswith("hybridrec: ") and unsafe in line, line
    assert not marker.exists() and not (ckpt / "export").exists()


@pytest.mark.slow
def test_resume_auto_never_skips_a_planted_checkpoint_quietly(trained, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(trained, d)
    _plant("metadata_pickle", d / "step_00000004", tmp_path / "ran")
    with pytest.raises(
        UnsafeCheckpoint, match="step_00000004/.metadata is not safe to open: it would call posix.system"
    ):
        latest(str(d))
    assert not (tmp_path / "ran").exists()


@pytest.mark.unit
def test_a_saved_config_may_name_only_shipped_or_trusted_classes(tmp_path):
    cfg = compose_cfg(TINY)
    from omegaconf import OmegaConf

    step = tmp_path / "step_00000001"
    step.mkdir()
    OmegaConf.save(cfg, step / "config.yaml", resolve=True)
    assert saved_config(str(step)).model._target_ == "hybridrec.models.dlrm.DLRMRanker"
    text = (step / "config.yaml").read_text()
    (step / "config.yaml").write_text(text.replace("hybridrec.models.dlrm.DLRMRanker", "mylib.MyRanker"))
    with pytest.raises(
        UnsafeCheckpoint,
        match=r"model._target_=mylib.MyRanker is not a class hybridrec ships for "
        r"model nor one this run trusts .*trusted_targets=\[mylib.MyRanker\]",
    ):
        saved_config(str(step))
    # trusted explicitly (by the loading run, never by the checkpoint), the class passes the
    # safety check; typing it again then needs a schema registered for it
    with pytest.raises(CheckpointError, match="does not fit this hybridrec's config schema") as typed:
        saved_config(str(step), trusted=["mylib.MyRanker"])
    assert not isinstance(typed.value, UnsafeCheckpoint)
    (step / "config.yaml").write_text(text.replace("seed: 0", "seed: ${oc.env:HOME}"))
    with pytest.raises(UnsafeCheckpoint, match="seed='\\${oc.env:HOME}' is an interpolation"):
        saved_config(str(step))
    (step / "config.yaml").write_text(
        text.replace(
            "_target_: hybridrec.models.losses.BCE", "_target_: hybridrec.models.losses.BCE\n  _partial_: true"
        )
    )
    with pytest.raises(UnsafeCheckpoint, match="loss._partial_ is a Hydra instantiation key"):
        saved_config(str(step))
    # saved before the losses moved into the models package: the loss is found where it is now,
    # and only the loss node's own old module is read so
    (step / "config.yaml").write_text(text.replace("hybridrec.models.losses.BCE", "hybridrec.losses.BCE"))
    assert saved_config(str(step)).loss._target_ == "hybridrec.models.losses.BCE"
    (step / "config.yaml").write_text(text.replace("hybridrec.models.dlrm.DLRMRanker", "hybridrec.losses.BCE"))
    with pytest.raises(UnsafeCheckpoint, match="model._target_=hybridrec.losses.BCE is not a class hybridrec ships"):
        saved_config(str(step))


@pytest.mark.unit
def test_the_metadata_reader_admits_only_what_dcp_metadata_is_made_of(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3), "n": 7}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert set(read_metadata(str(tmp_path / "ok")).state_dict_metadata) == {"w", "n"}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    with pytest.raises(UnsafeCheckpoint, match=f"{bad}/.metadata is not safe to open: it would call posix.system"):
        read_metadata(str(bad))
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------ integrity
@pytest.mark.slow
def test_every_file_is_checksummed_and_a_changed_byte_is_damage(trained, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(trained, d)
    newest = d / "step_00000004"
    recorded = json.load(open(newest / STATE_JSON))["files"]
    assert set(recorded) == set(os.listdir(newest)) - {STATE_JSON}
    check_complete(str(newest))
    distcp = next(name for name in recorded if name.endswith(".distcp"))
    with open(newest / distcp, "r+b") as f:  # one bit of one weight, length kept
        f.seek(os.path.getsize(newest / distcp) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    damaged = f"{newest} is damaged: {newest / distcp} does not match the checksum recorded when it was saved"
    with pytest.raises(CheckpointError, match=damaged):
        check_complete(str(newest))
    assert latest(str(d)) == str(d / "step_00000002")  # resume=auto falls back
    with pytest.raises(ValueError) as refused:  # an explicit path is refused
        check_before_launch(_resume_cfg(newest))
    assert user_message(refused.value).startswith(f"hybridrec: {damaged}")
    with pytest.raises(SystemExit, match=f"hybridrec.export: {damaged}"):
        export.main([f"checkpoint={newest}"])
    (d / "step_00000002" / STATE_JSON).write_text(
        (d / "step_00000002" / STATE_JSON).read_text().replace('"step": 2', '"step": 3')
    )
    with pytest.raises(CheckpointError, match="trainer_state.json does not match the checksum of its fields"):
        check_complete(str(d / "step_00000002"))


# ------------------------------------------------------------------ damage, edits and escapes
# Each case changes a copy of a committed checkpoint as damage, a careless edit or an
# attacker would (``rehash``: the checksums fixed up after, as someone who knows the format
# would), and names the fragment of the one line every reader (resume, evaluate, export)
# must refuse it with. Nothing outside the checkpoint may be read.
def _edit_json(directory, **changes):
    fields = json.load(open(directory / STATE_JSON))
    for key, value in changes.items():
        if value is _DROP:
            fields.pop(key)
        else:
            fields[key] = value
    json.dump(fields, open(directory / STATE_JSON, "w"))


_DROP = object()


def _metadata_entry(step, name):
    from hybridrec.checkpoint import read_metadata as read

    metadata = read(str(step))
    next(iter(metadata.storage_data.values())).relative_path = name
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


def _flip(path, find=None, at=None, to=None):
    data = bytearray(path.read_bytes())
    i = data.find(find) + 3 if find else at
    data[i] = to if to is not None else data[i] ^ 1
    path.write_bytes(bytes(data))


def _outside_link(step, tmp):
    """A .distcp replaced by a link to an identical copy outside: the bytes check out, the place does not."""
    distcp = next(p for p in step.iterdir() if p.suffix == ".distcp")
    shutil.copy(distcp, tmp / "outside.distcp")
    distcp.unlink()
    distcp.symlink_to(tmp / "outside.distcp")


DAMAGE = [  # (case, edit(step, tmp), rehash, fragment)
    (
        "metadata entry ../",
        lambda s, t: _metadata_entry(s, "../../outside_shard.distcp"),
        True,
        "the entry '../../outside_shard.distcp' (the storage file of ",
    ),
    (
        "metadata entry absolute",
        lambda s, t: _metadata_entry(s, "/etc/passwd"),
        True,
        "the entry '/etc/passwd' (the storage file of ",
    ),
    ("distcp linked outside", _outside_link, False, "outside.distcp, outside the checkpoint directory; refused"),
    (
        "checksums stripped",
        lambda s, t: _edit_json(s, files=_DROP),
        True,
        "has no 'files' field, so its content cannot be verified",
    ),
    (
        "self-hash stripped",
        lambda s, t: _edit_json(s, state_blake3=_DROP),
        False,
        "has no 'state_blake3' field, so its content cannot be verified",
    ),
    (
        "flipped byte in .metadata",
        lambda s, t: _flip(s / ".metadata", find=b"TensorProperties"),
        False,
        ".metadata does not match the checksum recorded when it was saved",
    ),
    (
        "flipped byte in .metadata, rehashed",
        lambda s, t: _flip(s / ".metadata", find=b"TensorProperties", to=ord("3")),
        True,
        ".metadata is damaged: it names torch.distributed.checkpoint.metadata.Ten3orProperties, which does not exist",
    ),
    (
        "truncated .metadata, rehashed",
        lambda s, t: (s / ".metadata").write_bytes((s / ".metadata").read_bytes()[:500]),
        True,
        ".metadata is damaged: not a valid pickle stream",
    ),
    (
        "bytes after .metadata, rehashed",
        lambda s, t: (s / ".metadata").write_bytes((s / ".metadata").read_bytes() + b"xx"),
        True,
        ".metadata is damaged: 2 bytes after the end of its pickle stream",
    ),
    (
        "trainer_state.pt garbage, rehashed",
        lambda s, t: (s / "trainer_state.pt").write_bytes(b"\x80\x02garbage" * 9),
        True,
        "trainer_state.pt is damaged: not a readable tensor record",
    ),
    (
        "duplicate key in config.yaml",
        lambda s, t: (s / "config.yaml").write_text("seed: 1\n" + (s / "config.yaml").read_text()),
        True,
        "config.yaml is damaged or was edited: not valid YAML (found duplicate key seed at line",
    ),
    (
        "unknown tag in config.yaml",
        lambda s, t: (s / "config.yaml").write_text("x: !custom 3\n" + (s / "config.yaml").read_text()),
        True,
        "config.yaml is not safe to open: it holds the YAML tag !custom (a type hybridrec never writes) at line 1",
    ),
    (
        "step a string",
        lambda s, t: _edit_json(s, step="4; rm -rf /"),
        True,
        "trainer_state.json is damaged or was edited: field 'step' is '4; rm -rf /' (a str), expected an integer >= 0",
    ),
    (
        "features an object",
        lambda s, t: _edit_json(s, features={"a": 1}),
        True,
        "field 'features' is \"{'a': 1}\" (a dict), expected a list of objects",
    ),
    (
        "feature without rows",
        lambda s, t: _edit_json(s, features=[{"name": "x"}]),
        True,
        "field 'features[0].num_embeddings' is 'None' (a NoneType), expected an integer >= 1",
    ),
    (
        "dense features missing",
        lambda s, t: _edit_json(s, num_dense_features=_DROP),
        True,
        "field 'num_dense_features' is missing",
    ),
    (
        "run ids that are numbers",
        lambda s, t: _edit_json(s, runs=[1, 2]),
        True,
        "field 'runs' is '[1, 2]' (a list), expected a list of run ids",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("edit, rehashed, fragment", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_damage_edits_and_escapes_are_refused_by_every_reader_in_one_line(trained, tmp_path, edit, rehashed, fragment):
    step = tmp_path / "ckpt" / "step_00000004"
    shutil.copytree(trained / "step_00000004", step)
    edit(step, tmp_path)
    if rehashed:
        rehash(step)
    for read in (lambda: check_complete(str(step)), lambda: check_before_launch(_resume_cfg(step))):
        with pytest.raises(CheckpointError) as refused:  # never a config error, never a traceback
            read()
        line = user_message(refused.value)
        assert line.startswith("hybridrec: ") and fragment in line and "\n" not in line, line
    with pytest.raises(SystemExit) as refused:
        export.main([f"checkpoint={step}"])
    assert fragment in str(refused.value), refused.value
    assert not (step / "export").exists()
    with pytest.raises(CheckpointError) as skipped:  # resume=auto skips damage loudly, and stops at a planted file
        latest(str(step.parent))
    assert isinstance(skipped.value, UnsafeCheckpoint) or "holds no loadable checkpoint" in str(skipped.value)


@pytest.mark.slow
def test_a_checkpoint_without_checksums_loads_only_when_allowed(trained, tmp_path):
    step = tmp_path / "step_00000004"
    shutil.copytree(trained / "step_00000004", step)
    _edit_json(step, files=_DROP, state_blake3=_DROP)  # what a checkpoint older than checksums holds
    with pytest.raises(CheckpointError, match="checkpoint.allow_unverified=true"):
        check_complete(str(step))
    assert check_complete(str(step), allow_unverified=True).step == 4
    export.main([f"checkpoint={step}", "allow_unverified=true", f"out={tmp_path / 'out'}"])
    assert (tmp_path / "out" / "model.pt2").exists()
    line = _last_line(
        commands.run("hybridrec.evaluate", f"checkpoint={step}", f"hydra.run.dir={tmp_path / 'e1'}", timeout=120)
    )
    assert "cannot be verified" in line and "allow_unverified=true" in line, line
    ok = commands.run(
        "hybridrec.evaluate",
        f"checkpoint={step}",
        "allow_unverified=true",
        f"hydra.run.dir={tmp_path / 'e2'}",
        timeout=120,
    )
    assert ok.returncode == 0 and "records no checksums" in ok.stdout + ok.stderr, ok.stderr[-2000:]


@pytest.mark.slow
def test_a_manifest_that_leaves_out_a_file_is_damage(trained, tmp_path):
    """A step whose manifest (trainer_state.json's files) was emptied, or lost one file,
    with its own checksum recomputed as an attacker would: a weight byte flipped behind it is
    refused as damage by resume, evaluate and export (not loaded because nothing listed it)."""
    import blake3

    from hybridrec.checkpoint.state import STATE_JSON as JSON

    for case in ("empty", "one file left out"):
        step = tmp_path / case.replace(" ", "_") / "step_00000004"
        shutil.copytree(trained / "step_00000004", step)
        shard = sorted(step.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        fields = json.load(open(step / JSON))
        fields.pop("state_blake3")
        fields["files"] = {} if case == "empty" else {k: v for k, v in fields["files"].items() if k != shard.name}
        fields["state_blake3"] = blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        json.dump(fields, open(step / JSON, "w"))
        want = "lists no files in its manifest" if case == "empty" else f"no checksum recorded for {shard.name}"
        for allow in (False, True):  # no setting lets a damaged manifest through
            with pytest.raises(CheckpointError, match=want):
                check_complete(str(step), allow_unverified=allow)
        with pytest.raises(CheckpointError, match=want):
            check_before_launch(_resume_cfg(step))
        with pytest.raises(SystemExit, match=want):
            export.main([f"checkpoint={step}", f"out={tmp_path / 'out'}"])
        line = _last_line(
            commands.run(
                "hybridrec.evaluate",
                f"checkpoint={step}",
                f"hydra.run.dir={tmp_path / case.replace(' ', '_') / 'eval'}",
                timeout=120,
            )
        )
        assert want in line and line.startswith("hybridrec"), line


@pytest.mark.slow
def test_an_uncommitted_save_is_never_resumed_evaluated_or_exported(trained, tmp_path):
    partial = tmp_path / "ckpt" / "step_00000004.partial"
    shutil.copytree(trained / "step_00000004", partial)  # complete, and never renamed: not committed
    fragment = "is not a committed checkpoint: a save that never finished"
    with pytest.raises(CheckpointError, match=fragment):
        check_before_launch(_resume_cfg(partial))
    with pytest.raises(SystemExit, match=fragment):
        export.main([f"checkpoint={partial}"])
    assert latest(str(partial.parent)) is None  # resume=auto never picks it


@pytest.mark.slow
def test_an_export_never_writes_through_a_planted_link(trained, tmp_path):
    step, victim = tmp_path / "step_00000004", tmp_path / "victim"
    shutil.copytree(trained / "step_00000004", step)
    victim.mkdir()
    (victim / "model.json").write_text("precious")
    (step / "export").symlink_to(victim)
    with pytest.raises(SystemExit, match="export is a symbolic link .* never through a link"):
        export.main([f"checkpoint={step}"])
    (step / "export").unlink()
    (step / "export").mkdir()
    (step / "export" / "model.json").symlink_to(victim / "model.json")  # a link where a file will be written
    with pytest.raises(SystemExit, match="holds an export already: overwrite=true replaces it"):
        export.main([f"checkpoint={step}"])
    export.main([f"checkpoint={step}", "overwrite=true"])
    assert (victim / "model.json").read_text() == "precious"
    assert not (step / "export" / "model.json").is_symlink()
    assert json.load(open(step / "export" / "model.json"))["program"] == "model.pt2"
    assert sorted(os.listdir(step / "export")) == [
        "model.json",
        "model.pt2",
        "preprocessing.json",
    ]  # no temporary file left


@pytest.mark.unit
def test_a_step_directory_linked_out_of_the_checkpoint_dir_is_never_read(tmp_path, caplog):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_00000009").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(
        CheckpointError, match="step_00000009 is a symbolic link to .*elsewhere, outside checkpoint.dir"
    ):
        latest(str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ one run per directory
@pytest.mark.slow
def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    first = commands.start(
        "hybridrec.train",
        *TINY,
        "train.steps=100000",
        "checkpoint.every_n_steps=20",
        f"checkpoint.dir={d}",
        f"hydra.run.dir={tmp_path / 'a'}",
    )
    try:
        deadline = time.monotonic() + 120
        while not ((d / ".lock").exists() and (d / ".lock").read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        line = _last_line(
            _train(
                "seed=7",
                "train.steps=100000",
                "checkpoint.every_n_steps=20",
                f"checkpoint.dir={d}",
                f"hydra.run.dir={tmp_path / 'b'}",
            )
        )
        assert line.startswith(f"hybridrec: checkpoint.dir={d} is in use by another run (pid {first.pid} on ")
        assert f"outputs in {tmp_path / 'a'}" in line and "another checkpoint.dir" in line
        while len(_committed(d)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        first.kill()
        first.wait(30)
    steps = _committed(d)
    assert len(steps) >= 2 and all("seed: 0" in (p / "config.yaml").read_text() for p in steps)  # the first run's only
    assert len({json.load(open(p / STATE_JSON))["runs"][-1] for p in steps}) == 1


def _committed(d):
    return sorted(p for p in d.iterdir() if p.name.startswith("step_") and not p.name.endswith(".partial"))


@pytest.mark.unit
def test_a_killed_runs_lock_is_not_stale(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(tmp_path / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid 1 elsewhere')\n"
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError, match=r"is in use by another run \(pid 1 elsewhere\)"):
        DirLock(str(tmp_path)).acquire("here")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = DirLock(str(tmp_path))
    lock.acquire("here")  # the kernel dropped the killed process's lock
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    lock.release()


# ------------------------------------------------------------------ diverged state
@pytest.mark.slow
def test_a_diverging_run_leaves_only_checkpoints_that_resume(tmp_path):
    """The losses of this run: 0.73 0.73 0.87 6.23 7480 1.2e12 nan. Step 3's save is followed
    by a loss over 5 x the run's median (checkpoint.max_loss_ratio), step 4's, 5's and 6's by
    worse: none of them is committed."""
    d, sgd = tmp_path / "ckpt", ["optimizer=sgd", "optimizer.sparse.lr=1e3", "optimizer.dense.lr=0.1"]
    proc = _train(
        "train.steps=12",
        *sgd,
        f"checkpoint.dir={d}",
        "checkpoint.every_n_steps=1",
        "train.log_every=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = _last_line(proc)
    assert line.startswith(
        "hybridrec: non-finite loss nan at step 7: the model diverged (a learning rate too high "
        "is the usual cause: optimizer.sparse.lr=1000.0, optimizer.dense.lr=0.1); the newest "
        f"committed checkpoint, {d / 'step_00000002'}, was followed by a finite loss"
    ), line
    for step, after in ((3, "6.23"), (4, "7480"), (5, "1.169e+12")):
        assert (
            f"checkpoint {d / f'step_{step:08d}'} not committed: the loss of the step after it, {after},"
            in proc.stdout + proc.stderr
        )
    assert sorted(os.listdir(d)) == [".lock", "step_00000001", "step_00000002"]  # no .partial left
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    # the newest committed checkpoint resumes: its next step is the run's own, finite
    again = _train("train.steps=3", *sgd, f"checkpoint.dir={d}", f"hydra.run.dir={tmp_path / 'again'}")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [r["loss"] for r in map(json.loads, open(tmp_path / "again" / "metrics.jsonl")) if "loss" in r]
    # its metrics.jsonl holds the training from step 1: the checkpoint's history, then its own step
    assert resumed == losses[:3] and losses[2] < 1


@pytest.mark.slow
def test_a_run_diverging_at_its_first_step_commits_nothing(tmp_path):
    d = tmp_path / "ckpt"
    line = _last_line(
        _train(
            "train.steps=8",
            "optimizer.sparse.lr=1e18",
            "optimizer.dense.lr=1e18",
            f"checkpoint.dir={d}",
            "checkpoint.every_n_steps=1",
            "checkpoint.max_loss_ratio=null",
            f"hydra.run.dir={tmp_path / 'run'}",
        )
    )
    # step 1's loss was finite (it is computed before the update): its save is not committed
    assert line.startswith("hybridrec: non-finite loss nan at step 2: the model diverged") and line.endswith(
        "no checkpoint of this run was committed"
    ), line
    assert os.listdir(d) == [".lock"]


# ------------------------------------------------------------------ pruning after a fallback
@pytest.mark.slow
def test_pruning_after_a_fallback_keeps_the_checkpoint_resumed_from(tmp_path):
    d = tmp_path / "ckpt"
    # 12 steps: over the summary's warm-up steps (summary.WARMUP_STEPS), whose steady rate it reports
    first = _train(
        "train.steps=12", "checkpoint.every_n_steps=4", f"checkpoint.dir={d}", f"hydra.run.dir={tmp_path / 'a'}"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    distcp = next(p for p in (d / "step_00000012").iterdir() if p.suffix == ".distcp")
    os.truncate(distcp, os.path.getsize(distcp) // 2)  # step 12 damaged, step 8 good
    second = _train(
        "train.steps=10", "checkpoint.every_n_steps=0", f"checkpoint.dir={d}", f"hydra.run.dir={tmp_path / 'b'}"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from " + str(d / "step_00000008") in second.stdout + second.stderr
    # keep_last=2 counts the loadable ones: 10 and the 8 it resumed from; the damaged 12 is left
    assert sorted(os.listdir(d)) == [".lock", "step_00000008", "step_00000010", "step_00000012"]
    assert latest(str(d)) == str(d / "step_00000010")


# ------------------------------------------------------------------ storage faults
# `python -m hybridrec.train` with one storage call failing in the save of step 4 (the second):
# a module of its own, run like any command (``commands.run``, with its directory as cwd).
_FAULT = """
import errno, os, shutil, sys
kind, where = sys.argv[1], sys.argv[2]
code = getattr(errno, kind)
def fail(path):
    if "step_00000004" in str(path):
        raise OSError(code, os.strerror(code), str(path))
if where == "write":
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    original_write = FileSystemWriter.write_data
    def write_data(self, plan, planner):
        fail(self.path)
        return original_write(self, plan, planner)
    FileSystemWriter.write_data = write_data
elif where == "mkdir":
    original_makedirs = os.makedirs
    def makedirs(path, *args, **kwargs):
        fail(path)
        return original_makedirs(path, *args, **kwargs)
    os.makedirs = makedirs
elif where == "commit":
    original_replace = os.replace
    def replace(src, dst, *args, **kwargs):
        fail(dst)
        return original_replace(src, dst, *args, **kwargs)
    os.replace = replace
import runpy
sys.argv = ["hybridrec.train", *sys.argv[3:]]
sys.modules.pop("hybridrec.train", None)  # (already imported where the command was forked: run it as __main__ only)
runpy.run_module("hybridrec.train", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, where, what",
    [
        ("EROFS", "write", "read-only file system"),
        ("EACCES", "mkdir", "permission denied"),
        ("EROFS", "commit", "read-only file system"),
    ],
)
def test_a_save_that_fails_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, kind, where, what):
    d = tmp_path / "ckpt"
    args = [
        *TINY,
        "train.steps=4",
        f"checkpoint.dir={d}",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    (tmp_path / "fault_train.py").write_text(_FAULT)
    proc = commands.run("fault_train", kind, where, *args, cwd=tmp_path, timeout=180)
    line = _last_line(proc)
    assert line.startswith(f"hybridrec: checkpoint save at step 4 failed: {what} ("), line
    assert f"Error: [Errno {getattr(errno, kind)}]" in line
    assert f"the previous checkpoint {d / 'step_00000002'} is intact" in line
    assert ("Remount it read-write" if kind == "EROFS" else "Make checkpoint.dir writable") in line
    assert sorted(os.listdir(d)) == [".lock", "step_00000002"]
    assert latest(str(d)) == str(d / "step_00000002")


@pytest.mark.slow
def test_no_free_inodes_while_saving_is_one_line(tmp_path):
    d = tmp_path / "few_inodes"
    d.mkdir()
    # root, the lock and one checkpoint (a directory and five files) fit; a second does not
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=11", "tmpfs", str(d)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root")
    try:
        proc = _train(
            "train.steps=4",
            f"checkpoint.dir={d}",
            "checkpoint.every_n_steps=2",
            "checkpoint.keep_last=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        )
        line = _last_line(proc)
        assert line.startswith("hybridrec: checkpoint save at step 4 failed: no free inodes on the device"), line
        assert f"the previous checkpoint {d / 'step_00000002'} is intact" in line
        assert latest(str(d)) == str(d / "step_00000002")
    finally:
        subprocess.run(["umount", str(d)], check=False)


# ------------------------------------------------------------------ diverged, and finite
@pytest.mark.unit
def test_the_typical_loss_cannot_diverge_with_the_run():
    from hybridrec.checkpoint import exploded, typical_loss

    healthy = [0.74, 0.72, 0.70, 0.66, 0.61, 0.58, 0.55, 0.52, 0.50, 0.49, 0.47, 0.46]
    assert typical_loss(healthy) == 0.58  # the median: lower than the first steps' (0.61) and the first (0.74)
    assert exploded(0.9, healthy, 5.0) is None
    # a run that diverged from its second step: its own medians diverged with it
    diverged = [0.739, 395.5, 38716.0, 69.4, 182.8, 120.8, 45.7, 240.7, 8.2, 202.8, 34.9, 181.9]
    assert typical_loss(diverged) == 0.739
    assert exploded(141.2, diverged, 5.0) == "over checkpoint.max_loss_ratio=5 x the run's typical loss 0.739"
    assert exploded(141.2, diverged, None) is None  # null: finite is enough
    assert exploded(-3.0, [-1.0, -2.0], 5.0) is None  # a loss that can be negative is not compared


@pytest.mark.slow
def test_non_finite_optimizer_state_is_never_committed(tmp_path):
    d = tmp_path / "ckpt"
    line = _last_line(
        _train(
            "optimizer.sparse.lr=1e18",
            "checkpoint.every_n_steps=1",
            "train.steps=20",
            f"checkpoint.dir={d}",
            f"hydra.run.dir={tmp_path / 'run'}",
        )
    )
    assert re.match(
        r"hybridrec: non-finite optimizer state after step \d+ \(optim\.state\.dense\.\S+\.sum\): the "
        r"model diverged .* nothing of step \d+ was saved; no checkpoint of this run was committed",
        line,
    ), line
    assert os.listdir(d) == [".lock"]


@pytest.mark.slow
def test_a_run_whose_loss_exploded_but_stayed_finite_ends_with_an_error(tmp_path):
    """The losses of this run: 0.73 8.9 14 56 14 13, finite. Step 3's save is followed by a loss
    over 5 x the typical loss, and so is the median of the last 3 steps (the window: up to 10)."""
    d = tmp_path / "ckpt"
    proc = _train(
        "optimizer=sgd",
        "optimizer.sparse.lr=0.1",
        "optimizer.dense.lr=100",
        "train.steps=6",
        "checkpoint.every_n_steps=3",
        f"checkpoint.dir={d}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = _last_line(proc)
    assert re.match(
        r"hybridrec: the loss at the end of training \(median \S+ over steps 4-6\) is over "
        r"checkpoint.max_loss_ratio=5 x the run's typical loss 0.7282: the model diverged .*optimizer.dense"
        r".lr=100.0\); its last save was not committed; no checkpoint of this run was committed$",
        line,
    ), line
    assert (
        "checkpoint " + str(d / "step_00000003") + " not committed: the loss of the step after it"
        in proc.stdout + proc.stderr
    )
    assert os.listdir(d) == [".lock"]
