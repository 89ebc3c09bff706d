"""Single-stage overhead: poptorch_lite's training call against plain PyTorch, same process.

    python benchmarks/overhead.py            # 8 x Linear(1024)+ReLU, micro-batch 32, 8 accumulated
    python benchmarks/overhead.py --width 256 --repeats 20

Both sides do the same arithmetic: G micro-batches forward+backward, gradients
averaged, one SGD step. Runs alternate (plain, wrapped, plain, ...) so that the
machine's noise falls on both; the median of each is reported, with the ratio.
"""

import argparse
import statistics
import time

import torch

import poptorch_lite as poptorch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
parser.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch")
parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step")
parser.add_argument("--repeats", type=int, default=15, help="timed steps per side")
parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")


class MLP(torch.nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.net = torch.nn.Sequential(*[m for _ in range(layers)
                                         for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.mse_loss(out, y)


def main():
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    G, B = args.accumulation, args.micro_batch
    plain, wrapped_model = MLP(args.width, args.layers), MLP(args.width, args.layers)
    x, y = torch.randn(G * B, args.width), torch.randn(G * B, args.width)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    wrapped = poptorch.trainingModel(wrapped_model, opts,
                                     torch.optim.SGD(wrapped_model.parameters(), lr=1e-4))

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        for i in range(G):
            _, loss = plain(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
            loss.backward()
        for p in plain.parameters():
            p.grad.div_(G)
        plain_opt.step()

    def wrapped_step():
        wrapped(x, y)

    for _ in range(3):  # warm up (and trace)
        plain_step()
        wrapped_step()
    times = {"plain": [], "poptorch_lite": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain_step), ("poptorch_lite", wrapped_step)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    p, w = statistics.median(times["plain"]), statistics.median(times["poptorch_lite"])
    # Each wrapped step against the plain step just before it: drift falls on both alike.
    paired = statistics.median(b / a for a, b in zip(times["plain"], times["poptorch_lite"]))
    print(f"model: {args.layers} x Linear({args.width})+ReLU, micro-batch {B}, accumulation {G}, "
          f"threads {torch.get_num_threads()}")
    print(f"plain PyTorch  : {p * 1e3:8.2f} ms/step")
    print(f"poptorch_lite  : {w * 1e3:8.2f} ms/step")
    print(f"ratio          : {w / p:8.3f} of medians, {paired:.3f} paired median "
          f"(overhead {100 * (paired - 1):+.1f}%)")

if __name__ == "__main__":
    main()
