"""fp16 with dynamic loss scaling through zeroshard.torch.GradScaler: the
daemons unscale the pushed gradients, skip a step whose gradients overflow
(nothing changes), back the scale off after it and grow it after
growth_interval good steps, as torch.cuda.amp.GradScaler does on a GPU.

The oracle: single-process torch, fp32 masters stepped by torch.optim.AdamW
on the same half-precision gradients (the model computing in float16 on the
masters' rounding at stage 3; in float32 with its scaled gradients rounded
to float16, as the wire carries them, at stage 2), with GradScaler's skip
and scale rules written out (torch's own GradScaler and its
_amp_update_scale_ kernel run on CUDA only). The skip pattern and every
step's scale must match exactly; the parameters within fp16 tolerance."""

import numpy as np
import pytest
import torch

import stage3_common as sc
import zeroshard
from binaries import running_daemons
from client_checks import refuse_whole_model_gather
from zeroshard.torch import GradScaler, shard_model

STEPS = 16
IN, HIDDEN, OUT = 4, 8, 2
LR = 1e-2
# Scaled by 2**20 the loss's gradients overflow float16 (max 65504): the
# first steps are skipped, the scale halving each time, until it fits; then
# it doubles after every 3 good steps, and overflows again.
LOSS_SCALE = {"init_scale": 2.0 ** 20, "growth_interval": 3, "growth_factor": 2.0,
              "backoff_factor": 0.5}


class HalfLinear(torch.nn.Module):
    """x @ weight + bias by multiply and sum (torch 1.13 has no float16
    matmul on CPU)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return (x[..., :, None] * self.weight).sum(-2) + self.bias


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.first = HalfLinear(IN, HIDDEN)
        self.second = HalfLinear(HIDDEN, OUT)

    def forward(self, x):
        h = self.first(x)
        return self.second(h * (1 - 0.05 * h * h))


def _data():
    g = torch.Generator().manual_seed(6)
    return torch.randn(STEPS, 16, IN, generator=g), torch.randn(STEPS, 16, OUT, generator=g)


def _loss(model, x, y, dtype):
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _flat(params):
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def _reference(stage):
    """(fp32 masters, [(skipped, scale the step's loss used)])."""
    masters = Net()
    compute = Net().half() if stage == 3 else masters
    opt = torch.optim.AdamW(masters.parameters(), lr=LR, betas=sc.BETAS, eps=sc.EPS,
                            weight_decay=0.01)
    x, y = _data()
    scale, good = LOSS_SCALE["init_scale"], 0
    steps = []
    for s in range(STEPS):
        if compute is not masters:
            with torch.no_grad():
                for h, m in zip(compute.parameters(), masters.parameters()):
                    h.copy_(m)  # rounds to nearest even, as the daemons' copy
        compute.zero_grad(set_to_none=True)
        (_loss(compute, x[s], y[s], torch.float16 if stage == 3 else torch.float32)
         * scale).backward()
        # What the daemons receive: float16 gradients.
        grads = [p.grad.half() for p in compute.parameters()]
        skipped = not all(bool(torch.isfinite(g).all()) for g in grads)
        steps.append((skipped, scale))
        if skipped:
            scale *= LOSS_SCALE["backoff_factor"]
            good = 0
            continue
        for m, g in zip(masters.parameters(), grads):
            m.grad = g.float() * (1.0 / scale)  # a power of two: exact
        opt.step()
        good += 1
        if good == LOSS_SCALE["growth_interval"]:
            scale *= LOSS_SCALE["growth_factor"]
            good = 0
    return _flat(masters.parameters()), steps


@pytest.fixture(scope="module")
def daemons():
    with running_daemons(1) as addresses:
        yield addresses


def _config(daemons, job, **extra):
    return dict(daemons=daemons, job_id=job, rank=0, world_size=1, bucket_bytes=4096,
                rpc_timeout=30.0, step_timeout=60.0, precision="fp16",
                loss_scale=LOSS_SCALE, **extra)


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_dynamic_loss_scale_matches_reference(daemons, stage):
    model = shard_model(Net(), _config(daemons, f"loss-scale-{stage}"), stage=stage,
                        lr=LR, betas=sc.BETAS, eps=sc.EPS, weight_decay=0.01)
    if stage < 3:
        refuse_whole_model_gather(model)
    scaler = GradScaler(model)
    x, y = _data()
    dtype = torch.float16 if stage == 3 else torch.float32
    steps = []
    for s in range(STEPS):
        before = _flat(model.full_state_dict().values())
        used = scaler.get_scale()
        model.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, x[s], y[s], dtype)).backward()
        returned = scaler.step(model.optimizer)
        scaler.update()
        result = model.last_result
        after = _flat(model.full_state_dict().values())
        assert result["step"] == s + 1
        assert result["loss_scale"] == scaler.get_scale()
        if result["skipped"]:
            assert returned is None
            assert torch.equal(before, after), f"step {s + 1} was skipped, yet changed"
        else:
            assert not torch.equal(before, after)
        steps.append((result["skipped"], used))
    expected, expected_steps = _reference(stage)
    got = _flat(model.full_state_dict().values())
    err = float(torch.linalg.norm(got - expected) / torch.linalg.norm(expected))
    skipped = [s + 1 for s, (k, _) in enumerate(steps) if k]
    print(f"stage {stage} fp16: skipped steps {skipped} of {STEPS}, scales "
          f"{[scale for _, scale in steps]}; relative error from the reference {err:.3e}")
    assert steps == expected_steps
    assert steps[0][0] and not all(k for k, _ in steps)  # overflowed, then trained
    assert sum(1 for k, _ in steps if not k) >= STEPS // 2
    assert err < 1e-5  # measured: 5.4e-9 at stage 3, 1.1e-6 at stage 2
    model.close()


def test_fp16_stage3_needs_a_loss_scale(daemons):
    config = _config(daemons, "loss-scale-none")
    del config["loss_scale"]
    with pytest.raises(ValueError, match="loss scaling"):
        shard_model(Net(), config)


def test_grad_scaler_refuses_what_it_cannot_do(daemons):
    model = shard_model(Net(), _config(daemons, "loss-scale-api"), stage=3)
    scaler = GradScaler(model)
    assert scaler.get_scale() == LOSS_SCALE["init_scale"]
    assert scaler.is_enabled()
    pair = scaler.scale((torch.ones(2), [torch.ones(1)]))
    assert torch.equal(pair[0], torch.full((2,), LOSS_SCALE["init_scale"]))
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        scaler.unscale_(model.optimizer)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(2.0)
    with pytest.raises(ValueError, match="another optimizer"):
        scaler.step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
    with pytest.raises(TypeError):
        GradScaler(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
    model.close()


def test_client_loss_scale_settings(daemons):
    client = zeroshard.Client(daemons, "loss-scale-client", rank=0, world_size=1,
                              precision="fp16", loss_scale=8.0)
    assert client.loss_scale == 8.0  # static
    with pytest.raises(ValueError, match="unknown key 'scale'"):
        zeroshard.Client(daemons, "loss-scale-bad", rank=0, world_size=1,
                         loss_scale={"scale": 2.0})
    with pytest.raises(TypeError, match="loss_scale"):
        zeroshard.Client(daemons, "loss-scale-bad", rank=0, world_size=1, loss_scale=True)
    with pytest.raises(zeroshard.Error, match="backoff_factor") as info:
        zeroshard.Client(daemons, "loss-scale-bad", rank=0, world_size=1,
                         loss_scale={"backoff_factor": 2.0})
    assert info.value.code == "INVALID_ARGUMENT"


def test_grad_scaler_state_dict_follows_the_daemons(daemons):
    """state_dict() has torch GradScaler's keys with the daemons' scale and
    the job's settings; its _growth_tracker, which the trainer follows from
    the step results, agrees at every step with the count of good steps
    since the daemons' scale last changed. load_state_dict accepts what
    agrees with the daemons and refuses anything else, naming the key; a
    trainer that joins a job past step 0 cannot tell the tracker."""
    config = _config(daemons, "loss-scale-state")
    model = shard_model(Net(), config, stage=2, lr=LR, betas=sc.BETAS, eps=sc.EPS)
    scaler = GradScaler(model)
    x, y = _data()
    since_change, previous = 0, scaler.get_scale()
    trackers = []
    for s in range(STEPS):
        model.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, x[s], y[s], torch.float32)).backward()
        scaler.step(model.optimizer)
        scaler.update()
        scale = scaler.get_scale()
        since_change = 0 if (model.last_result["skipped"] or scale != previous) \
            else since_change + 1
        previous = scale
        state = scaler.state_dict()
        assert state == {"scale": scale, "growth_factor": LOSS_SCALE["growth_factor"],
                         "backoff_factor": LOSS_SCALE["backoff_factor"],
                         "growth_interval": LOSS_SCALE["growth_interval"],
                         "_growth_tracker": since_change}, (s, state)
        trackers.append(state["_growth_tracker"])
    assert set(trackers) == {0, 1, 2}  # grew and was skipped in between
    state = scaler.state_dict()
    scaler.load_state_dict(dict(state))  # agrees: nothing to do
    before = model.full_state_dict()
    for key, value in [("scale", state["scale"] * 2), ("growth_factor", 4.0),
                       ("backoff_factor", 0.25), ("growth_interval", 7),
                       ("_growth_tracker", state["_growth_tracker"] + 1)]:
        with pytest.raises(ValueError, match=key):
            scaler.load_state_dict(dict(state, **{key: value}))
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == state
    after = model.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    # The same rank joining again (a restarted trainer) finds the job past
    # step 0: it reads the daemons' scale, cannot tell their tracker, and
    # says so.
    again = shard_model(Net(), config, stage=2, lr=LR, betas=sc.BETAS, eps=sc.EPS)
    rejoined = GradScaler(again)
    # Its scale is the daemons' from the start, before its first step.
    assert state["scale"] != LOSS_SCALE["init_scale"]
    assert rejoined.get_scale() == state["scale"]
    with pytest.raises(RuntimeError, match="growth tracker"):
        rejoined.state_dict()
    with pytest.raises(RuntimeError, match="growth tracker"):
        rejoined.load_state_dict(state)
    with pytest.raises(ValueError, match="growth_interval"):
        rejoined.load_state_dict(dict(state, growth_interval=7))
    again.close()
