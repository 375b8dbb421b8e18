"""offload_activations: the tensors autograd saves for backward, kept in a
daemon's activation arena (client/activation_store.h) instead of the
trainer's memory, through torch.autograd.graph.saved_tensors_hooks."""

import collections
import contextlib
import itertools
import threading
import warnings
import weakref

import torch

from zeroshard._zeroshard import ActivationStore, Client

# Saved tensors smaller than this stay in the trainer: each offload and
# fetch is a round trip to the daemon.
DEFAULT_MIN_BYTES = 1 << 20
# Fetches started ahead of the one backward asks for.
DEFAULT_PREFETCH = 2

# Keys (step, micro_batch, layer): every `with` block is a step of its own,
# numbered process-wide (a store's keys are this rank's on its daemon), and
# its saved tensors are layers 0, 1, ... in the order the forward saved them.
_block_ids = itertools.count(1)
# Slices whose handle autograd dropped without unpacking them (a graph freed
# without backward), by store: freed the next time a block opens on it.
_dropped = weakref.WeakKeyDictionary()  # ActivationStore -> deque of (step, layer)
_dropped_lock = threading.RLock()  # re-entered when a collection drops a handle


def _is_dense(t):
    """Whether t's elements fill its memory without gaps or overlaps (in any
    dimension order): then its data_ptr and nbytes are the whole of it, and
    torch.empty_strided(size, stride) lays out a copy the same way."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _is_parameter(t):
    # Parameters (and views of them: F.linear saves weight.t()) stay: the
    # graph holds them anyway, and stage 3 frees and re-gathers their
    # storage, which an offload still reading it must not see.
    base = t._base
    return (isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)
            or isinstance(base, torch.nn.Parameter)
            or (base is not None and base.is_leaf and base.requires_grad))


class _Saved:
    """What the graph holds in place of an offloaded tensor."""

    __slots__ = ("block", "layer", "size", "stride", "dtype", "device", "version", "state",
                 "src", "offload", "out", "fetch", "value", "__weakref__")

    def __init__(self, block, layer, src, device, offload):
        self.block = block
        self.layer = layer
        self.size = src.size()
        self.stride = src.stride()
        self.dtype = src.dtype
        self.device = device
        self.version = src._version  # the saved tensor's (detach shares the counter)
        # "offloading" (src held until the daemon has it) -> "stored" ->
        # "fetching" -> "fetched"; or "kept" when the offload failed (the
        # daemon's arena and spill space full): src stays the value; or
        # "modified": changed in place before its offload was seen done.
        self.state = "offloading"
        self.src = src
        self.offload = offload
        self.out = None    # the fetch's destination
        self.fetch = None
        self.value = None  # what unpack returned (a second backward gets it again)

    def __del__(self):
        if self.state in ("offloading", "stored"):  # on the daemon, never fetched
            try:
                self.block.dropped(self.layer)
            except Exception:  # noqa: BLE001 -- interpreter shutdown
                pass


class _Block:
    """One `with offload_activations(...)` block's saved tensors."""

    def __init__(self, store, min_bytes, prefetch):
        self.store = store
        self.step = next(_block_ids)
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.lock = threading.Lock()
        self.saved = []       # weak references to the _Saved handles, by layer
        self.offloading = []  # weak references to handles whose offload may still run
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self.kept_tensors = 0  # offloads that failed: kept in the trainer
        self.scanned_from = None  # the lowest layer backward's prefetch has looked at
        self.prefetched = []      # weak references to handles fetched ahead of their unpack
        # id(tensor) -> (weak reference to it, to its handle, its version):
        # a tensor saved again (by the next op, or twice by one) unchanged
        # shares its handle.
        self.by_id = {}

    def pack(self, t):
        if (t.layout != torch.strided or t.device.type not in ("cpu", "cuda")
                or t.numel() * t.element_size() < max(1, self.min_bytes)
                or _is_parameter(t) or not _is_dense(t)):
            return t
        with self.lock:
            seen = self.by_id.get(id(t))
            if seen is not None and seen[0]() is t and seen[2] == t._version:
                handle = seen[1]()
                if handle is not None:
                    return handle
            src = t.detach()
            if src.device.type == "cuda":
                src = src.to("cpu")  # same strides (preserve_format); waits for the copy
            self._settle(block=False)
            layer = len(self.saved)
            handle = _Saved(self, layer, src, t.device,
                            self.store.offload(self.step, layer, src))
            self.saved.append(weakref.ref(handle))
            self.offloading.append(self.saved[-1])
            self.by_id[id(t)] = (weakref.ref(t), self.saved[-1], t._version)
            self.offloaded_bytes += src.numel() * src.element_size()
            self.offloaded_tensors += 1
        return handle

    def _settle_one(self, h, block):
        """Ends h's "offloading" state once its offload is done (waiting for it
        when `block`); False if it still runs."""
        if h.state != "offloading":
            return True
        if not block and not h.offload.done:
            return False
        try:
            h.offload.wait()
            h.state = "stored"
        except Exception as e:  # noqa: BLE001 -- any failure: keep the tensor here
            value = h.src if h.device.type == "cpu" else h.src.to(h.device)
            h.state, h.value, h.src = "kept", value, None
            self.kept_tensors += 1
            self.offloaded_bytes -= h.value.numel() * h.value.element_size()
            self.offloaded_tensors -= 1
            warnings.warn(f"offload_activations: kept a saved tensor in the trainer ({e})",
                          RuntimeWarning, stacklevel=3)
        # The store read the tensor while the forward went on: changed in
        # place meanwhile, what it read may be either (autograd without the
        # hooks refuses any change of a saved tensor).
        changed = h.src is not None and h.src._version != h.version
        if h.state == "kept" and h.value._version != h.version:
            changed = True
        if changed:
            if h.state == "stored":
                self.dropped(h.layer)  # freed with the next block's
            h.state, h.value = "modified", None
        h.src, h.offload = None, None
        return True

    def _settle(self, block):
        self.offloading = [r for r in self.offloading
                           if r() is not None and not self._settle_one(r(), block)]

    def _start_fetch(self, h):
        h.out = torch.empty_strided(h.size, h.stride, dtype=h.dtype)
        h.fetch = self.store.start_fetch(self.step, h.layer, h.out, free=True)
        h.state = "fetching"

    def unpack(self, h):
        with self.lock:
            self._settle_one(h, block=True)
            if h.state == "modified":
                raise RuntimeError(
                    "offload_activations: one of the tensors saved for backward was "
                    f"modified by an inplace operation (shape {tuple(h.size)}, {h.dtype}, "
                    f"version {h.version} when saved) while it was being offloaded")
            if h.value is not None:
                return h.value
            if h.state == "stored":
                self._start_fetch(h)
            # Backward unpacks roughly in the reverse order of the forward's
            # saves: fetch the next ones while this one is used.
            self._settle(block=False)
            # At most `prefetch` fetches run ahead (below this layer). Layers
            # above the lowest one looked at before are not visited again (a
            # handle passed over there is fetched when unpacked).
            self.prefetched = [r for r in self.prefetched
                               if r() is not None and r().state == "fetching"]
            ahead = sum(1 for r in self.prefetched if r().layer < h.layer)
            layer = h.layer - 1
            if self.scanned_from is not None:
                layer = min(layer, self.scanned_from - 1)
            while ahead < self.prefetch and layer >= 0:
                nxt = self.saved[layer]()
                if nxt is not None and nxt.state == "stored":
                    self._start_fetch(nxt)
                    self.prefetched.append(self.saved[layer])
                    ahead += 1
                self.scanned_from = layer
                layer -= 1
        h.fetch.wait()
        value = h.out if h.device.type == "cpu" else h.out.to(h.device)
        h.value, h.out, h.fetch, h.state = value, None, None, "fetched"
        return value

    def dropped(self, layer):
        with _dropped_lock:
            _dropped.setdefault(self.store, collections.deque()).append((self.step, layer))


def _free_dropped(store):
    with _dropped_lock:
        keys = _dropped.pop(store, None)
    if keys:
        for step, layer in keys:
            store.free(step, layer)


def _store_of(target):
    """The ActivationStore of a ShardedModel, ShardedOptimizer, Client or
    ActivationStore."""
    if isinstance(target, ActivationStore):
        return target
    engine = getattr(target, "_engine", None)
    if engine is not None:
        return engine.activation_store()
    if isinstance(target, Client):
        # A store for this block alone: it lives as long as the graph's
        # handles. Pass client.open_activation_store() to reuse one.
        return target.open_activation_store()
    raise TypeError("offload_activations: expected a ShardedModel, ShardedOptimizer, "
                    f"zeroshard.Client or zeroshard.ActivationStore, got {type(target).__name__}")


@contextlib.contextmanager
def offload_activations(target, min_bytes=DEFAULT_MIN_BYTES, prefetch=DEFAULT_PREFETCH):
    """Within the block, each tensor autograd saves for backward that holds at
    least `min_bytes` bytes goes to a daemon's activation arena, and comes
    back when backward needs it (the next `prefetch` ones are fetched
    meanwhile); the gradients are bit-identical to keeping them. Yields an
    object whose `offloaded_bytes` and `offloaded_tensors` count what went.
    See zeroshard.torch.offload_activations."""
    if min_bytes < 0 or prefetch < 0:
        raise ValueError("offload_activations: min_bytes and prefetch must be >= 0")
    store = _store_of(target)
    _free_dropped(store)
    block = _Block(store, int(min_bytes), int(prefetch))

    def unpack(x):
        return block.unpack(x) if isinstance(x, _Saved) else x

    with torch.autograd.graph.saved_tensors_hooks(block.pack, unpack):
        yield block
    with block.lock:
        block._settle(block=False)  # drop the sources of offloads already done
