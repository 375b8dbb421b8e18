"""The node cache from Python (Client(node_cache=True), a shard_model
config key): a rank's gathers of other daemons' ranges are served by its
host's daemon, which fetches each range once per committed step. Two
daemons on this machine, stage 3: the job trains bit for bit as without
the cache, and the host daemon (the first, both being on loopback) holds
the other's parameters in its `param_cache` ledger category."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import stage3_common as sc
import zeroshard
from binaries import HERE_DIR, run_workers, running_daemons, zsctl_binary
from zeroshard.torch import init_from_env

WORLD = 2
_jobs = itertools.count()


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(2) as addresses:
        yield addresses


def _config(daemons, **extra):
    return dict(daemons=daemons, job_id=f"node-cache-{next(_jobs)}", rpc_timeout=30.0,
                step_timeout=60.0, bucket_bytes=4096, **extra)


def _param_cache_bytes(daemon, job):
    out = subprocess.run([zsctl_binary(), "memory", f"--daemons={daemon}", f"--job={job}",
                          "--output=json"], capture_output=True, text=True, timeout=30,
                         check=True)
    jobs = json.loads(out.stdout)["daemons"][0]["jobs"]
    return sum(j["categories"].get("param_cache", 0) for j in jobs if j["job_id"] == job)


def _train_ranks(daemons, tmp_path, **extra):
    config = _config(daemons, **extra)
    configs, outputs = [], []
    for rank in range(WORLD):
        configs.append(dict(config, rank=rank, world_size=WORLD, layers=None))
        outputs.append(tmp_path / f"{config['job_id']}-rank{rank}.npz")
    run_workers("stage3_worker.py", configs, outputs)
    return [np.load(out) for out in outputs]


def test_defaults_and_env_pass_through(monkeypatch):
    assert zeroshard._zeroshard.DEFAULTS["node_cache"] is False
    assert zeroshard._zeroshard.DEFAULTS["local_daemon"] == -1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ZS_DAEMONS", "127.0.0.1:1,127.0.0.1:2")
    monkeypatch.setenv("ZS_JOB_ID", "env-node-cache")
    config = init_from_env(node_cache=True, local_daemon=1)
    assert config["node_cache"] is True and config["local_daemon"] == 1
    # The keywords reach the client: node_cache with replicas=2 is refused
    # by the client's config check, naming the field.
    with pytest.raises(zeroshard.Error, match="node_cache") as info:
        zeroshard.Client(**dict(config, replicas=2))
    assert info.value.code == "INVALID_ARGUMENT"


def test_two_ranks_train_as_without_the_cache(daemons, tmp_path):
    plain = _train_ranks(daemons, tmp_path)
    cached = _train_ranks(daemons, tmp_path, node_cache=True)
    for rank in range(WORLD):
        for key in ("params", "norms", "gathered_bits"):
            assert np.array_equal(plain[rank][key], cached[rank][key], equal_nan=True), \
                (rank, key)
        # The same bytes gathered, from the host daemon instead of the owner.
        assert np.array_equal(plain[rank]["last_step"], cached[rank]["last_step"]), rank


@pytest.mark.parametrize("node_cache", [False, True])
def test_host_daemon_caches_the_other_daemons_parameters(daemons, tmp_path, node_cache):
    """Rank 1 in a worker, rank 0 here: after the steps and one more
    forward, daemon 0 (both ranks' host daemon) holds a copy of daemon 1's
    parameters with the cache, none without."""
    config = _config(daemons, world_size=WORLD, node_cache=node_cache, local_daemon=0)
    worker = subprocess.Popen([sys.executable, str(HERE_DIR / "node_cache_worker.py"),
                               json.dumps(dict(config, rank=1)), str(tmp_path / "unused")])
    try:
        model, _ = sc.train_in_process(dict(config, rank=0), stage=3)
        try:
            with torch.no_grad():  # gathers of the last committed step
                model(sc.make_data()[0][0])
            cached = _param_cache_bytes(daemons[0], config["job_id"])
            owner = _param_cache_bytes(daemons[1], config["job_id"])
        finally:
            model.close()
        assert worker.wait(timeout=120) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    print(f"node_cache={node_cache}: daemon 0 param_cache {cached} B, daemon 1 {owner} B")
    assert owner == 0
    if node_cache:
        assert cached > 0
    else:
        assert cached == 0
