"""One rank of the checkpoint tests. MODE "train" trains every step with
ShardedOptimizer, rank 0 saving checkpoint CHECKPOINT after step SAVE_AT;
MODE "resume" resumes the job from its latest checkpoint and trains the
steps after it. Writes the named parameters at the start, at the save and
at the end to OUT.npz, and what the calls returned to OUT.json.

Usage: checkpoint_worker.py CONFIG_JSON MODE OUT
"""

import json
import sys

import numpy as np
import torch

import train_common as tc
from zeroshard.torch import ShardedOptimizer

SAVE_AT = 8
CHECKPOINT = f"step-{SAVE_AT}"


def named_arrays(model, prefix):
    return {f"{prefix}:{name}": p.detach().numpy().copy()
            for name, p in model.named_parameters()}


def main():
    config = json.loads(sys.argv[1])
    mode, out = sys.argv[2], sys.argv[3]
    rank, world = config["rank"], config["world_size"]
    model = tc.make_model()
    if mode == "resume" or rank != 0:
        # What wins (the checkpoint, or rank 0's values) must not be what
        # this rank starts with.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
    x, y = tc.make_data()
    per_rank = tc.GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    opt = ShardedOptimizer(model.named_parameters(), config, stage=2,
                           lr=tc.LR, betas=tc.BETAS, eps=tc.EPS,
                           weight_decay=tc.WEIGHT_DECAY,
                           resume="latest" if mode == "resume" else None)
    arrays = named_arrays(model, "start")
    info = {"resumed_from": opt.resumed_from,
            "start_step": opt.client.committed_step}
    # Step s + 1 trains on batch s.
    for s in range(opt.client.committed_step, tc.STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[s][rows]), y[s][rows]).backward()
        opt.step()
        if mode == "train" and s + 1 == SAVE_AT:
            arrays.update(named_arrays(model, "saved"))
            if rank == 0:
                info["save"] = opt.save_checkpoint(CHECKPOINT)
    if mode == "train" and rank == 0:
        # The write went on while training did.
        info["await"] = opt.await_checkpoint()
        info["list"] = opt.list_checkpoints()
    arrays.update(named_arrays(model, "final"))
    info["names"] = [name for name, _ in model.named_parameters()]
    opt.close()
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
