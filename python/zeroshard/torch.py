"""ShardedOptimizer: AdamW whose fp32 master weights and moments live on
zeroshardd daemons (ZeRO stages 1 and 2), for use in place of
torch.optim.AdamW in a data-parallel job of `world_size` processes.

shard_model: the same for a whole module, and in stage 3 also the
parameters themselves, gathered layer by layer around forward and backward
(like FSDP's fully_shard).
"""

import collections
import os
import re
import time

import numpy as np
import torch
from torch.autograd import Variable

from zeroshard._zeroshard import Client, Error, Layout


def _config_error(message):
    """A zeroshard.Error with code INVALID_ARGUMENT."""
    error = Error(message)
    error.code = "INVALID_ARGUMENT"
    return error


def init_from_env(**overrides):
    """The `client_config` of this process, read from its launcher's
    environment, so that one script runs unchanged under `zsrun` or
    `torchrun`:

      rank        RANK (torchrun, zsrun), else ZS_RANK
      world_size  WORLD_SIZE, else ZS_WORLD_SIZE
      daemons     ZS_DAEMONS: HOST:PORT,HOST:PORT,... (zsrun sets it; under
                  torchrun export it yourself)
      job_id      ZS_JOB_ID, else TORCHELASTIC_RUN_ID (torchrun's --rdzv_id)
                  when it is a valid job id

    The job token is not copied: `Client` reads ZS_JOB_TOKEN itself. Keyword
    arguments are added to (or replace) what the environment gives, e.g.
    `init_from_env(replicas=2, rpc_timeout=30.0)`. A variable missing or
    malformed raises zeroshard.Error (code INVALID_ARGUMENT) naming it."""
    env = os.environ

    def number(names):
        for name in names:
            value = env.get(name)
            if value is None:
                continue
            if not re.fullmatch(r"[0-9]{1,9}", value):
                raise _config_error(
                    f"{name}: must be a whole number, got {value[:64]!r}")
            return int(value)
        raise _config_error(f"{' or '.join(names)}: not set (run under "
                            "zsrun or torchrun, or pass it to init_from_env)")

    config = {}
    if "rank" not in overrides:
        config["rank"] = number(["RANK", "ZS_RANK"])
    if "world_size" not in overrides:
        config["world_size"] = number(["WORLD_SIZE", "ZS_WORLD_SIZE"])
    if "daemons" not in overrides:
        daemons = [d for d in env.get("ZS_DAEMONS", "").split(",") if d]
        if not daemons:
            raise _config_error(
                "ZS_DAEMONS: not set (HOST:PORT,... of the job's daemons; "
                "zsrun sets it)")
        config["daemons"] = daemons
    if "job_id" not in overrides:
        job_id = env.get("ZS_JOB_ID")
        if not job_id:
            run_id = env.get("TORCHELASTIC_RUN_ID", "")
            if re.fullmatch(r"[A-Za-z0-9._-]{1,128}", run_id) and run_id != "none":
                job_id = run_id
        if not job_id:
            raise _config_error(
                "ZS_JOB_ID: not set (and no usable TORCHELASTIC_RUN_ID)")
        config["job_id"] = job_id
    config.update(overrides)
    return config


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
        self._config = config
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

    def reconnect(self):
        """Drops this rank's connection and joins the job again with a new
        one, after a `zeroshard.Error` that a new connection may get past
        (`reconnectable(error)`: a daemon died or was replaced, a call or
        a step ran out of time). With `replicas=2` the new connection finds
        where each replica group is served now (rank 0 promotes the backups
        of groups whose primary is gone). The parameters are loaded again
        from the daemons; returns the committed step: train on from the
        step after it (a step that failed before it committed is trained
        again, by every rank). Every rank of the job reconnects too: the
        others fail at their next step and reconnect in their turn."""
        _refuse_trainer_reconnect(self._config)
        self._client = None  # dropped first: its heartbeats stop
        self._client = _rejoin(self._config, self._layout)
        self._save_pending = False
        self._load_params()
        return self._client.committed_step

    def _load_params(self):
        self._client.gather_all(self._flat_params)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                n = p.numel()
                p.copy_(self._params_t[off:off + n].view_as(p))

    def step(self, closure=None):
        """Pushes the gradients, steps on the daemons and loads the new
        parameters. Returns the closure's loss, if any; the step's result
        dict (step, grad_norm, clip_coef, skipped, loss_scale,
        push_wait_ms: the time it waited for the pushes) is in
        `last_result`."""
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
        push_start = time.perf_counter()
        self._client.push_gradients(0, len(self._flat_grads), self._flat_grads,
                                    borrow=True)
        pushing = time.perf_counter() - push_start
        self.last_result = _with_push_time(
            self._client.step(float(self.param_groups[0]["lr"])), pushing)
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


def shard_model(module, client_config, stage=3, layers=None, lr=1e-3,
                betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                max_grad_norm=0.0, overlap_comm=True):
    """Shards `module`'s training state on the daemons; returns a
    ShardedModel (see there). Stages 1 and 2 keep the parameters on the
    trainer and use ShardedOptimizer; stage 3 frees them between uses."""
    return ShardedModel(module, client_config, stage=stage, layers=layers,
                        lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm,
                        overlap_comm=overlap_comm)


class ShardedModel(torch.nn.Module):
    """`module` trained with AdamW on the daemons (ZeRO stage 1, 2 or 3).

    Every rank builds one from the same model with the same `client_config`
    (as for ShardedOptimizer); construction blocks until every rank has
    joined, and rank 0's current parameter values become everyone's start.
    Call it like the module, then `step()` after each backward:

        model = shard_model(net, config, stage=3, max_grad_norm=1.0)
        loss_fn(model(x), y).backward()   # pushes the gradients
        model.step()                      # AdamW (with clipping) on the daemons
        model.zero_grad()

    Stage 3 cuts the parameters into layers: each module named in `layers`
    (names as in `module.named_modules()`), by default each direct child of
    `module` that has parameters; a parameter belongs to the innermost
    layer that contains it, and `module`'s parameters outside every layer
    form a layer of their own, held for the whole forward of `module`. The
    layers are registered in `module.named_modules()` order, which should be
    the order the forward runs them in (the client prefetches the layers
    that follow the one gathered). The daemons' tensors carry the names of
    `module.named_parameters()`, so checkpoints and `zsctl export` keep them.

    After construction every parameter's storage is freed (resized to 0;
    the tensors themselves stay, with their shapes). Each layer's
    parameters are gathered from the daemons right before its forward and
    freed after it; the layer's output tensors get a gradient hook that
    gathers them again before the layer's backward. Each parameter's
    gradient is pushed to the daemons as soon as autograd has accumulated
    it, and then dropped (`p.grad` stays None); once all of a layer's
    gradients are pushed its parameters are freed again. So a trainer holds
    about two layers' parameters at a time (a layer and the outer module's
    own), plus the client's prefetch buffers (`client.memory_report()`).

    Precision (stage 3): the job's, `client_config["precision"]`. In an
    "fp32" job (the default) parameters are float32. In a "bf16" job the
    trainer computes in bfloat16 while the daemons keep fp32 masters and
    step AdamW in fp32: `module`'s parameters (float32 or bfloat16) become
    bfloat16 tensors, and its floating-point buffers are cast to bfloat16,
    as `module.to(torch.bfloat16)` would; rank 0's values upload as the
    fp32 masters. Gathers fetch the daemons' bf16 copy of the masters
    straight into the layers' bf16 storage, and gradients are pushed as
    bfloat16, as autograd made them (the wire dtype is the job's
    precision); the daemons sum the ranks' gradients in fp32. The inputs
    must be bfloat16 too; bf16 needs no loss scaling.

    Limits of stage 3: an fp32 or bf16 job (fp16 would need loss scaling);
    one backward per step (no gradient accumulation); a parameter must not be used by a
    layer other than its own (tied weights across layers); parameters are
    only readable inside the forward of their layer, or through
    `full_state_dict()`.

    `overlap_comm` (stage 3; settable between steps): True (the default)
    pushes each gradient from its hook during backward, so the pushes
    overlap the rest of the backward; False keeps every gradient until
    `step()` and pushes them all there (a whole model's gradients held on
    the trainer) — the baseline the overlap is measured against
    (bench/python_overlap_bench). Stages 1-2 always push in `step()`.

    `optimizer` is a torch.optim.Optimizer whose `param_groups[0]["lr"]`
    `step()` uses (so LR schedulers work); `last_result` is the last step's
    dict(step, grad_norm, clip_coef, skipped, loss_scale, push_wait_ms), where
    push_wait_ms is how long step() waited for the step's gradients to
    reach the daemons (the pushes it made itself, then the wait for the
    daemons to accept every push). Failures raise `zeroshard.Error`.
    """

    def __init__(self, module, client_config, stage=3, layers=None, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 max_grad_norm=0.0, overlap_comm=True):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage: must be 1, 2 or 3, got {stage}")
        self.module = module
        self.stage = stage
        if stage in (1, 2):
            if layers is not None:
                raise ValueError("layers: only stage 3 gathers by layer")
            if not overlap_comm:
                raise ValueError("overlap_comm: stages 1-2 always push in "
                                 "step(); only stage 3 pushes from hooks")
            self._sharded = None
            self.optimizer = ShardedOptimizer(
                module.named_parameters(), client_config, stage=stage, lr=lr,
                betas=betas, eps=eps, weight_decay=weight_decay,
                max_grad_norm=max_grad_norm)
            return
        self._sharded = _LayerSharding(
            module, client_config, layers, lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self._sharded.overlap_comm = bool(overlap_comm)
        self.optimizer = _LayerShardedOptimizer(
            self._sharded, module.parameters(),
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @property
    def overlap_comm(self):
        """Stage 3: whether gradients are pushed from backward hooks (True)
        or all in step() (False). Stages 1-2: False."""
        return self._sharded is not None and self._sharded.overlap_comm

    @overlap_comm.setter
    def overlap_comm(self, value):
        if self._sharded is None:
            raise ValueError("overlap_comm: stages 1-2 always push in step()")
        self._sharded.overlap_comm = bool(value)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def client(self):
        """The underlying zeroshard.Client (reports, committed step,
        checkpoints)."""
        if self._sharded is None:
            return self.optimizer.client
        return self._sharded.client

    @property
    def last_result(self):
        return self.optimizer.last_result

    def step(self, lr=None):
        """Pushes what the backward did not (stage 3: zeros for parameters
        that got no gradient), runs AdamW on the daemons with `lr` (default
        `optimizer.param_groups[0]["lr"]`, which a given `lr` replaces) and
        returns the step's result dict. All ranks call it together."""
        if lr is not None:
            self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        return self.optimizer.last_result

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def reconnect(self):
        """Joins the job again with a new connection after a
        `zeroshard.Error` for which `reconnectable(error)` holds (see
        `ShardedOptimizer.reconnect`); returns the committed step, after
        which training goes on. Stage 3 drops what the failed step had
        gathered or held back; the next forward gathers from the daemons
        that now serve each group. Typical loop, with `replicas=2` in the
        config so that a daemon's death loses nothing:

            step = model.client.committed_step
            while step < steps:
                try:
                    loss_fn(model(x[step]), y[step]).backward()
                    model.step()
                    step += 1
                except zeroshard.Error as e:
                    if not reconnectable(e):
                        raise
                    model.zero_grad()
                    step = model.reconnect()
        """
        if self._sharded is None:
            return self.optimizer.reconnect()
        return self._sharded.reconnect()

    def full_state_dict(self):
        """{name: tensor}: a copy of every parameter as of the last committed
        step (stage 3 gathers the whole model for it: float32, the daemons'
        masters, also in a bf16 job)."""
        if self._sharded is None:
            return {name: p.detach().clone()
                    for name, p in self.module.named_parameters()}
        return self._sharded.full_state_dict()

    @property
    def peak_param_bytes(self):
        """Stage 3: the most bytes of parameter storage this trainer has
        held at once (gathered layers, alignment gaps included); stages
        1-2: the whole model's parameters."""
        if self._sharded is None:
            return sum(p.numel() * p.element_size()
                       for p in self.module.parameters())
        return self._sharded.peak_param_bytes

    def close(self):
        """Leaves the job (stages 1-2: after a pending checkpoint save)."""
        if self._sharded is None:
            self.optimizer.close()
        else:
            self._sharded.client.leave()


class _LayerShardedOptimizer(torch.optim.Optimizer):
    """The optimizer face of a stage-3 ShardedModel: step() runs the step
    on the daemons with param_groups[0]["lr"]."""

    def __init__(self, sharding, params, defaults):
        super().__init__(params, defaults)
        self._sharding = sharding
        self.last_result = None

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_result = self._sharding.step(
            float(self.param_groups[0]["lr"]))
        return loss

    def zero_grad(self, set_to_none=True):
        # Gradients are pushed and dropped during backward: nothing to zero.
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class _Layer:
    """One stage-3 layer: its parameters are views of `flat`, a tensor
    covering the layer's flat range in the job's precision, whose storage
    is freed between uses."""

    def __init__(self, layer_id, module, begin, end, dtype):
        self.id = layer_id
        self.module = module
        self.begin, self.end = begin, end
        self.flat = torch.zeros(end - begin, dtype=dtype)
        self.params = []   # (parameter, flat offset)
        self.gathered = True
        self.expected = 0  # gradients a backward delivers (requires_grad)
        self.unpushed = 0  # of those, still to come in this backward

    @property
    def bytes(self):
        return (self.end - self.begin) * self.flat.element_size()


class _LayerSharding:
    """Stage 3 for ShardedModel: the layout, hooks and client."""

    def __init__(self, module, client_config, layer_names, lr, betas, eps,
                 weight_decay, max_grad_norm):
        named = list(module.named_parameters())
        if not named:
            raise ValueError("module: has no parameters")
        config = dict(client_config)
        precision = config.get("precision", "fp32")
        if precision not in _STAGE3_DTYPES:
            raise ValueError(
                "stage 3: precision must be 'fp32' or 'bf16' (fp16 needs loss "
                f"scaling, which shard_model does not do), got {precision!r}")
        dtype = _STAGE3_DTYPES[precision]
        allowed = {torch.float32, dtype}
        for name, p in named:
            if p.dtype not in allowed:
                raise TypeError(
                    f"parameters must be float32 (or {dtype} in a "
                    f"{precision} job), got {p.dtype} for {name}")
        groups = _layer_groups(module, named, layer_names)
        specs = []
        for layer_id, (_, members) in enumerate(groups):
            specs += [(name, tuple(p.shape) or (1,), layer_id)
                      for name, p in members]
        self._layout = Layout(specs)
        offsets = self._layout.offsets
        offset_of = {spec[0]: off for spec, off in zip(specs, offsets)}
        # In module order, as state_dict lists them.
        self._named = [(name, p, offset_of[name]) for name, p in named]

        config.update(stage=3, lr=lr, betas=tuple(betas), eps=eps,
                      weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self._config = config
        self.client = Client(**config)
        rank = config["rank"]

        initial = None
        if rank == 0:
            # The daemons' fp32 masters start from these values (and write
            # their half copy from them in a bf16 job).
            initial = np.zeros(self._layout.total_elements, dtype=np.float32)
            initial_t = torch.from_numpy(initial)
            with torch.no_grad():
                for _, p, off in self._named:
                    initial_t[off:off + p.numel()].copy_(p.reshape(-1))
        self.client.register_model(self._layout, initial)
        del initial
        if dtype != torch.float32:
            # The module computes in the job's precision, as after
            # module.to(dtype): floating-point buffers are cast too.
            for sub in module.modules():
                for key, buf in list(sub.named_buffers(recurse=False)):
                    if buf.is_floating_point():
                        setattr(sub, key, buf.to(dtype))

        # Every parameter becomes a view of its layer's flat tensor.
        self._layers = []
        index = 0
        for layer_id, (layer_module, members) in enumerate(groups):
            begin, end = self._layout.layer_range(layer_id)
            layer = _Layer(layer_id, layer_module, begin, end, dtype)
            for _, p in members:
                off = offsets[index]
                index += 1
                local = off - begin
                p.data = layer.flat[local:local + p.numel()].view(p.shape)
                layer.params.append((p, off))
            self._layers.append(layer)
        self._pushed = set()  # id() of the parameters pushed in this step
        # Set by ShardedModel. False: gradients wait in _deferred (flat
        # offset, tensor) until step() pushes them.
        self.overlap_comm = True
        self._deferred = collections.deque()
        self._accumulators = []  # kept alive: the hooks live on them
        self._callback_queued = False
        self._held = sum(layer.bytes for layer in self._layers)
        self.peak_param_bytes = 0
        for layer in self._layers:
            self._install_hooks(layer)
        for layer in self._layers:
            self._free(layer)

    # ---- gather and free ----

    def _gather(self, layer):
        if layer.gathered:
            return
        _resize_storage(layer.flat, layer.end - layer.begin)
        try:
            self.client.gather(layer.id, layer.flat)
        except BaseException:
            _resize_storage(layer.flat, 0)
            raise
        layer.gathered = True
        self._held += layer.bytes
        self.peak_param_bytes = max(self.peak_param_bytes, self._held)

    def _free(self, layer):
        if not layer.gathered:
            return
        _resize_storage(layer.flat, 0)
        layer.gathered = False
        self._held -= layer.bytes

    # ---- hooks ----

    def _install_hooks(self, layer):
        def pre_forward(module, inputs):
            self._gather(layer)

        def post_forward(module, inputs, output):
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
            self._free(layer)

        def pre_backward(grad):
            if not self._callback_queued:
                self._callback_queued = True
                Variable._execution_engine.queue_callback(self._post_backward)
            self._gather(layer)
            return grad

        layer.module.register_forward_pre_hook(pre_forward)
        layer.module.register_forward_hook(post_forward)

        with torch.enable_grad():
            for p, off in layer.params:
                if not p.requires_grad:
                    continue
                # The parameter's AccumulateGrad node: its hooks run once
                # p.grad holds the whole gradient of the backward.
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(
                    self._make_grad_hook(layer, p, off))
                self._accumulators.append(accumulator)
                layer.expected += 1
        layer.unpushed = layer.expected

    def _make_grad_hook(self, layer, p, off):
        def grad_ready(*unused):
            grad = p.grad
            if grad is None:
                return
            # In the parameter's dtype, which is the wire dtype: a bf16
            # job's gradients go out as computed. Copied before the call
            # returns.
            data = grad.detach().reshape(-1).contiguous()
            if self.overlap_comm:
                self.client.push_gradients(off, off + p.numel(), data)
            else:
                self._deferred.append((off, data))
            self._pushed.add(id(p))
            p.grad = None
            layer.unpushed -= 1
            if layer.unpushed == 0:
                self._free(layer)
        return grad_ready

    def _post_backward(self):
        self._callback_queued = False
        for layer in self._layers:
            self._free(layer)

    # ---- reconnect ----

    def reconnect(self):
        _refuse_trainer_reconnect(self._config)
        for layer in self._layers:
            self._free(layer)
            layer.unpushed = layer.expected
        self._pushed.clear()
        self._deferred.clear()
        self._callback_queued = False
        self.client = None  # dropped first: its heartbeats stop
        self.client = _rejoin(self._config, self._layout)
        return self.client.committed_step

    # ---- step ----

    def step(self, lr):
        # What is pushed here is marked pushed at once, so that a step()
        # retried after an error pushes only the rest.
        push_start = time.perf_counter()
        # Lent, not copied: the client holds the gradients until it has
        # taken them in.
        while self._deferred:
            off, data = self._deferred[0]
            self.client.push_gradients(off, off + data.numel(), data,
                                       borrow=True)
            self._deferred.popleft()
        for layer in self._layers:
            for p, off in layer.params:
                if id(p) not in self._pushed:
                    self.client.push_gradients(
                        off, off + p.numel(),
                        np.zeros(p.numel(), dtype=np.float32))
                    self._pushed.add(id(p))
        pushing = time.perf_counter() - push_start
        result = self.client.step(lr)
        for layer in self._layers:
            self._free(layer)
            layer.unpushed = layer.expected
        self._pushed.clear()
        return _with_push_time(result, pushing)

    def full_state_dict(self):
        flat = np.zeros(self._layout.total_elements, dtype=np.float32)
        self.client.gather_all(flat)
        flat_t = torch.from_numpy(flat)
        out = {}
        for name, p, off in self._named:
            out[name] = flat_t[off:off + p.numel()].clone().view(p.shape)
        return out


# The status codes after which a new connection may get on: a daemon gone
# or replaced, a call or a step out of time, a step the daemons could not
# take (as the C++ trainer's reconnects).
_RECONNECTABLE = frozenset(["UNAVAILABLE", "DEADLINE_EXCEEDED",
                            "FAILED_PRECONDITION", "ABORTED", "CANCELLED"])


def reconnectable(error):
    """Whether `error` (a zeroshard.Error) may be got past by
    `ShardedModel.reconnect()` / `ShardedOptimizer.reconnect()`."""
    return isinstance(error, Error) and getattr(error, "code", None) in _RECONNECTABLE


def _refuse_trainer_reconnect(config):
    """The trainer collective's ranks are connected to each other: one rank
    cannot join again alone (restart every rank instead)."""
    if config.get("reduction", "daemon") == "trainer":
        raise ValueError(
            "reconnect: not supported with reduction='trainer' (the ranks' "
            "Gloo connections fail with the job); restart every rank, from "
            "a checkpoint")


def _rejoin(config, layout):
    """A new Client of `config` joined to the job with `layout`, for a rank
    whose old client was dropped without leaving the job (leaving would end
    it when this is the last rank). Nothing is uploaded: the daemons keep
    the job's state (a resume is not repeated)."""
    client = Client(**dict(config, resume=None))
    client.register_model(layout, None)
    return client


def _with_push_time(result, seconds):
    """`result` (Client.step's dict) with the `seconds` step() spent pushing
    gradients before Client.step added to its push_wait_ms: the whole time
    step() waited for the step's gradients to reach the daemons."""
    result["push_wait_ms"] += 1000 * seconds
    return result


# The dtype of stage 3's gathered parameters for each job precision.
_STAGE3_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _resize_storage(tensor, numel):
    """Resizes the storage under `tensor` (and every view of it) to `numel`
    elements: 0 frees the memory, the views keep their shapes."""
    if hasattr(tensor, "untyped_storage"):
        tensor.untyped_storage().resize_(numel * tensor.element_size())
    else:
        tensor.storage().resize_(numel)


def _tensors(obj):
    """The tensors in a module's output (a tensor, or nested tuples, lists
    and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _layer_groups(module, named, layer_names):
    """[(layer module, [(name, parameter)])] in registration order: the
    layer of `module`'s own parameters first, then the named layers in
    `module.named_modules()` order; layers without parameters left out."""
    if layer_names is None:
        layer_names = [name for name, child in module.named_children()
                       if any(True for _ in child.parameters())]
    else:
        layer_names = list(layer_names)
        if len(set(layer_names)) != len(layer_names):
            raise ValueError(f"layers: names repeat: {layer_names}")
        for name in layer_names:
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"layers: expected names of submodules, got {name!r}")
            try:
                module.get_submodule(name)
            except AttributeError:
                raise ValueError(f"layers: no submodule named {name!r}") from None
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    for name in layer_names:
        if name not in order:
            raise ValueError(f"layers: {name!r} is an alias of a submodule "
                             "registered under another name")
    layer_names.sort(key=order.__getitem__)
    wanted = set(layer_names)

    def owner(param_name):
        parts = param_name.split(".")[:-1]
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if prefix in wanted:
                return prefix
        return ""

    members = {name: [] for name in [""] + layer_names}
    owners = {}
    for name, p in named:
        members[owner(name)].append((name, p))
        owners[id(p)] = owner(name)
    # A layer may only use its own parameters and those of layers inside it.
    for name in layer_names:
        for p in module.get_submodule(name).parameters():
            o = owners[id(p)]
            if o != name and not o.startswith(name + "."):
                raise ValueError(
                    f"layers: a parameter of layer {o or 'the outer module'!r} "
                    f"is also used by layer {name!r}; shared parameters must "
                    "belong to one layer")
    groups = []
    for name in [""] + layer_names:
        if members[name]:
            layer_module = module if name == "" else module.get_submodule(name)
            groups.append((layer_module, members[name]))
    return groups

