"""The cost of all-or-nothing calls: a training call with its snapshot against the same call
with the snapshot switched off, alternating in one process.

    python benchmarks/undo.py                 # 8 x Linear(1024)+ReLU, Adam, micro-batch 32, 8 accumulated
    python benchmarks/undo.py --width 256 --repeats 30

[Note: all-or-nothing calls] (poptorch_lite/undo.py) copies the weights and the
optimizer state before every training call; this prints the median time of a call
with and without that copy, and their ratio.
"""

import argparse
import contextlib
import statistics
import time

import torch

import poptorch_lite as poptorch
from poptorch_lite import wrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
parser.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch")
parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step")
parser.add_argument("--repeats", type=int, default=15, help="timed calls per side")


@contextlib.contextmanager
def without_snapshot():
    captured = wrapper.capture
    wrapper.capture = lambda *args, **kwargs: (lambda: None)
    try:
        yield
    finally:
        wrapper.capture = captured


def main():
    args = parser.parse_args()
    torch.manual_seed(0)
    G, B, W = args.accumulation, args.micro_batch, args.width
    net = torch.nn.Sequential(*[m for _ in range(args.layers)
                                for m in (torch.nn.Linear(W, W), torch.nn.ReLU())])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, y)

    model = Model()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    trained = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters(), lr=1e-5))
    x, y = torch.randn(G * B, W), torch.randn(G * B, W)
    trained(x, y)  # compile and warm up
    with_copy, without = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        trained(x, y)
        with_copy.append(time.perf_counter() - start)
        with without_snapshot():
            start = time.perf_counter()
            trained(x, y)
            without.append(time.perf_counter() - start)
    a, b = statistics.median(with_copy), statistics.median(without)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters + Adam state; G={G}, micro-batch {B}")
    print(f"call with snapshot:    {a * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"call without snapshot: {b * 1e3:8.1f} ms")
    print(f"ratio: {a / b:.3f}")
    trained.destroy()


if __name__ == "__main__":
    main()
