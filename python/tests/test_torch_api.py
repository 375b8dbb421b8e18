"""zeroshard.torch as a torch user meets it, in this process against real
daemons: odd parameter shapes and layouts, state dict keys, sharded state
dicts, buffers, and bad input (which raises what torch would raise, naming
the parameter or group, and changes nothing on the daemons). Two-rank
cases run each rank on a thread (the client releases the GIL while it
waits)."""

import threading

import numpy as np
import pytest
import torch
from torch import nn

import zeroshard
from binaries import running_daemons
from zeroshard.torch import ShardedOptimizer, shard_model


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-checkpoints")
    with running_daemons(2, lambda i: [f"--checkpoint_dir={root}"]) as addresses:
        yield addresses


_jobs = iter(range(1000))


def _config(daemons, rank=0, world_size=1, job=None):
    return dict(daemons=daemons, job_id=job or f"api-{next(_jobs)}", rank=rank,
                world_size=world_size, bucket_bytes=4096, rpc_timeout=30.0,
                step_timeout=60.0)


def _on_threads(fns):
    """Runs each fn on its own thread; returns their results (re-raises)."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for e in errors:
        if e is not None:
            raise e
    return results


class Shapes(nn.Module):
    """A zero-element layer, a channels_last conv, a 0-d gain, a
    transposed (non-contiguous) weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv.weight.data = self.conv.weight.data.contiguous(
            memory_format=torch.channels_last)
        self.empty = nn.Linear(8, 0)
        self.gain = nn.Parameter(torch.tensor(0.7))
        self.t = nn.Parameter(torch.randn(6, 4 * 5 * 5).t())  # strides (1, 100)
        self.head = nn.Linear(6 + 0, 2)

    def forward(self, x):
        h = self.conv(x).flatten(1)                          # [B, 100]
        h = h @ self.t                                       # [B, 6]
        h = torch.cat([h, self.empty(h[:, :8].new_zeros(h.shape[0], 8))], dim=1)
        return self.gain * self.head(h)


def _shapes_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 2, 3, 5, 5, generator=g), torch.randn(4, 2, 2, generator=g)


@pytest.mark.parametrize("stage", [1, 3])
def test_odd_shapes_train_like_torch(daemons, stage):
    xs, ys = _shapes_data()
    ref = Shapes()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in zip(xs, ys):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()

    net = Shapes()
    model = shard_model(net, _config(daemons[:1]), stage=stage, lr=1e-2)
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert net.t.stride() == (1, 100)
    assert net.empty.weight.shape == (0, 8)
    for x, y in zip(xs, ys):
        nn.functional.mse_loss(model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
    got = model.state_dict()
    assert list(got) == list(ref.state_dict())
    for key, want in ref.state_dict().items():
        err = float((got[key] - want).norm() / max(float(want.norm()), 1e-30))
        assert got[key].shape == want.shape, key
        assert err < 1e-6, f"{key}: {err}"
    model.close()


def test_mixed_dtypes_refused_only_where_the_daemons_cannot_hold_them(daemons):
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[1].weight.data = net[1].weight.data.double()
    with pytest.raises(TypeError, match=r"parameter 1\.weight.*float64"):
        shard_model(net, _config(daemons[:1]), stage=3)
    # A bf16 parameter in an fp32 job keeps its dtype (its own storage at
    # stage 3) and trains.
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[1].to(torch.bfloat16)
    model = shard_model(net, _config(daemons[:1]), stage=3)

    def forward(x):
        return model.module[1](model.module[0](x).bfloat16()).float()

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    losses = []
    for _ in range(5):
        loss = nn.functional.mse_loss(forward(x), y)
        losses.append(float(loss))
        loss.backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
    assert net[1].weight.dtype == torch.bfloat16
    assert losses[-1] < losses[0]
    model.close()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.wte = nn.Embedding(40, 24)
        self.norm = nn.BatchNorm1d(24)
        self.head = nn.Linear(24, 40, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens):
        return self.head(self.norm(self.wte(tokens)))


def test_state_dict_keys_and_tied_tensors_as_torch(daemons):
    net = Tied()
    want = net.state_dict()
    model = shard_model(net, _config(daemons[:1]), stage=3)
    got = model.state_dict()
    assert list(got) == list(want)  # tied key and buffers included, in order
    assert got["wte.weight"] is got["head.weight"]
    for key in want:
        assert torch.equal(got[key], want[key]), key
    model.close()


def test_sharded_state_dict_loads_under_another_world_size(daemons):
    job = "api-sharded"

    def rank(r):
        net = Tied()
        model = shard_model(net, _config(daemons, r, 2, job), stage=3, lr=0.05)
        x = torch.randint(0, 40, (6,))
        nn.functional.cross_entropy(model(x), x).backward()
        model.optimizer.step()
        part = model.sharded_state_dict()
        full = model.state_dict() if r == 0 else None
        model.close()
        return part, full

    (p0, full), (p1, _) = _on_threads([lambda: rank(0), lambda: rank(1)])
    assert p1["buffers"] == {}  # rank 0 keeps them
    # Every element is in exactly one part.
    for key in ("wte.weight",):
        counts = sum(p["parameters"][key]["data"].numel() for p in (p0, p1)
                     if key in p["parameters"])
        assert counts == full[key].numel()
    fresh = shard_model(Tied(), _config(daemons[:1]), stage=3)
    fresh.load_sharded_state_dict([p0, p1])
    loaded = fresh.state_dict()
    for key in full:
        assert torch.equal(loaded[key], full[key]), key
    with pytest.raises(ValueError, match="wte.weight: elements from"):
        fresh.load_sharded_state_dict([p1])
    fresh.close()


def test_buffers_broadcast_from_rank0_and_kept_in_checkpoints(daemons):
    job = "api-buffers"

    def rank(r):
        net = Tied()
        with torch.no_grad():
            net.norm.running_mean.fill_(float(r + 1))  # rank 1's differs
        model = shard_model(net, _config(daemons, r, 2, job), stage=3)
        after = net.norm.running_mean.clone()
        x = torch.randint(0, 40, (8,))
        nn.functional.cross_entropy(model(x), x).backward()  # updates running stats
        model.optimizer.step()
        saved = None
        if r == 0:
            saved = net.norm.running_mean.clone()
            model.save_checkpoint("with-buffers")
            model.await_checkpoint()
        model.close()
        return after, saved

    (a0, saved), (a1, _) = _on_threads([lambda: rank(0), lambda: rank(1)])
    assert torch.equal(a0, torch.full((24,), 1.0))
    assert torch.equal(a1, a0)  # rank 0's reached rank 1
    net = Tied()
    model = shard_model(net, _config(daemons[:1], 0, 1, job), stage=3, resume="latest")
    assert torch.equal(net.norm.running_mean, saved)
    assert int(net.norm.num_batches_tracked) == 1
    model.close()


def _daemon_state(model):
    return (model.state_dict(), model.optimizer.state_dict())


def _same_state(a, b):
    (ma, oa), (mb, ob) = a, b
    assert list(ma) == list(mb)
    for key in ma:
        assert torch.equal(ma[key], mb[key]), key
    assert set(oa["state"]) == set(ob["state"])
    for i, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


def test_bad_input_raises_as_torch_and_changes_nothing(daemons):
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: not a parameter"):
        shard_model(Tied(), _config(daemons[:1]), param_groups=[{"params": [nn.Parameter(
            torch.zeros(2))]}])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\]"):
        net = Tied()
        shard_model(net, _config(daemons[:1]), param_groups=[
            {"params": list(net.parameters()), "amsgrad": True}])
    with pytest.raises(ValueError, match="more than one parameter group"):
        net = Tied()
        shard_model(net, _config(daemons[:1]), param_groups=[
            {"params": [net.wte.weight]}, {"params": [net.wte.weight]}])

    net = Tied()
    model = shard_model(net, _config(daemons[:1]), stage=3)
    x = torch.randint(0, 40, (8,))
    nn.functional.cross_entropy(model(x), x).backward()
    model.optimizer.step()
    model.optimizer.zero_grad()
    before = _daemon_state(model)

    # A second backward without gradient_accumulation_steps.
    nn.functional.cross_entropy(model(x), x).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=1"):
        nn.functional.cross_entropy(model(x), x).backward()
    # The first of the two is pushed: the step must be taken or the job
    # restarted; a new job is cleaner for what follows.
    model.close()

    net = Tied()
    model = shard_model(net, _config(daemons[:1]), stage=3)
    before = _daemon_state(model)
    model.optimizer.param_groups[0]["betas"] = (0.8, 0.999)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] changed"):
        model.optimizer.step()
    model.optimizer.param_groups[0]["betas"] = (0.9, 0.999)
    with pytest.raises(RuntimeError, match="Missing key.*norm.running_var"):
        sd = dict(before[0])
        del sd["norm.running_var"]
        model.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="size mismatch for wte.weight"):
        model.load_state_dict(dict(before[0], **{"wte.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match="different number of parameter groups"):
        model.optimizer.load_state_dict({"state": {}, "param_groups": []})
    bad = model.optimizer.state_dict()
    bad["param_groups"][0]["eps"] = 1e-3
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]"):
        model.optimizer.load_state_dict(bad)
    _same_state(before, _daemon_state(model))
    model.close()


def test_unfreezing_after_sharding_is_refused(daemons):
    net = Tied()
    net.wte.weight.requires_grad_(False)
    net.norm.weight.requires_grad_(False)
    model = shard_model(net, _config(daemons[:1]), stage=1)
    net.norm.weight.requires_grad_(True)
    x = torch.randint(0, 40, (8,))
    nn.functional.cross_entropy(model(x), x).backward()
    with pytest.raises(ValueError, match="norm.weight had requires_grad=False"):
        model.optimizer.step()
    model.close()


def test_sharded_optimizer_takes_param_groups(daemons):
    """ShardedOptimizer in place of torch.optim.AdamW, with two groups."""
    torch.manual_seed(11)
    ref = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    net = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    net.load_state_dict(ref.state_dict())

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() == 2], "weight_decay": 0.2},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0,
                 "lr": 5e-3}]

    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2)
    opt = ShardedOptimizer(groups(net), _config(daemons[:1]), stage=2, lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        for m, o in ((ref, opt_ref), (net, opt)):
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
            o.param_groups[1]["lr"] = 5e-3 / (step + 1)
            o.step()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert float((a - b).norm() / a.norm()) < 1e-6
    assert opt.state_dict()["param_groups"][1]["weight_decay"] == 0.0
    assert set(opt.state_dict()["state"]) == set(opt_ref.state_dict()["state"])
    opt.close()
