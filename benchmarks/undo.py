"""The cost of undoing failed calls: a training call with what it captures against the same
call capturing nothing, and against ``allOrNothingCalls(True)``, alternating in one process.

    python benchmarks/undo.py                 # 8 x Linear(1024)+ReLU, Adam, micro-batch 32, 8 accumulated
    python benchmarks/undo.py --width 256 --repeats 30

[Note: all-or-nothing calls] (poptorch_lite/undo.py): by default a call captures only
what a step does not commit (buffers, random state, loss scale) before each run;
``allOrNothingCalls(True)`` also copies every weight and the optimizer state before every
call. This prints the median time of a call each way and the ratios to capturing nothing.
"""

import argparse
import contextlib
import statistics
import time

import torch

import poptorch_lite as poptorch
from poptorch_lite.runtime import compiled, program

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
parser.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch")
parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step")
parser.add_argument("--repeats", type=int, default=15, help="timed calls per side")


@contextlib.contextmanager
def without_snapshot():
    """No capture at all: the wrapper's of a whole call, and each run's (``Program.run``)."""
    captured = compiled.capture, program.capture
    compiled.capture = program.capture = lambda *args, **kwargs: (lambda: None)
    try:
        yield
    finally:
        compiled.capture, program.capture = captured


def main():
    args = parser.parse_args()
    torch.manual_seed(0)
    G, B, W = args.accumulation, args.micro_batch, args.width
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[m for _ in range(args.layers) for m in
                                             (torch.nn.Linear(W, W), torch.nn.ReLU())])

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, y)

    def wrapped(all_or_nothing):
        torch.manual_seed(0)
        model = Model()
        opts = poptorch.Options().allOrNothingCalls(all_or_nothing)
        opts.Training.gradientAccumulation(G)
        return model, poptorch.trainingModel(model, opts,
                                             poptorch.optim.Adam(model.parameters(), lr=1e-5))

    model, default = wrapped(False)
    _, full = wrapped(True)
    x, y = torch.randn(G * B, W), torch.randn(G * B, W)
    default(x, y)  # compile and warm up
    full(x, y)
    times = {"default": [], "nothing": [], "all": []}
    for _ in range(args.repeats):
        for name, call in (("default", default), ("nothing", default), ("all", full)):
            context = without_snapshot() if name == "nothing" else contextlib.nullcontext()
            with context:
                start = time.perf_counter()
                call(x, y)
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters + Adam state; G={G}, micro-batch {B}")
    print(f"call capturing nothing:            {med['nothing'] * 1e3:8.1f} ms "
          f"(median of {args.repeats})")
    print(f"call, default (last-step commit):  {med['default'] * 1e3:8.1f} ms  "
          f"ratio {med['default'] / med['nothing']:.3f}")
    print(f"call, allOrNothingCalls(True):     {med['all'] * 1e3:8.1f} ms  "
          f"ratio {med['all'] / med['nothing']:.3f}")
    default.destroy()
    full.destroy()


if __name__ == "__main__":
    main()
