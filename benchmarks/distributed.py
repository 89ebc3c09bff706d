"""Replication across processes: samples/s with 1 and 2 processes, and the 2-process step against DDP's.

    python benchmarks/distributed.py                 # the MLP and the conv net, 3 rounds
    python benchmarks/distributed.py --model mlp --rounds 1 --steps 3 --width 256  # quick

Each process trains one stage on its own data with one intra-op thread, G
micro-batches of B rows per optimizer step (weak scaling: P processes see P times
the samples per step): the MLP of benchmarks/pipeline.py (8 x Linear(1024)+ReLU,
MSE) or the MNIST tutorial's conv net (NLL). The processes are started as
torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on
loopback). A round runs, per model, the 1-process job, the 2-process job and the
same 2-process step in plain PyTorch under torch's DistributedDataParallel (its
Reducer: 25 MB buckets all-reduced during the backward of the last micro-batch,
``no_sync`` for the G-1 before it; each micro-batch's loss divided by G, so the
gradients are poptorch_lite's Mean), then poptorch_lite's 2-process job with
the optimizer state sharded (``useReplicatedTensorSharding``: Adam's state bytes a
process holds and the bytes its collectives send a step, against the whole state's
and a ring all-reduce's 2(P-1)/P of the gradients), one after the other. Every
side steps Adam (lr 1e-4). Each job reports
samples/s over all processes after warm-up steps; the table gives each round's
scaling (2 processes / 1, ideal 2.00 on 2 free cores) and poptorch_lite's step
time over DDP's, then the medians and spreads. Each poptorch_lite 2-process job
also times the gradient all-reduce alone: its buckets against one collective
per parameter.
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import poptorch_lite as poptorch
from _pipeline_dist import conv_stages, mlp

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
parser.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch (B)")
parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step (G)")
parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per job")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
parser.add_argument("--rounds", type=int, default=3,
                    help="rounds of (1-process, 2-process, 2-process DDP) jobs per model")
parser.add_argument("--model", choices=["mlp", "conv", "both"], default="both")
parser.add_argument("--shard", action="store_true",
                    help=argparse.SUPPRESS)  # the worker shards the optimizer state
parser.add_argument("--worker", choices=["lite", "ddp"], help=argparse.SUPPRESS)


class Net(torch.nn.Module):
    """The MLP (MSE) or the conv net (NLL), one stage."""

    def __init__(self, model, width, layers):
        super().__init__()
        self.body = mlp(width, layers) if model == "mlp" else torch.nn.Sequential(*conv_stages())
        self.loss = F.mse_loss if model == "mlp" else F.nll_loss

    def forward(self, x, y):
        out = self.body(x)
        return out, self.loss(out, y)


def step_data(args, rows):
    if args.model == "conv":
        return torch.randn(rows, 1, 28, 28), torch.randint(0, 10, (rows,))
    return torch.randn(rows, args.width), torch.randn(rows, args.width)


def timed_steps(args, step):
    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return time.perf_counter() - start


def ddp_worker(args):
    """Plain PyTorch under DistributedDataParallel: G micro-batches, the all-reduce in the
    last one's backward, one SGD step; rank 0 prints a JSON line."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    P, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank)
    net = Net(args.model, args.width, args.layers)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    B, G = args.micro_batch, args.accumulation
    x, y = step_data(args, B * G)

    def step():
        optimizer.zero_grad(set_to_none=True)
        for k in range(G):
            with model.no_sync() if k < G - 1 else contextlib.nullcontext():
                _, loss = model(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
                (loss / G).backward()
        optimizer.step()

    elapsed = timed_steps(args, step)
    if rank == 0:
        print(json.dumps({"samples_per_s": B * G * P * args.steps / elapsed,
                          "step_ms": elapsed / args.steps * 1e3}), flush=True)
    dist.destroy_process_group()


def worker(args):
    """One process: time ``args.steps`` calls (one step each); rank 0 prints a JSON line."""
    torch.set_num_threads(1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(args.accumulation)
    P, rank = opts.Distributed.numProcesses, opts.Distributed.processId
    torch.manual_seed(rank)
    net = Net(args.model, args.width, args.layers)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useReplicatedTensorSharding(args.shard))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    model = poptorch.trainingModel(net, opts, optimizer)
    rows = args.micro_batch * args.accumulation
    x, y = step_data(args, rows)
    elapsed = timed_steps(args, lambda: model(x, y))
    result = {"samples_per_s": rows * P * args.steps / elapsed,
              "step_ms": elapsed / args.steps * 1e3,
              "state_mb": sum(v.numel() * v.element_size() for st in optimizer.state.values()
                              for v in st.values() if torch.is_tensor(v)) / 1e6}
    if P > 1:
        shards = model._processes.shards(optimizer)
        gradients = sum(p.numel() * p.element_size() for p in net.parameters())
        result["sent_mb"] = (shards.sent_bytes if shards is not None else  # a ring all-reduce
                             2 * (P - 1) / P * gradients) / 1e6
    if P > 1 and not args.shard:
        replicas = model._processes
        params = dict(net.named_parameters())
        for p in params.values():  # a step's gradients (the host's .grad are the user's)
            p.grad = torch.randn_like(p)
        grads = [p.grad for p in params.values()]

        def timed(fn, repeats=5):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            return (time.perf_counter() - t) / repeats * 1e3

        result["bucketed_ms"] = timed(lambda: replicas.all_reduce_grads(params))
        result["per_parameter_ms"] = timed(lambda: [dist.all_reduce(g) for g in grads])
    if rank == 0:
        print(json.dumps(result), flush=True)


def job(P, argv, side="lite"):
    """Run the ``side`` worker in P processes; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(P), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", side, *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(P)]
    out = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a {P}-process {side} job failed")
    return json.loads(out[0])


def spread(values, fmt="{:.2f}"):
    """``median (min-max)``."""
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")


def main():
    args = parser.parse_args()
    if args.worker:
        return (worker if args.worker == "lite" else ddp_worker)(args)
    models = ["mlp", "conv"] if args.model == "both" else [args.model]
    argv = [a for a in sys.argv[1:]]
    print(f"torch {torch.__version__}; G = {args.accumulation}, B = {args.micro_batch}, "
          f"{args.steps} timed steps per job after {args.warmup}", flush=True)
    for model in models:
        rest = [a for a in argv if a not in ("--model", args.model)] + ["--model", model]
        scaling, against, sharded = [], [], []
        for r in range(args.rounds):
            one, two, ddp = job(1, rest), job(2, rest), job(2, rest, "ddp")
            shard = job(2, rest + ["--shard"])
            scaling.append(two["samples_per_s"] / one["samples_per_s"])
            against.append(two["step_ms"] / ddp["step_ms"])
            sharded.append(shard["step_ms"] / two["step_ms"])
            print(f"{model} round {r + 1}: 1 process {one['samples_per_s']:.0f} samples/s, "
                  f"2 processes {two['samples_per_s']:.0f} ({scaling[-1]:.2f}x); step "
                  f"{two['step_ms']:.1f} ms, DDP {ddp['step_ms']:.1f} ms "
                  f"({against[-1]:.2f}x DDP); all-reduce {two['bucketed_ms']:.1f} ms bucketed, "
                  f"{two['per_parameter_ms']:.1f} ms per parameter; sharded state: step "
                  f"{shard['step_ms']:.1f} ms ({sharded[-1]:.2f}x), Adam's state "
                  f"{shard['state_mb']:.4g} MB a process against {two['state_mb']:.4g} MB, sent "
                  f"{shard['sent_mb']:.4g} MB a step against the all-reduce's "
                  f"{two['sent_mb']:.4g} MB", flush=True)
        print(f"{model} median (min-max) of {args.rounds}: scaling {spread(scaling)}x "
              f"(ideal 2.00x), poptorch_lite's 2-process step / DDP's {spread(against)}x, "
              f"sharded / whole state {spread(sharded)}x", flush=True)


if __name__ == "__main__":
    main()
