"""Python stage 1-2 steps with the gradients in push memory against the same
steps with them in torch's own memory, in one run under zsrun (every rank
runs both, one after the other, each its own job on the same daemons):

  push    shard_model(..., stage=2) over transport "ucx" with push_memory
          on (the default): the large gradients live in one push memory
          (zeroshard/_flat.py), which the daemon on this host sums in place.
  put     the same with push_memory=False: every bucket is Put into a
          staging slot of the daemon, which then sums the slot.

The model is --layers Linear(--width, --width) layers (Ψ = layers * width *
(width + 1)); each step is zero_grad(set_to_none=False) (torch 1.x's
default: the gradients stay where they are, in push memory with it), one
backward of a --batch-row batch (so that the gradients are fresh) and
optimizer.step(), which pushes every gradient,
steps on the daemons and loads the parameters. Figures: the median over
--steps timed steps (after --warmup) of the step() time and of the push
wait inside it (`push_wait_ms`: from the first push until the daemons had
summed them all), on rank 0. Last line:

  push_step_ms=A put_step_ms=B push_wait_ms=C put_wait_ms=D wait_ratio=C/D

Run: bazel run -c opt --config=clang //bench:python_push_bench -- [flags]
"""

import argparse
import statistics
import time

import torch
from torch import nn

import zeroshard
from zeroshard.torch import init_from_env, shard_model


def measure(args, push_memory, job_suffix):
    config = init_from_env(transport="ucx", ucx_tls=args.ucx_tls, bucket_bytes=args.bucket_bytes,
                           push_memory=push_memory)
    config["job_id"] = f"{config['job_id']}-{job_suffix}"
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    model = shard_model(net, config, stage=2, lr=1e-4)
    g = torch.Generator().manual_seed(config["rank"])
    steps, waits = [], []
    try:
        for i in range(args.warmup + args.steps):
            model.optimizer.zero_grad(set_to_none=False)
            x = torch.randn(args.batch, args.width, generator=g)
            model(x).square().mean().backward()
            start = time.perf_counter()
            model.optimizer.step()
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                steps.append(elapsed * 1e3)
                waits.append(model.optimizer.last_result["push_wait_ms"])
        report = model.memory_report()
    finally:
        model.close()
    return statistics.median(steps), statistics.median(waits), steps, report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket_bytes", type=int, default=32 << 20)
    p.add_argument("--ucx_tls", default="posix,cma,self")
    args = p.parse_args()
    torch.set_num_threads(1)
    try:
        push = measure(args, True, "push")
        put = measure(args, False, "put")
    except zeroshard.Error as e:
        if e.code == "UNAVAILABLE" and "ucx" in str(e).lower():
            print(f"SKIPPED: UCX cannot start here: {e}")
            return
        raise
    if init_from_env()["rank"] != 0:
        return
    psi = args.layers * args.width * (args.width + 1)
    print(f"stage 2, Ψ = {psi} fp32 parameters ({psi * 4 / 2**20:.1f} MiB of gradients per "
          f"rank), C_B {args.bucket_bytes} B, transport ucx (UCX_TLS {args.ucx_tls})")
    for name, (step_ms, wait_ms, all_steps, report) in (("push", push), ("put", put)):
        print(f"{name}: step {step_ms:.1f} ms, push wait {wait_ms:.1f} ms (medians of "
              f"{', '.join(f'{s:.1f}' for s in all_steps)} ms); gradients "
              f"{report['gradients']} B, of which in push memory {report['grad_push_memory']} B")
    print(f"push_step_ms={push[0]:.1f} put_step_ms={put[0]:.1f} push_wait_ms={push[1]:.1f} "
          f"put_wait_ms={put[1]:.1f} wait_ratio={push[1] / put[1]:.3f}")


if __name__ == "__main__":
    main()
