"""One data-parallel rank: trains the shared model on its half of every
global batch with ShardedOptimizer and saves the final parameters.

Usage: sharded_worker.py CONFIG_JSON OUT_NPZ
"""

import json
import sys

import numpy as np
import torch

import train_common as tc
from zeroshard.torch import ShardedOptimizer


def main():
    config = json.loads(sys.argv[1])
    rank, world = config["rank"], config["world_size"]
    stage = config.pop("stage")
    max_grad_norm = config.pop("max_grad_norm")
    model = tc.make_model()
    if rank != 0:
        # Rank 0's values must win: start the others from something else.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
    x, y = tc.make_data()
    per_rank = tc.GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    opt = ShardedOptimizer(model.parameters(), config, stage=stage, lr=tc.LR,
                           betas=tc.BETAS, eps=tc.EPS,
                           weight_decay=tc.WEIGHT_DECAY,
                           max_grad_norm=max_grad_norm)
    norms = []
    for s in range(tc.STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s][rows]), y[s][rows])
        loss.backward()
        opt.step()
        norms.append(opt.last_result["grad_norm"])
    opt.close()
    np.savez(sys.argv[2], params=tc.flat_params(model).numpy(),
             norms=np.array([np.nan if n is None else n for n in norms]))


if __name__ == "__main__":
    main()
