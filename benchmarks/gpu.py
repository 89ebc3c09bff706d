"""poptorch_lite on CUDA against plain PyTorch on the same GPU, each side in its own process.

    python benchmarks/gpu.py              # every case; exits 0 with a note when no GPU is present
    python benchmarks/gpu.py --pairs 5 --calls 50
    python benchmarks/gpu.py --case mlp conv pipe1 --pairs 2   # what benchmarks/gpu_check.sh runs
    python benchmarks/gpu.py --side lite --case conv --profile  # one side, and where its time goes
    python benchmarks/gpu.py --case mlp conv pipe1 --compiled  # and a row with compileStages

Cases (each prints plain ms/step, poptorch_lite ms/step, their ratio, and peak device
memory per device on both sides). The plain side's inputs wait on the GPU before it is
timed, a bar that poptorch_lite, fed host tensors as PopTorch is, must clear with its copies
in; "vs host-fed" is the ratio against the same plain process copying each call's inputs
in first (``x.cuda()``), as a loop over a host DataLoader does:
- ``mlp``: 8 x Linear(1024)+ReLU, one stage, micro-batch 32, accumulation 8, Adam;
- ``conv``: Graphcore's MNIST tutorial conv net, micro-batch 16, SGD with momentum;
- ``pipe1``: the MLP in 2 stages on one GPU (two CUDA streams), Grouped, accumulation 8; the
  last call's timeline (measured on the GPU by CUDA events) says how much of the step the two
  streams computed at once (``overlap``: the time both were busy / the step's span);
- ``pipeN``: the MLP in one stage per GPU present (needs 2 or more);
- ``offload``: ``mlp`` with the optimizer state offloaded to the host
  (``TensorLocations.setOptimizerLocation(useOnChipStorage(False))``): the peak device
  memory it saves against ``mlp``.

With ``--compiled`` each pair runs two more processes: poptorch_lite with
``Options.compileStages(True)`` (Inductor's kernels, and from the third call on each step
replayed as one CUDA graph; the stages compile and the step is captured in its warm-up),
and with ``compileStages(True, backend="eager")`` (the eager path's own kernels in one CUDA
graph per step); each case gets a row of each, ``<case>+c`` and ``<case>+g``. A third process
is plain PyTorch as a plain user would speed it up: the model under
``torch.compile(mode="reduce-overhead")`` (Inductor's kernels in CUDA graphs); its row is
``<case>+ro`` against plain eager, and the ``+c`` and ``+g`` rows say their ratio to it.

The scripts never call ``.cuda()``: like a PopTorch script, the wrapped side leaves the model
on the host and lets the default placement put the IPUs on the GPUs. The plain side moves the
same model to cuda:0 and runs the same arithmetic.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tax  # noqa: E402  (the models and the plain loop)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--case", choices=["mlp", "conv", "pipe1", "pipeN", "offload", "all"],
                    default=["all"], nargs="+", help="cases to run (all: every one)")
parser.add_argument("--pairs", type=int, default=3, help="plain/poptorch_lite process pairs")
parser.add_argument("--calls", type=int, default=30, help="timed calls per process")
parser.add_argument("--side", choices=["plain", "lite", "lite-compiled", "lite-graph", "plain-ro"],
                    help="run one side here, print JSON")
parser.add_argument("--compiled", action="store_true",
                    help="also poptorch_lite processes with Options.compileStages(True) per "
                         "pair: Inductor's stages in one CUDA graph per step (+c rows), and the "
                         "stages' own kernels in one (compileStages(True, backend='eager'): "
                         "+g rows)")
parser.add_argument("--profile", action="store_true",
                    help="with --side: then profile 5 calls (torch.profiler; table on stderr)")


def staged(model, stages):
    """Block annotations on the MLP's layers: ``stages`` equal blocks on IPUs 0.."""
    import poptorch_lite as poptorch
    layers = list(model.net)
    per = len(layers) // stages
    for s in range(stages):
        layers[s * per] = poptorch.BeginBlock(layers[s * per], f"s{s}", ipu_id=s)
    model.net = torch.nn.Sequential(*layers)
    return model


def one_side(args):
    case = args.case[0]
    kind = {"conv": "conv16"}.get(case, "mlp")
    model, optimizer, x, y, B, D, G, _ = tax.build(kind)
    if args.side in ("plain", "plain-ro"):
        model.cuda()
        optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)
        host = x, y
        x, y = x.cuda(), y.cuda()
        if args.side == "plain-ro":  # what a plain user does for speed: Inductor and CUDA graphs
            model = torch.compile(model, mode="reduce-overhead")

        def call():
            tax.plain_call(model, optimizer, x, y, B, D, G)

        def from_host():  # a loop over host batches: each call's inputs copied in first
            tax.plain_call(model, optimizer, host[0].cuda(), host[1].cuda(), B, D, G)
    else:
        from_host = None
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        import poptorch_lite as poptorch
        opts = poptorch.Options().deviceIterations(D)
        opts.Training.gradientAccumulation(G)
        if args.side == "lite-compiled":
            opts.compileStages(True)
        elif args.side == "lite-graph":
            opts.compileStages(True, backend="eager")
        if case in ("pipe1", "pipeN"):
            stages = 2 if case == "pipe1" else torch.cuda.device_count()
            staged(model, stages)
            opts.setExecutionStrategy(poptorch.PipelinedExecution())
            if case == "pipe1":
                opts.set_ipu_devices("cuda:0")
        if case == "offload":
            opts.TensorLocations.setOptimizerLocation(
                poptorch.TensorLocationSettings().useOnChipStorage(False))
        wrapped = poptorch.trainingModel(model, opts, optimizer)

        def call():
            wrapped(x, y)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    for d in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(d)
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        call()
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        times.append((time.perf_counter() - start) / D)
    peaks = [torch.cuda.max_memory_allocated(d) / 2**20 for d in range(torch.cuda.device_count())]
    host_times = []
    for _ in range(args.calls if from_host is not None else 0):
        start = time.perf_counter()
        from_host()
        torch.cuda.synchronize()
        host_times.append((time.perf_counter() - start) / D)
    if args.profile:  # host ops and CUDA runtime calls of every thread, kernels on the GPU
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30),
              file=sys.stderr)
    overlap = None
    if args.side.startswith("lite") and case in ("pipe1", "pipeN"):
        overlap = both_busy(wrapped.runStatistics().timeline)
    print(json.dumps({"step_ms": 1e3 * statistics.median(times), "peak_mib": peaks,
                      "overlap": overlap,
                      "host_ms": 1e3 * statistics.median(host_times) if host_times else None}))


def both_busy(timeline):
    """The fraction of the timeline's span during which two or more streams were busy.

    >>> from poptorch_lite.profiling.spans import Span
    >>> from poptorch_lite.profiling.timeline import Timeline
    >>> both_busy(Timeline([Span(0, 0, 0, "F", 0, 2), Span(1, 1, 0, "F", 1, 4)], ["a", "b"], "x"))
    0.25
    """
    busy = {s.stream: 0 for s in timeline.spans}  # stream -> its spans running now
    events = sorted([(s.start, 1, s.stream) for s in timeline.spans]
                    + [(s.end, -1, s.stream) for s in timeline.spans])
    both, last = 0.0, None
    for t, step, stream in events:
        if last is not None and sum(n > 0 for n in busy.values()) >= 2:
            both += t - last
        busy[stream] += step
        last = t
    span = timeline.makespan
    return both / span if span else 0.0


def run_side(side, case, calls):
    cmd = [sys.executable, __file__, "--side", side, "--case", case, "--calls", str(calls)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{side} side of {case} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing to measure")
        return
    if args.side:
        return one_side(args)
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    cases = (["mlp", "conv", "pipe1", "pipeN", "offload"] if "all" in args.case else
             list(dict.fromkeys(args.case)))
    print(f"{'case':8} {'plain ms':>9} {'lite ms':>9} {'ratio':>6} {'spread':>13}  "
          f"{'vs host-fed':>11}  peak MiB per GPU (plain | lite)  overlap")
    for case in cases:
        if case == "pipeN" and gpus < 2:
            print(f"{case:8} skipped: needs 2 or more GPUs")
            continue
        sides = ("plain", "lite") + (("lite-compiled", "lite-graph", "plain-ro")
                                     if args.compiled else ())
        pairs = []
        for k in range(args.pairs):
            order = sides if k % 2 == 0 else sides[::-1]
            pairs.append({side: run_side(side, case, args.calls) for side in order})
        for lite in sides[1:]:
            ratios = [p[lite]["step_ms"] / p["plain"]["step_ms"] for p in pairs]
            plain_ms = statistics.median(p["plain"]["step_ms"] for p in pairs)
            lite_ms = statistics.median(p[lite]["step_ms"] for p in pairs)
            peaks = (" ".join(f"{m:.0f}" for m in pairs[0]["plain"]["peak_mib"]) + " | "
                     + " ".join(f"{m:.0f}" for m in pairs[0][lite]["peak_mib"]))
            overlap = pairs[0][lite].get("overlap")
            fed = statistics.median(p[lite]["step_ms"] / p["plain"]["host_ms"] for p in pairs)
            name = case + {"lite": "", "lite-compiled": "+c", "lite-graph": "+g",
                           "plain-ro": "+ro"}[lite]
            anchor = ""
            if lite in ("lite-compiled", "lite-graph"):  # against plain's own best
                to_ro = statistics.median(p[lite]["step_ms"] / p["plain-ro"]["step_ms"]
                                          for p in pairs)
                anchor = f"  {to_ro:.3f} of reduce-overhead"
            print(f"{name:8} {plain_ms:9.3f} {lite_ms:9.3f} {statistics.median(ratios):6.3f} "
                  f"{min(ratios):6.3f}-{max(ratios):6.3f}  {fed:11.3f}  {peaks}"
                  + (f"  {overlap:.0%} of the step on two streams at once"
                     if overlap is not None else "") + anchor, flush=True)

if __name__ == "__main__":
    main()
