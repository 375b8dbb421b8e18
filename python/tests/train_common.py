"""The model, data and hyper-parameters shared by the test and its workers."""

import numpy as np
import torch

STEPS = 15
GLOBAL_BATCH = 16
IN, HIDDEN, OUT = 8, 13, 3  # odd bias sizes: tensors not multiples of 64
LR = 1e-2
WEIGHT_DECAY = 0.01
# The wire carries fp32 hyper-parameters; the reference uses the same values.
BETAS = (float(np.float32(0.9)), float(np.float32(0.999)))
EPS = float(np.float32(1e-8))


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT))


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(STEPS, GLOBAL_BATCH, OUT, generator=g)
    return x, y


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_reference(max_grad_norm):
    """Single-process AdamW on the full batch; returns (params, norms)."""
    model = make_model()
    x, y = make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[s]), y[s]).backward()
        if max_grad_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_grad_norm)))
        opt.step()
    return flat_params(model).numpy(), norms
