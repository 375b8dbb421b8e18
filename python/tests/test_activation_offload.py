"""zeroshard.torch.offload_activations: the tensors autograd saves go to the
daemon's activation arena during the forward and come back in backward,
and training with it is bit-identical to training without it (losses and
parameters), at stages 1 and 3, over the streaming RPCs and the grpc bulk
transport. The daemon's memory report (zsctl memory) shows the bytes while
the graph holds them."""

import gc
import json
import subprocess
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import zeroshard
from binaries import running_daemons, zsctl_binary
from zeroshard.torch import offload_activations, shard_model

STEPS = 3
ARENA_BYTES = 8 << 20
# Saved tensors of this size and more are offloaded: the model's are 1-10 KiB.
MIN_BYTES = 1024

_jobs = iter(range(1000))


@pytest.fixture(scope="module")
def daemons():
    flags = ["--bulk_transport=grpc", f"--activation_arena_bytes={ARENA_BYTES}"]
    with running_daemons(2, lambda i: flags) as addresses:
        yield addresses


class Net(nn.Module):
    """Linear layers (which save their inputs), tanh (its output) and a
    product of a transposed view with itself (mul saves both operands: a
    non-contiguous tensor, which must come back with its strides)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(24, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 6)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        t = h.t()
        h = (t * t).t() + h
        return self.c(torch.tanh(self.b(h)))


def _register(client):
    layout = zeroshard.Layout([("w", [4], 0)])
    client.register_model(layout, np.zeros(layout.total_elements, dtype=np.float32))


def _config(daemons, transport):
    return dict(daemons=daemons, job_id=f"offload-{next(_jobs)}", rank=0, world_size=1,
                bucket_bytes=4096, rpc_timeout=30.0, step_timeout=60.0, transport=transport)


def _daemon_activation_bytes(daemon, job):
    out = subprocess.run([zsctl_binary(), "memory", f"--daemons={daemon}", f"--job={job}",
                          "--output=json"], capture_output=True, text=True, timeout=30,
                         check=True)
    jobs = json.loads(out.stdout)["daemons"][0]["jobs"]
    return sum(j["categories"].get("activation", 0) for j in jobs if j["job_id"] == job)


def _train(daemons, transport, stage, offload):
    """STEPS steps of a one-rank job; returns (losses, state dict, what the
    offload moved: a list of (block bytes, daemon bytes seen), store stats)."""
    config = _config(daemons, transport)
    model = shard_model(Net(), config, stage=stage, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, moved, stats = [], [], None
    try:
        for _ in range(STEPS):
            x, y = torch.randn(32, 24, generator=g), torch.randn(32, 6, generator=g)
            if offload:
                with offload_activations(model, min_bytes=MIN_BYTES) as block:
                    loss = nn.functional.mse_loss(model(x), y)
                # The offloads run behind the forward: wait for the daemon to
                # hold them all, as its memory report shows.
                deadline = time.monotonic() + 20
                seen = _daemon_activation_bytes(daemons[0], config["job_id"])
                while seen < block.offloaded_bytes and time.monotonic() < deadline:
                    time.sleep(0.05)
                    seen = _daemon_activation_bytes(daemons[0], config["job_id"])
                moved.append((block.offloaded_bytes, seen))
            else:
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if offload:
            stats = model.activation_store.stats()
            assert _daemon_activation_bytes(daemons[0], config["job_id"]) == 0
        state = model.state_dict()
        if stage != 3:
            state.update({f"trainer.{k}": v.detach().clone()
                          for k, v in model.module.named_parameters()})
    finally:
        model.close()
    return losses, state, moved, stats


@pytest.mark.parametrize("transport", ["stream", "grpc"])
@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_training_is_bit_identical(daemons, stage, transport):
    losses, state, _, _ = _train(daemons[:1], transport, stage, offload=False)
    o_losses, o_state, moved, stats = _train(daemons[1:], transport, stage, offload=True)
    for i, (a, b) in enumerate(zip(losses, o_losses)):
        assert torch.equal(a, b), f"step {i}: loss {a} != {b}"
    assert state.keys() == o_state.keys()
    for k in state:
        assert torch.equal(state[k], o_state[k]), k
    # Every step sent its saved activations to the daemon (5 tensors, 35 KiB:
    # the input, tanh's outputs, which the next linear layer saves again,
    # the transposed view, which mul saves twice, and b's input) and fetched
    # each back once.
    assert len(moved) == STEPS
    for block_bytes, daemon_bytes in moved:
        assert block_bytes == 32 * 24 * 4 + 4 * 32 * 64 * 4, moved
        assert daemon_bytes == block_bytes, moved
    total = sum(b for b, _ in moved)
    assert stats["offload_bytes"] == stats["fetch_bytes"] == total, stats
    assert stats["stored_bytes"] == 0 and stats["failures"] == 0, stats
    if transport == "grpc":
        assert stats["streamed"] == 0, stats  # Put/Get into the arena
    else:
        assert stats["streamed"] == 2 * stats["offloads"], stats


def test_small_tensors_and_parameters_stay(daemons):
    model = shard_model(Net(), _config(daemons[:1], "stream"), stage=3)
    try:
        x = torch.randn(2, 24)
        with offload_activations(model, min_bytes=1 << 20) as block:
            model(x).sum().backward()
        model.optimizer.step()
        assert block.offloaded_tensors == 0
        with offload_activations(model, min_bytes=0) as block:
            y = model(x)
        # tanh outputs, the transposed view, the linear inputs: never the
        # weights (parameters, and the weight.t() views F.linear saves).
        param_bytes = sum(p.numel() * 4 for p in model.module.parameters())
        assert 0 < block.offloaded_bytes < param_bytes
        y.sum().backward()
        model.optimizer.step()
    finally:
        model.close()


def test_graph_dropped_without_backward_is_freed(daemons):
    config = _config(daemons[:1], "grpc")
    model = shard_model(Net(), config, stage=1)
    try:
        store = model.activation_store
        with offload_activations(model, min_bytes=MIN_BYTES) as block:
            loss = model(torch.randn(32, 24)).sum()
        assert block.offloaded_tensors > 0
        del loss
        gc.collect()
        with offload_activations(model, min_bytes=MIN_BYTES):  # frees the dropped ones
            pass
        assert store.stats()["stored_bytes"] == 0
        assert _daemon_activation_bytes(daemons[0], config["job_id"]) == 0
    finally:
        model.close()


def test_store_from_a_client_and_retain_graph(daemons):
    """A bare Client's store; a second backward (retain_graph) reuses what the
    first fetched."""
    client = zeroshard.Client(daemons[:1], f"offload-{next(_jobs)}", 0, 1)
    _register(client)
    store = client.open_activation_store()
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    with offload_activations(store, min_bytes=MIN_BYTES) as block:
        y = torch.tanh(x @ w)
    assert block.offloaded_tensors == 2  # x (mm's) and tanh's output
    y.sum().backward(retain_graph=True)
    first = w.grad.clone()
    w.grad = None
    y.sum().backward()
    assert torch.equal(first, w.grad)
    expected = torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0]
    assert torch.equal(first, expected)
    assert store.stats()["fetches"] == 2 and store.stats()["stored_bytes"] == 0
    # A tensor saved twice unchanged is offloaded once; changed in place in
    # between, twice, and the backward that needs the first version raises,
    # as autograd does without the hooks.
    a = torch.randn(64, 64, requires_grad=True) * 1
    b = torch.randn(64, 64)
    s1, s2 = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    with offload_activations(store, min_bytes=MIN_BYTES) as twice:
        z = a * a
        c = b * s1
        b.add_(1)  # a new version of the same tensor
        d = b * s2
    assert twice.offloaded_tensors == 3, twice.offloaded_tensors
    z.sum().backward()
    d.sum().backward()
    assert float(s2.grad) == float(b.sum())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()
    del c
    gc.collect()
    with offload_activations(store):  # frees what the modified one left
        pass
    assert store.stats()["fetches"] == 4 and store.stats()["stored_bytes"] == 0
    # The store's own API.
    t = torch.arange(1000, dtype=torch.int64).reshape(20, 50).t()
    store.offload(9_000_000, 0, t).wait()
    back = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    store.fetch(9_000_000, 0, back)
    assert torch.equal(back, t) and back.stride() == t.stride()
    with pytest.raises(zeroshard.Error) as info:
        store.fetch(9_000_000, 0, back)  # freed by the first fetch
    assert info.value.code == "NOT_FOUND", info.value
    with pytest.raises(ValueError):
        store.offload(9_000_001, 0, torch.zeros(4, 1).expand(4, 3))  # overlapping
    store.close()
    client.leave()


def test_refused_offload_keeps_the_tensor(tmp_path):
    """A slice larger than the daemon's arena (and no spill files) is
    refused: the tensor stays in the trainer, with a warning, and backward
    still gets it."""
    with running_daemons(1, lambda i: ["--activation_arena_bytes=65536"]) as small:
        client = zeroshard.Client(small, f"offload-{next(_jobs)}", 0, 1)
        _register(client)
        w = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(256, 256)  # 256 KiB
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with offload_activations(client, min_bytes=MIN_BYTES) as block:
                y = torch.tanh(x @ w)
            y.sum().backward()
        assert block.kept_tensors == 2, block.kept_tensors
        assert any("kept a saved tensor" in str(c.message) for c in caught)
        assert torch.equal(w.grad, torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0])
        client.leave()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_backward_fetches_at_most_prefetch_ahead(daemons, monkeypatch, prefetch):
    """12 layers, 13 saved tensors: backward holds the one it unpacks and at
    most `prefetch` fetched ahead, and the gradients are torch's."""
    from zeroshard import _offload
    client = zeroshard.Client(daemons[:1], f"offload-{next(_jobs)}", 0, 1, transport="grpc")
    _register(client)
    store = client.open_activation_store()
    fetched, peak = set(), [0]
    start_fetch, unpack = _offload._Block._start_fetch, _offload._Block.unpack

    def counting_start_fetch(self, h):
        start_fetch(self, h)
        fetched.add(h.layer)
        peak[0] = max(peak[0], len(fetched))

    def counting_unpack(self, h):
        value = unpack(self, h)
        fetched.discard(h.layer)
        return value

    monkeypatch.setattr(_offload._Block, "_start_fetch", counting_start_fetch)
    monkeypatch.setattr(_offload._Block, "unpack", counting_unpack)
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(12)]
    x = torch.randn(32, 64)

    def forward():
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        return h.sum()

    expected = torch.autograd.grad(forward(), ws)
    with offload_activations(store, min_bytes=MIN_BYTES, prefetch=prefetch) as block:
        loss = forward()
    got = torch.autograd.grad(loss, ws)
    assert block.offloaded_tensors == 13  # x and each tanh's output (the next mm's input)
    assert peak[0] == prefetch + 1
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert store.stats()["stored_bytes"] == 0
    store.close()
    client.leave()
