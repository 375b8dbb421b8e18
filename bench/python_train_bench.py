"""Python ZeRO stage 3 (zeroshard.torch) over UCX and over the streaming RPCs
against DDP (torch.nn.parallel.DistributedDataParallel over Gloo with
torch.optim.AdamW), in one run under zsrun: every rank trains the same GPT-2
(examples/python/train_gpt.py's model and batches) each of the three ways,
one after the other:

  ucx     shard_model(..., stage=3), transport "ucx" (UCX_TLS --ucx_tls):
          layers gathered before their forward and backward, gradients
          pushed from backward hooks, AdamW with clipping on the daemons.
  stream  the same over the Shard streaming RPCs.
  ddp     the model whole on every rank, DDP's Gloo all-reduce of the
          gradients during backward, clip_grad_norm_ and torch AdamW on the
          trainer (16Ψ per rank).

Each is used the way its users accumulate gradients over --accumulate
micro-batches: DDP all-reduces once per step (no_sync() for the first
micro-batches), stage 3 pushes every micro-batch's gradients
(gradient_accumulation_steps; its no_sync() would hold the whole gradient
on the trainer), so stage 3 moves --accumulate times DDP's gradient bytes.
The three run in this order, each after the previous one's job has ended.

Each way runs --warmup steps, then --steps timed ones (the forward and
backward of --accumulate micro-batches and the optimizer step); the figure
is the global batch's tokens (--batch sequences of --seq_len) divided by the
median step time on rank 0. Last line:

  ucx_tokens_per_s=A stream_tokens_per_s=B ddp_tokens_per_s=C ucx_vs_ddp=A/C stream_vs_ddp=B/C

Run: bazel run -c opt --config=clang //bench:python_train_bench -- [flags]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard
from zeroshard.torch import init_from_env, shard_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "python"))
import train_gpt  # noqa: E402  (the example's model and batches)


def timed_steps(args, rank, world, corpus, step_fn):
    """Median seconds of the timed steps."""
    times = []
    for step in range(1, args.warmup + args.steps + 1):
        batches = train_gpt.micro_batches(corpus, args, step, rank, world)
        start = time.perf_counter()
        step_fn(batches)
        if step > args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).float().reshape(-1, train_gpt.VOCAB), y.reshape(-1))


def run_zeroshard(args, transport, corpus):
    overrides = dict(transport=transport, bucket_bytes=args.bucket_bytes)
    if transport == "ucx":
        overrides["ucx_tls"] = args.ucx_tls
    config = init_from_env(**overrides)
    config["job_id"] = f"{config['job_id']}-{transport}"
    torch.manual_seed(args.seed)
    net = train_gpt.GPT2(args.layers, args.width, args.heads, args.seq_len)
    model = shard_model(net, config, stage=3, layers=net.layer_names(), lr=1e-4,
                        betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0,
                        param_groups=net.param_groups(0.1),
                        gradient_accumulation_steps=args.accumulate)

    def step(batches):
        for x, y in batches:
            (loss_of(model, x, y) / args.accumulate).backward()
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)

    try:
        return timed_steps(args, config["rank"], config["world_size"], corpus, step)
    finally:
        model.close()


def run_ddp(args, corpus):
    config = init_from_env()
    rank, world = config["rank"], config["world_size"]
    dist.init_process_group("gloo")  # MASTER_ADDR/MASTER_PORT from zsrun
    try:
        torch.manual_seed(args.seed)
        net = train_gpt.GPT2(args.layers, args.width, args.heads, args.seq_len)
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(net.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

        def step(batches):
            for i, (x, y) in enumerate(batches):
                if i < len(batches) - 1:
                    with model.no_sync():  # all-reduce once per step
                        (loss_of(model, x, y) / args.accumulate).backward()
                else:
                    (loss_of(model, x, y) / args.accumulate).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return timed_steps(args, rank, world, corpus, step)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket_bytes", type=int, default=4 << 20)
    p.add_argument("--ucx_tls", default="posix,cma,self")
    p.add_argument("--corpus", default="/usr/share/common-licenses")
    args = p.parse_args()
    config = init_from_env()
    rank, world = config["rank"], config["world_size"]
    if args.batch % (world * args.accumulate) != 0:
        raise SystemExit(f"--batch ({args.batch}) must be a multiple of the ranks times "
                         f"--accumulate ({world} x {args.accumulate})")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    corpus = train_gpt.load_corpus(args.corpus)
    seconds = {}
    try:
        seconds["ucx"] = run_zeroshard(args, "ucx", corpus)
    except zeroshard.Error as e:
        if not (e.code == "UNAVAILABLE" and "ucx" in str(e).lower()):
            raise
        print(f"ucx: UCX cannot start here ({e})")
    seconds["stream"] = run_zeroshard(args, "stream", corpus)
    seconds["ddp"] = run_ddp(args, corpus)
    if rank != 0:
        return
    tokens = args.batch * args.seq_len
    psi = sum(p.numel() for p in train_gpt.GPT2(args.layers, args.width, args.heads,
                                                 args.seq_len).parameters())
    print(f"GPT-2: {args.layers} blocks, width {args.width}, {args.seq_len} tokens, Ψ = {psi} "
          f"parameters; global batch {args.batch} sequences in {args.accumulate} micro-batches "
          f"per rank; {world} ranks; stage 3 (C_B {args.bucket_bytes} B) vs DDP over Gloo")
    rates = {k: tokens / s for k, s in seconds.items()}
    for k, s in seconds.items():
        print(f"{k}: {rates[k]:.0f} tokens/s (median step {s * 1e3:.1f} ms of {args.steps})")
    ucx = rates.get("ucx", float("nan"))
    print(f"ucx_tokens_per_s={ucx:.0f} stream_tokens_per_s={rates['stream']:.0f} "
          f"ddp_tokens_per_s={rates['ddp']:.0f} ucx_vs_ddp={ucx / rates['ddp']:.3f} "
          f"stream_vs_ddp={rates['stream'] / rates['ddp']:.3f}")


if __name__ == "__main__":
    main()
