"""A model the way PyTorch users write them, and its single-process
torch.optim.AdamW reference, shared by test_semantics.py and its workers.

The model has what real models have and flat-buffer ZeRO implementations
approximate: two parameter groups (weights with decay; biases and norms
without, at half the learning rate) under a cosine LR schedule, a frozen
submodule, a layer used only in odd steps, a layer used only by one
micro-batch of one rank every third step, a token embedding tied to the
output projection, a block applied twice per forward, gradient
accumulation over 2 micro-batches and global-norm clipping. Every layer
holds more than 4096 bytes of fp32 (the smallest bucket C_B), so the
buckets are smaller than every layer.

The reference trains the same global batch in one process, cut into the
same micro-batches (rank-major, then micro-batch) and accumulated in
p.grad, which is what single-process gradient accumulation computes.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 30
GLOBAL_BATCH = 12  # 2 micro-batches on each of 2 or 3 ranks
MICRO_BATCHES = 2
SEQ = 5
VOCAB, WIDTH = 67, 32
LR = 3e-3
MAX_GRAD_NORM = 0.3
# fp32-exact values: the daemons take fp32 hyper-parameters.
BETAS = (float(np.float32(0.9)), float(np.float32(0.95)))
EPS = float(np.float32(1e-8))
DECAY = 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(self.ln(h))))


class Final(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)  # tied to wte

    def forward(self, h):
        return self.out(self.proj(self.ln(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.block = Block()
        self.odd = nn.Linear(WIDTH, WIDTH)
        self.rare = nn.Linear(WIDTH, WIDTH)
        self.final = Final()
        self.final.out.weight = self.wte.weight
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, tokens, use_odd, use_rare):
        h = self.wte(tokens)
        h = h + torch.tanh(self.frozen(h))
        h = self.block(self.block(h))  # applied twice
        if use_odd:
            h = h + torch.tanh(self.odd(h))
        if use_rare:
            h = h + torch.tanh(self.rare(h))
        return self.final(h)


def make_model():
    torch.manual_seed(0)
    return Net()


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)


def groups_of(model):
    """Decay for matrices, none for biases and norms, at half the LR."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": DECAY},
            {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2}]


def lr_lambda(step):
    """Linear warm-up over 3 steps, then cosine to a tenth."""
    if step < 3:
        return (step + 1) / 3
    t = (step - 3) / max(1, STEPS - 3)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def micro_batch(data, step, world_size, rank, k):
    """Rank `rank`'s micro-batch `k` of `step`: (inputs, targets)."""
    size = GLOBAL_BATCH // (world_size * MICRO_BATCHES)
    first = (rank * MICRO_BATCHES + k) * size
    tokens = data[step, first:first + size]
    return tokens[:, :-1], tokens[:, 1:]


def uses(step, rank, k, uniform=False):
    """(use_odd, use_rare) of a micro-batch; with `uniform` every rank uses
    what rank 0 does (the trainer collective gathers collectively: every
    rank must run the same layers)."""
    return step % 2 == 1, step % 3 == 0 and (rank == 0 or uniform) and k == 1


def loss_of(model, inputs, targets, step, rank, k, world_size, precision="fp32",
            uniform=False):
    """The micro-batch's share of the step's mean loss."""
    use_odd, use_rare = uses(step, rank, k, uniform)
    logits = model(inputs, use_odd, use_rare).float()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    return loss / MICRO_BATCHES


def flat_params(named):
    """The model's parameters (first names), flattened in named_parameters
    order, as float64 numpy."""
    names = [n for n, _ in make_model().named_parameters()]
    return np.concatenate([named[n].detach().double().reshape(-1).numpy() for n in names])


def train_reference(world_size, steps=STEPS, precision="fp32", set_to_none=True,
                    uniform=False):
    """Single-process AdamW: (params after `steps` as {name: tensor},
    the clipped norms); `uniform` as in uses()."""
    model = make_model()
    if precision == "bf16":
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
        model = model.to(torch.bfloat16)
    data = make_data()
    if precision == "bf16":
        # Mixed precision as the daemons do it: fp32 masters stepped by
        # AdamW, the model computing in bf16 on their rounding.
        master_model = make_model()
        opt = torch.optim.AdamW(groups_of(master_model), lr=LR, betas=BETAS, eps=EPS)
    else:
        opt = torch.optim.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    norms = []
    for s in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        model.zero_grad(set_to_none=set_to_none)
        for r in range(world_size):
            for k in range(MICRO_BATCHES):
                x, y = micro_batch(data, s, world_size, r, k)
                (loss_of(model, x, y, s, r, k, world_size, precision, uniform)
                 / world_size).backward()
        if precision == "bf16":
            for (n, p), (_, q) in zip(master_model.named_parameters(), model.named_parameters()):
                p.grad = None if q.grad is None else q.grad.float()
            params = master_model.parameters()
        else:
            params = model.parameters()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        opt.step()
        sched.step()
        if precision == "bf16":
            with torch.no_grad():
                for p, q in zip(master_model.parameters(), model.parameters()):
                    q.copy_(p)
    final = master_model if precision == "bf16" else model
    return {n: p.detach().float().clone() for n, p in final.named_parameters()}, norms
