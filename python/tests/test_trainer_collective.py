"""The trainer collective from Python (reduction='trainer'): 2 trainer
processes reduce-scatter their gradients and all-gather each layer's
parameters among themselves over Gloo, each moving only its own partition
with the 2 daemons. Checked against single-process torch.optim.AdamW, bit
for bit against the same job with daemon reduction (both sum the ranks in
rank order in fp32), and by its traffic."""

import numpy as np
import pytest

import stage3_common as sc
from binaries import run_workers, running_daemons

TOLERANCE = 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(2) as addresses:
        yield addresses


def _train(daemons, tmp_path, job, **extra):
    configs, outputs = [], []
    for rank in range(WORLD):
        config = dict(daemons=daemons, job_id=job, rank=rank,
                      world_size=WORLD, bucket_bytes=4096, rpc_timeout=30.0,
                      step_timeout=60.0, layers=None, **extra)
        outputs.append(tmp_path / f"{job}-rank{rank}.npz")
        configs.append(config)
    run_workers("stage3_worker.py", configs, outputs)
    return [np.load(out) for out in outputs]


def test_stage3_trainer_collective_equals_daemon_reduction(daemons, tmp_path):
    rendezvous = tmp_path / "gloo"
    rendezvous.mkdir()
    trainer = _train(daemons, tmp_path, "pytest-trainer-collective",
                     reduction="trainer", collective_dir=str(rendezvous))
    daemon = _train(daemons, tmp_path, "pytest-trainer-collective-daemon")

    expected, _ = sc.train_reference()
    for rank, r in enumerate(trainer):
        err = float(np.linalg.norm(r["params"] - expected)
                    / np.linalg.norm(expected))
        push, gather, sent, received = (int(x) for x in r["last_step"])
        d_push, d_gather, _, _ = (int(x) for x in daemon[rank]["last_step"])
        print(f"trainer collective, stage 3, rank {rank}: relative error "
              f"{err:.3e}; last step with the daemons: pushed {push} B, "
              f"gathered {gather} B (daemon reduction: {d_push} B, "
              f"{d_gather} B); with the other rank: sent {sent} B, "
              f"received {received} B")
        assert err < TOLERANCE
        np.testing.assert_array_equal(r["params"], daemon[rank]["params"])
        assert r["peak"] <= r["outer_bytes"] + r["two_largest"]
    # The ranks' partitions make up what one rank pushes alone in daemon
    # reduction, and the layers both gather (daemon reduction also counts
    # prefetches it did not use). What a rank does not fetch from the
    # daemons it receives from the other rank, which fetched it, and its
    # partition of the gradient comes from the other rank too.
    pushes = [int(r["last_step"][0]) for r in trainer]
    gathers = [int(r["last_step"][1]) for r in trainer]
    d_push, d_gather = (int(x) for x in daemon[0]["last_step"][:2])
    assert sum(pushes) == d_push
    assert 0 < sum(gathers) <= d_gather
    assert all(0 < p < d_push for p in pushes)
    # Besides, a byte per tensor each way: the ranks' no-gradient marks.
    for rank, r in enumerate(trainer):
        other = 1 - rank
        marks = int(r["last_step"][3]) - pushes[rank] - gathers[other]
        assert 0 < marks < 1024
        assert int(r["last_step"][2]) == pushes[other] + gathers[rank] + marks
    for r in trainer[1:]:
        np.testing.assert_array_equal(r["params"], trainer[0]["params"])


@pytest.mark.parametrize("options, message", [
    (dict(reduction="allreduce"), "reduction: must be 'daemon' or"),
    (dict(reduction="trainer"), "collective_dir"),
    (dict(reduction="trainer", collective="mpi", collective_dir="/tmp"),
     "collective: must be 'gloo' or 'nccl'"),
    (dict(collective="mpi"), "collective: must be 'gloo' or 'nccl'"),
    (dict(collective="nccl"), "pass reduction='trainer'"),
])
def test_bad_reduction_raises(daemons, options, message):
    from zeroshard import Client
    with pytest.raises(ValueError, match=message):
        Client(daemons=daemons, job_id="x", rank=0, world_size=1,
               token="t" * 16, **options)


def test_nccl_collective_needs_a_cuda_build_and_device(daemons, tmp_path):
    """collective='nccl' is refused by a build without NCCL (ValueError) and,
    in one with it, by register_model on a client without a CUDA device."""
    import zeroshard
    from zeroshard import Client
    try:
        client = Client(daemons=daemons[:1], job_id="pytest-nccl-no-device",
                        rank=0, world_size=1, reduction="trainer",
                        collective="nccl", collective_dir=str(tmp_path))
    except ValueError as e:
        assert "needs a build with CUDA and NCCL" in str(e)
        return
    layout = zeroshard.Layout([("w", (4, 4), 0)])
    with pytest.raises(zeroshard.Error, match="cuda_device") as info:
        client.register_model(
            layout, np.zeros(layout.total_elements, dtype=np.float32))
    assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_trains_and_refuses_reconnect(daemons, tmp_path, stage):
    """One rank in this process: the collective has nobody to exchange with
    (no rendezvous), trains like daemon reduction, and reconnect() says it
    cannot work with the trainer collective instead of joining alone."""
    config = dict(daemons=daemons[:1], job_id=f"pytest-trainer-one-{stage}",
                  rank=0, world_size=1, bucket_bytes=4096, rpc_timeout=30.0,
                  step_timeout=60.0, reduction="trainer",
                  collective_dir=str(tmp_path))
    model, _ = sc.train_in_process(config, stage)
    expected, _ = sc.train_reference()
    params = sc.flatten(model.full_state_dict())
    err = float(np.linalg.norm(params - expected) / np.linalg.norm(expected))
    assert err < TOLERANCE
    with pytest.raises(ValueError, match="reduction='trainer'"):
        model.reconnect()
    model.close()
