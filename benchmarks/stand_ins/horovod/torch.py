"""The part of ``horovod.torch`` Graphcore's applications call (the CNNs' popdist path), on
torch.distributed's default group, which ``popdist.init()`` joins; in one process each call
is the identity. A stand-in for the apps harness (``benchmarks/apps.py``), not a Horovod.
"""

import os

import torch
import torch.distributed as dist

Sum, Average = "sum", "average"


def _several() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init() -> None:
    """Nothing more than ``popdist.init()`` did."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        import popdist
        popdist.init()


def rank() -> int:
    return dist.get_rank() if _several() else 0


def size() -> int:
    return dist.get_world_size() if _several() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def broadcast(tensor, root_rank, name=None):
    out = tensor.clone()
    if _several():
        dist.broadcast(out, root_rank)
    return out


def broadcast_parameters(params, root_rank) -> None:
    items = params.items() if hasattr(params, "items") else params
    for _, p in items:
        if _several():
            with torch.no_grad():
                dist.broadcast(p.data, root_rank)


def allgather(tensor, name=None):
    """The tensors of every process, concatenated along the first dimension."""
    if not _several():
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def allreduce(tensor, average=None, name=None, op=None):
    op = op or (Sum if average is False else Average)
    out = tensor.clone()
    if _several():
        dist.all_reduce(out)
        if op == Average:
            out = out / size() if out.is_floating_point() else out // size()
    return out


def grouped_allreduce(tensors, average=None, name=None, op=None):
    return [allreduce(t, average=average, op=op) for t in tensors]
