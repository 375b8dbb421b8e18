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

A layer kept after its forward (reshard_after_forward=False for it) is
not freed by its forward: the forward's hold passes to the backward,
which then needs no second gather, and ends once the layer's gradients
are in (or at the end of the backward; a forward whose backward never
runs holds it until step()), as FSDP's reshard_after_forward.
A forward without autograd (torch.no_grad(), or no output requiring a
gradient) frees it as usual.

Gradients: each parameter's gradient, once autograd has accumulated it
for the backward (a hook on its AccumulateGrad node: once per backward
however often the parameter was used), is copied into the layer's
gradient buffer and dropped; when every trainable parameter of the layer
has arrived, the layer is complete. Completed layers whose flat ranges
adjoin are coalesced into one push of about `bucket_bytes` (one
client.push_gradients call, copied together: the client's buckets are cut
at the layer boundaries, so a push never waits for another layer's,
whatever order autograd finishes them in): a bucket is pushed once it
holds bucket_bytes, when a completed layer does not adjoin it, and at the
end of the backward. A layer of at least bucket_bytes is pushed alone,
without a copy; bucket_bytes 0 pushes each layer as it completes. At the
end of the backward the layers still waiting are pushed with zeros for
the parameters that got no gradient, which are marked: the daemons skip a
tensor no rank gave a gradient in any micro-batch, as torch.optim skips a
parameter whose grad is None. Each backward is one micro-batch of the step
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
    the layers whose parameters it shares. `keep`: its layers stay
    gathered from its forward to its backward (reshard_after_forward
    False)."""

    def __init__(self, module, layer, deps, keep=False):
        self.module = module
        self.layer = layer
        self.deps = deps
        self.keep = keep

    @property
    def needs(self):
        return ([self.layer] if self.layer is not None else []) + self.deps


class _Bucket:
    """Completed gradients waiting to be pushed together: pieces (begin, end,
    grad, no_grad) whose flat ranges adjoin, in flat order."""

    def __init__(self):
        self.pieces = []
        self.bytes = 0

    def adjoins(self, begin, end):
        return (not self.pieces or begin == self.pieces[-1][1]
                or end == self.pieces[0][0])

    def add(self, piece, nbytes):
        if self.pieces and piece[1] == self.pieces[0][0]:
            self.pieces.insert(0, piece)
        else:
            self.pieces.append(piece)
        self.bytes += nbytes

    def take(self):
        """(begin, end, grad, no_grad) of the whole bucket (the pieces'
        gradients copied into one tensor when there are several), and empties
        it; None when empty."""
        if not self.pieces:
            return None
        pieces, self.pieces, self.bytes = self.pieces, [], 0
        if len(pieces) == 1:
            return pieces[0]
        grad = torch.cat([g for _, _, g, _ in pieces])
        no_grad = [i for _, _, _, marks in pieces for i in marks]
        return pieces[0][0], pieces[-1][1], grad, no_grad


class LayerSharding:
    """Stage 3 over `engine`: `units` are (module, layer id or None, [layer ids
    of shared parameters' layers], keep after forward); the engine's param
    entries carry their layer ids. `bucket_bytes`: completed layers are
    pushed together up to this many bytes of gradient (0: each alone)."""

    def __init__(self, engine, units, dtype, micro_batches, overlap_comm=True,
                 bucket_bytes=0):
        self.engine = engine
        self.client = engine.client
        self.dtype = dtype
        self.micro_batches = micro_batches
        self.overlap_comm = overlap_comm
        self.bucket_bytes = bucket_bytes
        self._bucket = _Bucket()
        # This step's client.push_gradients calls and layer gathers.
        self.pushes = 0
        self.gathers = 0
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
                           [self.layers[d] for d in deps], keep)
                      for m, lid, deps, keep in units]
        self._micro_batch = 0     # synced backward passes (micro-batches) this step
        self._unsynced = False    # no_sync() gradients wait in p.grad
        self._no_sync = False
        # Entries whose p.grad torch would hold (as zeros, at least) now: they
        # had a gradient, and zero_grad(set_to_none=False) since keeps it;
        # a step counts them as having one.
        self._sticky = set()
        self._callback_queued = False
        self._deferred = collections.deque()  # (begin, end, grad, no_grad, micro_batch)
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

    @property
    def held_bytes(self):
        """Bytes of the layers gathered now."""
        return self._held

    @property
    def gradient_bytes(self):
        """Bytes of the layers' gradient buffers held now (arriving, or
        waiting for their push)."""
        held = {id(layer.grad): layer.grad for layer in self._ordered if layer.grad is not None}
        for piece in self._bucket.pieces:
            held[id(piece[2])] = piece[2]
        for piece in self._deferred:
            held[id(piece[2])] = piece[2]
        return sum(t.numel() * t.element_size() for t in held.values())

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
        self.gathers += 1
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
            hooked = False
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
                        hooked = True
            if not (unit.keep and hooked):
                self._release(needs)
                return
            # Kept for the backward: this forward's hold becomes the
            # backward's (one per layer; a second call's is given back).
            for layer in needs:
                if layer.backward_held:
                    self._release([layer])
                else:
                    layer.backward_held = True

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
        self._add_to_bucket(layer.begin, layer.end, grad, no_grad)

    def _add_to_bucket(self, begin, end, grad, no_grad):
        """Queues the gradient of flat range [begin, end) for the current
        micro-batch: pushed with the bucket it joins once that is full, or
        alone (without a copy) when it is at least bucket_bytes."""
        nbytes = grad.numel() * grad.element_size()
        if nbytes >= self.bucket_bytes:
            self._push_bucket()
            self._send(begin, end, grad, no_grad)
            return
        if not self._bucket.adjoins(begin, end):
            self._push_bucket()
        self._bucket.add((begin, end, grad, no_grad), nbytes)
        if self._bucket.bytes >= self.bucket_bytes:
            self._push_bucket()

    def _push_bucket(self):
        taken = self._bucket.take()
        if taken is not None:
            self._send(*taken)

    def _send(self, begin, end, grad, no_grad):
        if self.overlap_comm:
            self.pushes += 1
            self.client.push_gradients(begin, end, grad, micro_batch=self._micro_batch,
                                       no_grad=no_grad)
        else:
            self._deferred.append((begin, end, grad, no_grad, self._micro_batch))

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
            self._add_to_bucket(begin, end, torch.zeros(end - begin, dtype=self.dtype), [])
        self._push_bucket()
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
            begin, end, grad, no_grad, mb = self._deferred[0]
            self.pushes += 1
            self.client.push_gradients(begin, end, grad, borrow=True,
                                       micro_batch=mb, no_grad=no_grad)
            self._deferred.popleft()
        pushing = time.perf_counter() - start
        result = self.engine.step(pushing)
        result["pushes"], result["gathers"] = self.pushes, self.gathers
        self._reset()
        return result

    def _reset(self):
        self.free_all()
        self._micro_batch = 0
        self._unsynced = False
        self._deferred.clear()
        self._bucket = _Bucket()
        self.pushes = 0
        self.gathers = 0
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
