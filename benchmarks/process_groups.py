"""Process groups and host traffic of each process order, at W processes of n stages each.

    python benchmarks/process_groups.py                      # W = 1024, n = 8, 8 per host
    python benchmarks/process_groups.py --world 64 --stages 4 --per-host 4

Groups (measured): one process, rank ``--rank`` of W, joins torch's "fake" process
group (no peers, no traffic: torch.testing's FakeStore) and compiles a chain of n
Linear stages over n processes (``set_ipu_processes([[0], ..., [n-1]])``), in each
order (``Options.Distributed.set_process_order``). The wrapper makes every group it
would make at W: the DeviceMesh (pipelines × stages) and, per pipeline, the groups
of each cross-process stage edge (values, gradients), of the end of a run, and of
tied weights. It prints the group-creation calls this process made (torch's own
counter, ``group_count``: one per ``new_group`` or ``split_group``), the groups it is
a member of (the only ones with a communicator), and the seconds spent making them.
Two things are replaced, since the fake group returns no data: the options check
(``Processes._check_same``) and the exchange of the stages' device kinds
(``Processes.gather``: every IPU "cpu").

Host traffic (arithmetic on the layout's own rank mapping, ``Layout.rank_of``):
ranks are on hosts of ``--per-host`` consecutive ranks. Each step, the replicas of
stage j all-reduce its gradients (G/n bytes) in a ring in rank order, each link
carrying 2(P-1)/P · G/n; and each pipeline sends each of m micro-batches'
activation (A bytes) forward over every stage boundary and its gradient back. The
table gives the most bytes any host sends to other hosts in one step. The defaults
are GPT-2 small (G = 496 MB of fp32 gradients) in 8 stages, micro-batches of
8 × 1024 tokens (A = 8 · 1024 · 768 · 4 B = 25 MB) and m = 16.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed import device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import poptorch_lite as poptorch
from poptorch_lite.distributed import processes as processes_module
from poptorch_lite.distributed.layout import Layout

ORDERS = ("pipeline_inner", "data_parallel_inner")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--world", type=int, default=1024, help="processes, W")
parser.add_argument("--stages", type=int, default=8, help="processes per pipeline, n")
parser.add_argument("--rank", type=int, default=3, help="the process that counts its groups")
parser.add_argument("--per-host", type=int, default=8, help="processes per host (GPUs)")
parser.add_argument("--gradients-mb", type=float, default=496.0, help="G: the model's gradients")
parser.add_argument("--activation-mb", type=float, default=25.0,
                    help="A: one micro-batch's activation at a stage boundary")
parser.add_argument("--micro-batches", type=int, default=16, help="m: micro-batches per step")


class Chain(torch.nn.Module):
    """n Linear layers, layer i on IPU i."""

    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            poptorch.BeginBlock(torch.nn.Linear(4, 4), ipu_id=i) for i in range(n))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return x, torch.nn.functional.mse_loss(x, y)


def groups(args, order):
    """(group-creation calls, groups joined, seconds) of rank ``args.rank`` compiling the chain."""
    c10d = dist.distributed_c10d
    calls, joined = c10d._world.group_count, len(c10d._world.pg_map)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(args.rank, args.world)
    opts.Distributed.set_ipu_processes([[i] for i in range(args.stages)])
    opts.Distributed.set_process_order(order)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(2 * args.stages)
    model = Chain(args.stages)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.zeros(2 * args.stages, 4)
    spent = [0.0]
    timed = {name: getattr(c10d, name) for name in ("new_group", "split_group")}

    def timer(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    for name, fn in timed.items():  # where the mesh and the wrapper find them
        setattr(c10d, name, timer(fn))
        setattr(dist, name, getattr(c10d, name))
        setattr(device_mesh, name, getattr(c10d, name))
    try:
        wrapped.compile(x, x)
    finally:
        for name, fn in timed.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
            setattr(device_mesh, name, fn)
    return c10d._world.group_count - calls, len(c10d._world.pg_map) - joined, spent[0]


def host_traffic(args, order):
    """(all-reduce bytes, activation bytes): the most any host sends to others in a step."""
    layout = Layout(0, args.world, tuple((i,) for i in range(args.stages)), order)
    P, n, host = layout.pipelines, layout.n, lambda rank: rank // args.per_host
    reduce_, acts = {}, {}
    link = 2 * (P - 1) / P * args.gradients_mb * 1e6 / n
    for j in range(n):
        ring = layout.replica_ranks(j)
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if P > 1 and host(a) != host(b):
                reduce_[host(a)] = reduce_.get(host(a), 0.0) + link
    each = args.micro_batches * args.activation_mb * 1e6
    for k in range(P):
        for j in range(n - 1):
            a, b = layout.rank_of(k, j), layout.rank_of(k, j + 1)
            if host(a) != host(b):  # the activations forward, their gradients back
                acts[host(a)] = acts.get(host(a), 0.0) + each
                acts[host(b)] = acts.get(host(b), 0.0) + each
    hosts = set(reduce_) | set(acts)
    worst = max(hosts, key=lambda h: reduce_.get(h, 0) + acts.get(h, 0), default=None)
    return reduce_.get(worst, 0.0), acts.get(worst, 0.0)


def main():
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    processes_module.Processes._check_same = lambda self, mine: None
    processes_module.Processes.gather = lambda self, mine: {i: "cpu" for i in
                                                            range(args.stages)}
    print(f"W = {args.world} processes, n = {args.stages} per pipeline, "
          f"{args.per_host} per host; torch {torch.__version__}")
    print(f"{'order':<22}{'group calls':>12}{'joined':>8}{'groups s':>10}"
          f"{'host all-reduce MB':>20}{'host activations MB':>21}{'host total MB':>15}")
    for order in ORDERS:
        made, joined, seconds = groups(args, order)
        reduce_, acts = host_traffic(args, order)
        print(f"{order:<22}{made:>12}{joined:>8}{seconds:>10.3f}{reduce_ / 1e6:>20.1f}"
              f"{acts / 1e6:>21.1f}{(reduce_ + acts) / 1e6:>15.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
