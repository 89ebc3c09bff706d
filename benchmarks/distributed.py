"""Replication across processes: samples/s with 1 and 2 processes on the pipelining benchmark's MLP.

    python benchmarks/distributed.py                 # 8 x Linear(1024)+ReLU, micro-batch 32, G = 8
    python benchmarks/distributed.py --rounds 1 --steps 3 --width 256   # a quick smoke run

Each process trains the compute-bound MLP of benchmarks/pipeline.py (one
stage, so one stream) with one intra-op thread, G micro-batches of B rows per
optimizer step, on its own data (weak scaling: P processes see P times the
samples per step). The processes are started as torchrun would start them
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on loopback). A round runs
the 1-process job, then the 2-process job; each reports samples/s over all
processes after warm-up calls, and the ratio of the two is the scaling (ideal
2.00 on 2 free cores). Each 2-process job also times the gradient all-reduce
alone: poptorch_lite's 25 MB buckets against one collective per parameter.
"""

import argparse
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
from _pipeline_dist import mlp

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
parser.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch (B)")
parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step (G)")
parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per job")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
parser.add_argument("--rounds", type=int, default=3, help="(1-process, 2-process) job pairs")
parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


class Net(torch.nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.body = mlp(width, layers)

    def forward(self, x, y):
        out = self.body(x)
        return out, F.mse_loss(out, y)


def worker(args):
    """One process: time ``args.steps`` calls (one step each); rank 0 prints a JSON line."""
    torch.set_num_threads(1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(args.accumulation)
    P, rank = opts.Distributed.numProcesses, opts.Distributed.processId
    torch.manual_seed(rank)
    net = Net(args.width, args.layers)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=1e-4))
    rows = args.micro_batch * args.accumulation
    x, y = torch.randn(rows, args.width), torch.randn(rows, args.width)
    for _ in range(args.warmup):
        model(x, y)
    start = time.perf_counter()
    for _ in range(args.steps):
        model(x, y)
    elapsed = time.perf_counter() - start
    result = {"samples_per_s": rows * P * args.steps / elapsed}
    if P > 1:
        replicas = model._processes  # the gradients of the last step are still in .grad
        params = dict(net.named_parameters())
        grads = [p.grad for p in params.values()]

        def timed(fn, repeats=5):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            return (time.perf_counter() - t) / repeats * 1e3

        result["bucketed_ms"] = timed(lambda: replicas.all_reduce_grads(params))
        result["per_parameter_ms"] = timed(lambda: [dist.all_reduce(g) for g in grads])
        result["step_ms"] = elapsed / args.steps * 1e3
    if rank == 0:
        print(json.dumps(result), flush=True)


def job(P, argv):
    """Run the worker in P processes; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(P), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(P)]
    out = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a {P}-process job failed")
    return json.loads(out[0])


def main():
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    argv = [a for a in sys.argv[1:]]
    one, two = [], []
    for r in range(args.rounds):
        one.append(job(1, argv))
        two.append(job(2, argv))
        print(f"round {r + 1}: 1 process {one[-1]['samples_per_s']:.0f} samples/s, "
              f"2 processes {two[-1]['samples_per_s']:.0f} samples/s, "
              f"ratio {two[-1]['samples_per_s'] / one[-1]['samples_per_s']:.2f}x; all-reduce "
              f"{two[-1]['bucketed_ms']:.1f} ms bucketed, {two[-1]['per_parameter_ms']:.1f} ms "
              f"per parameter, step {two[-1]['step_ms']:.0f} ms", flush=True)
    a = statistics.median(j["samples_per_s"] for j in one)
    b = statistics.median(j["samples_per_s"] for j in two)
    print(f"median: 1 process {a:.0f} samples/s, 2 processes {b:.0f} samples/s, "
          f"ratio {b / a:.2f}x (ideal 2.00x)")


if __name__ == "__main__":
    main()
