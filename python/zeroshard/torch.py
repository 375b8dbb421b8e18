"""PyTorch on zeroshardd daemons: ZeRO stages 1-3 with torch.optim.AdamW's
semantics.

`shard_model(module, config, stage=...)` wraps a module whose fp32 master
weights, gradients and AdamW states live on the job's daemons (stage 3:
the parameters too, gathered layer by layer, like FSDP's fully_shard);
`model.optimizer` is its torch.optim.Optimizer (parameter groups, LR
schedulers, state dicts). `ShardedOptimizer(params, config, stage=1|2)` is
the same for a list of parameters, in place of torch.optim.AdamW in a
data-parallel job. `GradScaler(model)` is torch.cuda.amp.GradScaler's
interface over the daemons' dynamic loss scale (fp16 jobs).

What it computes is torch.optim.AdamW's result: per parameter group
lr, betas, eps and weight_decay; a parameter whose grad is None in a step
(unused in that forward) is skipped as torch skips it (no weight decay, no
moment update, its own step count unchanged); parameters with
requires_grad=False (or in no group) are never changed and hold no
optimizer state; tied parameters are one tensor under every name.
"""

import collections
import contextlib
import inspect
import os
import re

import torch

from zeroshard._zeroshard import DEFAULTS as _DEFAULTS, Error
from zeroshard import _engine, _layout
from zeroshard._engine import Engine, config_error
from zeroshard._flat import FlatSharding, assign_layers
from zeroshard import _offload
from zeroshard._stage3 import LayerSharding, is_dense

# The optimizer's defaults are the client's (C++ ClientConfig's, through
# the binding), which are torch.optim.AdamW's.
_LR = _DEFAULTS["lr"]
_BETAS = _DEFAULTS["betas"]
_EPS = _DEFAULTS["eps"]
_WEIGHT_DECAY = _DEFAULTS["weight_decay"]
_MAX_GRAD_NORM = _DEFAULTS["max_grad_norm"]

# torch.optim.Optimizer.zero_grad's default (False in torch 1.x, True in 2.x).
_SET_TO_NONE = inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
    "set_to_none"].default


__all__ = ["init_from_env", "shard_model", "ShardedModel", "ShardedOptimizer",
           "GradScaler", "reconnectable", "offload_activations"]


def offload_activations(target, min_bytes=_offload.DEFAULT_MIN_BYTES,
                        prefetch=_offload.DEFAULT_PREFETCH):
    """A context manager: the tensors autograd saves for backward inside it
    (torch.autograd.graph.saved_tensors_hooks) go to the activation arena of
    this rank's daemon (zeroshardd --activation_arena_bytes, and its spill
    files), and come back when backward unpacks them; the gradients are
    bit-identical to keeping them:

        with offload_activations(model):
            loss = loss_fn(model(x), y)
        loss.backward()

    `target`: a ShardedModel or ShardedOptimizer (their client's store on the
    rank's partition's daemon, opened once and closed by close()), a
    zeroshard.ActivationStore (client.open_activation_store(...)), or a
    zeroshard.Client (a store for this block alone). Offloaded: saved
    tensors of at least `min_bytes` bytes whose elements are dense
    (contiguous or permuted; CUDA ones through a CPU copy), except
    parameters and views of them, which the graph holds anyway. Smaller
    ones stay. Offloads run behind the forward (each tensor is held until
    the daemon has it); backward fetches each one as it is unpacked, with
    the next `prefetch` ones (in the reverse order of the saves), and the
    daemon frees each once fetched (a second backward with retain_graph
    reuses the fetched tensor). An offload the daemon refuses (arena and
    spill space full) keeps its tensor in the trainer, with a
    RuntimeWarning. Every block is a step of its own in the store's keys
    (step, micro_batch 0, layer = the save's index). Slices of a graph freed
    without backward are freed when the next block opens on the store.
    Yields an object with `offloaded_bytes` and `offloaded_tensors`; the
    store's stats() count the bytes moved."""
    return _offload.offload_activations(target, min_bytes=min_bytes, prefetch=prefetch)


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
      transport   ZS_TRANSPORT, when set: zsrun sets it to the bulk
                  transport its daemons serve ("ucx" or "grpc" when every
                  one serves it, else "stream"); unset, the client's
                  default, "stream"
      ucx_tls     ZS_UCX_TLS, when the transport is "ucx" (zsrun: the
                  daemons' UCX_TLS)

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
                raise config_error(
                    f"{name}: must be a whole number, got {value[:64]!r}")
            return int(value)
        raise config_error(f"{' or '.join(names)}: not set (run under "
                           "zsrun or torchrun, or pass it to init_from_env)")

    config = {}
    if "rank" not in overrides:
        config["rank"] = number(["RANK", "ZS_RANK"])
    if "world_size" not in overrides:
        config["world_size"] = number(["WORLD_SIZE", "ZS_WORLD_SIZE"])
    if "daemons" not in overrides:
        daemons = [d for d in env.get("ZS_DAEMONS", "").split(",") if d]
        if not daemons:
            raise config_error(
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
            raise config_error(
                "ZS_JOB_ID: not set (and no usable TORCHELASTIC_RUN_ID)")
        config["job_id"] = job_id
    transport = env.get("ZS_TRANSPORT")
    if "transport" not in overrides and transport:
        config["transport"] = transport
    config.update(overrides)
    if config.get("transport") == "ucx" and "ucx_tls" not in config and "ZS_UCX_TLS" in env:
        config["ucx_tls"] = env["ZS_UCX_TLS"]
    return config


def _adamw_defaults(lr, betas, eps, weight_decay):
    """torch.optim.AdamW's default group options with these values, so that
    param_groups and state dicts carry AdamW's keys."""
    defaults = {name: p.default
                for name, p in inspect.signature(torch.optim.AdamW).parameters.items()
                if name != "params" and p.default is not inspect.Parameter.empty}
    defaults.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    return defaults


def _split_names(params):
    """(groups for torch.optim.Optimizer, {id(param): name}) from what
    torch.optim optimizers take: tensors, dicts of parameter groups, and
    also (name, tensor) pairs (model.named_parameters()), in either."""
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    names = {}

    def strip(items):
        out = []
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                names.setdefault(id(item[1]), item[0])
                out.append(item[1])
            else:
                out.append(item)
        return out

    if isinstance(params[0], dict):
        groups = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            g["params"] = strip([ps] if isinstance(ps, torch.Tensor) else list(ps))
            groups.append(g)
        return groups, names
    return strip(params), names


def _tensor_bytes(t):
    return t.numel() * t.element_size()


def _memory_report(engine, params, flat=None, sharded=None):
    """What a trainer holds, by category, in bytes (see
    ShardedModel.memory_report)."""
    unique = list({id(p): p for p in params}.values())
    psi = sum(p.numel() for p in unique)
    grads = sum(_tensor_bytes(p.grad) for p in unique if p.grad is not None
                and (flat is None or not flat.holds_grad(p.grad)))
    client = engine.client.memory_report()
    report = {"stage": engine.stage, "psi": psi}
    if sharded is None:
        report["parameters"] = sum(_tensor_bytes(p) for p in unique)
        # The push memory holding the large gradients counts whole, also
        # while some of its views are not p.grad.
        report["gradients"] = grads + flat.grad_memory_bytes
        report["grad_push_memory"] = flat.grad_memory_bytes
        report["staging"] = flat.staging_bytes + client["buffer"]
        report["gathered_layers"] = 0
    else:
        report["parameters"] = 0
        report["gradients"] = grads + sharded.gradient_bytes
        report["staging"] = client["buffer"]
        report["gathered_layers"] = sharded.held_bytes + client["param"] + client["param_half"]
        report["grad_push_memory"] = 0
    report["client_staging"] = client["buffer"]
    report["total"] = (report["parameters"] + report["gradients"] + report["staging"]
                       + report["gathered_layers"])
    report["ddp_bytes"] = 16 * psi
    return report


class _DaemonOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step() runs on the daemons. Its
    param_groups are the job's parameter groups: LR schedulers set their
    learning rates (read at every step); their betas, eps and weight_decay
    are fixed once sharded. state_dict() / load_state_dict() move the
    AdamW moments and step counts from / to the daemons, in
    torch.optim.AdamW's format."""

    def _bind(self, engine, step_fn):
        self._engine = engine
        self._step_fn = step_fn
        self.last_result = None

    def step(self, closure=None):
        """Runs the step on the daemons (every rank together). Returns the
        closure's loss, if any; the step's dict(step, grad_norm, clip_coef,
        skipped, loss_scale, push_wait_ms, and at stage 3 pushes and
        gathers) is in `last_result`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_result = self._step_fn()
        return loss

    def state_dict(self):
        return self._engine.optimizer_state_dict()

    def load_state_dict(self, state_dict):
        """Every rank calls it with the same state dict (each writes the same
        values; nothing needs a barrier), between steps."""
        self._engine.load_optimizer_state_dict(state_dict)

    @property
    def client(self):
        """The underlying zeroshard.Client (reports, committed step)."""
        return self._engine.client

    @property
    def activation_store(self):
        """The client's zeroshard.ActivationStore on this rank's partition's
        daemon, which offload_activations(self) uses (opened when first
        asked for; closed by close()): its stats() count the bytes moved."""
        return self._engine.activation_store()


class ShardedOptimizer(_DaemonOptimizer):
    """AdamW over the daemons (ZeRO stage 1 or 2), in place of
    torch.optim.AdamW in a data-parallel job of `world_size` processes.

    `params` as torch.optim takes them: tensors, or dicts of parameter
    groups with their own `lr`, `betas`, `eps`, `weight_decay`; tensors may
    also come with names (`model.named_parameters()`), which then label
    them on the daemons and in checkpoints (so `zsctl export` writes a dict
    `model.load_state_dict` takes). Every rank builds one with the same
    parameters (same order and shapes) and the same `client_config`: a dict
    with `daemons`, `job_id`, `rank` and `world_size`, and optionally any
    other `zeroshard.Client` keyword (`precision`, `bucket_bytes`,
    `rpc_timeout`, `step_timeout`, `token`, TLS files, `replicas`).
    Construction blocks until every rank has joined; rank 0's current
    parameter values become everyone's starting point.

    `resume` (None, a checkpoint name or "latest") starts the job from a
    checkpoint instead of rank 0's current values; see ShardedModel.

    Each `step()` pushes this rank's gradients (the daemons average them
    over the ranks: several backward passes before a step sum in p.grad as
    with torch), runs AdamW on the daemons and writes the new parameters
    into the tensors. A parameter whose grad is None on every rank is not
    touched. The trainer holds the parameters, their gradients and a
    staging buffer of constant size, no flat copy of them
    (`memory_report()`). Failures raise `zeroshard.Error`.
    """

    def __init__(self, params, client_config, stage=1, lr=_LR,
                 betas=_BETAS, eps=_EPS, weight_decay=_WEIGHT_DECAY,
                 max_grad_norm=_MAX_GRAD_NORM, resume=None):
        if stage not in (1, 2):
            raise ValueError(f"stage: must be 1 or 2, got {stage}")
        groups, names = _split_names(params)
        super().__init__(groups, _adamw_defaults(lr, betas, eps, weight_decay))
        entries, seen = [], set()
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = names.get(id(p), f"p{len(seen) - 1}")
                _layout.check_param_dtype(name, p)
                if p.numel() > 0:
                    entries.append(_layout.Entry(name, "param", p.shape, group=gi,
                                                 frozen=not p.requires_grad, param=p))
        assign_layers(entries)
        engine = Engine(entries, self.param_groups, client_config, stage, max_grad_norm,
                        resume=resume)
        engine.register()
        self._flat = FlatSharding(engine)
        self._flat.load_params()
        self._bind(engine, self._flat.step)

    def reconnect(self):
        """Drops this rank's connection and joins the job again with a new
        one, after a `zeroshard.Error` that a new connection may get past
        (`reconnectable(error)`). The parameters are loaded again from the
        daemons; returns the committed step: train on from the step after
        it. Every rank of the job reconnects too."""
        _refuse_trainer_reconnect(self._engine.config)
        self._engine.rejoin()
        self._flat.load_params()
        return self._engine.client.committed_step

    def memory_report(self):
        """What this trainer holds, in bytes, by category: see
        ShardedModel.memory_report (stages 1-2)."""
        return _memory_report(self._engine, [e.param for e in self._engine.entries
                                             if e.kind == "param"], flat=self._flat)

    @property
    def resumed_from(self):
        """On rank 0: dict(name, step, bytes_read, seconds) of the
        checkpoint the job resumed from, or None."""
        return self._engine.client.resumed_from

    def save_checkpoint(self, name):
        """Saves the daemons' committed state (see ShardedModel)."""
        return self._engine.save_checkpoint(name)

    def await_checkpoint(self):
        return self._engine.await_checkpoint()

    def list_checkpoints(self):
        return self._engine.client.list_checkpoints()

    def close(self):
        """Waits for a save not yet awaited, then leaves the job."""
        self._flat.close()
        self._engine.close()


def shard_model(module, client_config, stage=3, layers=None, lr=_LR,
                betas=_BETAS, eps=_EPS, weight_decay=_WEIGHT_DECAY,
                max_grad_norm=_MAX_GRAD_NORM, overlap_comm=True, param_groups=None,
                gradient_accumulation_steps=1, resume=None, reshard_after_forward=True,
                push_bucket_bytes=None):
    """Shards `module`'s training state on the daemons; returns a
    ShardedModel (see there)."""
    return ShardedModel(module, client_config, stage=stage, layers=layers, lr=lr,
                        betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, overlap_comm=overlap_comm,
                        param_groups=param_groups,
                        gradient_accumulation_steps=gradient_accumulation_steps,
                        resume=resume, reshard_after_forward=reshard_after_forward,
                        push_bucket_bytes=push_bucket_bytes)


class ShardedModel(torch.nn.Module):
    """`module` trained with AdamW on the daemons (ZeRO stage 1, 2 or 3).

    Every rank builds one from the same model with the same `client_config`
    (as for ShardedOptimizer); construction blocks until every rank has
    joined, and rank 0's parameter and buffer values become everyone's
    start (or, with `resume`, a checkpoint's). Then train as with torch:

        model = shard_model(net, config, stage=3, max_grad_norm=1.0,
                            param_groups=[{"params": decay, "weight_decay": 0.1},
                                          {"params": no_decay, "weight_decay": 0.0}])
        sched = torch.optim.lr_scheduler.LambdaLR(model.optimizer, f)
        loss_fn(model(x), y).backward()
        model.optimizer.step()          # AdamW (with clipping) on the daemons
        model.optimizer.zero_grad()
        sched.step()

    Parameter groups (`param_groups`: as torch.optim's first argument, dicts
    with "params" and any of lr, betas, eps, weight_decay; default: one
    group of every parameter with the keyword values). A parameter in no
    group, or with requires_grad=False, is frozen: stored on the daemons,
    never changed, no optimizer state. `max_grad_norm` clips the global
    gradient norm as torch.nn.utils.clip_grad_norm_ does (the daemons
    compute the norm of the reduced gradient; clipping p.grad on a rank
    would clip its local part only).

    Gradient accumulation: stages 1-2 sum the backward passes before a step
    in p.grad, as torch does. Stage 3 pushes each backward as one
    micro-batch of the step (`gradient_accumulation_steps` of them at most;
    the daemons sum them), or, inside `with model.no_sync():`, keeps the
    gradients in p.grad on the trainer until the next backward outside it
    (as DDP's and FSDP's no_sync()). Scale the loss by 1 /
    gradient_accumulation_steps as with torch; the daemons average over the
    ranks.

    Stage 3 cuts the parameters into layers: each module named in `layers`
    (names as in `module.named_modules()`), by default each direct child of
    `module` that has parameters; a parameter belongs to the innermost
    layer containing its first name, and `module`'s parameters outside
    every layer form a layer of their own, held for the whole forward of
    `module`. Layers are gathered around their forward and backward and
    freed after (a trainer holds about two layers); a module whose
    parameters include another layer's (tied weights: `lm_head.weight =
    wte.weight`) gathers that layer too. A parameter must be used inside
    the forward of a module containing it. Buffers stay on the trainer; the
    daemons keep a copy for checkpoints (rank 0's, written at each save).

    `reshard_after_forward` (stage 3): True (the default) frees each layer
    after its forward and gathers it again for its backward; False keeps
    every layer gathered from its forward until its gradients are in (one
    gather per layer and step instead of two, for up to the whole model's
    parameters held at the end of the forward), as FSDP's option; or a
    callable taking a layer's name (as in `layers`; "" for `module`'s own
    parameters) and returning that layer's choice. A forward without
    autograd (torch.no_grad()) frees its layers either way.

    Stage 3 pushes completed layers whose gradients adjoin in the flat
    layout together, in buckets of about `push_bucket_bytes` bytes of
    gradient (default None: the job's `bucket_bytes`, C_B; 0 pushes each
    layer as it completes), each as soon as it is full, when the next
    completed layer does not adjoin it, and at the end of the backward; a
    layer of at least that size is pushed alone. The daemons sum the same
    values however they are grouped: the results are bit-identical.
    Settable between steps (`model.push_bucket_bytes`). Each step's result
    dict has `pushes` (this rank's client.push_gradients calls) and
    `gathers` (layer gathers since the previous step).

    Precision (stage 3): the job's, `client_config["precision"]`: "fp32"
    (the default), "bf16" or "fp16", where the module computes in bfloat16
    or float16 (its floating-point parameters and buffers are cast, as
    module.to(dtype) would) and the daemons keep fp32 masters and step in
    fp32. "fp16" needs `loss_scale` in the config (a dict of
    torch.cuda.amp.GradScaler's arguments for dynamic scaling, or a
    number) and the loss multiplied by it: see GradScaler. Stages 1-2 keep
    the module's parameters (float32, bfloat16 or float16) and push their
    gradients in fp32 (converted to the job's precision on the wire).

    State: `state_dict()` is the module's (every key, tied ones included,
    the parameters' fp32 masters and the buffers), `load_state_dict()`
    loads one; `sharded_state_dict()` is this rank's part of it;
    `model.optimizer.state_dict()` is torch.optim.AdamW's. Every rank calls
    the loaders with the same dict. `save_checkpoint(name)` saves the
    daemons' state (masters, moments, step counts, buffers) under their
    --checkpoint_dir at every stage; `resume="latest"` (or a name) starts
    from one.

    `overlap_comm` (stage 3; settable between steps): True (the default)
    pushes each layer's gradients as soon as the backward has them; False
    keeps them until `step()` (the baseline the overlap is measured
    against). Failures raise `zeroshard.Error`.
    """

    def __init__(self, module, client_config, stage=3, layers=None, lr=_LR,
                 betas=_BETAS, eps=_EPS, weight_decay=_WEIGHT_DECAY,
                 max_grad_norm=_MAX_GRAD_NORM, overlap_comm=True, param_groups=None,
                 gradient_accumulation_steps=1, resume=None, reshard_after_forward=True,
                 push_bucket_bytes=None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage: must be 1, 2 or 3, got {stage}")
        if stage in (1, 2) and layers is not None:
            raise ValueError("layers: only stage 3 gathers by layer")
        if stage in (1, 2) and reshard_after_forward is not True:
            raise ValueError("reshard_after_forward: only stage 3 gathers (and frees) "
                             "parameters; stages 1-2 keep them on the trainer")
        if stage in (1, 2) and push_bucket_bytes is not None:
            raise ValueError("push_bucket_bytes: stages 1-2 push every gradient in step(), "
                             "in buckets of the job's bucket_bytes")
        if not (isinstance(reshard_after_forward, bool) or callable(reshard_after_forward)):
            raise TypeError("reshard_after_forward: expected a bool or a callable taking a "
                            f"layer's name, got {type(reshard_after_forward).__name__}")
        if push_bucket_bytes is None:
            push_bucket_bytes = client_config.get("bucket_bytes", _DEFAULTS["bucket_bytes"])
        push_bucket_bytes = _check_push_bucket_bytes(push_bucket_bytes)
        if stage in (1, 2) and not overlap_comm:
            raise ValueError("overlap_comm: stages 1-2 always push in step(); only stage 3 "
                             "pushes during the backward")
        if not isinstance(gradient_accumulation_steps, int) or not (
                1 <= gradient_accumulation_steps <= 4096):
            raise ValueError("gradient_accumulation_steps: must be an int in 1..4096, got "
                             f"{gradient_accumulation_steps!r}")
        self.module = module
        self.stage = stage
        named = list(module.named_parameters())
        if not named:
            raise ValueError("module: has no parameters")
        aliases = _layout.parameter_aliases(module)
        groups = param_groups if param_groups is not None else [
            {"params": [p for _, p in named]}]
        self.optimizer = _ModelOptimizer(groups, _adamw_defaults(lr, betas, eps, weight_decay))
        group_of = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                group_of.setdefault(id(p), gi)
        module_ids = {id(p) for _, p in named}
        for gi, g in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(g["params"]):
                if id(p) not in module_ids:
                    raise ValueError(f"param_groups[{gi}]['params'][{j}]: not a parameter of "
                                     "the module")
        precision = client_config.get("precision", _DEFAULTS["precision"])
        micro_batches = gradient_accumulation_steps if stage == 3 else 1

        def param_entry(name, p):
            _layout.check_param_dtype(name, p)
            if stage == 3 and not is_dense(p):
                raise ValueError(f"parameter {name}: its elements overlap or leave gaps "
                                 f"(strides {p.stride()}); make it contiguous")
            e = _layout.Entry(name, "param", p.shape, group=group_of.get(id(p), 0),
                              frozen=id(p) not in group_of or not p.requires_grad, param=p)
            e.aliases = [a for a in aliases.get(id(p), [name]) if a != name]
            return e

        if stage == 3:
            if precision not in _STAGE3_DTYPES:
                raise ValueError(
                    "stage 3: precision must be 'fp32', 'bf16' or 'fp16', got "
                    f"{precision!r}")
            if precision == "fp16" and client_config.get("loss_scale") is None:
                raise ValueError(
                    "stage 3: precision 'fp16' needs loss scaling: give the config a "
                    "loss_scale (a dict of torch.cuda.amp.GradScaler's arguments, e.g. "
                    "{'init_scale': 65536.0}, for dynamic scaling; or a number) and "
                    "multiply the loss by GradScaler(model).scale(loss)")
            dtype = _STAGE3_DTYPES[precision]
            layer_modules, units = _layer_units(module, named, layers)
            units = [(sub, own, deps, _keeps_after_forward(reshard_after_forward, name))
                     for sub, own, deps, name in units]
            entries = []
            for layer_id, (_, members) in enumerate(layer_modules):
                for name, p in members:
                    if p.numel() == 0:
                        continue
                    e = param_entry(name, p)
                    e.layer = layer_id
                    entries.append(e)
            buffer_layer = len(layer_modules)
        else:
            entries = [param_entry(n, p) for n, p in named if p.numel() > 0]
            buffer_layer = 1
        for name, sub, key, buf in _layout.named_persistent_buffers(module):
            _layout.check_buffer_dtype(name, buf)
            if buf.numel() == 0:
                continue
            e = _layout.Entry(name, "buffer", buf.shape, frozen=True, module=sub, key=key)
            e.layer = buffer_layer
            entries.append(e)
        if stage in (1, 2):
            assign_layers(entries)

        engine = Engine(entries, self.optimizer.param_groups, client_config, stage,
                        max_grad_norm, resume=resume, micro_batches=micro_batches)
        engine.register()
        self._engine = engine
        if stage in (1, 2):
            self._sharded = None
            self._flat = FlatSharding(engine)
            self._flat.load_params()
            step_fn = self._flat.step
        else:
            self._flat = None
            if dtype != torch.float32:
                # The module computes in the job's precision, as after
                # module.to(dtype); the daemons kept rank 0's fp32 values.
                for _, p in named:
                    if p.is_floating_point():
                        p.data = p.data.to(dtype)
                for name, sub, key, buf in _layout.named_persistent_buffers(module):
                    if buf.is_floating_point():
                        setattr(sub, key, buf.to(dtype))
            self._sharded = LayerSharding(engine, units, dtype, micro_batches,
                                          overlap_comm=bool(overlap_comm),
                                          bucket_bytes=push_bucket_bytes)
            step_fn = self._sharded.step
        engine.load_buffers()
        self.optimizer._bind(engine, step_fn)
        self.optimizer._model = self

    # ---- training ----

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self, lr=None):
        """`optimizer.step()`, with `lr` (when given) set on every group
        first; returns the step's result dict."""
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        self.optimizer.step()
        return self.optimizer.last_result

    def zero_grad(self, set_to_none=_SET_TO_NONE):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients in p.grad on the
        trainer (summed by autograd) instead of pushing them; the next
        backward outside (or step()) pushes the sum. Stages 1-2 always sum
        on the trainer: there it changes nothing."""
        if self._sharded is None:
            yield
            return
        with self._sharded.no_sync():
            yield

    @property
    def overlap_comm(self):
        """Stage 3: whether gradients are pushed during the backward (True)
        or all in step() (False). Stages 1-2: False."""
        return self._sharded is not None and self._sharded.overlap_comm

    @overlap_comm.setter
    def overlap_comm(self, value):
        if self._sharded is None:
            raise ValueError("overlap_comm: stages 1-2 always push in step()")
        self._sharded.overlap_comm = bool(value)

    @property
    def push_bucket_bytes(self):
        """Stage 3: the bytes of gradient up to which completed layers are
        pushed together (0: each layer alone); None at stages 1-2. Set it
        between steps."""
        return None if self._sharded is None else self._sharded.bucket_bytes

    @push_bucket_bytes.setter
    def push_bucket_bytes(self, value):
        if self._sharded is None:
            raise ValueError("push_bucket_bytes: stages 1-2 push every gradient in step(), in "
                             "buckets of the job's bucket_bytes")
        self._sharded.bucket_bytes = _check_push_bucket_bytes(value)

    @property
    def client(self):
        """The underlying zeroshard.Client (reports, committed step)."""
        return self._engine.client

    @property
    def activation_store(self):
        """The client's zeroshard.ActivationStore on this rank's partition's
        daemon, which offload_activations(self) uses (opened when first
        asked for; closed by close()): its stats() count the bytes moved."""
        return self._engine.activation_store()

    @property
    def last_result(self):
        return self.optimizer.last_result

    def reconnect(self):
        """Joins the job again with a new connection after a
        `zeroshard.Error` for which `reconnectable(error)` holds; returns
        the committed step, after which training goes on. Typical loop,
        with `replicas=2` in the config so that a daemon's death loses
        nothing:

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
        _refuse_trainer_reconnect(self._engine.config)
        if self._sharded is None:
            self._engine.rejoin()
            self._flat.load_params()
            return self._engine.client.committed_step
        return self._sharded.reconnect()

    def memory_report(self):
        """What this trainer holds now for the model's states, in bytes:

          stage, psi       the stage; Ψ, the parameters' element count
          parameters       the parameters' storage (stages 1-2: the model's
                           own tensors; stage 3: 0, see gathered_layers)
          gradients        p.grad tensors, and at stage 3 the layers'
                           gradient buffers not yet pushed
          grad_push_memory stages 1-2 on a bulk transport: the push memory
                           the large gradients live in (part of
                           gradients, counted whole)
          staging          constant-size buffers: the client's staging pool
                           (client_staging: staging_buffers buckets of C_B)
                           and at stages 1-2 the trainer's packing and
                           gather buffer (a bucket, or the largest layer
                           gathered through it, never more than about
                           max(C_B, 1 MiB) for float32 parameters that fill
                           their layers)
          gathered_layers  stage 3: the layers gathered now (their views'
                           storage) and the client's prefetch buffers
          total            parameters + gradients + staging + gathered_layers
          ddp_bytes        16Ψ, what a DDP rank with AdamW holds in fp32
                           (parameters, gradients, two moments)

        The Adam moments and the fp32 masters are on the daemons. Buffers
        and activations are not counted."""
        params = [p for _, p in self.module.named_parameters()]
        return _memory_report(self._engine, params, flat=self._flat, sharded=self._sharded)

    @property
    def peak_param_bytes(self):
        """Stage 3: the most bytes of parameter storage this trainer has
        held at once (gathered layers, alignment gaps included); stages
        1-2: the whole model's parameters."""
        if self._sharded is None:
            return sum(p.numel() * p.element_size() for p in self.module.parameters())
        return self._sharded.peak_param_bytes

    # ---- state dicts ----

    def _entries_by_key(self):
        """{state-dict key: entry} for every registered tensor."""
        out = {}
        for e in self._engine.entries:
            for n in e.names:
                out[n] = e
        return out

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The module's state dict, as `module.state_dict()` lists it (every
        key of a tied parameter, persistent buffers): each parameter's fp32
        master as of the last committed step (gathered from the daemons;
        tied keys share one tensor), each buffer as this rank holds it.
        Blocks for the read (the whole model's fp32 values)."""
        if destination is None:
            destination = collections.OrderedDict()
        masters, _ = self._engine.read("master")
        by_key = self._entries_by_key()
        values = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            e = by_key.get(key)
            if e is None:  # zero-element
                value = torch.empty(t.shape, dtype=t.dtype)
            elif e.kind == "buffer":
                value = e.tensor.detach().clone()
            else:
                if e.index not in values:
                    values[e.index] = masters[e.offset:e.offset + e.numel].clone().view(e.shape)
                value = values[e.index]
            destination[prefix + key] = value
        return destination

    def full_state_dict(self):
        """{name: tensor}: a copy of every parameter's fp32 master as of the
        last committed step, in named_parameters() order (no buffers, first
        names only)."""
        masters, _ = self._engine.read("master")
        by_key = self._entries_by_key()
        out = {}
        for name, p in self.module.named_parameters():
            e = by_key.get(name)
            out[name] = (torch.empty(p.shape) if e is None else
                         masters[e.offset:e.offset + e.numel].clone().view(e.shape))
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Loads a state dict of the module (from `state_dict()`, a torch
        checkpoint or `zsctl export`): parameters into the daemons' fp32
        masters (the moments stay), buffers into the module (and the
        daemons' copy). Every rank calls it with the same dict, between
        steps. Errors as torch's: RuntimeError listing missing and
        unexpected keys (strict) and size mismatches, with nothing
        changed."""
        expected = self.module.state_dict(keep_vars=True)
        by_key = self._entries_by_key()
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        errors = []
        if strict:
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " +
                              ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                errors.append("Missing key(s) in state_dict: " +
                              ", ".join(f'"{k}"' for k in missing) + ". ")
        for key, t in expected.items():
            if key in state_dict and tuple(state_dict[key].shape) != tuple(t.shape):
                errors.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(state_dict[key].shape)} from checkpoint, the shape in current "
                    f"model is {tuple(t.shape)}.")
        if errors:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                type(self.module).__name__, "\n\t".join(errors)))
        masters, _ = self._engine.read("master")
        with torch.no_grad():
            for key in expected:
                e = by_key.get(key)
                if e is None or key not in state_dict:
                    continue
                value = state_dict[key].detach()
                flat = masters[e.offset:e.offset + e.numel]
                if e.kind == "buffer":
                    e.tensor.copy_(value)
                    flat.copy_(_layout.buffer_values_as_float(key, value).reshape(-1))
                else:
                    flat.copy_(value.reshape(-1))
        self._engine.write("master", masters)
        if self._flat is not None:
            self._flat.load_params()
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self):
        """This rank's part of the state dict, the torch.distributed.
        checkpoint split: {"parameters": {key: {"shape", "offset", "data"}},
        "buffers": {...}} where each parameter's part is the stretch of its
        flattened elements that lies in this rank's partition of the flat
        space (`data`, fp32, starting at element `offset`; a parameter
        outside it is left out), and "buffers" (rank 0 only) the module's
        buffers. The parts of every rank together hold every element once."""
        begin, end = self._engine.client.partition_range(self._engine.rank)
        end = min(end, self._engine.total)
        masters, _ = self._engine.read("master", begin, end) if end > begin else (None, None)
        parts, buffers = {}, {}
        for e in self._engine.entries:
            if e.kind == "buffer":
                if self._engine.rank == 0:
                    buffers[e.name] = e.tensor.detach().clone()
                continue
            lo, hi = max(e.offset, begin), min(e.offset + e.numel, end)
            if lo >= hi:
                continue
            part = {"shape": tuple(e.shape), "offset": lo - e.offset,
                    "data": masters[lo - begin:hi - begin].clone()}
            for n in e.names:
                parts[n] = part
        return {"parameters": parts, "buffers": buffers}

    def load_sharded_state_dict(self, parts):
        """Loads the parts of every rank (a list of sharded_state_dict()
        results, e.g. each rank's saved file) into the daemons' masters and
        the module's buffers; the parts may come from another world size.
        Every rank calls it with every part (each rank writes the same
        values, so nothing waits for another). ValueError, with nothing
        changed, when some element of a parameter is in no part."""
        masters, _ = self._engine.read("master")
        covered = {}
        buffers = {}
        for part in parts:
            buffers.update(part.get("buffers", {}))
            for key, piece in part["parameters"].items():
                e = self._entries_by_key().get(key)
                if e is None or e.kind != "param":
                    raise ValueError(f"parameters[{key!r}]: not a parameter of the module")
                if tuple(piece["shape"]) != tuple(e.shape):
                    raise ValueError(f"parameters[{key!r}]: shape {tuple(piece['shape'])}, the "
                                     f"parameter's is {tuple(e.shape)}")
                data = piece["data"].reshape(-1)
                lo = int(piece["offset"])
                if lo < 0 or lo + data.numel() > e.numel:
                    raise ValueError(f"parameters[{key!r}]: elements [{lo}, "
                                     f"{lo + data.numel()}) outside its {e.numel}")
                masters[e.offset + lo:e.offset + lo + data.numel()].copy_(data)
                covered.setdefault(e.index, set()).add((lo, lo + data.numel()))
        for e in self._engine.entries:
            if e.kind != "param":
                continue
            pos = 0
            for lo, hi in sorted(covered.get(e.index, ())):
                if lo > pos:
                    break
                pos = max(pos, hi)
            if pos < e.numel:
                raise ValueError(f"parameter {e.name}: elements from {pos} on are in no part "
                                 "(pass every rank's part)")
        with torch.no_grad():
            for e in self._engine.entries:
                if e.kind == "buffer" and e.name in buffers:
                    e.tensor.copy_(buffers[e.name])
                    masters[e.offset:e.offset + e.numel].copy_(
                        _layout.buffer_values_as_float(e.name, buffers[e.name]).reshape(-1))
        self._engine.write("master", masters)
        if self._flat is not None:
            self._flat.load_params()

    # ---- checkpoints ----

    @property
    def resumed_from(self):
        """On rank 0: dict(name, step, bytes_read, seconds) of the
        checkpoint the job resumed from, or None. `client.committed_step`
        is the step training resumes after."""
        return self._engine.client.resumed_from

    def save_checkpoint(self, name):
        """Saves the daemons' committed state (fp32 masters, moments, step
        counts, loss scale) with this rank's buffers under `name`. Call it
        on one rank (rank 0) after a step; the daemons need
        --checkpoint_dir. Waits (up to 10 s) for the previous save to
        complete, then returns once every daemon holds its snapshot:
        dict(name, step, bytes, snapshot_seconds, previous_error: why the
        previous save did not complete, or ""); the files are written in
        the background (`await_checkpoint()` waits). Raises zeroshard.Error
        with code UNAVAILABLE, nothing saved, while the previous save is not
        complete or a daemon's checkpoint disk does not answer (a hung or
        slow disk): training may go on. The LR scheduler and the data
        position are the caller's to save."""
        return self._engine.save_checkpoint(name)

    def await_checkpoint(self):
        """Waits for the last save to be complete on disk: dict(name, step,
        bytes, write_seconds)."""
        return self._engine.await_checkpoint()

    def list_checkpoints(self):
        """The job's checkpoints complete on every daemon, by step."""
        return self._engine.client.list_checkpoints()

    def close(self):
        """Waits for a save not yet awaited, then leaves the job (the
        daemons free it once every rank has left)."""
        if self._flat is not None:
            self._flat.close()
        self._engine.close()


class _ModelOptimizer(_DaemonOptimizer):
    """ShardedModel.optimizer."""

    def zero_grad(self, set_to_none=_SET_TO_NONE):
        """torch's: with set_to_none each parameter's grad becomes None (a
        parameter the next backward does not reach is then skipped by the
        step), otherwise zeros (it is stepped with a zero gradient). Stage
        3 keeps that distinction for the gradients it pushed; call it after
        every step, as torch training loops do."""
        super().zero_grad(set_to_none=set_to_none)
        sharded = getattr(getattr(self, "_model", None), "_sharded", None)
        if sharded is not None:
            sharded.zero_grad(set_to_none)


class GradScaler:
    """torch.cuda.amp.GradScaler's interface over the daemons' loss scale,
    for jobs whose config has `loss_scale` (fp16 jobs need it):

        config = init_from_env(precision="fp16", loss_scale={"init_scale": 2.0**16})
        model = shard_model(net, config, stage=3)
        scaler = GradScaler(model)
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(model.optimizer)   # None when the step was skipped
        scaler.update()

    The daemons do what GradScaler does on the trainer: they divide the
    pushed gradients by the scale (after summing the ranks'), skip the step
    when they hold an inf or NaN (no parameter, moment or step count
    changes; `optimizer.last_result["skipped"]` is True, on every rank),
    multiply the scale by backoff_factor after a skipped step and by
    growth_factor after growth_interval steps in a row that were not.
    `get_scale()` is the scale the next backward must use, the same on
    every rank (the daemons' after the last step). The job's settings are
    fixed when it is registered (the config's `loss_scale`); the daemons'
    checkpoints hold the current scale. `state_dict()` / `load_state_dict()`
    have torch GradScaler's keys and report and check the daemons' state;
    they cannot set it.

    Clipping (`max_grad_norm`) is applied by the daemons to the unscaled
    gradient: there is no `unscale_()` (it raises)."""

    def __init__(self, target):
        """`target`: a ShardedModel, its `optimizer`, or a
        ShardedOptimizer."""
        if isinstance(target, ShardedModel):
            target = target.optimizer
        if not isinstance(target, _DaemonOptimizer):
            raise TypeError("GradScaler: expected a ShardedModel, its optimizer or a "
                            f"ShardedOptimizer, got {type(target).__name__}")
        self._optimizer = target

    def get_scale(self):
        """The current loss scale (a float)."""
        return float(self._optimizer.client.loss_scale)

    def is_enabled(self):
        return True

    def scale(self, outputs):
        """`outputs` (a tensor, or lists, tuples and dicts of them)
        multiplied by the current scale, in each tensor's dtype."""
        factor = self.get_scale()
        if isinstance(outputs, torch.Tensor):
            return outputs * factor
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        raise TypeError(f"scale: expected tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer):
        raise RuntimeError(
            "unscale_: the gradients are unscaled on the daemons, at the step; clip with "
            "shard_model's (or ShardedOptimizer's) max_grad_norm, which the daemons apply "
            "to the unscaled gradient")

    def step(self, optimizer=None, *args, **kwargs):
        """Runs `optimizer.step(*args, **kwargs)` (this scaler's optimizer;
        another raises ValueError). Returns what it returned, or None when
        the daemons skipped the step for an inf or NaN gradient."""
        if optimizer is None:
            optimizer = self._optimizer
        if optimizer is not self._optimizer:
            raise ValueError("step: this GradScaler scales the loss of another optimizer")
        result = optimizer.step(*args, **kwargs)
        return None if optimizer.last_result["skipped"] else result

    def update(self, new_scale=None):
        """Nothing to do: the daemons moved the scale at the step's commit.
        `new_scale` cannot be set (ValueError): the job's scale is the
        daemons'."""
        if new_scale is not None:
            raise ValueError("update: the loss scale is the daemons' (set loss_scale in the "
                             "config when the job is registered); new_scale cannot be set")

    def get_growth_factor(self):
        return float(self._optimizer.client.loss_scale_settings["growth_factor"])

    def get_backoff_factor(self):
        return float(self._optimizer.client.loss_scale_settings["backoff_factor"])

    def get_growth_interval(self):
        return int(self._optimizer.client.loss_scale_settings["growth_interval"])

    def _growth_tracker(self):
        tracker = self._optimizer._engine.growth_tracker
        if tracker is None:
            raise RuntimeError(
                "GradScaler: the scale and the growth tracker (steps without inf/NaN since "
                "the scale last changed) are the daemons', and this trainer has not seen "
                "every step since the job started (it resumed or rejoined), so it cannot "
                "tell the tracker (nor the scale before its first step); the daemons' "
                "checkpoints (save_checkpoint, resume=) hold both")
        return tracker

    def state_dict(self):
        """torch.cuda.amp.GradScaler.state_dict()'s keys, from the daemons'
        state: `scale` is the daemons' current scale; growth_factor,
        backoff_factor and growth_interval are the job's settings (a static
        scale has factors 1: it never moves); `_growth_tracker` is the
        daemons' count of steps without inf or NaN since the scale last
        changed, which the client cannot read: this trainer follows it from
        every step's result. RuntimeError when it has not seen every step
        since the job started (after a resume or a rejoin): the daemons'
        checkpoints hold the scale and the count."""
        tracker = self._growth_tracker()
        settings = self._optimizer.client.loss_scale_settings
        return {"scale": self.get_scale(),
                "growth_factor": float(settings["growth_factor"]),
                "backoff_factor": float(settings["backoff_factor"]),
                "growth_interval": int(settings["growth_interval"]),
                "_growth_tracker": tracker}

    def load_state_dict(self, state_dict):
        """Checks a GradScaler state dict against the daemons' state. The
        scale and the growth tracker live on the daemons, the settings are
        fixed when the job is registered, and no call sets any of them: a
        state dict that agrees with the daemons is accepted (nothing
        changes), any other raises ValueError naming the key and both
        values. To start a job from a saved scale, register it with
        `loss_scale={"init_scale": scale, ...}` or resume from the daemons'
        checkpoint (which holds the scale and the tracker). An empty dict
        (a disabled torch GradScaler's) raises too."""
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        settings = self._optimizer.client.loss_scale_settings
        fixed = {"growth_factor": float(settings["growth_factor"]),
                 "backoff_factor": float(settings["backoff_factor"]),
                 "growth_interval": int(settings["growth_interval"])}
        for key, have in fixed.items():
            if key in state_dict and float(state_dict[key]) != have:
                raise ValueError(f"load_state_dict: {key} is {state_dict[key]!r} in the state "
                                 f"dict, {have!r} for this job (fixed when the job was "
                                 "registered: config loss_scale)")
        # Raises when this trainer cannot tell the daemons' scale and count.
        mine = self.state_dict()
        for key in ("scale", "_growth_tracker"):
            if key in state_dict and float(state_dict[key]) != mine[key]:
                raise ValueError(
                    f"load_state_dict: {key} is {state_dict[key]!r} in the state dict, "
                    f"{mine[key]!r} on the daemons, where it moves only by the job's steps "
                    "(start a job from a saved scale with loss_scale={'init_scale': ...} in "
                    "its config, or resume from a daemons' checkpoint, which holds both)")


# The status codes after which a new connection may get on: a daemon gone
# or replaced, a call or a step out of time, a step the daemons could not
# take (as the C++ trainer's reconnects).
_RECONNECTABLE = frozenset(["UNAVAILABLE", "DEADLINE_EXCEEDED",
                            "FAILED_PRECONDITION", "ABORTED", "CANCELLED"])


def reconnectable(error):
    """Whether `error` (a zeroshard.Error) may be got past by
    `ShardedModel.reconnect()` / `ShardedOptimizer.reconnect()`: a daemon
    gone or replaced (one restarted so fast that the next call reached it
    empty answers NOT_FOUND "... is not registered on this daemon"), a call
    or a step out of time, a step the daemons could not take."""
    if not isinstance(error, Error):
        return False
    code = getattr(error, "code", None)
    return code in _RECONNECTABLE or (
        code == "NOT_FOUND" and "is not registered on this daemon" in str(error))


def _refuse_trainer_reconnect(config):
    """The trainer collective's ranks are connected to each other: one rank
    cannot join again alone (restart every rank instead)."""
    if config.get("reduction", _DEFAULTS["reduction"]) == "trainer":
        raise ValueError(
            "reconnect: not supported with reduction='trainer' (the ranks' "
            "Gloo connections fail with the job); restart every rank, from "
            "a checkpoint")


# The dtype of stage 3's gathered parameters for each job precision.
_STAGE3_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_push_bucket_bytes(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"push_bucket_bytes: must be an int >= 0, got {value!r}")
    return value


def _keeps_after_forward(reshard_after_forward, name):
    """Whether the layer `name` ("" for the outer module) stays gathered
    from its forward to its backward."""
    if isinstance(reshard_after_forward, bool):
        return not reshard_after_forward
    choice = reshard_after_forward(name)
    if not isinstance(choice, bool):
        raise TypeError(f"reshard_after_forward({name!r}): expected True or False, got "
                        f"{choice!r}")
    return not choice


def _layer_units(module, named, layer_names):
    """The stage-3 layers and the modules that gather them.

    Returns (layers, units): layers = [(layer module, [(name, parameter)])]
    in registration order (the layer of `module`'s own parameters first,
    then the named layers in `module.named_modules()` order; layers that
    own no parameter left out); units = [(module, layer index or None,
    [layer indices of the shared parameters it uses], its name ("" for
    `module`))] for every named layer and `module` itself."""
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
    layers, index = [], {}
    for name in [""] + layer_names:
        if members[name]:
            index[name] = len(layers)
            layer_module = module if name == "" else module.get_submodule(name)
            layers.append((layer_module, members[name]))

    def used_directly(prefix, sub):
        """Parameters under `sub` (named `prefix`) but not under a named
        layer nested in it."""
        nested = [w for w in layer_names
                  if w != prefix and (prefix == "" or w.startswith(prefix + "."))]
        out = []
        for mname, m in sub.named_modules(prefix=prefix):
            if any(mname == w or mname.startswith(w + ".") for w in nested):
                continue
            out.extend(p for p in m._parameters.values() if p is not None)
        return out

    units = []
    for name in [""] + layer_names:
        sub = module if name == "" else module.get_submodule(name)
        own = index.get(name)
        deps = sorted({index[owners[id(p)]] for p in used_directly(name, sub)
                       if id(p) in owners and index[owners[id(p)]] != own})
        if own is not None or deps:
            units.append((sub, own, deps, name))
    return layers, units
