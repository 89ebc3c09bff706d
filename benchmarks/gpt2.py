"""A step of transformers' GPT-2 pipelined: poptorch_lite against plain PyTorch and torch.distributed.pipelining.

    python benchmarks/gpt2.py                      # 2 stages, micro-batch 4, m = 8, 20 repeats
    python benchmarks/gpt2.py --repeats 5 --warmup 1 --torch-schedules ""   # a quick look

Needs transformers (the ``.[hf]`` extra). The model is examples/gpt2_pipelined.py's:
``GPT2LMHeadModel`` from a config (vocabulary 256, windows of 128 bytes, ``--width``,
``--layers``, dropout 0.1), split in 2 stages by ``BeginBlock`` on the middle layer. One
training step is m micro-batches of B windows forward and backward, gradients averaged, and
one SGD step. Rows:

    plain PyTorch, micro-batched   m forwards/backwards of the unwrapped model; the baseline
    poptorch_lite <schedule>       one call of the wrapped model (stages on worker streams)
    torch <schedule>               torch.distributed.pipelining, a process per stage (gloo on
                                   loopback), the same layers cut the same way (the output
                                   head an untied copy of the embedding: stages cannot share it)

"per step" is the wall time of a step over the baseline's (the pipelined rows run the
stages at once, so on an idle multi-core machine they are below 1). Every process
computes with one intra-op thread. Repetitions are interleaved after warm-up rounds;
each figure is the median, with the spread (lowest-highest) beside it.
"""

import argparse
import copy
import statistics
import time

import torch
from tqdm import tqdm

import poptorch_lite as poptorch
from _pipeline_dist import SCHEDULES as TORCH_SCHEDULES, Ranks, batch, gpt2

S = 2

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=128, help="embedding width")
parser.add_argument("--layers", type=int, default=4, help="transformer layers, half per stage")
parser.add_argument("--micro-batch", type=int, default=4, help="windows per micro-batch (B)")
parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (m)")
parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
parser.add_argument("--warmup", type=int, default=3, help="untimed rounds of every variant first")
parser.add_argument("--schedules", default="sequential,grouped,interleaved+recompute",
                    help="poptorch_lite variants: a PipelineSchedule name, optionally +recompute")
parser.add_argument("--torch-schedules", default="gpipe,1f1b",
                    help="torch.distributed.pipelining schedules; empty to skip them")


def timed(fn):
    def run():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run


def plain_step(base, ids, m, lr):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    chunks = ids.chunk(m)

    def step():
        opt.zero_grad(set_to_none=True)
        for c in chunks:
            model(input_ids=c, labels=c).loss.backward()
        for p in model.parameters():
            p.grad.div_(m)
        opt.step()
    return step


def lite_step(base, ids, m, lr, variant):
    name, plus, _ = variant.partition("+")
    model = copy.deepcopy(base)
    poptorch.BeginBlock(model.transformer.h[len(model.transformer.h) // 2], "s1", ipu_id=1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(m)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.parse(name)))
    if plus:
        opts._Popart.set("autoRecomputation", 3)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=lr))
    return lambda: wrapped(input_ids=ids, labels=ids)


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)
    m, B = args.microbatches, args.micro_batch
    base = gpt2(args.width, args.layers)
    base.train()
    ids, _ = batch("gpt2", m * B, args.width)
    baseline = f"plain PyTorch, micro-batched ({m} x {B})"
    variants = {baseline: timed(plain_step(base, ids, m, args.lr))}
    for v in filter(None, args.schedules.split(",")):
        variants[f"poptorch_lite {v}"] = timed(lite_step(base, ids, m, args.lr, v))
    names = [n for n in args.torch_schedules.split(",") if n]
    ranks = None
    if names:
        ranks = Ranks("torch", names, S, model="gpt2", width=args.width, layers=args.layers,
                      micro_batch=B, m=m, lr=args.lr)
        for n in names:
            variants[f"torch {TORCH_SCHEDULES[n].__name__} ({S} processes)"] = (
                lambda n=n: ranks.step(n)[0])
    try:
        for _ in tqdm(range(args.warmup), desc="warm-up", leave=False):
            for run in variants.values():
                run()
        samples = {label: [] for label in variants}
        for _ in tqdm(range(args.repeats), desc="timing", leave=False):
            for label, run in variants.items():
                samples[label].append(run())
    finally:
        if ranks is not None:
            ranks.close()
    params = sum(p.numel() for p in base.parameters())
    print(f"model: transformers GPT2LMHeadModel, {args.layers} layers of width {args.width} "
          f"({params} parameters), windows of 128 bytes, {S} stages; B = {B}, m = {m}; "
          f"torch {torch.__version__}")
    print(f"median of {args.repeats} interleaved steps after {args.warmup} warm-up rounds, "
          f"one intra-op thread per stream/process\n")
    print(f"{'variant':<44} {'ms/step':>8} {'spread ms':>15} {'per step':>9}")
    print(f"{'-' * 44} {'-' * 8} {'-' * 15} {'-' * 9}")
    base_ms = statistics.median(samples[baseline]) * 1e3
    for label, v in samples.items():
        ms = statistics.median(v) * 1e3
        print(f"{label:<44} {ms:8.1f} {min(v) * 1e3:7.1f}-{max(v) * 1e3:<7.1f} "
              f"{ms / base_ms:8.2f}x")


if __name__ == "__main__":
    main()
