"""The runtime's own cost per step: poptorch_lite against a bare loop of its compiled stage graph.

    python benchmarks/machinery.py                  # the tiny model and the tutorial conv net
    python benchmarks/machinery.py --model tiny --rounds 150 --timers
    python benchmarks/machinery.py --model conv --conv16 --rounds 1500   # tax.py's conv16, + lean

A one-stage model at deviceIterations 50 (micro-batch 8, SGD, dropout) runs three ways in one
process, one intra-op thread, in interleaved rounds: ``plain`` (the module, as tax.py's plain
side), ``bare`` (a loop over the stage graph poptorch_lite compiled: clear the gradients, the
forward under the micro-batch's random stream, backward, ``optimizer.step()``) and ``lite``
(the wrapped model). ``lite - bare`` is what the runtime adds per step around the same
arithmetic: the run's setup, dispatch and bookkeeping ([Note: one setup per call] in
``runtime/plan.py``). With ``--timers``, timers around ``Program.run``, ``Executor.run_call``,
``Executor._run_here`` and the action handlers split that per layer (the timers cost about a
microsecond each). Medians per optimizer step over the rounds.

With ``--conv16`` the shape is ``tax.py``'s conv16 (micro-batch 16, one step per call, SGD
with momentum 0.9), and a fourth way runs: ``lean``, the wrapped model's own program called
through the per-call mechanisms the runtime keeps and none of its layers (``lean.py``, which
checks first that its step leaves the wrapped call's weights and momenta to the bit). ``lean -
bare`` is the mechanisms' cost; ``lite - lean`` the layers'.
"""

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import poptorch_lite as poptorch  # noqa: E402
from lean import lean_call  # noqa: E402
from poptorch_lite.compiler import rng  # noqa: E402
from poptorch_lite.runtime import executor, program, stage_work, update  # noqa: E402
from poptorch_lite.runtime.split_backward import run_backward  # noqa: E402

D, B, MOMENTUM = 50, 8, 0.0


class Tiny(nn.Module):
    """Two small linear layers with dropout: almost all of a step is the machinery."""

    def __init__(self):
        super().__init__()
        self.l1, self.d, self.l2 = nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.l2(self.d(torch.relu(self.l1(x))))
        return out, self.loss(out, y)


def build(name):
    torch.manual_seed(0)
    if name == "tiny":
        return Tiny(), torch.randn(D * B, 4), torch.randint(0, 3, (D * B,))
    from tax import ConvNet
    return ConvNet(), torch.randn(D * B, 1, 28, 28), torch.randint(0, 10, (D * B,))


TIMERS = collections.Counter()


def timed(owner, name, key):
    """Add the time spent in ``owner.name`` to ``TIMERS[key]``."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[key] += time.perf_counter() - start
    setattr(owner, name, wrapper)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "conv", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    parser.add_argument("--timers", action="store_true", help="time the runtime's layers")
    parser.add_argument("--conv16", action="store_true",
                        help="tax.py's conv16 shape (micro-batch 16, one step per call, "
                             "momentum 0.9), and the lean side")
    args = parser.parse_args()
    global D, B, MOMENTUM
    if args.conv16:
        D, B, MOMENTUM = 1, 16, 0.9
    torch.set_num_threads(1)
    if args.timers:  # before any wrapper exists: the executors bind the handlers
        for owner, name in ((program.Program, "run"), (executor.Executor, "run_call"),
                            (executor.Executor, "_run_here"), (stage_work.StageWork, "forward"),
                            (stage_work.StageWork, "backward"), (update.Update, "reduce"),
                            (update.Update, "step")):
            timed(owner, name, name)
    for name in ["tiny", "conv"] if args.model == "all" else [args.model]:
        measure(name, args.rounds, args.timers)


def measure(name, rounds, timers):
    model, x, y = build(name)
    lite_model, bare_model = copy.deepcopy(model), copy.deepcopy(model)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=MOMENTUM)
           for m in (model, lite_model, bare_model)]
    wrapped = poptorch.trainingModel(lite_model, poptorch.Options().deviceIterations(D), sgd[1])
    wrapped(x, y)
    stage = next(iter(wrapped._programs.values())).partition.stages[0]
    params = dict(bare_model.named_parameters())
    leaves = {"input:0": x.split(B), "input:1": y.split(B)}

    def plain():
        for d in range(D):
            sgd[0].zero_grad(set_to_none=True)
            _, loss = model(x[d * B:(d + 1) * B], y[d * B:(d + 1) * B])
            loss.backward()
            sgd[0].step()

    args = [None if n in leaves else params[n.split(":", 1)[1]] for n in stage.inputs]
    inputs = [(k, leaves[n]) for k, n in enumerate(stage.inputs) if n in leaves]

    def bare():
        bases = rng.draw_bases(D)
        for d in range(D):
            for p in params.values():
                p.grad = None
            for k, split in inputs:
                args[k] = split[d]
            with rng.use(rng.Stream(bases[d])):
                out = stage.module(*args)
            run_backward([out[1]], [torch.ones_like(out[1])])  # autograd's engine, as lite's
            sgd[2].step()

    sides = {"plain": plain, "bare": bare, "lite": lambda: wrapped(x, y)}
    if D == 1:
        sides["lean"] = lean_call(wrapped, sgd[1], x, y)
    for fn in sides.values():
        fn()
    TIMERS.clear()
    times = {k: [] for k in sides}
    for r in range(rounds):
        for k in (list(sides) if r % 2 else list(sides)[::-1]):
            start = time.perf_counter()
            sides[k]()
            times[k].append((time.perf_counter() - start) / D * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name}: per step (us, median of {rounds} rounds, 1 thread): plain {med['plain']:.1f}, "
          f"bare {med['bare']:.1f}, lite {med['lite']:.1f}; lite - bare {med['lite'] - med['bare']:.1f}"
          f" ({med['lite'] / med['plain']:.3f}x plain)")
    if "lean" in med:
        print(f"  lean {med['lean']:.1f} ({med['lean'] / med['plain']:.3f}x plain, bare "
              f"{med['bare'] / med['plain']:.3f}x): mechanisms (lean - bare) "
              f"{med['lean'] - med['bare']:.1f}, layers (lite - lean) {med['lite'] - med['lean']:.1f}")
    if timers:
        per = {k: v / (rounds * D) * 1e6 for k, v in TIMERS.items()}
        handlers = sum(per[k] for k in ("forward", "backward", "reduce", "step"))
        print(f"  own time per step (us): Program.run {per['run'] - per['run_call']:.1f}, "
              f"Executor.run_call {per['run_call'] - per['_run_here']:.1f}, "
              f"Executor._run_here {per['_run_here'] - handlers:.1f}; "
              f"handlers: forward {per['forward']:.1f}, "
              f"backward {per['backward']:.1f}, reduce {per['reduce']:.1f}, "
              f"step {per['step']:.1f}")


if __name__ == "__main__":
    main()
