"""One data-parallel rank of a stage-3 job: trains stage3_common's model
on its share of every global batch through shard_model (in the config's
precision), checks during each forward that only the running layer and the
outer module's own parameters are materialised, and saves the final
parameters (the daemons' fp32 masters, and the gathered ones as the last
forward saw them) and memory figures.

Usage: stage3_worker.py CONFIG_JSON OUT_NPZ
"""

import json
import sys

import numpy as np
import torch

import stage3_common as sc
from zeroshard.torch import shard_model


def storage_bytes(p):
    return p.storage().size() * p.element_size()


def owner(name, layer_names):
    """The innermost layer holding parameter `name` ("" for the outer
    module), as shard_model assigns it."""
    parts = name.split(".")[:-1]
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in layer_names:
            return ".".join(parts[:k])
    return ""


def main():
    config = json.loads(sys.argv[1])
    rank, world = config["rank"], config["world_size"]
    layers = config.pop("layers")
    precision = config.get("precision", "fp32")
    model = sc.make_model()
    if rank != 0:
        # Rank 0's values must win: start the others from something else.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
    named = dict(model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in named.values())
    layer_names = layers if layers is not None else [
        name for name, child in model.named_children()
        if any(True for _ in child.parameters())]
    owners = {name: owner(name, layer_names) for name in named}

    sharded = shard_model(model, config, stage=3, layers=layers, lr=sc.LR,
                          betas=sc.BETAS, eps=sc.EPS,
                          weight_decay=sc.WEIGHT_DECAY,
                          max_grad_norm=sc.MAX_GRAD_NORM)
    freed = [name for name, p in named.items() if storage_bytes(p) != 0]
    assert not freed, f"not freed after construction: {freed}"

    layer_bytes = {}   # allocated bytes of each layer, seen in its forward
    peak_forward = [0]
    seen = {}          # {name: copy} of the gathered parameters

    def check(layer_name):
        def hook(module, inputs):
            held = {}
            for name, p in named.items():
                size = storage_bytes(p)
                if owners[name] in (layer_name, ""):
                    assert size > 0, f"{name} missing in {layer_name}'s forward"
                    layer_bytes[owners[name]] = size
                    seen[name] = p.detach().clone()
                else:
                    assert size == 0, f"{name} held in {layer_name}'s forward"
                if size:
                    held[p.storage().data_ptr()] = size
            peak_forward[0] = max(peak_forward[0], sum(held.values()))
        return hook

    for name in layer_names:
        # Registered after shard_model's hooks: runs once the layer is in.
        model.get_submodule(name).register_forward_pre_hook(check(name))

    x, y = sc.make_data()
    per_rank = sc.GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    norms = []
    for s in range(sc.STEPS):
        sharded.zero_grad()
        loss = sc.loss_of(sharded, x[s][rows], y[s][rows], precision)
        loss.backward()
        result = sharded.step()
        norms.append(result["grad_norm"])
    with torch.no_grad():  # gathers the last step's parameters
        sc.loss_of(sharded, x[0][rows], y[0][rows], precision)
    dtypes = {str(t.dtype) for t in seen.values()}
    expected_dtype = "torch.bfloat16" if precision == "bf16" else "torch.float32"
    assert dtypes == {expected_dtype}, dtypes
    gathered = torch.cat([seen[name].reshape(-1) for name in named])
    # As raw bits: numpy has no bfloat16.
    gathered_bits = gathered.view(
        torch.int16 if precision == "bf16" else torch.int32).numpy()
    held = [name for name, p in named.items() if storage_bytes(p) != 0]
    assert not held, f"held after the steps: {held}"
    final = sharded.full_state_dict()
    assert list(final) == list(named), "names or order differ"
    for name, t in final.items():
        assert t.shape == named[name].shape, name
    traffic = sharded.client.traffic_report()
    sorted_layers = sorted(
        (v for k, v in layer_bytes.items() if k != ""), reverse=True)
    np.savez(sys.argv[2], params=sc.flatten(final),
             norms=np.array([np.nan if n is None else n for n in norms]),
             gathered_bits=gathered_bits,
             model_bytes=model_bytes, peak_forward=peak_forward[0],
             peak=sharded.peak_param_bytes,
             outer_bytes=layer_bytes.get("", 0),
             two_largest=sum(sorted_layers[:2]),
             client_param_bytes=sharded.client.memory_report()["param"],
             prefetch_hits=traffic["prefetch_hits"],
             prefetch_misses=traffic["prefetch_misses"],
             last_step=np.array([traffic["last_step"][k] for k in (
                 "push", "gather", "collective_sent", "collective_received")]))
    sharded.close()


if __name__ == "__main__":
    main()
