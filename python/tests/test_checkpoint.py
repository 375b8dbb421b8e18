"""Checkpoints end to end: two daemons with a checkpoint directory each (as
on local disks), two ShardedOptimizer ranks that save one while training,
`zsctl export` of it read back with torch.load, `zsctl checkpoint`, and a
new run of the job resumed from it."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint_worker as cw
import train_common as tc
import zeroshard
from binaries import HERE_DIR, running_daemons, zsctl_binary
from zeroshard.torch import ShardedOptimizer

WORLD_SIZE = 2
JOB = "pytest-checkpoint"
ADMIN_TOKEN_FILE = pathlib.Path(os.environ.get("TEST_TMPDIR", "/tmp")) / "admin.token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(daemon addresses, each daemon's --checkpoint_dir)."""
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = [root / f"daemon{i}" for i in range(2)]
    # Checkpoints of a job that has ended are the admin's to list.
    ADMIN_TOKEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    ADMIN_TOKEN_FILE.write_text("pytest-admin-token-0123456789\n")
    ADMIN_TOKEN_FILE.chmod(0o600)
    with running_daemons(2, lambda i: [f"--checkpoint_dir={dirs[i]}",
                                       f"--admin_token_file={ADMIN_TOKEN_FILE}"]) as addresses:
        yield addresses, dirs


def _run_ranks(addresses, mode, out_dir):
    """Runs checkpoint_worker.py on every rank; returns (info, arrays) per rank."""
    workers, outs = [], []
    for rank in range(WORLD_SIZE):
        config = dict(daemons=addresses, job_id=JOB, rank=rank,
                      world_size=WORLD_SIZE, bucket_bytes=4096,
                      rpc_timeout=30.0, step_timeout=60.0)
        out = str(out_dir / f"{mode}-rank{rank}")
        outs.append(out)
        workers.append(subprocess.Popen(
            [sys.executable, str(HERE_DIR / "checkpoint_worker.py"),
             json.dumps(config), mode, out]))
    for rank, worker in enumerate(workers):
        try:
            assert worker.wait(timeout=240) == 0, f"{mode}: rank {rank} failed"
        finally:
            if worker.poll() is None:
                worker.kill()
    results = []
    for out in outs:
        with open(out + ".json") as f:
            info = json.load(f)
        results.append((info, dict(np.load(out + ".npz"))))
    return results


def _zsctl(*args):
    return subprocess.run([zsctl_binary(), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(cluster, tmp_path_factory):
    addresses, _ = cluster
    return _run_ranks(addresses, "train",
                      tmp_path_factory.mktemp("train"))


def test_save_and_await_while_training(trained):
    info, arrays = trained[0]
    assert info["save"]["name"] == cw.CHECKPOINT
    assert info["save"]["step"] == cw.SAVE_AT
    n = sum(a.size for k, a in arrays.items() if k.startswith("saved:"))
    # Masters and both Adam moments, alignment padding included.
    assert info["save"]["bytes"] >= 3 * 4 * n
    assert info["save"]["snapshot_seconds"] >= 0
    assert info["save"]["previous_error"] == ""  # the first save
    assert info["await"]["name"] == cw.CHECKPOINT
    assert info["await"]["step"] == cw.SAVE_AT
    assert info["await"]["bytes"] == info["save"]["bytes"]
    assert [c["name"] for c in info["list"]] == [cw.CHECKPOINT]
    assert info["list"][0]["step"] == cw.SAVE_AT
    assert info["list"][0]["world_size"] == WORLD_SIZE
    assert info["list"][0]["daemon_count"] == 2
    assert info["resumed_from"] is None
    # Both ranks hold the same parameters at the save.
    for name in info["names"]:
        assert torch.equal(torch.from_numpy(arrays[f"saved:{name}"]),
                           torch.from_numpy(trained[1][1][f"saved:{name}"]))


def test_a_save_waits_for_the_previous_one_ten_seconds_by_default():
    # Past it the save raises UNAVAILABLE and training may go on
    # (tests/hung_disk_test.sh runs that against a frozen disk).
    assert zeroshard._zeroshard.DEFAULTS["checkpoint_wait"] == 10.0


def test_export_reads_back_bit_for_bit(cluster, trained, tmp_path):
    _, dirs = cluster
    info, arrays = trained[0]
    # Each daemon wrote its part to its own directory: the export, which
    # reads files only, first names what it cannot find...
    alone = dirs[0] / JOB / cw.CHECKPOINT
    out = tmp_path / "model.pt"
    r = _zsctl("export", f"--checkpoint={alone}", f"--out={out}")
    assert r.returncode == 1, r
    assert "FAILED_PRECONDITION" in r.stderr and "part-1" in r.stderr, r.stderr
    assert not out.exists()

    # ...and works on the parts gathered in one tree.
    gathered = tmp_path / "gathered" / JOB / cw.CHECKPOINT
    shutil.copytree(alone, gathered)
    shutil.copytree(dirs[1] / JOB / cw.CHECKPOINT / "part-1", gathered / "part-1")
    r = _zsctl("export", f"--checkpoint={gathered}", f"--out={out}")
    assert r.returncode == 0, r.stderr
    assert f"(step {cw.SAVE_AT})" in r.stdout, r.stdout

    loaded = torch.load(str(out), weights_only=True)
    assert isinstance(loaded, dict)
    assert list(loaded) == info["names"]  # model.named_parameters() order
    for name, tensor in loaded.items():
        expected = torch.from_numpy(arrays[f"saved:{name}"])
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name
    # A state dict the model takes as it is.
    model = tc.make_model()
    model.load_state_dict(loaded)

    # "latest" names the same checkpoint.
    latest = tmp_path / "latest.pt"
    r = _zsctl("export", f"--checkpoint={gathered.parent}/latest",
               f"--out={latest}")
    assert r.returncode == 0, r.stderr
    assert latest.read_bytes() == out.read_bytes()


def test_zsctl_checkpoint_commands(cluster, trained):
    addresses, _ = cluster
    # The job has ended: its checkpoints open with its token (ZS_JOB_TOKEN,
    # which pytest_test.sh exports) and with the admin's, not with another.
    daemons = f"--daemons={','.join(addresses)}"
    r = _zsctl("checkpoint", "list", daemons, f"--job={JOB}")
    assert r.returncode == 0, r.stderr
    stranger = ADMIN_TOKEN_FILE.parent / "stranger.token"
    stranger.write_text("a-stranger-guessing-tokens\n")
    stranger.chmod(0o600)
    r = _zsctl("checkpoint", "list", daemons, f"--token_file={stranger}", f"--job={JOB}")
    assert r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, r
    admin = f"--token_file={ADMIN_TOKEN_FILE}"
    r = _zsctl("checkpoint", "list", daemons, admin, f"--job={JOB}")
    assert r.returncode == 0, r.stderr
    assert cw.CHECKPOINT in r.stdout and " 8 " in r.stdout, r.stdout
    r = _zsctl("checkpoint", "verify", daemons, admin, f"--job={JOB}",
               f"--name={cw.CHECKPOINT}")
    assert r.returncode == 0, r.stderr
    assert "match their CRC-32C" in r.stdout, r.stdout
    # Every rank has left: the job is gone from the daemons.
    r = _zsctl("checkpoint", "save", daemons, admin, f"--job={JOB}", "--name=again")
    assert r.returncode == 1
    assert "NOT_FOUND" in r.stderr and addresses[0] in r.stderr, r.stderr
    r = _zsctl("checkpoint", "save", daemons, f"--job={JOB}", "--name=latest")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr and "--name" in r.stderr, r.stderr
    r = _zsctl("checkpoint", "rewind", daemons, f"--job={JOB}")
    assert r.returncode == 1 and "unknown action" in r.stderr, r.stderr


def test_resume_gives_back_the_saved_state(cluster, trained, tmp_path):
    addresses, _ = cluster
    # A new run of the job (every rank of the first one has left), from
    # the latest checkpoint: the parameters saved, then the same training
    # as the uninterrupted run.
    resumed = _run_ranks(addresses, "resume", tmp_path)
    names = trained[0][0]["names"]
    for rank, (info, arrays) in enumerate(resumed):
        assert info["start_step"] == cw.SAVE_AT
        if rank == 0:
            assert info["resumed_from"]["name"] == cw.CHECKPOINT
            assert info["resumed_from"]["step"] == cw.SAVE_AT
        for name in names:
            assert torch.equal(
                torch.from_numpy(arrays[f"start:{name}"]),
                torch.from_numpy(trained[0][1][f"saved:{name}"])), name
            assert torch.equal(
                torch.from_numpy(arrays[f"final:{name}"]),
                torch.from_numpy(trained[0][1][f"final:{name}"])), name


def test_bad_checkpoint_calls_raise(cluster):
    addresses, _ = cluster
    layout = zeroshard.Layout([("w", (4, 3), 0)])
    n = layout.total_elements

    def client(job, **kwargs):
        return zeroshard.Client(addresses[:1], job, rank=0, world_size=1,
                                stage=1, bucket_bytes=4096, rpc_timeout=10.0,
                                step_timeout=10.0, **kwargs)

    c = client("pytest-resume-not-found", resume="no-such-checkpoint")
    with pytest.raises(zeroshard.Error) as e:
        c.register_model(layout, np.ones(n, dtype=np.float32))
    assert e.value.code == "NOT_FOUND", e.value
    # A malformed name is refused with the config, before any daemon is asked.
    with pytest.raises(zeroshard.Error) as e:
        client("pytest-resume-bad-name", resume="bad name")
    assert e.value.code == "INVALID_ARGUMENT", e.value
    assert "resume" in str(e.value), e.value

    c = client("pytest-bad-save")
    with pytest.raises(zeroshard.Error) as e:
        c.save_checkpoint("early")  # before register_model
    assert e.value.code == "FAILED_PRECONDITION"
    c.register_model(layout, np.ones(n, dtype=np.float32))
    assert c.resumed_from is None
    with pytest.raises(zeroshard.Error) as e:
        c.await_checkpoint()
    assert e.value.code == "FAILED_PRECONDITION"
    for name in ("latest", "a/b", ""):
        with pytest.raises(zeroshard.Error) as e:
            c.save_checkpoint(name)
        assert e.value.code == "INVALID_ARGUMENT", name
    assert c.list_checkpoints() == []
    c.push_gradients(0, n, np.zeros(n, dtype=np.float32))
    c.step(1e-3)
    assert c.save_checkpoint("one")["step"] == 1
    assert c.await_checkpoint()["name"] == "one"
    with pytest.raises(zeroshard.Error) as e:
        c.save_checkpoint("one")
    assert e.value.code == "ALREADY_EXISTS"
    c.leave()

    with pytest.raises(TypeError, match="resume"):
        ShardedOptimizer([torch.zeros(3, requires_grad=True)],
                         dict(daemons=addresses[:1], job_id="x", rank=0,
                              world_size=1), resume=1)
