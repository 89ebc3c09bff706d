"""MNIST on one device, written as Graphcore's PopTorch MNIST tutorial writes it.

Run (offline, with the shared data):
    python examples/mnist.py --data-dir ../shared/data
Run (with internet; torchvision downloads MNIST into ./data):
    python examples/mnist.py
Compare steps per execution (trains a copy for a short stretch with 1 and with N first):
    python examples/mnist.py --data-dir ../shared/data --device-iterations 50

The conv net of the tutorial, unannotated, so the whole model is one stage on
one device. With ``--device-iterations N`` one call of the model runs N
optimizer steps (the tutorials' "steps per execution"); the script first times
a short stretch of training with 1 and with N on a copy of the model and
prints how much faster N is.
"""

import argparse
import copy
import os
import time

import torch
import torch.nn as nn
import torchvision
from tqdm import tqdm

import poptorch_lite as poptorch

def example_parser(doc: str) -> argparse.ArgumentParser:
    """An MNIST example's parser: its docstring's first line, every default shown in --help,
    and --data-dir (every MNIST example's first option)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("MNIST_DATA", "data"),
                        help="folder holding MNIST/ (downloaded there if missing); $MNIST_DATA "
                             "if set, else data")
    return parser


parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=16, help="batch size of one step")
parser.add_argument("--device-iterations", type=int, default=1,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference batch size")
parser.add_argument("--lr", type=float, default=0.01,
                    help="SGD learning rate of the first epoch (momentum 0.9)")
parser.add_argument("--lr-decay", type=float, default=0.3, help="learning rate factor after each epoch")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256, bias=False)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)
        self.softmax = nn.LogSoftmax(1)
        self.loss = nn.NLLLoss(reduction="mean")

    def forward(self, x, target=None):
        x = self.layer2(self.layer1(x))
        x = self.layer3_act(self.layer3(x.view(-1, 320)))
        x = self.softmax(self.layer4(x))
        if target is None:
            return x
        return x, self.loss(x, target)


def accuracy(predictions, labels):
    return (predictions.argmax(1) == labels).float().mean().item() * 100.0


def open_mnist(data_dir, train, transform=None):
    """torchvision's MNIST in ``data_dir``, downloaded there if missing (with a hint offline)."""
    try:
        return torchvision.datasets.MNIST(data_dir, train=train, download=True, transform=transform)
    except (RuntimeError, OSError) as exc:  # torchvision: "Error downloading ..." after its mirrors
        raise SystemExit(f"MNIST is not in {data_dir!r} and could not be downloaded ({exc}). "
                         f"Offline, point --data-dir (or $MNIST_DATA) at a folder that holds "
                         f"MNIST/raw, e.g. --data-dir ../shared/data") from exc


def datasets(data_dir, limit):
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(), torchvision.transforms.Normalize((0.1307,), (0.3081,))])
    train = open_mnist(data_dir, True, transform)
    test = open_mnist(data_dir, False, transform)
    if limit:
        train = torch.utils.data.Subset(train, range(min(limit, len(train))))
        test = torch.utils.data.Subset(test, range(min(limit, len(test))))
    return train, test


def images_per_second(model, args, device_iterations, warm_up, batches):
    """Train ``model`` with ``device_iterations`` steps per call: untimed on ``warm_up``
    (the first call traces the model), then timed on ``batches``; return images/s."""
    opts = poptorch.Options().deviceIterations(device_iterations)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)

    def calls(steps):  # device_iterations steps of (data, labels) per call
        for k in range(0, len(steps), device_iterations):
            group = steps[k:k + device_iterations]
            yield torch.cat([d for d, _ in group]), torch.cat([t for _, t in group])

    for data, labels in calls(warm_up):
        training_model(data, labels)
    start = time.perf_counter()
    for data, labels in calls(batches):
        training_model(data, labels)
    elapsed = time.perf_counter() - start
    training_model.destroy()
    return sum(data.shape[0] for data, _ in batches) / elapsed


def report_speed_gained(model, train_set, args):
    """Time the same stretch of training with 1 and N steps per call, on copies of ``model``."""
    n = args.device_iterations
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, drop_last=True)
    steps = n * max(2, 400 // n + 1)  # at least 2 calls of N, and about 400 steps
    batches = [batch for _, batch in zip(range(steps), loader)]
    batches = batches[:len(batches) - len(batches) % n]
    warm_up, timed = batches[:n], batches[n:]
    one = images_per_second(copy.deepcopy(model), args, 1, warm_up, timed)
    many = images_per_second(copy.deepcopy(model), args, n, warm_up, timed)
    print(f"device iterations {n}: {many / one:.2f}x the speed of 1 "
          f"({many:.0f} vs {one:.0f} images/s over {len(timed)} timed steps)")


class RunningMean:
    """The epoch's mean loss and accuracy so far, over every micro-batch trained.

    A call trains on deviceIterations x gradientAccumulation x replicas micro-batches.
    Under ``OutputMode.All`` (the examples' training option) it returns the loss of each
    and an output row for each image; the default mode returns the last micro-batch's.
    """

    def __init__(self):
        self.loss_sum, self.micro_batches, self.correct, self.images = 0.0, 0, 0, 0

    def add(self, losses, output, labels):
        """Count one call's losses and outputs; return the figures for a progress bar."""
        if output.shape[0] != labels.shape[0]:
            raise ValueError(f"{output.shape[0]} output rows for {labels.shape[0]} labels: "
                             f"train with opts.outputMode(poptorch.OutputMode.All)")
        self.loss_sum += losses.sum().item()
        self.micro_batches += losses.numel()
        self.correct += (output.argmax(1) == labels).sum().item()
        self.images += labels.shape[0]
        return {"epoch mean loss": f"{self.loss:.4f}", "epoch accuracy": f"{self.accuracy:.2f}%"}

    @property
    def loss(self):
        return self.loss_sum / self.micro_batches

    @property
    def accuracy(self):
        return 100.0 * self.correct / self.images


def train(training_model, train_data, epochs, scheduler=None, pipelines=1):
    """Run ``epochs`` passes with a tqdm bar of the epoch's mean loss and accuracy so far,
    over every micro-batch trained (the model's options need ``OutputMode.All``); return
    (images, seconds, the last epoch's RunningMean).

    A torch ``scheduler`` steps after each epoch; ``setOptimizer`` hands the new
    learning rate to the model, as in PopTorch. ``pipelines`` data-parallel copies of the
    model (under torchrun) each train on their own share of the images.
    """
    main_process = poptorch.is_main_process()  # under torchrun, process 0 alone reports
    start, seen = time.perf_counter(), 0
    for epoch in range(1, epochs + 1):
        if scheduler is not None and epoch > 1:
            scheduler.step()
            training_model.setOptimizer(scheduler.optimizer)
        bar = tqdm(train_data, desc=f"epoch {epoch}/{epochs}", disable=not main_process)
        running = RunningMean()
        for data, labels in bar:
            output, losses = training_model(data, labels)  # every micro-batch's (OutputMode.All)
            seen += data.shape[0] * pipelines
            bar.set_postfix(running.add(losses, output, labels))
    elapsed = time.perf_counter() - start
    if main_process:
        print(f"trained on {seen} images in {elapsed:.1f} s "
              f"({seen / max(elapsed, 1e-9):.0f} samples/s)")
    return seen, elapsed, running


def test(model, test_set, batch_size, opts):
    """Print and return the accuracy of ``model`` on ``test_set``, run as inferenceModel."""
    main_process = poptorch.is_main_process()
    test_data = poptorch.DataLoader(opts, test_set, batch_size=batch_size)
    model.eval()
    inference_model = poptorch.inferenceModel(model, opts)
    correct, total, start = 0.0, 0, time.perf_counter()
    for data, labels in tqdm(test_data, desc="test", disable=not main_process):
        output = inference_model(data)
        correct += accuracy(output, labels) * labels.shape[0] / 100.0
        total += labels.shape[0]
    elapsed = time.perf_counter() - start
    inference_model.detachFromDevice()
    if main_process:
        pipelines = opts.Distributed.numProcesses // opts.Distributed.processes_per_pipeline
        share = f" (pipeline 0's share of {pipelines})" if pipelines > 1 else ""
        print(f"tested on {total} images{share} in {elapsed:.1f} s "
              f"({total / max(elapsed, 1e-9):.0f} samples/s)")
        print(f"Accuracy on test set: {100.0 * correct / total:.2f}%")
    return 100.0 * correct / total


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.data_dir, args.limit)
    model = Network()
    model.train()
    if args.device_iterations > 1:
        report_speed_gained(model, train_set, args)

    opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True,
                                     generator=torch.Generator().manual_seed(args.seed))
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    train(training_model, train_data, args.epochs, scheduler)
    training_model.detachFromDevice()
    return test(model, test_set, args.test_batch_size, poptorch.Options())


if __name__ == "__main__":
    main()
