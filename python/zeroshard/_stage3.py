"""Stage 3: the parameters themselves live on the daemons and are gathered
one layer at a time around each forward and backward, like FSDP's
fully_shard.

A layer's parameters are views of one flat tensor over the layer's range
of the job's layout, in the job's precision, whose storage is freed
between uses (a parameter whose dtype or memory layout the flat tensor
cannot carry gets storage of its own, filled from the flat tensor after
each gather). Gathers are counted: a layer is gathered when its module's
forward starts (or its backward, through hooks on its outputs) and freed
when nobody needs it, so a module called twice in a forward, or a weight
shared by two layers (a tied embedding and output projection), is held
while any user runs: a module whose parameters include another layer's
(shared) parameters gathers that layer around its own forward and
backward too.

Gradients: each parameter's gradient, once autograd has accumulated it
for the backward (a hook on its AccumulateGrad node: once per backward
however often the parameter was used), is copied into the layer's
gradient buffer and dropped; when every trainable parameter of the layer
has arrived, the layer is pushed whole (its buckets are cut at the layer
boundaries, so a layer's push never waits for another layer's, whatever
order autograd finishes them in). At the end of the backward the layers
still waiting are pushed with zeros for the parameters that got no
gradient, which are marked: the daemons skip a tensor no rank gave a
gradient in any micro-batch, as torch.optim skips a parameter whose grad
is None. Each backward is one micro-batch of the step
(gradient_accumulation_steps of them at most; fewer are padded with empty
ones in step()); inside no_sync() nothing is pushed and the gradients sum
in p.grad on the trainer, to be pushed by the next backward outside it or
by step().
"""

import collections
import contextlib
import time

import torch
from torch.autograd import Variable

from zeroshard._flat import unfrozen_message


def resize_storage(tensor, numel):
    """Resizes the storage under `tensor` (and every view of it) to `numel`
    elements: 0 frees the memory, the views keep their shapes."""
    if hasattr(tensor, "untyped_storage"):
        tensor.untyped_storage().resize_(numel * tensor.element_size())
    else:
        tensor.storage().resize_(numel)


def is_dense(t):
    """Whether `t`'s elements fill its storage span exactly once (any dim
    order: contiguous, channels_last, transposed)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def tensors_in(obj):
    """The tensors in a module's output (a tensor, or nested tuples, lists
    and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors_in(item)]
    return []


_Range = collections.namedtuple("_Range", ["begin", "end"])


class Layer:
    """One layer of the layout: flat range [begin, end) of `dtype`."""

    def __init__(self, layer_id, begin, end, dtype):
        self.id = layer_id
        self.begin, self.end = begin, end
        self.flat = torch.zeros(end - begin, dtype=dtype)
        self.views = []      # (entry, parameter): views of flat
        self.own = []        # (entry, parameter): storage of their own
        self.trainable = []  # (entry, parameter) not frozen
        self.has_frozen = False
        self.refs = 0        # users holding it gathered
        self.gathered = True
        # The backward of the current micro-batch.
        self.backward_held = False
        self.grad = None     # gradient buffer (dtype), allocated on first arrival
        self.arrived = set()  # entry indices whose gradient is in grad
        self.pushed = False

    @property
    def bytes(self):
        return (self.end - self.begin) * self.flat.element_size() + sum(
            e.numel * p.element_size() for e, p in self.own)


class Unit:
    """A module whose forward and backward need layers gathered: its own
    layer (None when it owns no parameters, only uses shared ones) and
    the layers whose parameters it shares."""

    def __init__(self, module, layer, deps):
        self.module = module
        self.layer = layer
        self.deps = deps

    @property
    def needs(self):
        return ([self.layer] if self.layer is not None else []) + self.deps


class LayerSharding:
    """Stage 3 over `engine`: `units` are (module, layer id or None, [layer ids
    of shared parameters' layers]); the engine's param entries carry their
    layer ids."""

    def __init__(self, engine, units, dtype, micro_batches, overlap_comm=True):
        self.engine = engine
        self.client = engine.client
        self.dtype = dtype
        self.micro_batches = micro_batches
        self.overlap_comm = overlap_comm
        layout = engine.layout
        self.layers = {}
        for e in engine.entries:
            if e.kind != "param":
                continue
            layer = self.layers.get(e.layer)
            if layer is None:
                begin, end = layout.layer_range(e.layer)
                layer = self.layers[e.layer] = Layer(e.layer, begin, end, dtype)
            p = e.param
            local = e.offset - layer.begin
            if p.dtype == dtype and p.is_contiguous():
                p.data = layer.flat[local:local + e.numel].view(p.shape)
                layer.views.append((e, p))
            else:
                p.data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
                layer.own.append((e, p))
            if e.frozen:
                layer.has_frozen = True
            else:
                layer.trainable.append((e, p))
        self._ordered = [self.layers[k] for k in sorted(self.layers)]
        # Layers with no parameter (the buffers' copy): every micro-batch
        # pushes zeros for them, as the daemons count every element in.
        self._zero_ranges = [layout.layer_range(k) for k in layout.layers
                             if k not in self.layers]
        self.units = [Unit(m, self.layers.get(lid) if lid is not None else None,
                           [self.layers[d] for d in deps])
                      for m, lid, deps in units]
        self._micro_batch = 0     # synced backward passes (micro-batches) this step
        self._unsynced = False    # no_sync() gradients wait in p.grad
        self._no_sync = False
        # Entries whose p.grad torch would hold (as zeros, at least) now: they
        # had a gradient, and zero_grad(set_to_none=False) since keeps it;
        # a step counts them as having one.
        self._sticky = set()
        self._callback_queued = False
        self._deferred = collections.deque()  # (layer, grad, no_grad, micro_batch)
        self._accumulators = []  # kept alive: the hooks live on them
        self._not_requiring = [e for e in engine.entries
                               if e.kind == "param" and not e.param.requires_grad]
        self._held = sum(layer.bytes for layer in self._ordered)
        self.peak_param_bytes = 0
        for unit in self.units:
            self._install_forward_hooks(unit)
        self._install_grad_hooks()
        for layer in self._ordered:
            self._free(layer)

    # ---- gather and free ----

    def _gather(self, layer):
        if layer.gathered:
            return
        resize_storage(layer.flat, layer.end - layer.begin)
        try:
            self.client.gather(layer.id, layer.flat)
            with torch.no_grad():
                for e, p in layer.own:
                    resize_storage(p.data, e.numel)
                    local = e.offset - layer.begin
                    p.data.copy_(layer.flat[local:local + e.numel].view(p.shape))
        except BaseException:
            resize_storage(layer.flat, 0)
            for _, p in layer.own:
                resize_storage(p.data, 0)
            raise
        layer.gathered = True
        self._held += layer.bytes
        self.peak_param_bytes = max(self.peak_param_bytes, self._held)

    def _free(self, layer):
        if not layer.gathered:
            return
        resize_storage(layer.flat, 0)
        for _, p in layer.own:
            resize_storage(p.data, 0)
        layer.gathered = False
        self._held -= layer.bytes

    def _acquire(self, layers):
        for layer in layers:
            layer.refs += 1
            self._gather(layer)

    def _release(self, layers):
        for layer in layers:
            layer.refs -= 1
            if layer.refs == 0:
                self._free(layer)

    def free_all(self):
        for layer in self._ordered:
            layer.refs = 0
            layer.backward_held = False
            self._free(layer)

    # ---- hooks ----

    def _install_forward_hooks(self, unit):
        needs = unit.needs

        def pre_forward(module, inputs):
            self._acquire(needs)

        def post_forward(module, inputs, output):
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
            self._release(needs)

        def pre_backward(grad):
            self._queue_callback()
            for layer in needs:
                if not layer.backward_held:
                    layer.backward_held = True
                    self._acquire([layer])
            return grad

        unit.module.register_forward_pre_hook(pre_forward)
        unit.module.register_forward_hook(post_forward)

    def _queue_callback(self):
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._post_backward)

    def _install_grad_hooks(self):
        with torch.enable_grad():
            for layer in self._ordered:
                for e, p in layer.trainable:
                    # The parameter's AccumulateGrad node: its hooks run once
                    # p.grad holds the parameter's whole gradient of the backward.
                    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                    accumulator.register_hook(self._grad_hook(layer, e, p))
                    self._accumulators.append(accumulator)

    def _grad_hook(self, layer, e, p):
        def grad_ready(*unused):
            self._queue_callback()
            if p.grad is None or self._no_sync:
                return
            self._take(layer, e, p)
            if len(layer.arrived) == len(layer.trainable):
                self._push(layer)
                # Every use of its trainable parameters is behind us; a
                # frozen one's may not be (it has no hook to tell), so such a
                # layer stays until the end of the backward.
                if layer.backward_held and not layer.has_frozen:
                    layer.backward_held = False
                    self._release([layer])
        return grad_ready

    def _take(self, layer, e, p):
        """p.grad into the layer's gradient buffer; p.grad is dropped."""
        if layer.grad is None:
            layer.grad = torch.zeros(layer.end - layer.begin, dtype=self.dtype)
        local = e.offset - layer.begin
        with torch.no_grad():
            layer.grad[local:local + e.numel].view(p.shape).copy_(p.grad)
        p.grad = None
        layer.arrived.add(e.index)
        self._sticky.add(e.index)

    def _push(self, layer):
        if self._micro_batch >= self.micro_batches:
            raise RuntimeError(
                f"backward pass {self._micro_batch + 1} since the last step: the model was "
                f"sharded with gradient_accumulation_steps={self.micro_batches}; call step() "
                "after that many backward passes (or accumulate on the trainer inside "
                "model.no_sync())")
        no_grad = self.engine.no_grad(e.index for e, _ in layer.trainable
                                      if e.index not in layer.arrived
                                      and e.index not in self._sticky)
        grad = layer.grad
        if grad is None:
            grad = torch.zeros(layer.end - layer.begin, dtype=self.dtype)
        layer.grad = None
        layer.pushed = True
        if self.overlap_comm:
            self.client.push_gradients(layer.begin, layer.end, grad,
                                       micro_batch=self._micro_batch, no_grad=no_grad)
        else:
            self._deferred.append((layer, grad, no_grad, self._micro_batch))

    def _flush(self):
        """Ends a micro-batch: every layer not pushed in it yet is pushed,
        with the gradients waiting in p.grad (no_sync) and zeros marked for
        the rest."""
        for layer in self._ordered:
            if layer.pushed:
                continue
            for e, p in layer.trainable:
                if e.index not in layer.arrived and p.grad is not None:
                    self._take(layer, e, p)
            self._push(layer)
        for begin, end in self._zero_ranges:
            zeros = torch.zeros(end - begin, dtype=self.dtype)
            if self.overlap_comm:
                self.client.push_gradients(begin, end, zeros, micro_batch=self._micro_batch)
            else:
                self._deferred.append((_Range(begin, end), zeros, [], self._micro_batch))
        for layer in self._ordered:
            layer.pushed = False
            layer.arrived.clear()
        self._micro_batch += 1
        self._unsynced = False

    def _post_backward(self):
        self._callback_queued = False
        for layer in self._ordered:
            if layer.backward_held:
                layer.backward_held = False
                self._release([layer])
        if self._no_sync:
            self._unsynced = True
        else:
            self._flush()

    @contextlib.contextmanager
    def no_sync(self):
        previous = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = previous

    # ---- step ----

    def step(self):
        for e in self._not_requiring:
            if e.param.requires_grad:
                raise ValueError(unfrozen_message(e.name))
        start = time.perf_counter()
        if self._unsynced:
            self._flush()
        # Micro-batches never run are empty: no parameter has a gradient.
        while self._micro_batch < self.micro_batches:
            self._flush()
        # Lent, not copied: each buffer stays untouched until the step has
        # taken it in.
        while self._deferred:
            layer, grad, no_grad, mb = self._deferred[0]
            self.client.push_gradients(layer.begin, layer.end, grad, borrow=True,
                                       micro_batch=mb, no_grad=no_grad)
            self._deferred.popleft()
        pushing = time.perf_counter() - start
        result = self.engine.step(pushing)
        self._reset()
        return result

    def _reset(self):
        self.free_all()
        self._micro_batch = 0
        self._unsynced = False
        self._deferred.clear()
        self._callback_queued = False
        for layer in self._ordered:
            layer.grad = None
            layer.arrived.clear()
            layer.pushed = False

    def reconnect(self):
        self._reset()
        self.engine.rejoin()
        self.client = self.engine.client
        return self.client.committed_step

    def zero_grad(self, set_to_none):
        """As torch's: set_to_none drops the gradients (a parameter then has
        none until a backward gives it one); otherwise they become zeros,
        which torch.optim steps with (weight decay and moments move)."""
        if set_to_none:
            self._sticky.clear()
