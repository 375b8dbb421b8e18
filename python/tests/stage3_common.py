"""The model, data and reference shared by test_stage3.py and its workers."""

import numpy as np
import torch

STEPS = 30
GLOBAL_BATCH = 12  # splits evenly over 2 and 3 ranks
IN, HIDDEN, MID, OUT = 8, 61, 37, 3  # odd sizes: tensors not multiples of 64
LR = 1e-2
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 0.5
# The wire carries fp32 hyper-parameters; the reference uses the same values.
BETAS = (float(np.float32(0.9)), float(np.float32(0.999)))
EPS = float(np.float32(1e-8))


class Gain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(1.1))  # 0-d

    def forward(self, x):
        return self.gain * x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(IN, HIDDEN)
        self.act = torch.nn.Tanh()
        self.block = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, MID), torch.nn.Tanh(),
            torch.nn.Linear(MID, MID), Gain())
        self.head = torch.nn.Linear(MID, OUT)
        # The outer module's own parameters: a 0-d one and an odd-sized one.
        self.scale = torch.nn.Parameter(torch.tensor(0.8))
        self.shift = torch.nn.Parameter(torch.linspace(-0.1, 0.1, OUT))

    def forward(self, x):
        h = self.block(self.act(self.embed(x)))
        return self.scale * self.head(h) + self.shift


def make_model():
    torch.manual_seed(0)
    return Net()


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(STEPS, GLOBAL_BATCH, OUT, generator=g)
    return x, y


def flatten(named):
    """The values of {name: tensor} in Net's named_parameters order."""
    names = [name for name, _ in make_model().named_parameters()]
    return torch.cat([named[n].detach().reshape(-1) for n in names]).numpy()


def loss_of(model, x, y, precision="fp32"):
    """The training loss; in a bf16 job the model computes in bfloat16 and
    the loss is taken in float32 (torch has no bfloat16 mse_loss on CPU)."""
    if precision == "bf16":
        return torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
    return torch.nn.functional.mse_loss(model(x), y)


def train_reference():
    """Single-process AdamW with clipping on the full batch: (params, norms)."""
    model = make_model()
    x, y = make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[s]), y[s]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), MAX_GRAD_NORM)))
        opt.step()
    return flatten(dict(model.named_parameters())), norms


def train_reference_bf16(world_size):
    """A bf16 job of `world_size` ranks in one process: fp32 masters
    stepped by torch AdamW with clip_grad_norm_; each step computes forward
    and backward in bfloat16 with the masters rounded to bfloat16, once per
    rank on that rank's share of the batch, as the ranks do. The ranks'
    bfloat16 gradients are converted to float32 and summed in rank order,
    and the sum multiplied by float32(1 / world_size), as the daemons
    reduce them. Returns (masters, norms)."""
    masters = make_model()
    half = make_model().bfloat16()
    x, y = make_data()
    opt = torch.optim.AdamW(masters.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    scale = torch.tensor(1.0 / world_size, dtype=torch.float32)
    per_rank = GLOBAL_BATCH // world_size
    norms = []
    for s in range(STEPS):
        with torch.no_grad():
            for h, m in zip(half.parameters(), masters.parameters()):
                h.copy_(m)  # rounds to nearest even, as the daemons do
        total = None
        for rank in range(world_size):
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            half.zero_grad(set_to_none=True)
            loss_of(half, x[s][rows], y[s][rows], "bf16").backward()
            grads = [p.grad.float() for p in half.parameters()]
            total = grads if total is None else [
                t + g for t, g in zip(total, grads)]
        for m, g in zip(masters.parameters(), total):
            m.grad = g * scale
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            masters.parameters(), MAX_GRAD_NORM)))
        opt.step()
    return flatten(dict(masters.named_parameters())), norms


def train_in_process(config, stage):
    """shard_model(make_model(), config) in this process at `stage`, one
    rank on the full batch for STEPS steps with the reference's
    hyper-parameters; returns the model and the step results."""
    from zeroshard.torch import shard_model
    model = shard_model(make_model(), config, stage=stage, lr=LR, betas=BETAS,
                        eps=EPS, weight_decay=WEIGHT_DECAY,
                        max_grad_norm=MAX_GRAD_NORM)
    x, y = make_data()
    results = []
    for s in range(STEPS):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[s]), y[s]).backward()
        results.append(model.step())
    return model, results
