"""The part of a sharded model or optimizer that talks to the daemons: the
client, the layout, the step with each parameter group's learning rate,
and the state reads and writes behind state dicts and checkpoints.
Shared by stages 1-2 (zeroshard/_flat.py) and stage 3
(zeroshard/_stage3.py)."""

import time

import numpy as np
import torch

from zeroshard._zeroshard import Client, Error
from zeroshard import _layout


def config_error(message):
    """A zeroshard.Error with code INVALID_ARGUMENT."""
    error = Error(message)
    error.code = "INVALID_ARGUMENT"
    return error


# torch.optim.AdamW's group options the daemons implement, and the values of
# the others they require.
_HYPER_KEYS = ("betas", "eps", "weight_decay")
_FIXED_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False}


def check_group_options(groups):
    """ValueError naming the group and option that the daemons' AdamW does
    not implement."""
    for i, g in enumerate(groups):
        for key, want in _FIXED_OPTIONS.items():
            if bool(g.get(key, want)) != want:
                raise ValueError(
                    f"param_groups[{i}]['{key}']: the daemons' AdamW runs with "
                    f"{key}={want}, got {g[key]!r}")
        betas = g["betas"]
        if len(betas) != 2:
            raise ValueError(f"param_groups[{i}]['betas']: expected two values, got {betas!r}")


def _group_settings(g):
    return dict(lr=float(g["lr"]), betas=(float(g["betas"][0]), float(g["betas"][1])),
                eps=float(g["eps"]), weight_decay=float(g["weight_decay"]))


class Engine:
    """The client of one sharded model: `entries` (the registered tensors,
    in layout order) in the torch parameter groups `groups` (the facade
    optimizer's param_groups list, read at every step for the learning
    rates)."""

    def __init__(self, entries, groups, client_config, stage, max_grad_norm,
                 resume=None, micro_batches=1):
        if resume is not None and not isinstance(resume, str):
            raise TypeError(
                "resume: expected None, a checkpoint name or 'latest', got "
                f"{type(resume).__name__}")
        self.entries = entries
        self.groups = groups
        self.stage = stage
        check_group_options(groups)
        self._registered = [_group_settings(g) for g in groups]
        first = self._registered[0]
        config = dict(client_config)
        config.update(stage=stage, lr=first["lr"], betas=first["betas"],
                      eps=first["eps"], weight_decay=first["weight_decay"],
                      max_grad_norm=max_grad_norm, resume=resume,
                      param_groups=[dict(s) for s in self._registered],
                      micro_batches=micro_batches)
        self.config = config
        self.rank = config["rank"]
        self.layout = _layout.make_layout(entries)
        self.total = self.layout.total_elements
        self.by_id = {id(e.param): e for e in entries if e.kind == "param"}
        self.buffers = [e for e in entries if e.kind == "buffer"]
        self.client = Client(**config)
        # How many clients this engine has made (rejoin makes a new one).
        self.client_generation = 0
        # Daemon reduction and the Gloo collective skip a tensor no rank gave
        # a gradient, as torch does; the NCCL trainer collective carries no
        # marks: there such tensors are pushed as zeros and stepped, as
        # DeepSpeed and FSDP1 do.
        self.marks_no_grad = self.client.carries_no_grad_marks
        self.save_pending = False
        self._activations = None  # (client, its ActivationStore), opened when first used
        # The daemons' count of steps in a row without an inf or NaN since
        # the loss scale last changed (GradScaler's _growth_tracker), as
        # this trainer follows it from the step results; None while it has
        # not seen every step since the job started (a resume, a rejoin
        # past steps it did not see). The client cannot read the daemons'.
        self.growth_tracker = None
        self._seen_step = None

    # ---- construction ----

    def initial_values(self):
        """Rank 0's values of every entry, flat fp32 (numpy)."""
        flat = np.zeros(self.total, dtype=np.float32)
        flat_t = torch.from_numpy(flat)
        with torch.no_grad():
            for e in self.entries:
                t = e.tensor
                values = (_layout.buffer_values_as_float(e.name, t) if e.kind == "buffer"
                          else t.detach().float())
                flat_t[e.offset:e.offset + e.numel].copy_(values.reshape(-1))
        return flat

    def register(self):
        """Registers and joins; rank 0's values (or a resumed checkpoint's)
        become the daemons' state. Blocks until every rank joined."""
        initial = self.initial_values() if self.rank == 0 else None
        self.client.register_model(self.layout, initial)
        self._seen_step = self.client.committed_step
        self.growth_tracker = 0 if self._seen_step == 0 else None

    def rejoin(self):
        """A new client of the same job, after a failure (no upload, no
        resume)."""
        self.close_activation_store()
        self.client = None  # dropped first: its heartbeats stop
        client = Client(**dict(self.config, resume=None))
        client.register_model(self.layout, None)
        self.client = client
        self.client_generation += 1
        self.save_pending = False
        if client.committed_step != self._seen_step:
            self.growth_tracker = None  # steps committed that this trainer did not see
        self._seen_step = client.committed_step

    # ---- the step ----

    def group_lrs(self):
        """Each group's learning rate for this step, after checking that the
        options the daemons hold fixed were not changed."""
        for i, (g, reg) in enumerate(zip(self.groups, self._registered)):
            now = _group_settings(g)
            for key in _HYPER_KEYS:
                if now[key] != reg[key]:
                    raise ValueError(
                        f"param_groups[{i}]['{key}'] changed from {reg[key]} to "
                        f"{now[key]} after sharding: the daemons hold each group's betas, "
                        "eps and weight_decay fixed (lr may change at every step); "
                        "save a checkpoint and shard anew to change them")
        return [float(g["lr"]) for g in self.groups]

    def no_grad(self, indices):
        """The no-grad marks a push carries (none with the NCCL trainer
        collective)."""
        return sorted(indices) if self.marks_no_grad else []

    def step(self, push_seconds=0.0):
        result = self.client.step(self.group_lrs())
        result["push_wait_ms"] += 1000 * push_seconds
        self._follow_loss_scale(result)
        return result

    def _follow_loss_scale(self, result):
        """GradScaler's rule for its growth tracker, which the daemons apply
        at each commit: reset by a skipped step and by growth, else one
        more. Loses track when a step was committed unseen."""
        if self.growth_tracker is not None and result["step"] != self._seen_step + 1:
            self.growth_tracker = None
        self._seen_step = result["step"]
        if self.growth_tracker is None:
            return
        settings = self.client.loss_scale_settings
        if result["skipped"] or not settings["dynamic"]:
            self.growth_tracker = 0
        elif self.growth_tracker + 1 >= settings["growth_interval"]:
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1

    # ---- states ----

    def read(self, array, begin=0, end=None):
        """(fp32 tensor of [begin, end), {tensor index: update count})."""
        end = self.total if end is None else end
        out = torch.zeros(end - begin, dtype=torch.float32)
        steps = self.client.read_state(array, begin, end, out) if end > begin else {}
        return out, steps

    def write(self, array, values, begin=0, steps=None):
        end = begin + (0 if values is None else values.numel())
        self.client.write_state(array, begin, end,
                                None if values is None else values.contiguous(),
                                steps or {})

    def buffer_range(self):
        if not self.buffers:
            return None
        return self.buffers[0].offset, self.total

    def upload_buffers(self):
        """Writes this rank's buffer values to the daemons (before a save)."""
        r = self.buffer_range()
        if r is None:
            return
        flat = torch.zeros(r[1] - r[0], dtype=torch.float32)
        with torch.no_grad():
            for e in self.buffers:
                values = _layout.buffer_values_as_float(e.name, e.tensor)
                flat[e.offset - r[0]:e.offset - r[0] + e.numel].copy_(values.reshape(-1))
        self.write("master", flat, begin=r[0])

    def load_buffers(self):
        """Copies the daemons' buffer values into the module's buffers (rank
        0's at construction, a checkpoint's after a resume)."""
        r = self.buffer_range()
        if r is None:
            return
        flat, _ = self.read("master", r[0], r[1])
        with torch.no_grad():
            for e in self.buffers:
                t = e.tensor
                t.copy_(flat[e.offset - r[0]:e.offset - r[0] + e.numel].view(t.shape))

    # ---- checkpoints ----

    def save_checkpoint(self, name):
        self.upload_buffers()
        result = self.client.save_checkpoint(name)
        self.save_pending = True
        return result

    def await_checkpoint(self):
        self.save_pending = False
        return self.client.await_checkpoint()

    def close(self):
        if self.save_pending:
            self.await_checkpoint()
        self.close_activation_store()
        self.client.leave()

    # ---- activation offload (zeroshard.torch.offload_activations) ----

    def activation_store(self):
        """This rank's ActivationStore on its partition's daemon, of the
        current client (opened when first asked for)."""
        if self._activations is None or self._activations[0] is not self.client:
            self.close_activation_store()
            self._activations = (self.client, self.client.open_activation_store())
        return self._activations[1]

    def close_activation_store(self):
        if self._activations is not None:
            store, self._activations = self._activations[1], None
            store.close()

    # ---- optimizer state dicts (torch.optim.AdamW's format) ----

    def optimizer_state_dict(self):
        """{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
        [...]} as torch.optim.AdamW.state_dict() gives it: parameters indexed
        in group order; a parameter that never had a gradient (update count
        0), or is frozen, has no state. The moments are read from the
        daemons (fp32, the parameter's shape)."""
        m, steps = self.read("exp_avg")
        v, _ = self.read("exp_avg_sq")
        state, groups, index = {}, [], 0
        for g in self.groups:
            packed = {k: v_ for k, v_ in g.items() if k != "params"}
            packed["params"] = []
            for p in g["params"]:
                packed["params"].append(index)
                e = self.by_id.get(id(p))
                if e is not None and not e.frozen and steps.get(e.index, 0) > 0:
                    sl = slice(e.offset, e.offset + e.numel)
                    state[index] = {
                        "step": torch.tensor(float(steps[e.index])),
                        "exp_avg": m[sl].clone().view(p.shape),
                        "exp_avg_sq": v[sl].clone().view(p.shape),
                    }
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state_dict):
        """Sends the moments and update counts of a torch.optim.AdamW state
        dict (of these parameter groups) to the daemons and takes its groups'
        learning rates. ValueError, with nothing changed, when the groups do
        not match or a group's betas, eps or weight_decay differ from what
        the daemons hold."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for i, (s, g) in enumerate(zip(saved, self.groups)):
            if len(s["params"]) != len(g["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group that doesn't match the "
                    f"size of optimizer's group (param_groups[{i}]: {len(s['params'])} "
                    f"parameters, this optimizer's has {len(g['params'])})")
            for key in _HYPER_KEYS:
                if key in s and _group_settings(dict(g, **{key: s[key]}))[key] != \
                        self._registered[i][key]:
                    raise ValueError(
                        f"param_groups[{i}]['{key}']: the state dict has {s[key]}, the "
                        f"daemons hold {self._registered[i][key]} (fixed at sharding)")
        m = torch.zeros(self.total, dtype=torch.float32)
        v = torch.zeros(self.total, dtype=torch.float32)
        steps = {}
        saved_state = state_dict["state"]
        for s, g in zip(saved, self.groups):
            for key, p in zip(s["params"], g["params"]):
                e = self.by_id.get(id(p))
                if e is None or e.frozen:
                    continue
                st = saved_state.get(key)
                steps[e.index] = 0 if st is None else int(float(st["step"]))
                if st is None:
                    continue
                for name, flat in (("exp_avg", m), ("exp_avg_sq", v)):
                    t = st[name]
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(
                            f"state[{key}]['{name}']: shape {tuple(t.shape)}, the "
                            f"parameter's is {tuple(p.shape)}")
                    flat[e.offset:e.offset + e.numel].copy_(t.detach().reshape(-1))
        self.write("exp_avg", m)
        self.write("exp_avg_sq", v, steps=steps)
        for s, g in zip(saved, self.groups):
            g["lr"] = s["lr"]


def with_push_time(result, seconds):
    """`result` (Client.step's dict) with `seconds` of pushing before the
    step added to its push_wait_ms."""
    result["push_wait_ms"] += 1000 * seconds
    return result


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self):
        return time.perf_counter() - self.start
