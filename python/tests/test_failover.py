"""A daemon killed (SIGKILL) in the middle of a run of a replicated job
(replicas=2, 2 daemons, 2 trainer processes): each rank catches the error,
reconnects with ShardedModel.reconnect() (rank 0 promotes the backup) and
trains on from the committed step; the parameters end bit-identical to an
undisturbed run's. Stage 3 (layer hooks) and stage 2 (ShardedOptimizer)."""

import numpy as np
import pytest

import zeroshard
from binaries import run_workers, running_daemons
from zeroshard.torch import reconnectable

KILL_AT = 10  # rank 0 kills daemon 0 once this many steps are committed


def _run(daemons, job, stage, tmp_path, kill=None):
    configs, outputs = [], []
    for rank in range(2):
        config = dict(daemons=daemons, job_id=job, rank=rank, world_size=2,
                      replicas=2, bucket_bytes=4096, rpc_timeout=5.0,
                      step_timeout=30.0, stage=stage)
        if kill is not None and rank == 0:
            config.update(kill_pid=kill, kill_at=KILL_AT)
        configs.append(config)
        outputs.append(tmp_path / f"{job}-rank{rank}.npz")
    run_workers("failover_worker.py", configs, outputs)
    return [np.load(out) for out in outputs]


@pytest.mark.parametrize("stage", [3, 2])
def test_daemon_killed_mid_run(stage, tmp_path):
    procs = []
    with running_daemons(2, procs=procs) as daemons:
        expected = _run(daemons, f"pytest-failover-ref-{stage}", stage,
                        tmp_path)
        assert [int(r["reconnects"]) for r in expected] == [0, 0]
        results = _run(daemons, f"pytest-failover-{stage}", stage, tmp_path,
                       kill=procs[0].pid)
        assert procs[0].wait(timeout=10) is not None  # it was killed
    reconnects = [int(r["reconnects"]) for r in results]
    print(f"stage {stage}: reconnects per rank {reconnects}")
    assert all(n >= 1 for n in reconnects), reconnects
    for r in results:
        np.testing.assert_array_equal(r["params"], expected[0]["params"])


def test_reconnectable():
    assert not reconnectable(ValueError("UNAVAILABLE"))
    assert not reconnectable(zeroshard.Error("x"))  # no code


def test_a_daemon_restarted_empty_is_reconnectable():
    def error(code, message):
        e = zeroshard.Error(message)
        e.code = code
        return e

    assert reconnectable(error("UNAVAILABLE", "daemon a: Gather: connection reset"))
    assert reconnectable(error(
        "NOT_FOUND", 'daemon a: GetStepState j: job "j" is not registered on this daemon'))
    assert not reconnectable(error("NOT_FOUND", "checkpoint step-7 of job j: no such checkpoint"))
    assert not reconnectable(error("INVALID_ARGUMENT", "is not registered on this daemon"))
