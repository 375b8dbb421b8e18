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
