"""A byte-level GPT-2, written as an ordinary torch nn.Module the way
nanoGPT and Hugging Face write it (token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, a final LayerNorm, and an
output projection tied to the token embedding), trained data-parallel with
ZeRO through `zeroshard.torch.shard_model`: the fp32 master weights, the
gradients and AdamW's moments live on the zeroshardd daemons, and at stage
3 (the default) each rank gathers one layer at a time.

The training loop is a PyTorch user's: AdamW with two parameter groups
(weight decay on matrices and embeddings, none on biases and LayerNorm),
a warm-up then cosine LR schedule (torch.optim.lr_scheduler.LambdaLR on
`model.optimizer`), gradient accumulation over --accumulate micro-batches,
global-norm clipping, optional bf16 (--precision=bf16), a checkpoint every
--checkpoint_every steps and --resume from the newest one.

It trains on the text the C++ demo (`./zs demo`, examples/gpt_train.cc)
uses: every regular file of /usr/share/common-licenses in name order, one
token per byte. Run it under zsrun, which starts the daemons and one
process per rank and gives each the environment
`zeroshard.torch.init_from_env()` reads:

    zsrun --daemons=2 --nproc=2 -- python3 train_gpt.py --steps=300

(or `bazel run --config=clang //examples/python:train_gpt -- --steps=300`,
which finds zsrun, the daemon, zsctl and the package in its runfiles).

Rank 0 draws a progress bar (loss, step time, bytes moved), and at the end
prints the memory report: what the trainer held and, when zsctl is found,
the daemons' ledger. With --compare_torch=FILE.svg rank 0 then trains the
same model in one process with torch.optim.AdamW on the whole global batch
and writes both loss curves (its own micro-batches' loss) to FILE.svg.
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


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, w = x.shape
        hd = w // self.heads
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, hd).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.c_proj(attn.transpose(1, 2).reshape(b, t, w))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, layers, width, heads, seq_len):
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"--heads must divide --width ({width}), got {heads}")
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
        # GPT-2's initialisation: N(0, 0.02), residual projections scaled
        # by 1/sqrt(2L), biases zero.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def layer_names(self):
        """shard_model's layers, in the order the forward runs them: the
        embeddings, each block on its own, the final norm, the head (whose
        weight is the token embedding's: it gathers that layer)."""
        return (["wte", "wpe"] + [f"h.{i}" for i in range(len(self.h))]
                + ["ln_f", "lm_head"])

    def param_groups(self, weight_decay):
        """Decay on matrices and embeddings; none on biases and LayerNorm
        weights (every LLM recipe's two groups)."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]


def lr_schedule(warmup, steps, min_ratio):
    """LambdaLR's factor: linear warm-up, then cosine down to min_ratio."""
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return factor


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
    """Rank 0's progress bar: one line redrawn in place on a terminal, else
    a plain line every `every` steps (and at the last)."""

    WIDTH = 24  # characters of the bar

    def __init__(self, first, steps, every, stream=sys.stdout):
        self.first, self.steps = first, steps
        self.every, self.stream = max(1, every), stream
        self.tty = stream.isatty()
        self.losses, self.times = [], []
        self.start = time.perf_counter()

    def update(self, step, loss, seconds, traffic):
        self.losses.append(loss)
        self.times.append(seconds)
        last = step == self.steps
        if not self.tty and step % self.every != 0 and not last:
            return
        window = slice(-self.every, None)
        mean_loss = sum(self.losses[window]) / len(self.losses[window])
        ms = 1000 * sum(self.times[window]) / len(self.times[window])
        done = (step - self.first) / max(1, self.steps - self.first)
        filled = int(round(done * self.WIDTH))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1e-9) - elapsed
        step_t = traffic["last_step"]
        line = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                f"step {step:>{len(str(self.steps))}}/{self.steps}  "
                f"loss {mean_loss:.4f}  {ms:7.1f} ms/step  eta {eta:5.0f} s  "
                f"moved {format_bytes(traffic_bytes(step_t))}/step "
                f"(push {format_bytes(step_t['push'])}, "
                f"gather {format_bytes(step_t['gather'])})")
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


# ---- the single-process reference and the plot ----


def micro_batches(corpus, args, step, rank, world):
    """Rank `rank`'s micro-batches of step `step`: [(tokens, targets)]."""
    tokens, targets = make_batch(corpus, args.seq_len, step, args.batch, rank, world,
                                 args.seed)
    n = tokens.shape[0] // args.accumulate
    return [(tokens[k * n:(k + 1) * n], targets[k * n:(k + 1) * n])
            for k in range(args.accumulate)]


def train_reference(corpus, args, world, dtype, reverse=False):
    """The same training in this process with torch.optim.AdamW on the whole
    global batch (every rank's micro-batches, accumulated in p.grad): rank
    0's loss at each step, as the sharded run logs it. In a bf16 run the
    model computes in bfloat16 on the rounding of fp32 masters that AdamW
    steps, as the daemons do. `reverse` accumulates the micro-batches in
    the opposite order: the same training, other fp32 roundings."""
    torch.manual_seed(args.seed)
    masters = GPT2(args.layers, args.width, args.heads, args.seq_len)
    model = masters
    if dtype != torch.float32:
        torch.manual_seed(args.seed)
        model = GPT2(args.layers, args.width, args.heads, args.seq_len).to(dtype)
    opt = torch.optim.AdamW(masters.param_groups(args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_schedule(args.warmup, args.steps, args.min_lr_ratio))
    losses = []
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        rank0 = []
        order = [(r, x, y) for r in range(world)
                 for x, y in micro_batches(corpus, args, step, r, world)]
        for r, x, y in reversed(order) if reverse else order:
            loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
            (loss / (args.accumulate * world)).backward()
            if r == 0:
                rank0.append(loss.item())
        if model is not masters:
            for p, q in zip(masters.parameters(), model.parameters()):
                p.grad = None if q.grad is None else q.grad.float()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(masters.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        if model is not masters:
            with torch.no_grad():
                for p, q in zip(masters.parameters(), model.parameters()):
                    q.copy_(p)
        losses.append(sum(rank0) / len(rank0))
    return losses


def write_svg(path, series, title):
    """A line chart of `series` ([(label, colour, [(step, loss)])]) as SVG."""
    w, h, left, right, top, bottom = 720, 400, 60, 20, 40, 50
    points = [p for _, _, pts in series for p in pts]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    pad = 0.05 * (y1 - y0 or 1)
    y0, y1 = y0 - pad, y1 + pad

    def sx(x):
        return left + (x - x0) / max(x1 - x0, 1) * (w - left - right)

    def sy(y):
        return top + (y1 - y) / (y1 - y0) * (h - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" '
           f'stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        out.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        out.append(f'<line x1="{left}" y1="{sy(y):.1f}" x2="{w - right}" y2="{sy(y):.1f}" '
                   'stroke="#ddd"/>')
        x = x0 + (x1 - x0) * i / 5
        out.append(f'<text x="{sx(x):.1f}" y="{h - bottom + 18}" text-anchor="middle">'
                   f'{x:.0f}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {h / 2})">loss (rank 0\'s micro-batches)</text>')
    for i, (label, colour, pts) in enumerate(series):
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="6 4"' if i else ""
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} '
                   f'points="{d}"/>')
        out.append(f'<line x1="{w - 300}" y1="{top + 14 + 18 * i}" x2="{w - 270}" '
                   f'y2="{top + 14 + 18 * i}" stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - 264}" y="{top + 18 + 18 * i}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


# ---- training ----


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Train a byte-level GPT-2 with zeroshard ZeRO (run under zsrun).")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="what the model computes in (the daemons keep fp32 masters)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", "--dim", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8,
                   help="global batch: sequences per step over all ranks and micro-batches")
    p.add_argument("--accumulate", type=int, default=2,
                   help="micro-batches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--min_lr_ratio", type=float, default=0.1,
                   help="the cosine schedule's floor, as a fraction of --lr")
    p.add_argument("--weight_decay", type=float, default=0.1,
                   help="on matrices and embeddings; biases and norms get none")
    p.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="gradient clipping norm (0 = off)")
    p.add_argument("--bucket_bytes", type=int, default=256 << 10,
                   help="the client's constant gradient bucket size C_B (its "
                        "staging pool holds a few of them); the C++ demo's")
    p.add_argument("--checkpoint_every", type=int, default=0,
                   help="rank 0 saves a checkpoint every this many steps (0: never; the "
                        "daemons need --checkpoint_dir, e.g. zsrun "
                        "--daemon_args=--checkpoint_dir=DIR)")
    p.add_argument("--stop_at", type=int, default=0,
                   help="end this run after that step (an interrupted run, to be resumed "
                        "with --resume; the LR schedule still spans --steps)")
    p.add_argument("--resume", action="store_true",
                   help="start from the job's newest checkpoint (the same zsrun --job_id "
                        "and ZS_JOB_TOKEN as the run that saved it)")
    p.add_argument("--compare_torch", default="",
                   help="rank 0 then trains the same model in one process with "
                        "torch.optim.AdamW and writes both loss curves to this SVG file")
    p.add_argument("--loss_log", default="",
                   help="rank 0 writes each step's loss (of its micro-batches) to this file, "
                        "one 'step<TAB>loss' line per step")
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
                   help="stage 3: when gradients are pushed: as each layer's are "
                        "ready (hooks), all in step() (step), or alternating per "
                        "step with both timed and compared at the end (compare)")
    p.add_argument("--zsctl", default="",
                   help="zsctl binary for the daemons' ledger (default: "
                        "$ZSCTL, else zsctl on PATH)")
    args = p.parse_args(argv)
    for name in ("steps", "layers", "width", "heads", "seq_len", "batch",
                 "eval_batch", "accumulate", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.overlap == "compare" and args.steps < 4:
        p.error("--overlap=compare needs --steps >= 4 (two steps each way)")
    if args.overlap != "hooks" and args.stage != 3:
        p.error("--overlap: stages 1-2 push in step()")
    return args


def main(argv):
    args = parse_args(argv)
    try:
        config = init_from_env()
    except zeroshard.Error as e:
        raise SystemExit(f"train_gpt: {e} (run it under zsrun)")
    config.update(bucket_bytes=args.bucket_bytes, precision=args.precision)
    rank, world = config["rank"], config["world_size"]
    if args.batch % (world * args.accumulate) != 0:
        raise SystemExit(f"train_gpt: --batch ({args.batch}) must be a multiple of the "
                         f"ranks times --accumulate ({world} x {args.accumulate})")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    leader = rank == 0
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    corpus = load_corpus(args.corpus)
    torch.manual_seed(args.seed)
    net = GPT2(args.layers, args.width, args.heads, args.seq_len)
    psi = sum(p.numel() for p in net.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if leader:
        print(f"GPT-2: {args.layers} blocks, width {args.width}, {args.heads} heads, "
              f"{args.seq_len} tokens, tied token embedding and output; Ψ = "
              f"{format_count(psi)} parameters; global batch {args.batch} in "
              f"{args.accumulate} micro-batches per rank; {args.precision}; ZeRO stage "
              f"{args.stage}; N_d = {world}; {len(config['daemons'])} daemon(s) over "
              f"{config.get('transport', 'stream')}; corpus "
              f"{args.corpus} ({format_bytes(len(corpus))})", flush=True)

    # Blocks until every rank has joined; rank 0's values (or the newest
    # checkpoint's) become everyone's.
    model = shard_model(net, config, stage=args.stage,
                        layers=net.layer_names() if args.stage == 3 else None,
                        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                        max_grad_norm=args.max_grad_norm,
                        param_groups=net.param_groups(args.weight_decay),
                        gradient_accumulation_steps=args.accumulate if args.stage == 3 else 1,
                        resume="latest" if args.resume else None)
    client = model.client
    first = client.committed_step  # the steps a resumed job has taken
    schedule = lr_schedule(args.warmup, args.steps, args.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(model.optimizer, schedule,
                                              last_epoch=-1)
    for g in model.optimizer.param_groups:  # a resumed job's LR at step first
        g["lr"] = g["initial_lr"] * schedule(first)
    sched.last_epoch = first
    if leader and first > 0:
        print(f"resumed from checkpoint {model.resumed_from['name']} at step {first}",
              flush=True)
    # {overlap_comm: [(backward s, step s, push wait s)]} for --overlap=compare.
    timings = {True: [], False: []}

    held_x, held_y = make_batch(corpus, args.seq_len, 0, args.eval_batch,
                                0, 1, args.seed)

    def held_out_loss():
        with torch.no_grad():
            logits = model(held_x).float()
            return F.cross_entropy(logits.reshape(-1, VOCAB),
                                   held_y.reshape(-1)).item()

    loss_before = held_out_loss()
    progress = (Progress(first, min(args.steps, args.stop_at or args.steps), args.log_every)
                if leader else None)
    losses = []
    traffic = None
    last = min(args.steps, args.stop_at) if args.stop_at > 0 else args.steps
    for step in range(first + 1, last + 1):
        if args.stage == 3:
            overlap = (args.overlap == "hooks" or
                       (args.overlap == "compare" and step % 2 == 1))
            model.overlap_comm = overlap
        else:
            overlap = False
        start = time.perf_counter()
        step_losses, backward_seconds = [], 0.0
        for x, y in micro_batches(corpus, args, step, rank, world):
            loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
            backward_start = time.perf_counter()
            # Stage 3 pushes each micro-batch's gradients as they are ready.
            (loss / args.accumulate).backward()
            backward_seconds += time.perf_counter() - backward_start
            step_losses.append(loss.item())
        step_start = time.perf_counter()
        model.optimizer.step()  # AdamW with clipping, on the daemons
        end = time.perf_counter()
        model.optimizer.zero_grad(set_to_none=True)
        sched.step()
        result = model.last_result
        timings[overlap].append((backward_seconds, end - step_start,
                                 result["push_wait_ms"] / 1000))
        losses.append(sum(step_losses) / len(step_losses))
        traffic = client.traffic_report()
        if leader:
            progress.update(step, losses[-1], end - start, traffic)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                try:
                    saved = model.save_checkpoint(f"step-{step}")
                    if saved["previous_error"]:
                        print(saved["previous_error"], flush=True)
                except zeroshard.Error as e:
                    # A hung or slow checkpoint disk holds the save up:
                    # reported, and training goes on.
                    if e.code != "UNAVAILABLE":
                        raise
                    print(f"checkpoint step-{step} not saved: {e}", flush=True)

    memory = client.memory_report()
    loss_after = held_out_loss()
    print(f"finished: {client.committed_step} steps, held-out loss {loss_before:.4f} -> "
          f"{loss_after:.4f}", flush=True)

    if leader and losses:
        k = min(args.log_every, len(losses))
        t = traffic["last_step"]
        paper = (3 if args.stage == 3 else 2) * psi * 4
        print(f"\n==== zeroshard memory report: Ψ = {format_count(psi)}, "
              f"N_d = {world}, ZeRO stage {args.stage}, {args.precision} ====")
        print(f"Loss: held-out ({args.eval_batch} sequences) {loss_before:.4f} "
              f"before -> {loss_after:.4f} after step {client.committed_step}; "
              f"rank 0's training loss, mean of the first {k} steps "
              f"{sum(losses[:k]) / k:.4f} -> last {k} {sum(losses[-k:]) / k:.4f}")
        print(f"Trainer rank 0 holds: staging buffers "
              f"{format_bytes(memory['buffer'])}, layer buffers "
              f"{format_bytes(memory['param'] + memory['param_half'])} "
              f"(client.memory_report()); parameters at most "
              f"{format_bytes(model.peak_param_bytes)} at once, of the "
              f"model's {format_bytes(model_bytes)}")
        held = memory["buffer"] + memory["param"] + memory["param_half"]
        print(f"A plain data-parallel rank would hold 16Ψ = "
              f"{format_bytes(16 * psi)} of model states (fp32 parameters, "
              f"gradients, Adam's two moments); trainer rank 0's client holds "
              f"{format_bytes(held)} of buffers, {held / (16 * psi):.2f} of "
              f"that (the staging pool is constant, so the ratio falls as "
              f"the model grows)")
        print(f"Traffic of rank 0 in the last step ({args.accumulate} micro-batches): "
              f"pushed {format_bytes(t['push'])} + gathered {format_bytes(t['gather'])}"
              f" = {format_bytes(traffic_bytes(t))}; the paper's {paper // (psi * 4)}Ψ "
              f"(one micro-batch) = {format_bytes(paper)}; in all "
              f"{format_bytes(traffic_bytes(traffic['total']))}; layer "
              f"gathers served by a prefetch: {traffic['prefetch_hits']}, "
              f"fetched on demand: {traffic['prefetch_misses']}")
        print("Daemon memory by category (ledger, zsctl memory):")
        sys.stdout.write(daemon_ledger(find_zsctl(args.zsctl), config))
        sys.stdout.flush()
        if args.overlap == "compare":
            print_overlap(timings)
    if leader and args.loss_log:
        with open(args.loss_log, "w") as f:
            for s, loss in enumerate(losses, start=first + 1):
                f.write(f"{s}\t{loss!r}\n")
    if leader and args.checkpoint_every:
        model.await_checkpoint()
    model.close()
    if leader and args.compare_torch and losses:
        print("training the same model in one process with torch.optim.AdamW, twice (the "
              "micro-batches accumulated in both orders) ...", flush=True)
        reference = train_reference(corpus, args, world, dtype)
        reversed_ref = train_reference(corpus, args, world, dtype, reverse=True)
        ours = list(zip(range(first + 1, first + 1 + len(losses)), losses))
        steps = range(1, args.steps + 1)

        def largest(pairs):
            return max(abs(a - b) for a, b in pairs)

        diff = largest((a, reference[s - 1]) for s, a in ours)
        drift = largest(zip(reference, reversed_ref))
        agree = next((s for s, a in ours if abs(a - reference[s - 1]) > 1e-5), None)
        write_svg(args.compare_torch, [
            (f"zeroshard stage {args.stage}, {world} ranks", "#1f77b4", ours),
            ("torch.optim.AdamW, one process", "#d62728", list(zip(steps, reference))),
            ("the same, micro-batches reversed", "#7f7f7f", list(zip(steps, reversed_ref)))],
            f"GPT-2 ({format_count(psi)} parameters, {args.precision}): loss per step")
        print(f"loss curves written to {args.compare_torch}: the largest difference "
              f"of a step's loss from the single-process run's is {diff:.3g} (final "
              f"loss {losses[-1]:.4f} vs {reference[-1]:.4f}; within 1e-5 "
              f"{'throughout' if agree is None else f'up to step {agree - 1}'}); "
              f"torch against itself with the micro-batches reversed: {drift:.3g}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
