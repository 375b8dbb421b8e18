"""What a trainer holds (ShardedModel.memory_report) against the real
tensors: at stages 1-2 the model's parameters and gradients and a staging
buffer whose size does not grow with Ψ, and no flat copy of the model
anywhere in the process; at stage 3 the gathered layers. Prints the
figures beside DDP's 16Ψ and the paper's per-rank formula."""

import gc

import numpy as np
import pytest
import torch
from torch import nn

from binaries import running_daemons
from client_checks import refuse_whole_model_gather
from zeroshard.torch import ShardedOptimizer, shard_model

BUCKET_BYTES = 64 << 10
# The client's staging pool: ClientConfig.staging_buffers (4) buckets.
CLIENT_POOL_BYTES = 4 * BUCKET_BYTES
# The stage 1-2 trainer's own staging: one bucket, or the largest layer
# gathered through it (zeroshard/_flat.py: at most 2**18 fp32 elements).
TRAINER_STAGING_BOUND = max(BUCKET_BYTES, 4 << 18)


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(1) as addresses:
        yield addresses


def _net(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width),
                         nn.GELU(), nn.Linear(width, 256))


def _config(daemons, job, precision="fp32"):
    return dict(daemons=daemons, job_id=job, rank=0, world_size=1, precision=precision,
                bucket_bytes=BUCKET_BYTES, rpc_timeout=30.0, step_timeout=60.0)


def _storage(t):
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr(), s.nbytes() if hasattr(s, "nbytes") else s.size() * t.element_size()


def _large_buffers(allowed, min_bytes):
    """(kind, bytes) of every tensor or numpy array the process's objects
    reach holding at least `min_bytes`, except storages in `allowed`."""
    gc.collect()  # models of earlier tests, kept only by reference cycles
    found = []
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            ptr, nbytes = _storage(o)
        elif isinstance(o, np.ndarray):
            base = o if o.base is None else o.base
            ptr, nbytes = o.__array_interface__["data"][0], getattr(base, "nbytes", o.nbytes)
        else:
            continue
        if nbytes >= min_bytes and ptr not in allowed:
            found.append((type(o).__name__, nbytes))
    return found


def _paper_bytes(stage, psi, n_d=1, k=12):
    """The paper's model-state bytes per rank (mixed-precision Adam), and
    its part that is not partitioned (the trainer's part here: the daemons
    hold the partitions)."""
    return {1: (4 * psi + k * psi // n_d, 4 * psi),
            2: (2 * psi + (2 + k) * psi // n_d, 2 * psi),
            3: ((4 + k) * psi // n_d, 0)}[stage]


def _train_step(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _print(stage, report):
    paper, paper_trainer = _paper_bytes(stage, report["psi"])
    mib = 1 << 20
    print(f"stage {stage}, Ψ = {report['psi']}: parameters {report['parameters'] / mib:.2f} MiB, "
          f"gradients {report['gradients'] / mib:.2f} MiB, staging "
          f"{report['staging'] / mib:.3f} MiB (client pool {report['client_staging'] / mib:.3f}), "
          f"gathered layers {report['gathered_layers'] / mib:.3f} MiB; total "
          f"{report['total'] / mib:.2f} MiB = {report['total'] / report['psi']:.2f}Ψ "
          f"| DDP fp32 AdamW 16Ψ = {report['ddp_bytes'] / mib:.2f} MiB "
          f"| paper per rank at N_d=1 {paper / mib:.2f} MiB, of it unpartitioned "
          f"({['fp16 params + grads', 'fp16 params', 'none'][stage - 1]}) "
          f"{paper_trainer / mib:.2f} MiB")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_trainer_holds_model_and_a_constant_pool(daemons, stage, precision):
    """In a bf16 job too: its parameters are loaded from the fp32 masters
    layer by layer (gather_range), each equal to its master after the
    step, several layers and a parameter gathered straight into itself at
    width 1024."""
    staging = []
    for width in (512, 1024):
        model = shard_model(_net(width),
                            _config(daemons, f"memory-{stage}-{width}-{precision}", precision),
                            stage=stage, lr=1e-3)
        if precision != "fp32":
            refuse_whole_model_gather(model)
        try:
            params = list(model.module.parameters())
            param_bytes = sum(p.numel() * p.element_size() for p in params)
            psi = sum(p.numel() for p in params)
            _train_step(model, 0)
            report = model.memory_report()
            assert report["psi"] == psi
            assert report["parameters"] == param_bytes
            assert report["gradients"] == sum(p.grad.numel() * p.grad.element_size()
                                              for p in params) == param_bytes
            assert report["client_staging"] == model.client.memory_report()["buffer"]
            assert report["client_staging"] <= CLIENT_POOL_BYTES
            assert report["staging"] - report["client_staging"] <= TRAINER_STAGING_BOUND
            assert report["total"] == (report["parameters"] + report["gradients"]
                                       + report["staging"])
            assert report["ddp_bytes"] == 16 * psi
            # No tensor or array of half a flat fp32 copy of the model or
            # more, except the parameters and their gradients.
            allowed = {_storage(p)[0] for p in params} | {_storage(p.grad)[0] for p in params}
            assert _large_buffers(allowed, 2 * psi) == []
            model.optimizer.step()
            assert _large_buffers(allowed, 2 * psi) == []
            masters = model.full_state_dict()
            for name, p in model.module.named_parameters():
                assert torch.equal(p.detach(), masters[name]), name
            model.optimizer.zero_grad(set_to_none=True)
            after = model.memory_report()
            assert after["gradients"] == 0
            assert after["staging"] == report["staging"]
            _print(stage, report)
            staging.append((psi, report["staging"]))
        finally:
            model.close()
    (psi_a, staging_a), (psi_b, staging_b) = staging
    assert psi_b > 2.5 * psi_a
    # Bounded by the bucket and the layer size, not by Ψ: three times the
    # parameters, no more staging.
    assert staging_b <= staging_a, staging
    assert staging_b < psi_b  # less than a quarter of one fp32 copy


def test_sharded_optimizer_reports_the_same(daemons):
    net = _net(512)
    opt = ShardedOptimizer(net.parameters(), _config(daemons, "memory-opt"), stage=2)
    try:
        _train_step(net, 1)
        report = opt.memory_report()
        param_bytes = sum(p.numel() * 4 for p in net.parameters())
        assert report["parameters"] == report["gradients"] == param_bytes
        assert report["staging"] - report["client_staging"] <= TRAINER_STAGING_BOUND
        opt.step()
    finally:
        opt.close()


def test_stage3_reports_gathered_layers(daemons):
    model = shard_model(_net(1024), _config(daemons, "memory-3"), stage=3, lr=1e-3)
    try:
        psi = sum(p.numel() for p in model.module.parameters())
        before = model.memory_report()
        assert before["parameters"] == 0 and before["gradients"] == 0
        client = model.client.memory_report()
        assert before["gathered_layers"] == client["param"] + client["param_half"]
        seen = []
        hook = model.module[2].register_forward_pre_hook(
            lambda *unused: seen.append(model.memory_report()))
        _train_step(model, 2)
        hook.remove()
        inside = seen[0]
        # Inside the middle layer's forward: that layer (width x width + width,
        # fp32, alignment gaps included) is held, never the whole model.
        middle = 4 * (1024 * 1024 + 1024)
        assert inside["gathered_layers"] - before["gathered_layers"] >= middle
        assert inside["gathered_layers"] - before["gathered_layers"] < 4 * psi
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
        after = model.memory_report()
        assert after["gradients"] == 0
        assert after["gathered_layers"] == before["gathered_layers"]
        _print(3, inside)
    finally:
        model.close()
