"""Stages 1 and 2: the parameters stay on the trainer (ZeRO's P_os and
P_os+g); each step pushes the gradients the backward passes accumulated in
`p.grad` (as torch sums micro-batches: several backward passes per step
are summed on the trainer), marks the parameters that got none, runs the
step on the daemons and loads the new values into the parameters.

The trainer holds the model's parameters and gradients and a staging
buffer of constant size, never a flat copy of the model:

- Gradients go from `p.grad` to the client. A float32, contiguous CPU
  gradient of at least 2**14 elements (or a quarter of a bucket) is lent
  to the client from `p.grad` itself (it sends the buckets the gradient
  covers whole from there and stages the rest in its pool of C_B-sized
  buffers). In an fp32 job with daemon reduction on a bulk transport
  (with the config's `push_memory`, on by default) those gradients live in
  one push memory (`Client.allocate_push_memory`, allocated with the
  model), as DDP's `gradient_as_bucket_view` keeps them in its buckets: a
  hook on each such parameter's AccumulateGrad node moves a `p.grad` that
  autograd allocated elsewhere (the first backward, or the first after
  `zero_grad(set_to_none=True)`) to its place there as soon as backward
  has written it, and makes `p.grad` that view, into which later backward
  passes accumulate in place; a daemon on the same host then sums it
  straight from there. Everything else (smaller gradients, other
  dtypes or strides, CUDA gradients, the zeros of frozen tensors, buffers
  and parameters without a gradient) is packed in flat order into the
  staging buffer, converted to float32 as torch's copy_ converts, and
  pushed a bucket at a time.
- Parameters come back layer by layer: stages 1-2 cut the layout into
  layers of at most GATHER_LAYER_ELEMENTS elements (a larger tensor is a
  layer of its own), and each layer is gathered straight into its
  parameter (a float32, contiguous CPU tensor that fills its layer's range)
  or into the staging buffer and copied from there into its parameters.
  The client's layer gathers give the job's precision; a bf16 or fp16 job
  loads each layer's fp32 masters with a ranged gather of the layer's flat
  range instead (`gather_range`), the same way.

What is pushed and loaded is the same, bit for bit, as pushing and
loading the whole model in one flat float32 buffer: the daemons sum the
same values however the pushes are split."""

import time
import warnings
import weakref

import torch

from zeroshard._zeroshard import DEFAULTS, Error

# Stages 1-2 gather the parameters in layers of at most this many elements
# (1 MiB of fp32): consecutive tensors are grouped up to it, a larger tensor
# is a layer alone. A constant, not the job's bucket size, because layers
# are part of the layout's fingerprint, which checkpoints are matched by.
GATHER_LAYER_ELEMENTS = 1 << 18

# The layout's alignment (elements; common/layout.h kDefaultAlignment).
_ALIGNMENT = 64


def unfrozen_message(name):
    return (f"parameter {name} had requires_grad=False when the model was sharded and "
            "now requires a gradient: the daemons hold no optimizer state for it; save a "
            "checkpoint, then shard anew with it trainable")


def assign_layers(entries):
    """Sets the layer of each entry of a stage 1-2 layout (in layout order):
    parameters grouped in runs of at most GATHER_LAYER_ELEMENTS aligned
    elements (a larger one alone), the buffers in one layer after them."""
    layer, size = 0, 0
    for e in entries:
        if e.kind != "param":
            continue
        span = -(-e.numel // _ALIGNMENT) * _ALIGNMENT
        if size > 0 and size + span > GATHER_LAYER_ELEMENTS:
            layer, size = layer + 1, 0
        e.layer = layer
        size += span
    for e in entries:
        if e.kind != "param":
            e.layer = layer + 1


def copy_elements(src, lo, hi, out):
    """Elements [lo, hi) of `src` in row-major (flat layout) order into the
    1-d `out` (hi - lo elements), converted to out's dtype, without copying
    more of `src` than those elements (a non-contiguous `src` is walked by
    rows)."""
    if src.is_contiguous():
        out.copy_(src.reshape(-1)[lo:hi])
        return
    if src.dim() <= 1:
        out.copy_(src.reshape(-1)[lo:hi])  # a strided 1-d view: no copy of src
        return
    row = src.numel() // src.shape[0]
    pos = lo
    while pos < hi:
        i, start = divmod(pos, row)
        if start == 0 and hi - pos >= row:  # whole rows
            n = (hi - pos) // row
            out[pos - lo:pos - lo + n * row].view((n,) + tuple(src.shape[1:])).copy_(
                src[i:i + n])
            pos += n * row
        else:  # part of one row
            end = min(hi, (i + 1) * row)
            copy_elements(src[i], start, end - i * row, out[pos - lo:end - lo])
            pos = end


class FlatSharding:
    """The step of a stage 1-2 job over `engine`'s entries (whose layers
    assign_layers set)."""

    def __init__(self, engine):
        self.engine = engine
        layout = engine.layout
        self._fp32 = engine.config.get("precision", "fp32") == "fp32"
        bucket_bytes = int(engine.config.get("bucket_bytes", DEFAULTS["bucket_bytes"]))
        # Elements per packed push: one of the job's buckets (C_B).
        self._push_elements = max(_ALIGNMENT, min(bucket_bytes // 4, engine.total))
        # Gradients pushed from p.grad itself from this size on (smaller
        # ones cost more in calls than their copy into the staging buffer).
        self._direct_push_elements = max(1, min(self._push_elements // 4, 1 << 14))
        self._trainable = [e for e in engine.entries if e.kind == "param" and not e.frozen]
        # Gradients lent from p.grad live in push memory (see the module's
        # docstring) where a daemon may read them in place: fp32 jobs
        # (a bf16 or fp16 job stages float32 gradients), daemon reduction
        # (the trainer collective reduces them itself), bulk transports.
        config = engine.config
        self._grad_memory_wanted = (
            config.get("transport", DEFAULTS["transport"]) != "stream"
            and config.get("push_memory", DEFAULTS["push_memory"]) and self._fp32
            and config.get("reduction", DEFAULTS["reduction"]) == "daemon")
        # Entry index -> its float32 view in the push memory of the client
        # of generation _grad_generation (a rejoin's new client allocates
        # anew); never given out (p.grad gets a view of it), so that what
        # a caller does to p.grad leaves it as it is.
        self._grad_views = {}
        self._grad_view_ptrs = set()
        self._grad_memory_bytes = 0
        self._grad_generation = None
        self._accumulators = []  # the hooked AccumulateGrad nodes, kept alive
        self._hook_handles = []
        if self._grad_memory_wanted:
            self._allocate_grad_views()
            self._install_grad_hooks()
        # Frozen by requires_grad=False (the others are in no group, and
        # torch.optim ignores their gradients too).
        self._not_requiring = [e for e in engine.entries
                               if e.kind == "param" and not e.param.requires_grad]
        # (layer id, begin, end, [param entries]) of every layer holding
        # parameters, in flat order.
        self._layers = []
        for e in engine.entries:
            if e.kind != "param":
                continue
            if not self._layers or self._layers[-1][0] != e.layer:
                begin, end = layout.layer_range(e.layer)
                self._layers.append((e.layer, begin, end, []))
            self._layers[-1][3].append(e)
        gather_elements = max([end - begin for _, begin, end, members in self._layers
                               if not self._direct(begin, end, members)], default=0)
        # The staging buffer, allocated once: packed pushes, then layer
        # gathers (never both at once). Packed pushes need the longest run
        # of tensors pushed through it (those not pushed from p.grad
        # itself, foreseen from the parameters) up to a bucket; a longer
        # run than foreseen (a large parameter without a gradient) grows it
        # to a bucket, once.
        pack_elements, run_begin = 0, None
        for e in engine.entries:
            if self._pushed_directly(e, e.param if e.kind == "param" else None):
                run_begin = None
                continue
            if run_begin is None:
                run_begin = e.offset
            pack_elements = max(pack_elements, e.offset + e.numel - run_begin)
        self._staging = torch.zeros(
            max(min(pack_elements, self._push_elements), gather_elements, 1),
            dtype=torch.float32)

    @property
    def staging_bytes(self):
        return self._staging.numel() * self._staging.element_size()

    def _pushed_directly(self, e, grad):
        """Whether `grad`, entry e's gradient, is pushed as it is (not
        packed into the staging buffer)."""
        return (e.kind == "param" and not e.frozen and grad is not None
                and grad.dtype == torch.float32 and grad.device.type == "cpu"
                and grad.is_contiguous() and e.numel >= self._direct_push_elements)

    @staticmethod
    def _direct(begin, end, members):
        """Whether the layer can be gathered straight into its parameter."""
        if len(members) != 1:
            return False
        p = members[0].param
        return (p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()
                and end - begin == members[0].numel)

    def _grow_staging(self, elements):
        """A parameter changed dtype or layout after sharding: its layer now
        goes through the staging buffer, which grows to hold it."""
        if elements > self._staging.numel():
            self._staging = torch.zeros(elements, dtype=torch.float32)

    def load_params(self):
        """The daemons' masters into every registered parameter."""
        client = self.engine.client

        def gather(layer, begin, end, out):
            """The layer's parameters as float32: the job's precision in an
            fp32 job, the fp32 masters of its flat range otherwise."""
            if self._fp32:
                client.gather(layer, out)
            else:
                client.gather_range(begin, end, out)

        with torch.no_grad():
            for layer, begin, end, members in self._layers:
                if self._direct(begin, end, members):
                    gather(layer, begin, end, members[0].param.data.view(-1))
                    continue
                self._grow_staging(end - begin)
                out = self._staging[:end - begin]
                gather(layer, begin, end, out)
                for e in members:
                    local = e.offset - begin
                    e.param.copy_(out[local:local + e.numel].view(e.param.shape))

    @property
    def grad_memory_bytes(self):
        """Bytes of the push memory the gradients live in (whole pages; 0
        without one)."""
        return self._grad_memory_bytes

    def holds_grad(self, grad):
        """Whether `grad` lies in the gradients' push memory (counted in
        grad_memory_bytes)."""
        return (grad.data_ptr(), tuple(grad.shape)) in self._grad_view_ptrs

    def _allocate_grad_views(self):
        """One push memory of the current client for the gradients of every
        parameter whose gradient would be lent (float32, contiguous, CPU,
        large enough), each at a 64-element boundary, and their views. Where
        the system refuses the memory, gradients stay where autograd puts
        them (with a warning)."""
        places, size = [], 0
        for e in self._trainable:
            p = e.param
            if (p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()
                    and e.numel >= self._direct_push_elements):
                places.append((e, size))
                size += -(-e.numel // _ALIGNMENT) * _ALIGNMENT
        self._grad_generation = self.engine.client_generation
        self._grad_views, self._grad_view_ptrs, self._grad_memory_bytes = {}, set(), 0
        if size == 0:
            return
        try:
            memory = self.engine.client.allocate_push_memory(size * 4)
        except Error as e:
            warnings.warn(f"gradients stay in torch's memory, not push memory: {e}",
                          RuntimeWarning)
            self._grad_memory_wanted = False
            return
        base = torch.frombuffer(memory, dtype=torch.float32)
        self._grad_memory_bytes = memory.nbytes
        for e, offset in places:
            view = base[offset:offset + e.numel].view(e.param.shape)
            self._grad_views[e.index] = view
            self._grad_view_ptrs.add((view.data_ptr(), tuple(view.shape)))

    def _install_grad_hooks(self):
        with torch.enable_grad():
            for e in self._trainable:
                if e.index in self._grad_views and e.param.requires_grad:
                    # The parameter's AccumulateGrad node: its hooks run once
                    # p.grad holds the backward's gradient.
                    accumulator = e.param.expand_as(e.param).grad_fn.next_functions[0][0]
                    self._hook_handles.append(accumulator.register_hook(self._grad_hook(e)))
                    self._accumulators.append(accumulator)

    def _grad_hook(self, e):
        # Weak: a node outlives this object when its module is sharded
        # again (the nodes' hooks are shared).
        this = weakref.ref(self)

        def grad_ready(*unused):
            flat = this()
            if flat is not None:
                flat._move_to_push_memory(e)
        return grad_ready

    def close(self):
        """Removes the backward hooks; the gradients already in push memory
        stay there (the memory lives as long as they do)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles, self._accumulators = [], []
        self._grad_memory_wanted = False

    def _move_to_push_memory(self, e):
        """e.param.grad, when autograd (or the caller) put it elsewhere,
        copied to its view in push memory, which becomes e.param.grad."""
        grad = e.param.grad
        # A gradient with a graph (backward(create_graph=True)) keeps it.
        if grad is None or grad.requires_grad or not self._grad_memory_wanted:
            return
        if self._grad_generation != self.engine.client_generation:
            self._allocate_grad_views()
        view = self._grad_views.get(e.index)
        if (view is None or grad.data_ptr() == view.data_ptr() or grad.shape != view.shape
                or not self._pushed_directly(e, grad)):
            return
        with torch.no_grad():
            view.copy_(grad)
        e.param.grad = view.view(view.shape)

    def _push_gradients(self):
        """Pushes every element of the layout once (gradients, and zeros for
        the rest) in flat order; returns the number of push calls."""
        client = self.engine.client
        staging = self._staging
        limit = min(self._push_elements, staging.numel())
        calls = 0
        # The packed push being filled: flat [begin, end) in staging[:end -
        # begin], and the tensors without a gradient it covers.
        begin = end = None
        no_grad = []

        def flush():
            nonlocal begin, end, no_grad, calls
            if begin is not None and end > begin:
                client.push_gradients(begin, end, staging[:end - begin],
                                      no_grad=self.engine.no_grad(no_grad))
                calls += 1
            begin = end = None
            no_grad = []

        def grow():
            """The staging buffer to a whole bucket, keeping what it holds."""
            nonlocal staging, limit
            bigger = torch.zeros(self._push_elements, dtype=torch.float32)
            bigger[:end - begin].copy_(staging[:end - begin])
            self._staging = staging = bigger
            limit = self._push_elements

        def pack(e, grad, mark):
            """e's elements (grad, or zeros when None) into packed pushes."""
            nonlocal begin, end
            pos, stop = e.offset, e.offset + e.numel
            while pos < stop:
                if begin is not None and pos != end:
                    if pos - begin < limit:  # an alignment gap: zeros
                        staging[end - begin:pos - begin].zero_()
                        end = pos
                    else:
                        flush()
                if begin is None:
                    begin = end = pos
                n = min(limit - (end - begin), stop - pos)
                out = staging[end - begin:end - begin + n]
                if grad is None:
                    out.zero_()
                else:
                    copy_elements(grad, pos - e.offset, pos - e.offset + n, out)
                if mark and (not no_grad or no_grad[-1] != e.index):
                    no_grad.append(e.index)
                end += n
                pos += n
                if end - begin == limit and pos < stop and limit < self._push_elements:
                    grow()
                elif end - begin == limit:
                    flush()

        with torch.no_grad():
            for e in self.engine.entries:
                if e.kind != "param" or e.frozen:
                    pack(e, None, False)
                    continue
                g = e.param.grad
                if g is None:
                    pack(e, None, True)
                elif self._pushed_directly(e, g):
                    flush()
                    # Where backward's hook did not (a gradient set by
                    # the caller, or a rejoin's new client).
                    self._move_to_push_memory(e)
                    g = e.param.grad
                    # Lent: the client sends the buckets it covers whole
                    # straight from p.grad (staging the rest) and holds the
                    # tensor until the step has taken it in; nothing writes
                    # p.grad before the engine's step below returns.
                    client.push_gradients(e.offset, e.offset + e.numel, g.reshape(-1),
                                          borrow=True)
                    calls += 1
                else:
                    pack(e, g, False)
            flush()
        return calls

    def step(self):
        """Pushes the gradients, steps on the daemons and loads the new
        parameters; returns the step's result dict (with `pushes`, this
        rank's push_gradients calls)."""
        for e in self._not_requiring:
            if e.param.requires_grad:
                raise ValueError(unfrozen_message(e.name))
        start = time.perf_counter()
        pushes = self._push_gradients()
        result = self.engine.step(time.perf_counter() - start)
        result["pushes"] = pushes
        self.load_params()
        return result
