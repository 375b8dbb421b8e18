"""Stage 3 end to end: two zeroshardd daemons and 2 or 3 trainer processes
training through shard_model(stage=3), checked against single-process
torch.optim.AdamW with clip_grad_norm_, and the trainers' parameter memory
checked during forward and backward."""


import numpy as np
import pytest
import torch

import stage3_common as sc
import zeroshard
from binaries import run_workers, running_daemons
from zeroshard.torch import shard_model

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(2) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def reference():
    return sc.train_reference()


def _config(daemons, job, rank, world_size):
    return dict(daemons=daemons, job_id=job, rank=rank,
                world_size=world_size, bucket_bytes=4096, rpc_timeout=30.0,
                step_timeout=60.0)


@pytest.mark.parametrize("world_size,layers", [
    (2, None),  # each child with parameters is a layer
    (3, ["embed", "block.0", "block.2", "head"]),  # block.3 goes outer
])
def test_matches_single_process_adamw(daemons, reference, tmp_path,
                                      world_size, layers):
    job = f"pytest-stage3-{world_size}"
    configs, outputs = [], []
    for rank in range(world_size):
        config = _config(daemons, job, rank, world_size)
        config["layers"] = layers
        out = tmp_path / f"rank{rank}.npz"
        outputs.append(out)
        configs.append(config)
    run_workers("stage3_worker.py", configs, outputs)

    expected, expected_norms = reference
    results = [np.load(out) for out in outputs]
    for rank, r in enumerate(results):
        err = float(np.linalg.norm(r["params"] - expected)
                    / np.linalg.norm(expected))
        worst = float(np.max(np.abs(r["params"] - expected)
                             / np.maximum(np.abs(expected), 1e-3)))
        print(f"stage 3, {world_size} ranks, rank {rank}: relative error "
              f"{err:.3e} (worst element {worst:.3e}); parameter bytes held: "
              f"peak {int(r['peak'])} (forward {int(r['peak_forward'])}) of "
              f"the model's {int(r['model_bytes'])}; client layer buffers "
              f"{int(r['client_param_bytes'])}; prefetch hits "
              f"{int(r['prefetch_hits'])}, misses {int(r['prefetch_misses'])}")
        assert err < TOLERANCE
        # Forward: the running layer and the outer module's own parameters;
        # backward may overlap two layers.
        assert r["peak_forward"] <= r["outer_bytes"] + r["two_largest"]
        assert r["peak"] <= r["outer_bytes"] + r["two_largest"]
        assert r["peak"] < r["model_bytes"]
    for r in results[1:]:
        np.testing.assert_array_equal(r["params"], results[0]["params"])
    np.testing.assert_allclose(results[0]["norms"], expected_norms, rtol=1e-5)
    assert max(expected_norms) > sc.MAX_GRAD_NORM  # clipping took effect


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_in_process(daemons, reference, stage):
    """shard_model in this process, one rank on the full batch: stage 2
    goes through ShardedOptimizer, stage 3 through the layer hooks."""
    config = _config(daemons[:1], f"pytest-one-rank-stage{stage}", 0, 1)
    model = shard_model(sc.make_model(), config, stage=stage, lr=sc.LR,
                        betas=sc.BETAS, eps=sc.EPS,
                        weight_decay=sc.WEIGHT_DECAY,
                        max_grad_norm=sc.MAX_GRAD_NORM)
    x, y = sc.make_data()
    for s in range(sc.STEPS):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[s]), y[s]).backward()
        result = model.step()
        assert result["step"] == s + 1 and not result["skipped"]
    expected, _ = reference
    params = sc.flatten(model.full_state_dict())
    err = float(np.linalg.norm(params - expected) / np.linalg.norm(expected))
    print(f"stage {stage}, one rank: relative error {err:.3e}")
    assert err < TOLERANCE
    model.close()


def test_bad_layers_raise(daemons):
    config = _config(daemons[:1], "pytest-stage3-bad", 0, 1)
    with pytest.raises(ValueError, match="no submodule"):
        shard_model(sc.make_model(), config, layers=["nope"])
    with pytest.raises(ValueError, match="repeat"):
        shard_model(sc.make_model(), config, layers=["head", "head"])
    with pytest.raises(ValueError, match="stage"):
        shard_model(sc.make_model(), config, stage=4)
    with pytest.raises(ValueError, match="precision"):
        shard_model(sc.make_model(), dict(config, precision="bf16"))

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)
            self.b.weight = self.a.weight

    with pytest.raises(ValueError, match="shared"):
        shard_model(Tied(), config)


def test_layer_gather_errors(daemons):
    client = zeroshard.Client(daemons[:1], "pytest-stage3-gather", rank=0,
                              world_size=1, stage=3, bucket_bytes=4096)
    layout = zeroshard.Layout([("a", (5, 3), 0), ("b", (7,), 1),
                               ("c", (2,), 1)])
    assert layout.layers == [0, 1]
    assert layout.tensor_layers == [0, 1, 1]
    assert layout.layer_range(1) == (64, 192)
    with pytest.raises(zeroshard.Error) as info:
        layout.layer_range(2)
    assert info.value.code == "NOT_FOUND"
    with pytest.raises(zeroshard.Error) as info:
        client.gather(0, np.zeros(64, dtype=np.float32))
    assert info.value.code == "FAILED_PRECONDITION"

    initial = np.arange(layout.total_elements, dtype=np.float32)
    client.register_model(layout, initial)
    out = np.zeros(128, dtype=np.float32)
    client.gather(1, out)
    np.testing.assert_array_equal(out[:7], initial[64:71])
    np.testing.assert_array_equal(out[64:66], initial[128:130])
    tensor = torch.zeros(128)
    client.gather(1, tensor)  # a tensor is written in place
    np.testing.assert_array_equal(tensor.numpy(), out)
    with pytest.raises(ValueError, match="elements"):
        client.gather(0, np.zeros(3, dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        client.gather(1, torch.zeros(128, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        client.gather(1, torch.zeros(128, 2)[:, 0])
    freed = torch.zeros(128)
    freed.storage().resize_(0)
    with pytest.raises(ValueError, match="storage"):
        client.gather(1, freed)
    with pytest.raises(TypeError, match="float32"):
        client.gather(0, np.zeros(64, dtype=np.float64))
    with pytest.raises(zeroshard.Error) as info:
        client.gather(5, np.zeros(64, dtype=np.float32))
    assert info.value.code == "NOT_FOUND"
    client.prefetch(0)
    client.release(0)
    client.release(1)
    client.leave()
