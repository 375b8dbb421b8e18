"""One rank of a replicated (replicas=2) job trained through shard_model,
reconnecting after every error a new connection may get past. Rank 0 kills
daemon `kill_pid` (SIGKILL) once `kill_at` steps are committed, when
given. Saves the final parameters and how often the rank reconnected.

Usage: failover_worker.py CONFIG_JSON OUT_NPZ
"""

import json
import os
import signal
import sys

import numpy as np

import stage3_common as sc
import zeroshard
from zeroshard.torch import reconnectable, shard_model


def main():
    config = json.loads(sys.argv[1])
    stage = config.pop("stage")
    kill_pid = config.pop("kill_pid", None)
    kill_at = config.pop("kill_at", None)
    rank, world = config["rank"], config["world_size"]
    model = shard_model(sc.make_model(), config, stage=stage, lr=sc.LR,
                        betas=sc.BETAS, eps=sc.EPS,
                        weight_decay=sc.WEIGHT_DECAY,
                        max_grad_norm=sc.MAX_GRAD_NORM)
    x, y = sc.make_data()
    rows = slice(rank * sc.GLOBAL_BATCH // world,
                 (rank + 1) * sc.GLOBAL_BATCH // world)
    step = model.client.committed_step
    reconnects = 0
    while step < sc.STEPS:
        if kill_pid is not None and step == kill_at:
            os.kill(kill_pid, signal.SIGKILL)
            kill_pid = None
        try:
            model.zero_grad()
            sc.loss_of(model, x[step][rows], y[step][rows]).backward()
            model.step()
            step += 1
        except zeroshard.Error as e:
            print(f"rank {rank} step {step + 1}: {e.code}: {e}", flush=True)
            if not reconnectable(e) or reconnects == 3:
                raise
            reconnects += 1
            model.zero_grad()
            step = model.reconnect()
            print(f"rank {rank} reconnected; the job has committed step {step}",
                  flush=True)
    np.savez(sys.argv[2], params=sc.flatten(model.full_state_dict()),
             reconnects=reconnects)
    model.close()


if __name__ == "__main__":
    main()
