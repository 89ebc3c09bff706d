"""Replication across processes: samples/s with 1 and 2 processes, and the 2-process step against DDP's.

    python benchmarks/distributed.py                 # the MLP and the conv net, 10 rounds
    python benchmarks/distributed.py --model mlp --rounds 2 --steps 2 --width 256  # quick

Each process trains one stage on its own data with one intra-op thread, G
micro-batches of B rows per optimizer step (weak scaling: P processes see P times
the samples per step): the MLP of benchmarks/pipeline.py (8 x Linear(1024)+ReLU,
MSE) or the MNIST tutorial's conv net (NLL). Every side steps Adam (lr 1e-4). The
processes are started as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; gloo on loopback). Per model, four jobs are started and warmed up one
after the other, then live side by side: poptorch_lite in 1 process, poptorch_lite
in 2, the same 2-process step in plain PyTorch under torch's
DistributedDataParallel (its Reducer: 25 MB buckets all-reduced during the backward
of the last micro-batch, ``no_sync`` for the G-1 before it; each micro-batch's loss
divided by G, so the gradients are poptorch_lite's Mean), and poptorch_lite's
2-process job with the optimizer state sharded (``useReplicatedTensorSharding``).
A round asks each job in turn for a block of ``--steps`` steps (by default as many
as the 2-process job takes in about a second; the order rotates by one each round)
while the others wait on their pipes, as ``tax.py`` takes turns, so a shared
machine's drift over seconds falls on all four alike. Each round's
row gives the step times, the scaling (2 processes / 1 in samples/s, ideal 2.00 on
2 free cores), poptorch_lite's step over DDP's beside it, and the sharded step over
the whole state's; then the medians and spreads over the rounds. At the end the
2-process jobs report Adam's state bytes a process holds and the bytes their
collectives send a step (against the whole state's and a ring all-reduce's 2(P-1)/P
of the gradients), and the 2-process job times the gradient all-reduce alone: its
buckets against one collective per parameter.
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
parser.add_argument("--steps", type=int, default=0,
                    help="timed optimizer steps per block (0: about a second's worth)")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
parser.add_argument("--rounds", type=int, default=10,
                    help="rounds per model: a block of steps from each job in turn")
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


def serve(args, step, rank, final=lambda: {}):
    """Warm up, say ready, then time a block of K steps for each line ``block K`` read on
    stdin (every rank reads the line; the ranks meet at a barrier first) and answer with a
    JSON line; at the end of stdin, every rank runs ``final`` and rank 0 prints its JSON."""
    for _ in range(args.warmup):
        step()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        steps = int(line.split()[1])
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        print(json.dumps({"step_ms": (time.perf_counter() - start) / steps * 1e3}),
              flush=True)
    result = final()
    if rank == 0:
        print(json.dumps(result), flush=True)


def ddp_worker(args):
    """Plain PyTorch under DistributedDataParallel: G micro-batches, the all-reduce in the
    last one's backward, one Adam step (``serve``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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

    serve(args, step, rank)
    dist.destroy_process_group()


def worker(args):
    """One process of poptorch_lite: calls of one step each (``serve``); at the end, the
    optimizer state it holds, the bytes a step sends and the all-reduce timed alone."""
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
    x, y = step_data(args, args.micro_batch * args.accumulation)

    def final():
        result = {"state_mb": sum(v.numel() * v.element_size()
                                  for st in optimizer.state.values()
                                  for v in st.values() if torch.is_tensor(v)) / 1e6}
        if P > 1:
            shards = model._processes.shards(optimizer)
            gradients = sum(p.numel() * p.element_size() for p in net.parameters())
            result["sent_mb"] = (shards.sent_bytes if shards is not None else  # a ring
                                 2 * (P - 1) / P * gradients) / 1e6  # all-reduce
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
        return result

    serve(args, lambda: model(x, y), rank, final)


class Job:
    """A ``--serve`` worker in each of P processes (torchrun's variables, gloo on loopback),
    warmed up; ``block()`` times a block of steps in all of them (rank 0's step in ms),
    ``close()`` ends them and returns rank 0's final report."""

    def __init__(self, P, argv, side="lite"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(P), "OMP_NUM_THREADS": "1"}
        self.name = f"the {P}-process {side} job"
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker", side, *argv],
                                       env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for r in range(P)]
        self._answers()  # warmed up (the next job starts after)

    def _answers(self) -> list:
        lines = [p.stdout.readline() for p in self.procs]
        if not all(lines):
            self.kill()
            sys.exit(f"{self.name} failed (exit codes {[p.wait() for p in self.procs]})")
        return [json.loads(line) for line in lines]

    def block(self, steps: int) -> float:
        for p in self.procs:
            p.stdin.write(f"block {steps}\n")
            p.stdin.flush()
        return self._answers()[0]["step_ms"]

    def close(self) -> dict:
        for p in self.procs:
            p.stdin.close()
        out = self.procs[0].stdout.read()
        if any(p.wait() for p in self.procs):
            sys.exit(f"{self.name} failed at its end")
        return json.loads(out)

    def kill(self):
        for p in self.procs:
            p.kill()


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
          f"{args.rounds} rounds of a block of {args.steps or 'about a second of'} timed steps "
          f"per job after {args.warmup}", flush=True)
    for model in models:
        rest = [a for a in argv if a not in ("--model", args.model)] + ["--model", model]
        jobs = {}
        try:
            for name, P, extra in (("one", 1, ()), ("two", 2, ()), ("ddp", 2, ("ddp",)),
                                   ("shard", 2, ())):
                jobs[name] = Job(P, rest + (["--shard"] if name == "shard" else []), *extra)
            scaling, against, sharded = [], [], []
            names = list(jobs)
            steps = args.steps or max(1, round(1000 / jobs["two"].block(1)))
            print(f"{model}: blocks of {steps} steps", flush=True)
            for r in range(args.rounds):  # the order rotates: no job always follows another
                step = {}
                for name in names[r % 4:] + names[:r % 4]:
                    step[name] = jobs[name].block(steps)
                scaling.append(2 * step["one"] / step["two"])  # samples/s, 2 processes / 1
                against.append(step["two"] / step["ddp"])
                sharded.append(step["shard"] / step["two"])
                print(f"{model} round {r + 1}: step ms 1 process {step['one']:.1f}, 2 processes "
                      f"{step['two']:.1f} (scaling {scaling[-1]:.2f}x), DDP {step['ddp']:.1f} "
                      f"({against[-1]:.2f}x DDP), sharded state {step['shard']:.1f} "
                      f"({sharded[-1]:.2f}x)", flush=True)
            two, shard = jobs.pop("two").close(), jobs.pop("shard").close()
        finally:
            for job in jobs.values():
                job.kill()
        print(f"{model}: all-reduce {two['bucketed_ms']:.1f} ms bucketed, "
              f"{two['per_parameter_ms']:.1f} ms per parameter; sharded state: Adam's state "
              f"{shard['state_mb']:.4g} MB a process against {two['state_mb']:.4g} MB, sent "
              f"{shard['sent_mb']:.4g} MB a step against the all-reduce's "
              f"{two['sent_mb']:.4g} MB", flush=True)
        print(f"{model} median (min-max) of {args.rounds}: scaling {spread(scaling)}x "
              f"(ideal 2.00x), poptorch_lite's 2-process step / DDP's {spread(against)}x, "
              f"sharded / whole state {spread(sharded)}x", flush=True)


if __name__ == "__main__":
    main()
