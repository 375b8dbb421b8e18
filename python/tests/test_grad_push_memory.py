"""Stage 1-2 gradients in push memory from Python: on a bulk transport the
large float32 gradients live in one Client.allocate_push_memory, which the
daemon on this host sums in place instead of a copy Put into its staging
slot. Training is bit-identical to push_memory=False (the same losses,
masters, trainer parameters and gradients), through shard_model and
ShardedOptimizer; p.grad stays in the memory across steps and is moved
back to it during backward after zero_grad(set_to_none=True), a
parameter left without a gradient keeps None, and the daemon's traffic
shows where the pushes were read from."""

import os
import re
import urllib.request

import pytest
import torch
from torch import nn

import zeroshard
from binaries import daemon_with_metrics
from zeroshard.torch import ShardedOptimizer, shard_model

STEPS = 4
# 16 KiB buckets: gradients of 1024 elements or more are lent from p.grad,
# and the weights cover whole buckets (which the client sends from there).
BUCKET_BYTES = 1 << 14
DAEMON_FLAGS = {
    "grpc": ["--bulk_transport=grpc"],
    "ucx": ["--bulk_transport=ucx", "--ucx_tls=posix,cma,self"],
}

_jobs = iter(range(1000))


class Net(nn.Module):
    """Lent gradients (the weights) beside packed ones (the biases), and a
    layer no backward reaches on step 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(64, 128)
        self.middle = nn.Linear(128, 128)
        self.skipped = nn.Linear(128, 128)
        self.last = nn.Linear(128, 8)

    def forward(self, x, step):
        x = torch.tanh(self.middle(torch.tanh(self.first(x))))
        if step != 2:
            x = torch.tanh(self.skipped(x))
        return self.last(x)


@pytest.fixture(scope="module", params=["grpc", "ucx"])
def daemon(request):
    """(transport, address, metrics port) of one daemon serving it."""
    with daemon_with_metrics(DAEMON_FLAGS[request.param]) as (address, port):
        yield request.param, address, port


def _pushed_bytes(port):
    """{transport label: bytes} of the daemon's received pushes."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("zeroshard_comm_bytes_total{") and 'op="push"' in line:
            label = re.search(r'transport="([^"]*)"', line).group(1)
            out[label] = out.get(label, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def _config(daemon, **extra):
    """A one-rank job's client config on `daemon`, over its transport."""
    transport, address, _ = daemon
    config = dict(daemons=[address], job_id=f"grad-push-memory-{next(_jobs)}", rank=0,
                  world_size=1, bucket_bytes=BUCKET_BYTES, transport=transport, **extra)
    if transport == "ucx":
        config["ucx_tls"] = "posix,cma,self"
    return config


def _sharded(transport, make):
    """make() (a sharded model or optimizer); skips the test where UCX
    cannot start."""
    try:
        return make()
    except zeroshard.Error as e:
        if transport == "ucx" and e.code == "UNAVAILABLE" and "ucx" in str(e).lower():
            pytest.skip(f"UCX unavailable here: {e}")
        raise


def _train(daemon, push_memory, api, zero, reconnect_after=None):
    """STEPS steps of two backward passes each, through shard_model (api
    "model") or ShardedOptimizer ("optimizer"). zero_grad keeps the
    gradients except before step 2 (zero "keep"), or drops them before
    every step ("none"). Returns (losses, the masters, the trainer's
    parameters and gradients, the daemon's pushed bytes by transport,
    p.grad's storage of each large weight after each backward, memory
    reports after each backward). With reconnect_after, the model joins
    again (model.reconnect(): a new client) after that step."""
    transport, _, port = daemon
    config = _config(daemon, rpc_timeout=30.0, step_timeout=60.0, push_memory=push_memory)
    before = _pushed_bytes(port)
    net = Net()
    if api == "model":
        model = _sharded(transport,
                         lambda: shard_model(net, config, stage=2, lr=1e-2, weight_decay=0.1))
        net, opt = model.module, model.optimizer
    else:
        model = opt = _sharded(transport, lambda: ShardedOptimizer(
            net.named_parameters(), config, stage=2, lr=1e-2, weight_decay=0.1))
    g = torch.Generator().manual_seed(1)
    losses, storage, reports = [], [], []
    large = [net.first.weight, net.middle.weight]
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=(zero == "none" or step == 2))
            for _ in range(2):
                x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
                loss = nn.functional.mse_loss(net(x, step), y)
                loss.backward()
                losses.append(loss.detach())
            storage.append([p.grad.data_ptr() for p in large])
            reports.append(model.memory_report())
            opt.step()
            if step == 2:  # no backward reached it: no gradient, as in torch
                assert net.skipped.weight.grad is None
            if step == reconnect_after:
                model.reconnect()
        # The daemons' masters (ShardedOptimizer: its parameters are loaded
        # from them after every step).
        masters = model.state_dict() if api == "model" else {}
        params = {k: v.detach().clone() for k, v in net.named_parameters()}
        grads = {k: v.grad.clone() for k, v in net.named_parameters() if v.grad is not None}
    finally:
        model.close()
    after = _pushed_bytes(port)
    pushed = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return losses, masters, params, grads, pushed, storage, reports


def _daemon_may_take_descriptors():
    """Whether a daemon this process started may take its descriptors
    (pidfd_getfd): not under Yama ptrace_scope >= 1 without root, where only
    an ancestor may (the daemon is a child here)."""
    try:
        scope = int(open("/proc/sys/kernel/yama/ptrace_scope").read())
    except (OSError, ValueError):
        scope = 0
    return scope == 0 or os.geteuid() == 0


def _assert_read_in_place(transport, plain, pulled):
    """The pushed bytes by transport of a run with push memory (`pulled`)
    and without (`plain`): the daemon read every push in place and Put
    none (skipped where it may not take the memory)."""
    if pulled.get("push_memory", 0) == 0 and not _daemon_may_take_descriptors():
        pytest.skip("the daemon may not take this process's descriptors (Yama ptrace_scope)")
    assert pulled.get("push_memory", 0) == plain[transport], pulled
    assert pulled.get(transport, 0) == 0, pulled


@pytest.mark.parametrize("zero", ["keep", "none"])
@pytest.mark.parametrize("api", ["model", "optimizer"])
def test_gradients_in_push_memory_train_as_without(daemon, api, zero):
    transport = daemon[0]
    plain = _train(daemon, False, api, zero)
    pulled = _train(daemon, True, api, zero)
    for i, (x, y) in enumerate(zip(plain[0], pulled[0])):
        assert torch.equal(x, y), f"loss {i}: {x} != {y}"
    for which, a, b in (("master", plain[1], pulled[1]), ("parameter", plain[2], pulled[2]),
                        ("gradient", plain[3], pulled[3])):
        assert a.keys() == b.keys(), which
        for k in a:
            assert torch.equal(a[k], b[k]), f"{which} {k}"

    # p.grad of the large weights: with push memory in the same place after
    # every backward, also after zero_grad(set_to_none=True) (autograd's new
    # tensor moved there by the hook); the memory is their storage, not a
    # copy beside them.
    large_bytes = (64 * 128 + 128 * 128) * 4
    storage = pulled[5]
    assert all(s == storage[0] for s in storage), storage
    assert all(r["grad_push_memory"] >= large_bytes for r in pulled[6]), pulled[6]
    assert all(r["grad_push_memory"] == 0 for r in plain[6]), plain[6]
    for r_plain, r_pulled in zip(plain[6], pulled[6]):
        assert r_pulled["gradients"] - r_pulled["grad_push_memory"] <= (
            r_plain["gradients"] - large_bytes), (r_plain, r_pulled)

    # Where the daemon read the pushes: with push memory every push in
    # place (the lent gradients from their memory, the packed ones from the
    # client's staging pool), nothing Put; without it, everything Put.
    assert plain[4].get("push_memory", 0) == 0, plain[4]
    assert plain[4].get(transport, 0) >= STEPS * large_bytes, plain[4]
    _assert_read_in_place(transport, plain[4], pulled[4])


def test_a_reconnected_model_keeps_its_gradients_in_push_memory(daemon):
    """A rejoin's new client gets a push memory of its own: the gradients
    move there in the next backward and its pushes are read in place."""
    transport = daemon[0]
    plain = _train(daemon, False, "model", "keep")
    pulled = _train(daemon, True, "model", "keep", reconnect_after=1)
    for i, (x, y) in enumerate(zip(plain[0], pulled[0])):
        assert torch.equal(x, y), f"loss {i}: {x} != {y}"
    for k in plain[2]:
        assert torch.equal(plain[2][k], pulled[2][k]), k
    storage = pulled[5]
    assert storage[0] == storage[1] and storage[2] == storage[3], storage
    _assert_read_in_place(transport, plain[4], pulled[4])


def test_a_closed_model_leaves_the_gradients_to_torch(daemon):
    """close() removes the backward hooks: a later backward of the module
    leaves p.grad where autograd puts it."""
    net = Net()
    config = _config(daemon)
    model = _sharded(daemon[0], lambda: shard_model(net, config, stage=2))
    x, y = torch.randn(4, 64), torch.randn(4, 8)
    flat = model._flat
    try:
        nn.functional.mse_loss(net(x, 0), y).backward()
        assert flat.holds_grad(net.first.weight.grad)
        model.optimizer.step()
    finally:
        model.close()
    net.zero_grad(set_to_none=True)
    nn.functional.mse_loss(net(x, 0), y).backward()
    assert net.first.weight.grad is not None
    assert not flat.holds_grad(net.first.weight.grad)


def test_push_memory_is_a_client_option():
    assert zeroshard._zeroshard.DEFAULTS["push_memory"] is True
    client = zeroshard.Client(["127.0.0.1:1"], "push-memory-option", 0, 1,
                              token="push-memory-option-token", push_memory=False)
    memory = client.allocate_push_memory(10000)
    view = torch.frombuffer(memory, dtype=torch.float32)
    assert view.numel() * 4 == memory.nbytes and memory.nbytes >= 10000
    assert memory.nbytes % 4096 == 0 and torch.count_nonzero(view) == 0
    del memory  # the tensor keeps the memory
    view.fill_(1.5)
    assert float(view.sum()) == 1.5 * view.numel()
