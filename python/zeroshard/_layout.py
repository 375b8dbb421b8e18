"""What a torch model is to the daemons: each parameter and buffer as one
tensor of the job's layout, with its names (tied weights have several),
its parameter group, whether it is frozen, and (stage 3) its layer.

Frozen tensors are stored on the daemons (for gathers, checkpoints and
exports) but never updated and hold no optimizer state: the parameters
with requires_grad=False or in no parameter group (torch.optim never
updates those), and the module's persistent buffers, which are kept with
the model's states so that checkpoints hold them and rank 0's values reach
every rank at construction. Zero-element tensors have no state and are not
registered; they keep their shapes.
"""

import torch

from zeroshard._zeroshard import Layout

# The dtypes the daemons can hold a tensor's values in without loss: fp32
# masters keep float32, bfloat16 and float16 exactly; integer and bool
# buffers are exact while their values stay within 2**24.
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXACT_INTEGER = 2 ** 24


class Entry:
    """One tensor of the layout.

    `kind` is "param" (the nn.Parameter `param`) or "buffer" (the buffer
    `key` of `module`, read afresh each time: module.to() replaces buffer
    tensors). `index` is its place in the layout and `offset` its first flat
    element, both set once the layout is made."""

    __slots__ = ("name", "aliases", "kind", "param", "module", "key", "group",
                 "frozen", "layer", "shape", "numel", "index", "offset")

    def __init__(self, name, kind, shape, group=0, frozen=False, param=None,
                 module=None, key=None):
        self.name = name
        self.aliases = []
        self.kind = kind
        self.param = param
        self.module = module
        self.key = key
        self.group = group
        self.frozen = frozen
        self.layer = 0
        self.shape = tuple(shape)
        self.numel = 1
        for d in self.shape:
            self.numel *= d
        self.index = -1
        self.offset = -1

    @property
    def tensor(self):
        if self.kind == "param":
            return self.param
        return getattr(self.module, self.key)

    @property
    def names(self):
        return [self.name] + self.aliases


def check_param_dtype(name, p, allowed=_FLOAT_DTYPES):
    """TypeError naming a parameter whose dtype the daemons cannot hold."""
    if p.dtype not in allowed:
        raise TypeError(
            f"parameter {name}: the daemons keep fp32 masters, which hold "
            f"{', '.join(str(d) for d in allowed)} parameters; got {p.dtype}")
    if p.is_complex():
        raise TypeError(f"parameter {name}: complex parameters are not supported")


def check_buffer_dtype(name, b):
    if b.dtype == torch.float64 or b.is_complex():
        raise TypeError(
            f"buffer {name}: the daemons keep fp32, which cannot hold {b.dtype} "
            "exactly; keep it float32 (or make it non-persistent)")


def buffer_values_as_float(name, b):
    """The buffer's values as float32 (ValueError naming it when an integer
    value would not survive the round trip)."""
    if b.is_floating_point():
        return b.detach().float()
    values = b.detach().to(torch.int64) if b.dtype != torch.bool else b.long()
    if values.numel() > 0 and int(values.abs().max()) > _EXACT_INTEGER:
        raise ValueError(
            f"buffer {name}: integer values beyond 2**24 cannot be kept exactly "
            "in the daemons' fp32 state")
    return values.float()


def named_persistent_buffers(module):
    """[(name, module, key, tensor)] of the persistent buffers, each buffer
    object once (the first name), as module.state_dict() lists them."""
    out, seen = [], set()
    for prefix, sub in module.named_modules():
        for key, buf in sub._buffers.items():
            if buf is None or key in sub._non_persistent_buffers_set:
                continue
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{key}" if prefix else key, sub, key, buf))
    return out


def parameter_aliases(module):
    """{id(parameter): [every name it has in module.state_dict()]}, in
    state_dict order (the first is named_parameters' name)."""
    names = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for key, p in sub._parameters.items():
            if p is None:
                continue
            full = f"{prefix}.{key}" if prefix else key
            lst = names.setdefault(id(p), [])
            if full not in lst:
                lst.append(full)
    return names


def make_layout(entries):
    """Places the registered entries (numel > 0, in layer order) and sets
    their index and offset; returns the Layout."""
    specs = []
    for i, e in enumerate(entries):
        e.index = i
        specs.append((e.name, e.shape or (1,), e.layer, e.group, e.frozen,
                      e.aliases))
    layout = Layout(specs)
    for e, off in zip(entries, layout.offsets):
        e.offset = off
    return layout
