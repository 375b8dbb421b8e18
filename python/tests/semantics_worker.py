"""One rank of test_semantics.py: trains semantics_common's model through
shard_model and saves what the test compares.

argv: CONFIG_JSON OUTPUT. The config is a client config plus "stage",
"accumulate" ("daemons": gradient_accumulation_steps micro-batches;
"no_sync": the first micro-batch inside model.no_sync()), "steps",
optionally shard_model's "push_bucket_bytes" and "reshard_after_forward" (a
bool), and optionally "save_at" / "resume" / "state_dict_at" for the checkpoint
tests: save a checkpoint named "ck" after that many steps; resume from
"latest"; or round-trip the model's and optimizer's state dicts through
torch.save after that many steps.
"""

import io
import json
import sys
import warnings

import numpy as np
import torch

import semantics_common as sc
from zeroshard.torch import shard_model


def main():
    config = json.loads(sys.argv[1])
    out = sys.argv[2]
    stage = config.pop("stage")
    accumulate = config.pop("accumulate", "daemons")
    steps = config.pop("steps", sc.STEPS)
    save_at = config.pop("save_at", None)
    resume = config.pop("resume", None)
    state_dict_at = config.pop("state_dict_at", None)
    set_to_none = config.pop("set_to_none", True)
    uniform = config.pop("uniform", False)
    extra = {k: config.pop(k) for k in ("push_bucket_bytes", "reshard_after_forward")
             if k in config}
    precision = config.get("precision", "fp32")
    rank, world = config["rank"], config["world_size"]

    net = sc.make_model()
    frozen_start = {n: p.detach().clone() for n, p in net.frozen.named_parameters()}
    model = shard_model(net, config, stage=stage, lr=sc.LR, betas=sc.BETAS, eps=sc.EPS,
                        max_grad_norm=sc.MAX_GRAD_NORM, param_groups=sc.groups_of(net),
                        gradient_accumulation_steps=(sc.MICRO_BATCHES
                                                     if accumulate == "daemons" else 1),
                        resume=resume, **extra)
    sched = torch.optim.lr_scheduler.LambdaLR(model.optimizer, sc.lr_lambda)
    start = model.client.committed_step
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore")
        for _ in range(start):  # the schedule of the steps already taken
            sched.step()
    data = sc.make_data()
    norms = []
    for s in range(start, steps):
        for k in range(sc.MICRO_BATCHES):
            x, y = sc.micro_batch(data, s, world, rank, k)
            if accumulate == "no_sync" and k == 0:
                with model.no_sync():
                    sc.loss_of(model, x, y, s, rank, k, world, precision, uniform).backward()
            else:
                sc.loss_of(model, x, y, s, rank, k, world, precision, uniform).backward()
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=set_to_none)
        sched.step()
        norms.append(model.last_result["grad_norm"] or 0.0)
        if save_at is not None and s + 1 == save_at and rank == 0:
            model.save_checkpoint("ck")
            model.await_checkpoint()
        if state_dict_at is not None and s + 1 == state_dict_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(),
                        "optimizer": model.optimizer.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)
            model.load_state_dict(saved["model"])
            model.optimizer.load_state_dict(saved["optimizer"])
    state = model.state_dict()
    frozen_now = {n: state[f"frozen.{n}"] for n in frozen_start}
    frozen_same = all(torch.equal(frozen_start[n], frozen_now[n]) for n in frozen_start)
    optim = model.optimizer.state_dict()
    np.savez(out,
             params=sc.flat_params(model.full_state_dict()),
             norms=np.array(norms),
             frozen_same=np.array(frozen_same),
             tied_same=np.array(state["wte.weight"] is state["final.out.weight"]),
             state_keys=np.array(list(state.keys())),
             odd_step=np.array(float(optim["state"][_index_of(model, net.odd.weight)]["step"])),
             block_step=np.array(float(optim["state"][_index_of(model, net.block.fc1.weight)]["step"])),
             rare_step=np.array(float(optim["state"][_index_of(model, net.rare.weight)]["step"])),
             peak=np.array(model.peak_param_bytes),
             pushes=np.array(model.last_result["pushes"] if stage == 3 else 0),
             gathers=np.array(model.last_result["gathers"] if stage == 3 else 0))
    model.close()


def _index_of(model, param):
    """The parameter's index in torch's optimizer state dict numbering."""
    i = 0
    for g in model.optimizer.param_groups:
        for p in g["params"]:
            if p is param:
                return i
            i += 1
    raise KeyError("parameter not in the optimizer")


if __name__ == "__main__":
    main()
