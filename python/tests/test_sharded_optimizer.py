"""End to end: two zeroshardd daemons, two trainer processes using
ShardedOptimizer, checked against single-process torch.optim.AdamW."""

import array
import gc

import numpy as np
import pytest
import torch

import train_common as tc
import zeroshard
from binaries import run_workers, running_daemons

WORLD_SIZE = 2
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(2) as addresses:
        yield addresses


def _relative_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("stage,max_grad_norm", [(1, 0.0), (2, 0.5)])
def test_matches_single_process_adamw(daemons, tmp_path, stage, max_grad_norm):
    job = f"pytest-stage{stage}"
    configs, outputs = [], []
    for rank in range(WORLD_SIZE):
        config = dict(daemons=daemons, job_id=job, rank=rank,
                      world_size=WORLD_SIZE, bucket_bytes=4096, stage=stage,
                      max_grad_norm=max_grad_norm, rpc_timeout=30.0,
                      step_timeout=60.0)
        out = tmp_path / f"rank{rank}.npz"
        outputs.append(out)
        configs.append(config)
    run_workers("sharded_worker.py", configs, outputs)

    expected, expected_norms = tc.train_reference(max_grad_norm)
    results = [np.load(out) for out in outputs]
    for rank, r in enumerate(results):
        err = _relative_error(r["params"], expected)
        print(f"stage {stage} rank {rank}: relative error {err:.3e}")
        assert err < TOLERANCE
    np.testing.assert_array_equal(results[0]["params"], results[1]["params"])
    if max_grad_norm > 0:
        np.testing.assert_allclose(results[0]["norms"], expected_norms,
                                   rtol=1e-5)
        assert max(expected_norms) > max_grad_norm  # clipping took effect


def test_bad_buffers_raise(daemons):
    client = zeroshard.Client(daemons[:1], "pytest-bad-input", rank=0,
                              world_size=1, stage=1, bucket_bytes=4096)
    layout = zeroshard.Layout([("w", (5, 3), 0), ("b", (5,), 0)])
    assert layout.offsets == [0, 64]
    with pytest.raises(TypeError, match="float32"):
        client.register_model(
            layout, np.zeros(layout.total_elements, dtype=np.float64))
    with pytest.raises(ValueError, match="elements"):
        client.register_model(layout, np.zeros(3, dtype=np.float32))
    with pytest.raises(zeroshard.Error) as info:
        client.gather_all(np.zeros(layout.total_elements, dtype=np.float32))
    assert info.value.code == "FAILED_PRECONDITION"

    client.register_model(layout,
                          np.ones(layout.total_elements, dtype=np.float32))
    n = layout.total_elements
    with pytest.raises(TypeError, match="float32"):
        client.push_gradients(0, n, torch.zeros(n, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        client.push_gradients(0, n, torch.zeros(n, 2)[:, 0])
    with pytest.raises(TypeError, match="float32"):
        client.push_gradients(0, n, np.zeros(n, dtype=np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        client.push_gradients(0, n, np.zeros(2 * n, dtype=np.float32)[::2])
    with pytest.raises(zeroshard.Error) as info:
        client.push_gradients(0, n + 64, np.zeros(n + 64, dtype=np.float32))
    assert info.value.code == "INVALID_ARGUMENT"

    # The client is still usable after the errors.
    client.push_gradients(0, n, np.zeros(n, dtype=np.float32))
    result = client.step(1e-3)
    assert result["step"] == 1 and not result["skipped"]
    # A lent buffer nobody else references stays alive until the step.
    client.push_gradients(0, n, np.zeros(n, dtype=np.float32), borrow=True)
    gc.collect()
    result = client.step(1e-3)
    assert result["step"] == 2 and not result["skipped"]
    # A lent buffer stays exported until the step: it cannot be resized (its
    # memory moved) while the client may still read it.
    lent = array.array("f", [0.0] * n)
    client.push_gradients(0, n, lent, borrow=True)
    with pytest.raises(BufferError):
        lent.extend([1.0])
    result = client.step(1e-3)
    assert result["step"] == 3 and not result["skipped"]
    lent.extend([1.0])  # released by the step
    out = np.zeros(n, dtype=np.float32)
    client.gather_all(out)
    assert out[0] < 1.0 and out[20] == 0.0  # decayed; gaps read as zeros
    assert client.traffic_report()["total"]["push"] > 0
    assert client.memory_report()["buffer"] > 0
    client.leave()


def test_unreachable_daemon_raises():
    client = zeroshard.Client(["127.0.0.1:1"], "pytest-unreachable", rank=0,
                              world_size=1, stage=1, bucket_bytes=4096,
                              rpc_timeout=5.0, step_timeout=5.0)
    with pytest.raises(zeroshard.Error) as info:
        client.register_model([("w", (4,), 0)], None)
    assert info.value.code == "UNAVAILABLE"
    assert "127.0.0.1:1" in str(info.value)


def test_bad_config_raises():
    with pytest.raises(zeroshard.Error) as info:
        zeroshard.Client([], "x", rank=0, world_size=1)
    assert info.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ValueError, match="precision"):
        zeroshard.Client(["127.0.0.1:1"], "x", rank=0, world_size=1,
                         precision="fp8")


def test_cuda_device_without_cuda_raises():
    # A build without CUDA, or a machine without the device: Client refuses
    # at once, naming CUDA.
    try:
        zeroshard.Client(["127.0.0.1:1"], "x", rank=0, world_size=1,
                         cuda_device=0)
    except zeroshard.Error as e:
        assert e.code == "FAILED_PRECONDITION"
        assert "CUDA" in str(e)
    else:
        pytest.skip("this build and machine have CUDA device 0")
    with pytest.raises(zeroshard.Error) as info:
        zeroshard.Client(["127.0.0.1:1"], "x", rank=0, world_size=1,
                         cuda_device=-2)
    assert info.value.code == "INVALID_ARGUMENT"
