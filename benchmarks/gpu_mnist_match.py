"""examples/mnist_pipelined.py's training, step for step, against plain PyTorch on the same device.

    python benchmarks/gpu_mnist_match.py --data-dir ../shared/data --steps 200

The example's network, options and optimizer (2 stages under the Grouped schedule,
micro-batch 8, accumulation 8, deviceIterations 10, SGD with momentum) train on real MNIST
batches through poptorch_lite, whose default placement puts the stages on the GPU when
there is one (two CUDA streams on one GPU). Beside it, the same model trains in plain
PyTorch on the same device: the same micro-batches, one backward each, the gradients
averaged, one step per 8. Every 10 steps it prints the largest difference of the losses
so far and of the weights; the run fails (exit 1) if either passes ``--tolerance``. On a
machine without a GPU both sides run on the CPU.
"""

import argparse
import copy
import os
import pathlib
import sys

import torch
from tqdm import tqdm

import poptorch_lite as poptorch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from mnist import datasets  # noqa: E402
from mnist_pipelined import Network, parser as example_parser, strategy  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data-dir", default=os.environ.get("MNIST_DATA", "data"))
parser.add_argument("--steps", type=int, default=200, help="optimizer steps (a multiple of 10)")
parser.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest difference of a loss or a weight that passes")


def main():
    args = parser.parse_args()
    ex = example_parser.parse_args([])
    B, G, D = ex.batch_size, ex.gradient_accumulation, ex.device_iterations
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(ex.seed)
    train_set, _ = datasets(args.data_dir, B * G * D * args.steps // D)
    loader = torch.utils.data.DataLoader(train_set, batch_size=B * G * D, shuffle=True,
                                         drop_last=True,
                                         generator=torch.Generator().manual_seed(ex.seed))
    model = Network()
    plain = copy.deepcopy(model).to(device)
    opts = poptorch.Options().deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy(ex)).outputMode(poptorch.OutputMode.All)
    trained = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=ex.lr, momentum=0.9))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=ex.lr, momentum=0.9)
    worst_loss = 0.0
    print(f"poptorch_lite (its default placement: the GPU when there is one) against plain "
          f"PyTorch on {device}; torch {torch.__version__}")
    for call, (x, y) in enumerate(tqdm(loader, desc="calls", total=args.steps // D)):
        if call == args.steps // D:
            break
        _, losses = trained(x, y)
        xs, ys = x.to(device).chunk(D * G), y.to(device).chunk(D * G)
        plain_losses = []
        for d in range(D):
            plain_opt.zero_grad(set_to_none=True)
            for i in range(d * G, (d + 1) * G):
                _, loss = plain(xs[i], ys[i])
                loss.backward()
                plain_losses.append(loss.detach())
            for p in plain.parameters():
                p.grad.div_(G)
            plain_opt.step()
        worst_loss = max(worst_loss, (losses - torch.stack(plain_losses).cpu()).abs().max().item())
        worst_weight = max((a - b.cpu()).abs().max().item() for a, b in
                           zip(model.state_dict().values(), plain.state_dict().values()))
        tqdm.write(f"steps {(call + 1) * D}: max |loss difference| so far {worst_loss:.2e}, "
                   f"max |weight difference| {worst_weight:.2e}, last loss "
                   f"{losses[-1].item():.4f}")
    trained.destroy()
    if max(worst_loss, worst_weight) > args.tolerance:
        print(f"FAILED: a difference of {max(worst_loss, worst_weight):.2e} is above "
              f"--tolerance {args.tolerance}")
        sys.exit(1)
    print(f"the same numbers within {args.tolerance}")


if __name__ == "__main__":
    main()
