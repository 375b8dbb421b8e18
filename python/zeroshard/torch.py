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

    `params` may be `model.named_parameters()`: the names then label the
    tensors on the daemons and in checkpoints, so `zsctl export` writes a
    dict that `model.load_state_dict` takes (0-d parameters are stored with
    shape (1,)). Plain tensors are labelled p0, p1, ...

    `resume` (None, a checkpoint name or "latest") starts the job from a
    checkpoint instead of rank 0's current values. The load is part of
    construction: while joining, rank 0 has the daemons load the
    checkpoint's fp32 masters and optimizer state (moments, step count, loss
    scale) in place of uploading its parameters, and every rank's parameters
    are then overwritten with the loaded values. So it only resumes a job
    that is starting (a new run of it, or a restart after every rank left);
    an optimizer already training cannot load. With "latest" and no complete
    checkpoint the job starts from the current values: `resumed_from` says
    which happened, and `client.committed_step` is the step training resumes
    after. The checkpoint's layout must match these parameters; world size,
    stage and daemon count may differ from the run that saved it (each
    daemon then reads the parts it needs: give them a shared
    `--checkpoint_dir`).

    Each `step()` pushes this rank's gradients (the daemons average them over
    the ranks), runs the optimizer step and writes the new parameters into
    the tensors in place. All ranks must call it together with the same
    learning rate (`param_groups[0]["lr"]`, so LR schedulers work).
    Failures raise `zeroshard.Error`.
    """

    def __init__(self, params, client_config, stage=1, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 max_grad_norm=0.0, resume=None):
        if stage not in (1, 2):
            raise ValueError(f"stage: must be 1 or 2, got {stage}")
        if resume is not None and not isinstance(resume, str):
            raise TypeError(
                f"resume: expected None, a checkpoint name or 'latest', "
                f"got {type(resume).__name__}")
        params, names = _split_names(params)
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("ShardedOptimizer takes one parameter group")
        self._params = list(self.param_groups[0]["params"])
        for p in self._params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameters must be float32, got {p.dtype}")
        if names is None:
            names = [f"p{i}" for i in range(len(self._params))]
        # A 0-d parameter is registered as shape (1,).
        specs = [(name, tuple(p.shape) or (1,), i)
                 for i, (name, p) in enumerate(zip(names, self._params))]
        self._layout = Layout(specs)
        self._offsets = self._layout.offsets
        total = self._layout.total_elements

        config = dict(client_config)
        config.update(stage=stage, lr=lr, betas=tuple(betas), eps=eps,
                      weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                      resume=resume)
        self._client = Client(**config)
        self._rank = config["rank"]
        self._save_pending = False

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

    @property
    def resumed_from(self):
        """On rank 0: dict(name, step, bytes_read, seconds) of the
        checkpoint the job resumed from, or None (see `resume`)."""
        return self._client.resumed_from

    def save_checkpoint(self, name):
        """Saves the daemons' committed state (fp32 masters, moments, step
        count, loss scale) under `name`. Call it on one rank (rank 0) after
        a step; the daemons need `--checkpoint_dir`. Waits for this
        optimizer's previous save to complete, then returns once every
        daemon holds its snapshot (the training stall): dict(name, step,
        bytes, snapshot_seconds). The files are written in the background
        while training goes on; `await_checkpoint()` waits for them.

        Only what the daemons hold is saved: the model's buffers (such as
        batch-norm statistics), the LR scheduler and the data position are
        the caller's to save."""
        result = self._client.save_checkpoint(name)
        self._save_pending = True
        return result

    def await_checkpoint(self):
        """Waits for the last `save_checkpoint` to be complete on disk (its
        MANIFEST written): dict(name, step, bytes, write_seconds)."""
        self._save_pending = False
        return self._client.await_checkpoint()

    def list_checkpoints(self):
        """The job's checkpoints complete on every daemon, by step."""
        return self._client.list_checkpoints()

    def close(self):
        """Waits for a save not yet awaited, then leaves the job (the
        daemons free it once every rank has left)."""
        if self._save_pending:
            self.await_checkpoint()
        self._client.leave()


def _split_names(params):
    """(tensors, names) from named parameters; (params, None) otherwise."""
    params = list(params)
    if params and all(isinstance(p, tuple) and len(p) == 2
                      and isinstance(p[0], str) for p in params):
        return [p for _, p in params], [n for n, _ in params]
    return params, None
