"""A step of transformers' GPT-2 pipelined: poptorch_lite against plain PyTorch and torch.distributed.pipelining.

    python benchmarks/gpt2.py                      # 2 stages, micro-batch 4, m = 4 and 8, 20 repeats
    python benchmarks/gpt2.py --repeats 5 --warmup 1 --torch-schedules ""   # a quick look
    python benchmarks/gpt2.py --device cuda --width 768 --layers 12 --seq 512 \
        --torch-schedules "" --repeats 5 --warmup 2   # GPT-2 small's shape on one GPU

Needs transformers (the ``.[hf]`` extra). The model is examples/gpt2_pipelined.py's:
``GPT2LMHeadModel`` from a config (vocabulary 256, windows of 128 bytes, ``--width``,
``--layers``, heads of width 64, dropout 0.1), split in 2 stages by ``BeginBlock`` on the
middle layer (``--seq`` sets the window). One
training step is m micro-batches of B windows forward and backward, gradients averaged, and
one SGD step. Rows:

    plain PyTorch, micro-batched   m forwards/backwards of the unwrapped model; the baseline
    plain PyTorch, 2 threads       the same m forwards/backwards, m/2 on each of two threads at
                                   once (each its own copy of the model): no pipeline, no
                                   bubble, so the machine's two-thread ceiling for this work
    poptorch_lite <schedule>       one call of the wrapped model (stages on worker streams);
                                   "+recompute" recomputes every stage, "+loop" cuts the
                                   layers in 4 virtual stages on IPUs 0, 1, 0, 1, "+V" on
                                   IPUs 0, 1, 1, 0 (as ZBV; zero_bubble only), "+compiled"
                                   compiles the stages (Options.compileStages)
    torch <schedule>               torch.distributed.pipelining, a process per stage (gloo on
                                   loopback), the same layers cut the same way (the output
                                   head an untied copy of the embedding: stages cannot share it);
                                   the looped and V schedules hold 2 of 4 stages per process

Every torch.distributed.pipelining schedule runs by default (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), beside poptorch_lite's, once
per m of ``--microbatches`` (torch 2.11's ZBVZeroBubble and DualPipeV fail in their own first
step over gloo, "Pair is not connected": leave them out of ``--torch-schedules`` there). "stash MiB" is poptorch_lite's peak of activations stashed
(``runStatistics().peak_stash_bytes``, all stages together); torch does not report it.

"per step" is the wall time of a step over the baseline's (the pipelined rows run the
stages at once, so on an idle multi-core machine they are below 1). Every process
computes with one intra-op thread. With ``--device cuda`` the plain model and batch are
on the GPU and poptorch_lite's default placement puts both IPUs there (one GPU: two CUDA
streams on it); a step's time then includes waiting for the GPU, and each row also shows
the peak GPU memory of its steps. torch.distributed.pipelining needs a GPU per rank there,
so its rows run only with ``--torch-schedules`` on a machine of several GPUs. Repetitions are interleaved after warm-up rounds;
each figure is the median, with the spread (lowest-highest) beside it.
"""

import argparse
import concurrent.futures
import copy
import statistics
import time

import torch
from tqdm import tqdm

import poptorch_lite as poptorch
from _pipeline_dist import GPT2_SEQ, SCHEDULES as TORCH_SCHEDULES, Ranks, batch, gpt2, local_stages

S = 2
VIRTUAL = {"loop": (1, 0, 1), "V": (1, 1, 0)}  # 4 virtual stages: block 0 on IPU 0, these after

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=128, help="embedding width")
parser.add_argument("--layers", type=int, default=4, help="transformer layers, half per stage")
parser.add_argument("--micro-batch", type=int, default=4, help="windows per micro-batch (B)")
parser.add_argument("--microbatches", default="4,8",
                    help="micro-batches per step (m), comma-separated: a table each")
parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
parser.add_argument("--warmup", type=int, default=3, help="untimed rounds of every variant first")
parser.add_argument("--schedules",
                    default="sequential,grouped,interleaved,gpipe,zero_bubble,zero_bubble+loop,"
                            "zero_bubble+V",
                    help="poptorch_lite variants: a PipelineSchedule name, optionally +recompute, "
                         "+compiled (compileStages) and +loop or +V")
parser.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES),
                    help="torch.distributed.pipelining schedules; empty to skip them")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the plain model and poptorch_lite's stages compute")
parser.add_argument("--seq", type=int, default=GPT2_SEQ, help="bytes per window (sequence length)")


def timed(fn, cuda=False):
    """``fn`` as a timed step: seconds, and the peak GPU memory it allocated (0 on the CPU)."""
    def run():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, torch.cuda.max_memory_allocated() if cuda else 0
    return run


def plain_step(base, ids, m, lr):
    model = copy.deepcopy(base).to(ids.device)
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


def ceiling_step(base, ids, m, lr):
    """The machine's two-thread ceiling: the baseline's m forwards and backwards, m/2 on each of
    two threads at once, each thread its own copy of the model (then one SGD step on each)."""
    halves = [ids.chunk(m)[k::2] for k in range(2)]
    models = [copy.deepcopy(base).to(ids.device) for _ in range(2)]
    opts = [torch.optim.SGD(mdl.parameters(), lr=lr) for mdl in models]
    pool = concurrent.futures.ThreadPoolExecutor(2, initializer=torch.set_num_threads,
                                                 initargs=(1,))

    def half(k):
        opts[k].zero_grad(set_to_none=True)
        for c in halves[k]:
            models[k](input_ids=c, labels=c).loss.backward()
        opts[k].step()

    def step():
        for done in [pool.submit(half, 0), pool.submit(half, 1)]:
            done.result()
    return step


def lite_step(base, ids, m, lr, variant):
    """One step of the wrapped model, and the wrapper (for its run statistics)."""
    name, *extras = variant.split("+")
    model = copy.deepcopy(base)
    h = model.transformer.h
    virtual = next((VIRTUAL[e] for e in extras if e in VIRTUAL), None)  # the IPUs of blocks 1-3
    cuts = [(len(h) * k // 4, virtual[k - 1]) for k in (1, 2, 3)] if virtual else [(len(h) // 2, 1)]
    for at, ipu in cuts:
        poptorch.BeginBlock(h[at], f"s{at}", ipu_id=ipu)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(m)
    auto = [poptorch.AutoStage.AutoIncrement] if virtual else []  # IPUs repeat
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        *auto, schedule=poptorch.PipelineSchedule.parse(name)))
    if "recompute" in extras:
        opts._Popart.set("autoRecomputation", 3)
    if "compiled" in extras:  # Options.compileStages: the stages compile in the warm-up
        opts.compileStages(True)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=lr))
    return (lambda: wrapped(input_ids=ids, labels=ids)), wrapped


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")
    for m in [int(v) for v in args.microbatches.split(",") if v]:
        run(args, m)


def run(args, m):
    """The table of one m."""
    B, cuda = args.micro_batch, args.device == "cuda"
    base = gpt2(args.width, args.layers, args.seq)
    base.train()
    ids, _ = batch("gpt2", m * B, args.width, seq_len=args.seq)
    baseline = f"plain PyTorch, micro-batched ({m} x {B})"
    variants = {baseline: timed(plain_step(base, ids.to(args.device), m, args.lr), cuda)}
    ceiling = "plain PyTorch, 2 threads (the ceiling)"
    if not cuda:
        variants[ceiling] = timed(ceiling_step(base, ids, m, args.lr))
    wrappers = {}
    for v in filter(None, args.schedules.split(",")):  # the model stays on the host, as in PopTorch
        if "+loop" in v and m < 7 and v.split("+")[0] in ("grouped", "interleaved"):
            # PopTorch's minimum for its own schedules: gradientAccumulation >= 2·stages - 1
            print(f"poptorch_lite {v}: skipped at m = {m} (4 stages need m >= 7)")
            continue
        step, wrappers[f"poptorch_lite {v}"] = lite_step(base, ids, m, args.lr, v)
        variants[f"poptorch_lite {v}"] = timed(step, cuda)
    names = [n for n in args.torch_schedules.split(",") if n]
    ranks = None
    if names:
        if args.seq != GPT2_SEQ:
            parser.error(f"--torch-schedules run windows of {GPT2_SEQ} bytes; pass --seq "
                         f"{GPT2_SEQ} or --torch-schedules ''")
        if args.layers < 2 * S and any(local_stages(n, 0, S)[1] > S for n in names):
            parser.error(f"--torch-schedules with two stages per process need --layers >= {2 * S}")
        ranks = Ranks("torch", names, S, model="gpt2", width=args.width, layers=args.layers,
                      micro_batch=B, m=m, lr=args.lr)
        for n in names:
            variants[f"torch {TORCH_SCHEDULES[n].__name__} ({S} processes)"] = (
                lambda n=n: (ranks.step(n)[0], 0))
    try:
        for _ in tqdm(range(args.warmup), desc=f"warm-up, m = {m}", leave=False):
            for run_step in variants.values():
                run_step()
        samples = {label: [] for label in variants}
        for _ in tqdm(range(args.repeats), desc=f"timing, m = {m}", leave=False):
            for label, run_step in variants.items():
                samples[label].append(run_step())
    finally:
        if ranks is not None:
            ranks.close()
    params = sum(p.numel() for p in base.parameters())
    where = torch.cuda.get_device_name() if cuda else "the CPU"
    print(f"model: transformers GPT2LMHeadModel, {args.layers} layers of width {args.width} "
          f"({params} parameters), windows of {args.seq} bytes, {S} stages; B = {B}, m = {m}; "
          f"torch {torch.__version__}; on {where}")
    print(f"median of {args.repeats} interleaved steps after {args.warmup} warm-up rounds, "
          f"one intra-op thread per stream/process\n")
    print(f"{'variant':<50} {'ms/step':>8} {'spread ms':>15} {'per step':>9} {'stash MiB':>9}"
          + (f" {'peak GiB':>9}" if cuda else ""))
    print(f"{'-' * 50} {'-' * 8} {'-' * 15} {'-' * 9} {'-' * 9}" + (f" {'-' * 9}" if cuda else ""))
    base_ms = statistics.median(t for t, _ in samples[baseline]) * 1e3
    for label, v in samples.items():
        times = [t for t, _ in v]
        ms = statistics.median(times) * 1e3
        stash = (f"{sum(wrappers[label].runStatistics().peak_stash_bytes) / 2**20:9.1f}"
                 if label in wrappers else f"{'n/a':>9}")
        print(f"{label:<50} {ms:8.1f} {min(times) * 1e3:7.1f}-{max(times) * 1e3:<7.1f} "
              f"{ms / base_ms:8.2f}x {stash}"
              + (f" {max(b for _, b in v) / 2**30:9.2f}" if cuda else ""))
    ms = {label: statistics.median(t for t, _ in v) * 1e3 for label, v in samples.items()}
    lite = {label: t for label, t in ms.items() if label.startswith("poptorch_lite ")}
    peers = {label: t for label, t in ms.items() if label.startswith("torch ")}
    if lite and peers:
        best, rival = min(lite, key=lite.get), min(peers, key=peers.get)
        print(f"\nthe best poptorch_lite row ({best.split(' ', 1)[1]}) against the best torch "
              f"schedule's ({rival.split(' ', 2)[1]}): {peers[rival] / lite[best]:.2f}x as fast")
    if ceiling in ms and lite:
        best = min(lite, key=lite.get)
        print(f"the machine's two-thread ceiling: {ms[ceiling] / base_ms:.2f}x of the baseline's "
              f"time; the best poptorch_lite row ({best.split(' ', 1)[1]}) is {ms[ceiling] / lite[best]:.2f}x as fast as it")
    print()


if __name__ == "__main__":
    main()
