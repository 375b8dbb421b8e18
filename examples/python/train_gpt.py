"""A small GPT-style byte-level language model, written as an ordinary
torch nn.Module, trained data-parallel with ZeRO stage 3 through
`zeroshard.torch.shard_model`: the parameters, gradients and AdamW states
live on the zeroshardd daemons, and each rank gathers one layer at a time.

It trains on the text the C++ demo (`./zs demo`, examples/gpt_train.cc)
uses: every regular file of /usr/share/common-licenses in name order, one
token per byte, with the demo's default shape (4 blocks, width 64, 4 heads,
32 tokens, a global batch of 8 sequences).

Run it under zsrun, which starts the daemons and one process per rank and
gives each the environment `zeroshard.torch.init_from_env()` reads:

    zsrun --daemons=2 --nproc=2 -- python3 train_gpt.py --steps=200

(or `bazel run --config=clang //examples/python:train_gpt -- --steps=200`,
which finds zsrun, the daemon, zsctl and the package in its runfiles).

Rank 0 shows progress (the mean loss and step time of the last steps and
the bytes its client moved to and from the daemons), and at the end the
memory report: what the trainer held (the client's buffers, the peak of
gathered parameters) and, when zsctl is found, the daemons' ledger.
"""

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.torch import init_from_env, shard_model

VOCAB = 256  # bytes

# ---- the model ----


class Embedding(nn.Module):
    """Token and position embeddings: tokens [B, T] -> hidden [B, T, W]."""

    def __init__(self, width, seq_len):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(seq_len, width)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions).unsqueeze(0)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        hd = w // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final layer norm and the output projection: hidden -> logits."""

    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.out(self.ln(x)) * self.logit_scale


class GPT(nn.Module):
    def __init__(self, layers, width, heads, seq_len):
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"--heads must divide --width ({width}), "
                             f"got {heads}")
        self.embed = Embedding(width, seq_len)
        self.blocks = nn.ModuleList(Block(width, heads)
                                    for _ in range(layers))
        self.head = Head(width)
        self._init(layers)

    def _init(self, layers):
        # GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2L).
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("weight") and p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def layer_names(self):
        """shard_model's layers, in the order the forward runs them: the
        embeddings, each block on its own, the head."""
        return (["embed"] + [f"blocks.{i}" for i in range(len(self.blocks))]
                + ["head"])


# ---- the data ----


def load_corpus(directory):
    """Every regular file of `directory` in name order, concatenated, as
    bytes (as the C++ demo reads it)."""
    names = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                   if not n.startswith("."))
    data = b"".join(open(n, "rb").read() for n in names if os.path.isfile(n))
    if len(data) < 4096:
        raise SystemExit(f"train_gpt: corpus in {directory} has only "
                         f"{len(data)} bytes")
    return np.frombuffer(data, dtype=np.uint8)


_MASK = (1 << 64) - 1


def _splitmix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def make_batch(corpus, seq_len, step, batch, rank, world, seed):
    """This rank's part of step `step`'s global batch: sequences
    [rank*batch/world, (rank+1)*batch/world) of `batch`, each at a
    pseudo-random offset of (seed, step, sequence index), so the ranks read
    different text and the global batch does not depend on the world size.
    With seed 0 these are the C++ demo's batches. Returns (tokens, targets),
    [n, seq_len] int64."""
    begin, end = rank * batch // world, (rank + 1) * batch // world
    span = len(corpus) - seq_len - 1
    offsets = []
    for i in range(begin, end):
        z = (step * 0x9E3779B97F4A7C15 + i + 1
             + seed * 0xD1B54A32D192ED03) & _MASK
        offsets.append(_splitmix64(z) % span)
    idx = np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(seq_len + 1)
    window = torch.from_numpy(corpus[idx].astype(np.int64) % VOCAB)
    return window[:, :-1], window[:, 1:]


# ---- reporting ----


def _sig3(v):
    """v to 3 significant digits, as the C++ tools print numbers."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    digits = math.floor(math.log10(abs(v)))
    rounded = round(v, 2 - digits)
    digits = math.floor(math.log10(abs(rounded)))  # 999.7 -> 1000
    rounded = round(v, 2 - digits)
    return f"{rounded:.{max(0, 2 - digits)}f}"


def _with_unit(v, units, sep):
    u = 0
    while abs(v) >= 999.5 and u + 1 < len(units):
        v /= 1000
        u += 1
    return _sig3(v) + sep + units[u]


def format_bytes(n):
    if abs(n) < 1000:
        return f"{n:.0f} B"
    return _with_unit(float(n), ["B", "kB", "MB", "GB", "TB"], " ")


def format_count(n):
    return _with_unit(float(n), ["", "K", "M", "B", "T"], "")


def traffic_bytes(t):
    return t["push"] + t["gather"] + t["init"]


class Progress:
    """Rank 0's progress: one line redrawn in place on a terminal, else a
    plain line every `every` steps (and at the last)."""

    def __init__(self, steps, every, stream=sys.stdout):
        self.steps, self.every, self.stream = steps, max(1, every), stream
        self.tty = stream.isatty()
        self.losses, self.times = [], []

    def update(self, step, loss, seconds, traffic):
        self.losses.append(loss)
        self.times.append(seconds)
        last = step == self.steps
        if not self.tty and step % self.every != 0 and not last:
            return
        window = slice(-self.every, None)
        mean_loss = sum(self.losses[window]) / len(self.losses[window])
        ms = 1000 * sum(self.times[window]) / len(self.times[window])
        step_t = traffic["last_step"]
        line = (f"step {step:>{len(str(self.steps))}}/{self.steps}  "
                f"loss {mean_loss:.4f}  {ms:7.1f} ms/step  "
                f"moved {format_bytes(traffic_bytes(step_t))}/step "
                f"(push {format_bytes(step_t['push'])}, "
                f"gather {format_bytes(step_t['gather'])})  "
                f"total {format_bytes(traffic_bytes(traffic['total']))}")
        if self.tty:
            end = "\n" if last else ""
            self.stream.write("\r" + line + "\x1b[K" + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def find_zsctl(flag):
    if flag:
        return flag if os.access(flag, os.X_OK) else None
    return os.environ.get("ZSCTL") or shutil.which("zsctl")


def daemon_ledger(zsctl, config):
    """`zsctl memory` for this job: each daemon's bytes by category, next to
    the paper's formula. zsctl reads the job's token from $ZS_JOB_TOKEN."""
    if zsctl is None:
        return ("  (zsctl not found: pass --zsctl=PATH or put it on PATH "
                "to show the daemons' ledger)\n")
    cmd = [zsctl, "memory", "--daemons=" + ",".join(config["daemons"]),
           "--job=" + config["job_id"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"  (zsctl memory failed: {done.stderr.strip()})\n"
    return "".join("  " + line + "\n" for line in done.stdout.splitlines())


def print_overlap(timings):
    """--overlap=compare: medians of the steps run each way (the first of
    each way left out: it warms up), the ratio as the last line."""
    def medians(rows):
        rows = rows[1:] if len(rows) > 1 else rows
        return [1000 * statistics.median(col) for col in zip(*rows)]

    hooks, deferred = medians(timings[True]), medians(timings[False])
    print(f"\nOverlap, rank 0, medians of {len(timings[True])} + "
          f"{len(timings[False])} alternating steps:")
    for name, (backward, step, wait) in (
            ("pushes from backward hooks", hooks),
            ("all pushes in step()      ", deferred)):
        print(f"  {name}: backward {backward:7.1f} ms, step() {step:7.1f} ms "
              f"(of it waiting for pushes {wait:7.1f} ms), backward + step() "
              f"{backward + step:7.1f} ms")
    print(f"push wait after backward: hooks {hooks[2]:.1f} ms, in step() "
          f"{deferred[2]:.1f} ms, ratio {hooks[2] / max(deferred[2], 1e-9):.3f}; "
          f"backward + step(): {hooks[0] + hooks[1]:.1f} ms vs "
          f"{deferred[0] + deferred[1]:.1f} ms, ratio "
          f"{(hooks[0] + hooks[1]) / (deferred[0] + deferred[1]):.3f}", flush=True)


# ---- training ----


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Train a small byte-level GPT with zeroshard ZeRO stage 3 "
                    "(run under zsrun).")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", "--dim", type=int, default=64,
                   help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8,
                   help="global batch: sequences per step over all ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="gradient clipping norm (0 = off)")
    p.add_argument("--bucket_bytes", type=int, default=256 << 10,
                   help="the client's constant gradient bucket size C_B (its "
                        "staging pool holds a few of them); the C++ demo's")
    p.add_argument("--seed", type=int, default=0,
                   help="the model's initial values and the batches' offsets")
    p.add_argument("--corpus", default="/usr/share/common-licenses",
                   help="directory of training text")
    p.add_argument("--eval_batch", type=int, default=32,
                   help="held-out sequences the loss is measured on before "
                        "and after training")
    p.add_argument("--log_every", type=int, default=10,
                   help="steps per progress line (when not on a terminal)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank; 0 = the cores shared among "
                        "the ranks")
    p.add_argument("--overlap", choices=("hooks", "step", "compare"),
                   default="hooks",
                   help="when gradients are pushed: from backward hooks as "
                        "each is ready (hooks), all in step() (step), or "
                        "alternating per step with both timed and compared "
                        "at the end (compare)")
    p.add_argument("--zsctl", default="",
                   help="zsctl binary for the daemons' ledger (default: "
                        "$ZSCTL, else zsctl on PATH)")
    args = p.parse_args(argv)
    for name in ("steps", "layers", "width", "heads", "seq_len", "batch",
                 "eval_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.overlap == "compare" and args.steps < 4:
        p.error("--overlap=compare needs --steps >= 4 (two steps each way)")
    return args


def main(argv):
    args = parse_args(argv)
    try:
        config = init_from_env()
    except zeroshard.Error as e:
        raise SystemExit(f"train_gpt: {e} (run it under zsrun)")
    config["bucket_bytes"] = args.bucket_bytes
    rank, world = config["rank"], config["world_size"]
    if args.batch < world:
        raise SystemExit(f"train_gpt: --batch ({args.batch}) must be at least "
                         f"the number of ranks ({world})")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    leader = rank == 0

    corpus = load_corpus(args.corpus)
    torch.manual_seed(args.seed)
    net = GPT(args.layers, args.width, args.heads, args.seq_len)
    psi = sum(p.numel() for p in net.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if leader:
        print(f"GPT: {args.layers} blocks, width {args.width}, {args.heads} "
              f"heads, {args.seq_len} tokens; Ψ = {format_count(psi)} "
              f"parameters ({len(net.layer_names())} layers); global batch "
              f"{args.batch}; ZeRO stage 3; N_d = {world}; "
              f"{len(config['daemons'])} daemon(s); corpus {args.corpus} "
              f"({format_bytes(len(corpus))})", flush=True)

    # Blocks until every rank has joined; rank 0's values become everyone's.
    model = shard_model(net, config, stage=3, layers=net.layer_names(),
                        lr=args.lr, weight_decay=args.weight_decay,
                        max_grad_norm=args.max_grad_norm)
    client = model.client
    # {overlap_comm: [(backward s, step s, push wait s)]} for --overlap=compare.
    timings = {True: [], False: []}

    held_x, held_y = make_batch(corpus, args.seq_len, 0, args.eval_batch,
                                0, 1, args.seed)

    def held_out_loss():
        with torch.no_grad():
            logits = model(held_x)
            return F.cross_entropy(logits.reshape(-1, VOCAB),
                                   held_y.reshape(-1)).item()

    loss_before = held_out_loss()
    progress = Progress(args.steps, args.log_every) if leader else None
    losses = []
    traffic = None
    for step in range(1, args.steps + 1):
        tokens, targets = make_batch(corpus, args.seq_len, step, args.batch,
                                     rank, world, args.seed)
        overlap = (args.overlap == "hooks" or
                   (args.overlap == "compare" and step % 2 == 1))
        model.overlap_comm = overlap
        start = time.perf_counter()
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        backward_start = time.perf_counter()
        loss.backward()  # pushes each gradient to the daemons as it is ready
        step_start = time.perf_counter()
        result = model.step()  # AdamW (with clipping) on the daemons
        end = time.perf_counter()
        model.zero_grad()
        seconds = end - start
        timings[overlap].append((step_start - backward_start, end - step_start,
                                 result["push_wait_ms"] / 1000))
        losses.append(loss.item())
        traffic = client.traffic_report()
        if leader:
            progress.update(step, losses[-1], seconds, traffic)

    memory = client.memory_report()
    loss_after = held_out_loss()
    print(f"finished: {args.steps} steps, held-out loss {loss_before:.4f} -> "
          f"{loss_after:.4f}", flush=True)

    if leader:
        k = min(args.log_every, len(losses))
        first = sum(losses[:k]) / k
        last = sum(losses[-k:]) / k
        t = traffic["last_step"]
        paper = 3 * psi * 4
        print(f"\n==== zeroshard memory report: Ψ = {format_count(psi)}, "
              f"N_d = {world}, ZeRO stage 3, fp32 ====")
        print(f"Loss: held-out ({args.eval_batch} sequences) {loss_before:.4f} "
              f"before training -> {loss_after:.4f} after step {args.steps}; "
              f"rank 0's training loss, mean of the first {k} steps "
              f"{first:.4f} -> last {k} {last:.4f}")
        print(f"Trainer rank 0 holds: staging buffers "
              f"{format_bytes(memory['buffer'])}, layer buffers "
              f"{format_bytes(memory['param'] + memory['param_half'])} "
              f"(client.memory_report()); gathered parameters at most "
              f"{format_bytes(model.peak_param_bytes)} at once, of the "
              f"model's {format_bytes(model_bytes)}")
        held = memory["buffer"] + memory["param"] + memory["param_half"]
        print(f"A plain data-parallel rank would hold 16Ψ = "
              f"{format_bytes(16 * psi)} of model states (fp32 parameters, "
              f"gradients, Adam's two moments); trainer rank 0 holds "
              f"{format_bytes(held)} of buffers, {held / (16 * psi):.2f} of "
              f"that (the staging pool is constant, so the ratio falls as "
              f"the model grows)")
        print(f"Traffic of rank 0 in the last step: pushed "
              f"{format_bytes(t['push'])} + gathered {format_bytes(t['gather'])}"
              f" = {format_bytes(traffic_bytes(t))}; paper 3Ψ = "
              f"{format_bytes(paper)} (ratio {traffic_bytes(t) / paper:.3f}); "
              f"in all {format_bytes(traffic_bytes(traffic['total']))}; layer "
              f"gathers served by a prefetch: {traffic['prefetch_hits']}, "
              f"fetched on demand: {traffic['prefetch_misses']}")
        print("Daemon memory by category (ledger, zsctl memory):")
        sys.stdout.write(daemon_ledger(find_zsctl(args.zsctl), config))
        sys.stdout.flush()
        if args.overlap == "compare":
            print_overlap(timings)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
