"""The tax of a step: poptorch_lite against the same loop in plain PyTorch, each in its own process.

    python benchmarks/tax.py                       # every case, default threads and one thread
    python benchmarks/tax.py --case conv8 --threads 1 --pairs 7
    python benchmarks/tax.py --side lite --case conv8 --threads 0   # one side (for py-spy)

Cases (issue 11's table):
- ``conv8``:  Graphcore's MNIST tutorial conv net, micro-batch 8, deviceIterations 50, SGD;
- ``conv16``: the same net, micro-batch 16, deviceIterations 1, SGD with momentum;
- ``mlp``:    8 x Linear(1024)+ReLU, one stage, micro-batch 32, accumulation 8, Adam.

Each pair starts a plain process and a poptorch_lite process one after the other
(which goes first alternates), each warming up and then timing ``--calls`` calls
of the same arithmetic; a process reports its median time per optimizer step and
its peak resident memory. The parent prints, per case and thread count, the
median ratio (poptorch_lite / plain) over the pairs with its spread (min-max),
and the ratio of peak RSS. The two sides never share a process, so their thread
pools never compete.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

CASES = {  # name: (model, micro-batch, deviceIterations, accumulation, optimizer)
    "conv8": ("conv", 8, 50, 1, "sgd"),
    "conv16": ("conv", 16, 1, 1, "sgd-momentum"),
    "mlp": ("mlp", 32, 1, 8, "adam"),
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--case", choices=[*CASES, "all"], default="all", help="which case")
parser.add_argument("--threads", type=int, nargs="*", default=[0, 1],
                    help="torch intra-op threads per process (0: torch's default)")
parser.add_argument("--pairs", type=int, default=5, help="plain/poptorch_lite process pairs")
parser.add_argument("--calls", type=int, default=0,
                    help="timed calls per process (0: about two seconds' worth)")
parser.add_argument("--side", choices=["plain", "lite"], help="run one side here and print JSON")


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


def build(case):
    kind, B, D, G, opt = CASES[case]
    torch.manual_seed(0)
    model = ConvNet() if kind == "conv" else MLP()
    n = B * D * G
    if kind == "conv":
        x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    else:
        x, y = torch.randn(n, 1024), torch.randn(n, 1024)
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    elif opt == "sgd-momentum":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    return model, optimizer, x, y, B, D, G


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


def one_side(args):
    threads = args.threads[0]
    if threads:
        torch.set_num_threads(threads)
    model, optimizer, x, y, B, D, G = build(args.case)
    if args.side == "plain":
        def call():
            plain_call(model, optimizer, x, y, B, D, G)
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        import poptorch_lite as poptorch
        opts = poptorch.Options().deviceIterations(D)
        opts.Training.gradientAccumulation(G)
        wrapped = poptorch.trainingModel(model, opts, optimizer)

        def call():
            wrapped(x, y)
    for _ in range(3):  # warm up (and trace)
        call()
    calls = args.calls
    if not calls:
        start = time.perf_counter()
        call()
        calls = max(5, int(2.0 / (time.perf_counter() - start)))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) / D)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    print(json.dumps({"step_ms": 1e3 * statistics.median(times), "rss_mib": rss,
                      "threads": torch.get_num_threads(), "calls": calls}))


def run_side(side, case, threads, calls):
    cmd = [sys.executable, __file__, "--side", side, "--case", case, "--threads", str(threads),
           "--calls", str(calls)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    args = parser.parse_args()
    if args.side:
        return one_side(args)
    cases = list(CASES) if args.case == "all" else [args.case]
    print(f"{'case':8} {'threads':>7} {'plain ms':>9} {'lite ms':>9} {'ratio':>6} "
          f"{'spread':>13} {'RSS ratio':>9}")
    for case in cases:
        for threads in args.threads:
            pairs = []
            for k in range(args.pairs):
                order = ("plain", "lite") if k % 2 == 0 else ("lite", "plain")
                got = {side: run_side(side, case, threads, args.calls) for side in order}
                pairs.append(got)
            ratios = [p["lite"]["step_ms"] / p["plain"]["step_ms"] for p in pairs]
            rss = statistics.median(p["lite"]["rss_mib"] / p["plain"]["rss_mib"] for p in pairs)
            print(f"{case:8} {pairs[0]['plain']['threads']:>7} "
                  f"{statistics.median(p['plain']['step_ms'] for p in pairs):9.3f} "
                  f"{statistics.median(p['lite']['step_ms'] for p in pairs):9.3f} "
                  f"{statistics.median(ratios):6.3f} {min(ratios):6.3f}-{max(ratios):6.3f} "
                  f"{rss:9.3f}", flush=True)


if __name__ == "__main__":
    main()
