"""Stages 1 and 2: the parameters stay on the trainer (ZeRO's P_os and
P_os+g); each step pushes the gradients the backward passes accumulated in
`p.grad` (as torch sums micro-batches: several backward passes per step
are summed on the trainer), marks the parameters that got none, runs the
step on the daemons and loads the new values into the parameters."""

import time

import numpy as np
import torch

from zeroshard import _engine


def unfrozen_message(name):
    return (f"parameter {name} had requires_grad=False when the model was sharded and "
            "now requires a gradient: the daemons hold no optimizer state for it; save a "
            "checkpoint, then shard anew with it trainable")


class FlatSharding:
    """The step of a stage 1-2 job over `engine`'s entries."""

    def __init__(self, engine):
        self.engine = engine
        total = engine.total
        # Reused every step; the tensors share memory with the arrays.
        self._flat_params = np.zeros(total, dtype=np.float32)
        self._flat_grads = np.zeros(total, dtype=np.float32)
        self._params_t = torch.from_numpy(self._flat_params)
        self._grads_t = torch.from_numpy(self._flat_grads)
        self._trainable = [e for e in engine.entries if e.kind == "param" and not e.frozen]
        # Frozen by requires_grad=False (the others are in no group, and
        # torch.optim ignores their gradients too).
        self._not_requiring = [e for e in engine.entries
                               if e.kind == "param" and not e.param.requires_grad]

    def load_params(self):
        """The daemons' masters into every registered parameter."""
        self.engine.client.gather_all(self._flat_params)
        with torch.no_grad():
            for e in self.engine.entries:
                if e.kind == "param":
                    e.param.copy_(self._params_t[e.offset:e.offset + e.numel].view(e.param.shape))

    def step(self):
        """Pushes the gradients, steps on the daemons and loads the new
        parameters; returns the step's result dict."""
        for e in self._not_requiring:
            if e.param.requires_grad:
                raise ValueError(unfrozen_message(e.name))
        no_grad = []
        with torch.no_grad():
            self._grads_t.zero_()
            for e in self._trainable:
                g = e.param.grad
                if g is None:
                    no_grad.append(e.index)
                else:
                    self._grads_t[e.offset:e.offset + e.numel].copy_(g.reshape(-1))
        start = time.perf_counter()
        # Lent, not copied: _flat_grads is not written again before step()
        # has taken the pushes in.
        self.engine.client.push_gradients(0, self.engine.total, self._flat_grads, borrow=True,
                                          no_grad=self.engine.no_grad(no_grad))
        result = self.engine.step(time.perf_counter() - start)
        self.load_params()
        return result
