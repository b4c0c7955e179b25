"""Simulated GPU placement on CPU: fail a CPU run where CUDA and NCCL would fail the GPU run.

On a GPU node the learner's tensors live on the GPU, and NCCL collectives take CUDA tensors only
("No backend type associated with device type cpu"). On CPU every tensor is a CPU tensor and gloo
takes anything, so a tensor left on the host — `torch.tensor([flag])` handed to an all-reduce, a
batch field mixed with a model output — passes every CPU test and breaks the first GPU step.
With `MRL_DEVICE_CHECK=1` (set by the test suite) `install()` tracks where each tensor *would*
live on a GPU node and enforces CUDA's two rules.

Where a tensor would live:
- host: made by a factory without `device=` (`torch.tensor([x])`, `torch.zeros(n)`), by `.cpu()`,
  `torch.from_numpy`, `torch.load` (no `map_location`), or an op whose tensor inputs are all host
  (or by `x.new_*` / `*_like` of a host tensor);
- device: a factory with an explicit CUDA `device=` (Megatron's
  `device=torch.cuda.current_device()`, our `device=ctx.device`), `.to(device)` / `.cuda()`,
  and an op with a device input (activations, logits);
- unknown: tensors made outside torch's Python API (parameters wrapped by nn.Parameter, file
  readers such as safetensors, autograd's gradients); they never count as a violation.
Under the check `ctx.device` is `torch.device("cuda")`, which the CPU layer places on the CPU
(handing the rewritten spec on as the string "cpu"). A `torch.device("cpu")` argument is unknown:
it is what `x.device` returns for every tensor here, host or device.

The rules (CUDA's own):
1. a collective on a device group — any group but one created with `backend="gloo"` — takes
   device tensors only (object collectives pickle through tensors of their own and are exempt);
2. no op mixes a device tensor with a host tensor of one or more dimensions ("Expected all
   tensors to be on the same device"); 0-dim host tensors are scalars to CUDA and may mix, a
   device tensor may be indexed with host indices, and copies between the two are fine.
A violation raises `DeviceDisciplineError` at the offending call.

This is a test instrument for the CPU suite; on machines with CUDA it is never installed.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_PLACE = "_mrl_place"  # "host" | "device"; absent: unknown (made outside torch's Python API)
_installed = False
_host_groups: set = set()  # groups made with backend="gloo": on a GPU node these stay on the host
_in_object_collective = 0


class DeviceDisciplineError(RuntimeError):
    pass


def enabled() -> bool:
    return os.environ.get("MRL_DEVICE_CHECK") == "1"


def place(t) -> str | None:
    return getattr(t, _PLACE, None) if isinstance(t, torch.Tensor) else None


def is_host(t) -> bool:
    return place(t) == "host"


def _mark(out, where: str | None):
    """Tag `out` (a tensor or a flat tuple/list of them) with its place; None leaves it."""
    if where is not None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                setattr(t, _PLACE, where)
    return out


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _describe(t: torch.Tensor) -> str:
    return f"{place(t) or 'unknown'} {t.dtype} {tuple(t.shape)}"


def _fns(prefix: str, *names: str) -> frozenset:
    # Matched by qualified name: the function objects the mode receives are not always the ones
    # `torch.X` / `torch.Tensor.X` hold (the CPU layer wraps some; torch wraps some methods).
    return frozenset(f"{prefix}.{n}" for n in names)


_FN, _METHOD = "_VariableFunctionsClass", "TensorBase"
_FACTORIES = _fns(_FN, "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
                  "randint", "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor")
_LIKE = _fns(_FN, "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
             "randint_like") | _fns(_METHOD, "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")
_TO_HOST = _fns(_METHOD, "cpu") | _fns(_FN, "from_numpy", "frombuffer")
_TO, _GETITEM = f"{_METHOD}.to", f"{_METHOD}.__getitem__"
# May take host and device tensors together on CUDA (copies), or never mix (reads of one tensor).
_MIX_OK = _fns(_METHOD, "copy_", "__setitem__", "index_put_", "index_put", "__repr__", "__format__",
               "type_as", "set_")


def _placed(d) -> str | None:
    """Where a device argument puts a tensor: a `torch.device("cpu")` object is unknown (it is
    what `x.device` gives for every tensor here, host or device); anything else names a device
    (the CPU layer rewrites CUDA specs to the string "cpu")."""
    return None if isinstance(d, torch.device) and d.type == "cpu" else "device"


def _factory_place(kwargs) -> str | None:
    return "host" if "device" not in kwargs else _placed(kwargs["device"])


def _to_target(args, kwargs) -> str | None:
    """`.to(...)`'s placement, or None when it names no device (a dtype change)."""
    if "device" in kwargs:
        return _placed(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return place(a)
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return _placed(a)
    return None


def _to_device(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if out is src and place(src) != "device":
        out = src.view_as(src)  # on CPU no copy happens: the "device copy" is an alias
    return _mark(out, "device")


class DeviceCheckMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", "")
        if name in _FACTORIES:
            # torch.as_tensor(t) / torch.tensor(t) of a tensor stay where it is.
            if args and isinstance(args[0], torch.Tensor) and "device" not in kwargs:
                return _mark(func(*args, **kwargs), place(args[0]))
            return _mark(func(*args, **kwargs), _factory_place(kwargs))
        if name in _TO_HOST:
            return _mark(func(*args, **kwargs), "host")
        if name in _LIKE:
            where = place(args[0]) if "device" not in kwargs else _placed(kwargs["device"])
            return _mark(func(*args, **kwargs), where)
        if name == _TO:
            target = _to_target(args, kwargs)
            if target == "device":
                return _to_device(args[0], func(*args, **kwargs))
            out = func(*args, **kwargs)
            return _mark(out, target or place(args[0])) if out is not args[0] else out
        tensors = _tensors(args, kwargs)
        places = [place(t) for t in tensors]
        if name == _GETITEM:
            # CUDA moves host indices to the device; a host tensor indexed by device ones fails.
            if places and places[0] == "host" and any(p == "device" and t.dim()
                                                      for p, t in zip(places[1:], tensors[1:])):
                self._fail(func, tensors)
            return _mark(func(*args, **kwargs), places[0] if places else None)
        if name not in _MIX_OK and "device" in places and any(
                p == "host" and t.dim() for p, t in zip(places, tensors)):
            self._fail(func, tensors)
        out = func(*args, **kwargs)
        if not tensors or name in _MIX_OK or (args and out is args[0]):
            return out  # in place: the tensor stays where it was
        if "device" in places:
            return _mark(out, "device")
        return _mark(out, "host" if all(p == "host" for p in places) else None)

    @staticmethod
    def _fail(func, tensors):
        raise DeviceDisciplineError(
            f"{getattr(func, '__qualname__', func)} mixes tensors that would be on different devices "
            f"on a GPU node: {', '.join(_describe(t) for t in tensors)} (CUDA: 'Expected all tensors "
            "to be on the same device'); create the host one with device=... or move it with .to(device)")


# --- collectives ------------------------------------------------------------------------------
_DATA_ARGS = ("tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor",
              "scatter_list", "gather_list", "output_tensor_list", "input_tensor_list", "input_list")
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
                "send", "recv", "_all_gather_base", "_reduce_scatter_base")
# isend / irecv stay unwrapped: P2POp checks its op by identity against them; P2P ops go through
# batch_isend_irecv, which is checked.
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object",
                       "scatter_object_list", "send_object_list", "recv_object_list")


def _check_collective(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if not _in_object_collective and group not in _host_groups:
            data = [a for a in args[:2]] + [kwargs[k] for k in _DATA_ARGS if k in kwargs]
            for t in _tensors(data, {}):
                if is_host(t):
                    raise DeviceDisciplineError(
                        f"torch.distributed.{name} got a host tensor ({_describe(t)}) on a device "
                        "group: NCCL takes CUDA tensors only ('No backend type associated with "
                        "device type cpu'); create it with device=... or move it with .to(device)")
        return fn(*args, **kwargs)

    return wrapper


def _batch_isend_irecv(fn):
    @functools.wraps(fn)
    def wrapper(p2p_op_list):
        for op in p2p_op_list:
            if op.group not in _host_groups and is_host(op.tensor):
                raise DeviceDisciplineError(f"batch_isend_irecv got a host tensor ({_describe(op.tensor)})")
        return fn(p2p_op_list)

    return wrapper


def _object_collective(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _in_object_collective
        _in_object_collective += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _in_object_collective -= 1

    return wrapper


def _new_group(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = fn(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo":
            _host_groups.add(group)
        return group

    return wrapper


def _load(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if kwargs.get("map_location") is None and len(args) < 2:
            _mark_tree(out)
        return out

    return wrapper


def _mark_tree(obj) -> None:
    """Tag every CPU tensor in a loaded object (dicts, lists, tuples) as host."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            _mark(obj, "host")
    elif isinstance(obj, dict):
        for v in obj.values():
            _mark_tree(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _mark_tree(v)


def installed() -> bool:
    return _installed


def install() -> None:
    """Start checking (idempotent); after the CPU layer, so this mode runs innermost."""
    global _installed
    if _installed:
        return
    for name in _COLLECTIVES:
        setattr(dist, name, _check_collective(name, getattr(dist, name)))
    for name in _OBJECT_COLLECTIVES:
        setattr(dist, name, _object_collective(getattr(dist, name)))
    dist.batch_isend_irecv = _batch_isend_irecv(dist.batch_isend_irecv)
    dist.new_group = _new_group(dist.new_group)
    torch.load = _load(torch.load)
    cuda = torch.Tensor.cuda  # the CPU layer's: returns the tensor itself, no torch call to see
    torch.Tensor.cuda = lambda self, *a, **k: _to_device(self, cuda(self, *a, **k))
    DeviceCheckMode().__enter__()  # process-wide; never exited
    _installed = True
