"""ShardedOptimizer: AdamW whose fp32 master weights and moments live on
zeroshardd daemons (ZeRO stages 1 and 2), for use in place of
torch.optim.AdamW in a data-parallel job of `world_size` processes.
"""

import numpy as np
import torch

from zeroshard._zeroshard import Client, Layout


class ShardedOptimizer(torch.optim.Optimizer):
    """AdamW over the daemons.

    Every rank builds one with the same parameters (same order and shapes)
    and the same `client_config`: a dict with `daemons`, `job_id`, `rank` and
    `world_size`, and optionally any other `zeroshard.Client` keyword
    (`precision`, `bucket_bytes`, `rpc_timeout`, `step_timeout`).
    Construction blocks until every rank has joined; rank 0's current
    parameter values become everyone's starting point.

    Each `step()` pushes this rank's gradients (the daemons average them over
    the ranks), runs the optimizer step and writes the new parameters into
    the tensors in place. All ranks must call it together with the same
    learning rate (`param_groups[0]["lr"]`, so LR schedulers work).
    Failures raise `zeroshard.Error`.
    """

    def __init__(self, params, client_config, stage=1, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 max_grad_norm=0.0):
        if stage not in (1, 2):
            raise ValueError(f"stage: must be 1 or 2, got {stage}")
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("ShardedOptimizer takes one parameter group")
        self._params = list(self.param_groups[0]["params"])
        for p in self._params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameters must be float32, got {p.dtype}")
        # A 0-d parameter is registered as shape (1,).
        specs = [(f"p{i}", tuple(p.shape) or (1,), i)
                 for i, p in enumerate(self._params)]
        self._layout = Layout(specs)
        self._offsets = self._layout.offsets
        total = self._layout.total_elements

        config = dict(client_config)
        config.update(stage=stage, lr=lr, betas=tuple(betas), eps=eps,
                      weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self._client = Client(**config)
        self._rank = config["rank"]

        # Reused every step; the tensors share memory with the arrays.
        self._flat_params = np.zeros(total, dtype=np.float32)
        self._flat_grads = np.zeros(total, dtype=np.float32)
        self._params_t = torch.from_numpy(self._flat_params)
        self._grads_t = torch.from_numpy(self._flat_grads)

        initial = None
        if self._rank == 0:
            with torch.no_grad():
                for p, off in zip(self._params, self._offsets):
                    self._params_t[off:off + p.numel()].copy_(p.reshape(-1))
            initial = self._flat_params
        self._client.register_model(self._layout, initial)
        self._load_params()
        self.last_result = None

    @property
    def client(self):
        """The underlying zeroshard.Client (reports, committed step)."""
        return self._client

    def _load_params(self):
        self._client.gather_all(self._flat_params)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                n = p.numel()
                p.copy_(self._params_t[off:off + n].view_as(p))

    def step(self, closure=None):
        """Pushes the gradients, steps on the daemons and loads the new
        parameters. Returns the closure's loss, if any; the step's result
        dict (step, grad_norm, clip_coef, skipped) is in `last_result`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                n = p.numel()
                dst = self._grads_t[off:off + n]
                if p.grad is None:
                    dst.zero_()
                else:
                    dst.copy_(p.grad.reshape(-1))
        # Lent, not copied: _flat_grads is not written again before step()
        # has taken the pushes in.
        self._client.push_gradients(0, len(self._flat_grads), self._flat_grads,
                                    borrow=True)
        self.last_result = self._client.step(float(self.param_groups[0]["lr"]))
        self._load_params()
        return loss

    def close(self):
        """Leaves the job (the daemons free it once every rank has left)."""
        self._client.leave()
