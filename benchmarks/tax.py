"""The tax of a step: poptorch_lite against the same loop in plain PyTorch, each in its own process.

    python benchmarks/tax.py                       # every case, default threads and one thread
    python benchmarks/tax.py --case conv8 --threads 1 --pairs 7
    python benchmarks/tax.py --side lite --case conv8 --threads 0   # one side (for py-spy)
    python benchmarks/tax.py --case tiny --threads 1 --twin          # the GPU path's host work
    python benchmarks/tax.py --compiled --threads 1                  # the compiled column

Cases (issue 11's table):
- ``conv8``:  Graphcore's MNIST tutorial conv net, micro-batch 8, deviceIterations 50, SGD;
- ``conv16``: the same net, micro-batch 16, deviceIterations 1, SGD with momentum;
- ``mlp``:    8 x Linear(1024)+ReLU, one stage, micro-batch 32, accumulation 8, Adam;
- ``tiny``, ``tiny-r4``, ``tiny-g8``: PopTorch's user-guide ``device_iterations.py`` (issue 27
  D): one Linear(6, 2) with CrossEntropyLoss, micro-batch 2, SGD(lr=0.01) (trainingModel's
  default optimizer), ``deviceIterations(100)``; ``-r4`` with ``replicationFactor(4)`` (the
  plain side averages the 4 replicas' micro-batches into each step), ``-g8`` with
  ``deviceIterations(400)`` and ``gradientAccumulation(8)``. The smallest case of the tax:
  a step is a few dozen microseconds of arithmetic, so what a step costs besides it shows.

Each pair starts a plain process and a poptorch_lite process side by side; both warm
up (and trace), then take turns: the parent asks one for a block of ``--calls`` calls,
then the other, ``--blocks`` times each (which goes first alternates), while the other
waits on its pipe, so only one computes at a time and their thread pools never compete.
A block's time is the median per optimizer step of its calls; a pair's ratio is the
median over its blocks of (poptorch_lite block / the plain block beside it), so a
shared machine's drift over seconds falls on both sides alike. The parent prints, per
case and thread count, the median ratio over the pairs with its spread (min-max), the
median step times, and the ratio of peak RSS.

On a shared machine whose speed drifts within a second (a block of a quarter second of the
same code differs by 30% from the next), short blocks resolve what long ones cannot: ``--calls
10 --blocks 61 --pairs 3`` pairs each block of ten calls with the other side's ten: a run's
pairs agree to about half a percent, and runs to about one, where the default's differ by ten (``docs/PERFORMANCE.md``
(g), issue 47 F). Each block then starts after the other process ran, so its ratio is that
regime's, a little higher than the default's; compare figures taken with the same settings.

With ``--compiled`` each pair is four processes taking turns: plain eager, plain PyTorch
with ``torch.compile(model)`` (forward and backward compiled, the optimizer eager),
poptorch_lite eager, and poptorch_lite with ``Options().compileStages(True)``
([Note: compiled stages]); it prints the compiled poptorch_lite step against each of the
other three (the compiled processes warm up, and so compile, before the timed blocks).

With ``--lean`` (conv16 only) a third process takes its turns: ``lean``, the wrapped model's
own program called through the lean call (``lean.py``), which keeps every per-call mechanism
the runtime needs (the input signature, the attribute and host-edit checks, collection paused,
grad mode, the Ctrl-C handler, the host gradients, the random snapshot, base and stream, the
step bound to the homes) and none of its layers, after checking that it leaves the wrapped
call's weights and momenta to the bit. Its ratio is the floor of the tax in this script's own
regime: what a call path with today's mechanisms could reach, and what the layers cost above
it (``docs/PERFORMANCE.md`` (g), issue 47 F).

With ``--twin`` the poptorch_lite side puts every IPU on the GPU twin of the test suite
(``tests/support/gpu_twin.py``: the GPU's branches, streams, events and input copies, with CPU
tensors), so what the GPU path does on the host besides the kernels (hand-offs between
threads, copies in, events) is measured on a machine without a GPU. The twin's stand-in
streams cost host time of their own, so it tells which way a change to that path goes, not
what it is worth on a GPU (``benchmarks/gpu.py`` measures that).
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

CASES = {  # name: (model, micro-batch, deviceIterations, accumulation, optimizer, replicas)
    "conv8": ("conv", 8, 50, 1, "sgd", 1),
    "conv16": ("conv", 16, 1, 1, "sgd-momentum", 1),
    "mlp": ("mlp", 32, 1, 8, "adam", 1),
    "tiny": ("tiny", 2, 100, 1, "sgd", 1),
    "tiny-r4": ("tiny", 2, 100, 1, "sgd", 4),
    "tiny-g8": ("tiny", 2, 400, 8, "sgd", 1),
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--case", choices=[*CASES, "all"], default="all", help="which case")
parser.add_argument("--threads", type=int, nargs="*", default=[0, 1],
                    help="torch intra-op threads per process (0: torch's default)")
parser.add_argument("--pairs", type=int, default=5, help="plain/poptorch_lite process pairs")
parser.add_argument("--calls", type=int, default=0,
                    help="timed calls per block (0: about a quarter second's worth)")
parser.add_argument("--blocks", type=int, default=15, help="blocks of calls per side and pair")
parser.add_argument("--lean", action="store_true",
                    help="conv16: a third process, the lean call (lean.py), takes turns")
parser.add_argument("--side", choices=["plain", "lite", "lean", "plain-compiled",
                                       "lite-compiled"],
                    help="run one side here and print JSON")
parser.add_argument("--backend", default="inductor",
                    help="the compiled sides' backend (the suite's smoke run: aot_eager)")
parser.add_argument("--compiled", action="store_true",
                    help="four sides: plain, plain torch.compile, lite, lite compileStages")
parser.add_argument("--twin", action="store_true",
                    help="poptorch_lite's IPUs on the GPU twin (tests/support/gpu_twin.py)")
parser.add_argument("--serve", action="store_true",
                    help="with --side: time a block of calls per line read from stdin")


class ConvNet(nn.Module):
    """The tutorial's network (examples/mnist.py), with its loss."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU())
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = nn.Dropout(0.5)
        self.layer4 = nn.Linear(256, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        x = self.layer2(self.layer1(x)).view(-1, 320)
        x = self.layer4(self.layer3_dropout(self.layer3_act(self.layer3(x))))
        return x, self.loss(x, labels)


class MLP(nn.Module):
    def __init__(self, width=1024, layers=8):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x, y):
        out = self.net(x)
        return out, nn.functional.mse_loss(out, y)


class Tiny(nn.Module):
    """The user guide's ``ExampleModelWithLoss`` for data of shape [3, 2] and 2 classes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 2)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, target):
        fc = self.fc(x.reshape([x.shape[0], -1]))
        return fc, self.loss(fc, target)


def build(case):
    """The case's model, optimizer and one call's inputs; B, D, the micro-batches a step
    averages (accumulation x replicas), and the replicas."""
    kind, B, D, G, opt, R = CASES[case]
    torch.manual_seed(0)
    model = {"conv": ConvNet, "mlp": MLP, "tiny": Tiny}[kind]()
    n = B * D * G * R
    if kind == "conv":
        x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    elif kind == "tiny":
        x, y = torch.rand(n, 3, 2), torch.randint(0, 2, (n,))
    else:
        x, y = torch.randn(n, 1024), torch.randn(n, 1024)
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    elif opt == "sgd-momentum":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    return model, optimizer, x, y, B, D, G * R, R


def plain_call(model, optimizer, x, y, B, D, G):
    """D optimizer steps of G micro-batches each: what one poptorch_lite call does."""
    for d in range(D):
        optimizer.zero_grad(set_to_none=True)
        for g in range(G):
            k = (d * G + g) * B
            _, loss = model(x[k:k + B], y[k:k + B])
            loss.backward()
        if G > 1:
            for p in model.parameters():
                p.grad.div_(G)
        optimizer.step()


IN_FORCE = contextlib.ExitStack()  # what stays entered until the process exits (--twin)


def one_side(args):
    """One side: standalone, time ``--calls`` calls and print a JSON report; with ``--serve``,
    time a block of calls for each line read on stdin and answer each with a JSON line."""
    threads = args.threads[0]
    if threads:
        torch.set_num_threads(threads)
    model, optimizer, x, y, B, D, G, R = build(args.case)
    if args.side == "plain-compiled":
        model = torch.compile(model, backend=args.backend)
    if args.side.startswith("plain"):
        def call():
            plain_call(model, optimizer, x, y, B, D, G)
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        import poptorch_lite as poptorch
        opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
        opts.Training.gradientAccumulation(G // R)
        if args.side == "lite-compiled":
            opts.compileStages(True, backend=args.backend)
        if args.twin:  # in force for the whole process: placements are made on first call
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
            from gpu_twin import TWIN, TwinGpu
            from poptorch_lite.runtime import gpu
            IN_FORCE.enter_context(gpu.installed(TwinGpu()))
            opts.set_ipu_devices(TWIN)
        wrapped = poptorch.trainingModel(model, opts, optimizer)

        def call():
            wrapped(x, y)
        if args.side == "lean":  # after one wrapped call: traced, and its step to compare
            wrapped(x, y)
            sys.path.insert(0, os.path.dirname(__file__))
            from lean import lean_call
            call = lean_call(wrapped, optimizer, x, y)
    for _ in range(3):  # warm up (and trace)
        call()
    calls = args.calls
    if not calls:
        start = time.perf_counter()
        call()
        calls = max(3, int((0.25 if args.serve else 2.0) / (time.perf_counter() - start)))

    def block() -> dict:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) / D)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
        return {"step_ms": 1e3 * statistics.median(times), "rss_mib": rss,
                "threads": torch.get_num_threads(), "calls": calls}
    if not args.serve:
        return print(json.dumps(block()))
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:  # one block per request, until the parent closes the pipe
        print(json.dumps(block()), flush=True)


def take_turns(cmds: dict, blocks: int, first: str) -> dict:
    """Start a ``--serve`` process per command (name -> argv), each warmed up before the
    next starts, then ask them for ``blocks`` blocks in turn (``first`` goes first in block
    0, and the order rotates by one each block) while the others wait on their pipes.
    Returns name -> the blocks' reports. ``tax_ab.py`` pairs two checkouts with it."""
    procs = {}
    got = {name: [] for name in cmds}
    names = list(cmds)
    names = names[names.index(first):] + names[:names.index(first)]
    try:
        for name, cmd in cmds.items():
            procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True)
            json.loads(procs[name].stdout.readline())  # warmed up: one at a time
        for k in range(blocks):
            for name in names[k % len(names):] + names[:k % len(names)]:
                proc = procs[name]
                proc.stdin.write("block\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {name} process exited: rc {proc.wait()}")
                got[name].append(json.loads(line))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    return got


def run_pair(case, threads, calls, blocks, lite_first, twin=False, sides=("plain", "lite"),
             backend="inductor"):
    """A process per side (plain and poptorch_lite, and the others ``sides`` names), taking
    turns for ``blocks`` blocks each."""
    cmds = {side: [sys.executable, __file__, "--side", side, "--case", case, "--threads",
                   str(threads), "--calls", str(calls), "--serve", "--backend", backend]
            + (["--twin"] if twin else []) for side in sides}
    return take_turns(cmds, blocks, sides[-1] if lite_first else sides[0])


def _ratio(got: dict, top: str, bottom: str) -> float:
    """The median over blocks of ``top``'s step over the ``bottom`` step beside it."""
    return statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(got[top], got[bottom]))


def main():
    args = parser.parse_args()
    if args.side:
        return one_side(args)
    cases = list(CASES) if args.case == "all" else [args.case]
    if args.lean and (cases != ["conv16"] or args.compiled or args.twin):
        parser.error(f"--lean measures one step a call on one stage: --case conv16, eager, on "
                     f"the CPU (got --case {args.case}{' --compiled' if args.compiled else ''}"
                     f"{' --twin' if args.twin else ''})")
    if args.compiled:
        return compiled_table(args, cases)
    sides = ("plain", "lite", "lean") if args.lean else ("plain", "lite")
    print(f"{'case':8} {'threads':>7} {'plain ms':>9} {'lite ms':>9} {'ratio':>6} "
          f"{'spread':>13} {'RSS ratio':>9}"
          + (f" {'lean ms':>9} {'lean':>6} {'spread':>13}" if args.lean else ""))
    for case in cases:
        for threads in args.threads:
            ratios = {side: [] for side in sides[1:]}
            ms = {side: [] for side in sides}
            rss = []
            for k in range(args.pairs):
                got = run_pair(case, threads, args.calls, args.blocks, lite_first=k % 2 == 1,
                               twin=args.twin, sides=sides)
                for side in sides:
                    ms[side].append(statistics.median(b["step_ms"] for b in got[side]))
                for side in ratios:
                    ratios[side].append(_ratio(got, side, "plain"))
                rss.append(got["lite"][-1]["rss_mib"] / got["plain"][-1]["rss_mib"])
            cells = {side: f"{statistics.median(ms[side]):9.3f} {statistics.median(r):6.3f} "
                           f"{f'{min(r):.3f}-{max(r):.3f}':>13}" for side, r in ratios.items()}
            print(f"{case:8} {got['plain'][0]['threads']:>7} {statistics.median(ms['plain']):9.3f} "
                  f"{cells['lite']} {statistics.median(rss):9.3f}"
                  + (f" {cells['lean']}" if args.lean else ""), flush=True)


def compiled_table(args, cases) -> None:
    """``--compiled``: per case, the four sides' step times and compiled poptorch_lite's
    ratio to each of the others (median over the pairs, and its spread)."""
    sides = ("plain", "plain-compiled", "lite", "lite-compiled")
    print(f"{'case':8} {'thr':>3} {'plain':>8} {'plain-c':>8} {'lite':>8} {'lite-c':>8}   "
          f"{'lite-c/plain':>20} {'lite-c/plain-c':>20} {'lite-c/lite':>20}   (ms per step)")
    for case in cases:
        for threads in args.threads:
            ms = {side: [] for side in sides}
            ratios = {other: [] for other in sides[:3]}
            for k in range(args.pairs):
                got = run_pair(case, threads, args.calls, args.blocks, lite_first=k % 2 == 1,
                               sides=sides, backend=args.backend)
                for side in sides:
                    ms[side].append(statistics.median(b["step_ms"] for b in got[side]))
                for other in ratios:
                    ratios[other].append(_ratio(got, "lite-compiled", other))
            cells = [f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
                     for r in ratios.values()]
            print(f"{case:8} {got['plain'][0]['threads']:>3} "
                  + " ".join(f"{statistics.median(ms[side]):8.3f}" for side in sides)
                  + "   " + " ".join(f"{c:>20}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
