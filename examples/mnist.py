"""MNIST with a pipelined conv net, written as a PopTorch script.

Run (offline, with the shared data):
    python examples/mnist.py --data-dir ../shared/data
Run (with internet; torchvision downloads MNIST into ./data):
    python examples/mnist.py

The network is the conv net of Graphcore's PopTorch MNIST tutorial, annotated
with four blocks: B1 and B2 (the conv layers) on IPU 0, B3 and B4 (the dense
layers and the loss) on IPU 1, so it trains as a 2-stage pipeline.
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torchvision
from tqdm import tqdm

import poptorch_lite as poptorch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data-dir", default=os.environ.get("MNIST_DATA", "data"),
                    help="folder holding MNIST/ (downloaded there if missing)")
parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
parser.add_argument("--gradient-accumulation", type=int, default=8,
                    help="micro-batches per optimizer step (>= 3 for a 2-stage pipeline)")
parser.add_argument("--device-iterations", type=int, default=10,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference micro-batch size")
parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
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
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.softmax(self.layer4(x))
            if target is None:
                return x
            return x, self.loss(x, target)


def strategy():
    """Blocks B1, B2 on IPU 0 and B3, B4 on IPU 1: a 2-stage pipeline."""
    return poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0),
                                       poptorch.Stage("B3", "B4").ipu(1))


def accuracy(predictions, labels):
    return (predictions.argmax(1) == labels).float().mean().item() * 100.0


def datasets(data_dir, limit):
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(), torchvision.transforms.Normalize((0.1307,), (0.3081,))])
    train = torchvision.datasets.MNIST(data_dir, train=True, download=True, transform=transform)
    test = torchvision.datasets.MNIST(data_dir, train=False, download=True, transform=transform)
    if limit:
        train = torch.utils.data.Subset(train, range(min(limit, len(train))))
        test = torch.utils.data.Subset(test, range(min(limit, len(test))))
    return train, test


def main(argv=None):
    args = parser.parse_args(argv)
    train_set, test_set = datasets(args.data_dir, args.limit)

    opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.setExecutionStrategy(strategy())
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True)
    print(f"effective batch: {args.batch_size} x {args.gradient_accumulation} accumulation = "
          f"{args.batch_size * args.gradient_accumulation} per step, "
          f"{train_data.combinedBatchSize} per call ({args.device_iterations} steps)")

    model = Network()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)

    start, seen = time.perf_counter(), 0
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(train_data, desc=f"epoch {epoch}/{args.epochs}")
        for data, labels in bar:
            output, loss = training_model(data, labels)
            seen += data.shape[0]
            bar.set_postfix(loss=f"{loss.item():.4f}",
                            accuracy=f"{accuracy(output, labels[-output.shape[0]:]):.1f}%")
    elapsed = time.perf_counter() - start
    print(f"trained on {seen} images in {elapsed:.1f} s ({seen / max(elapsed, 1e-9):.0f} images/s)")
    training_model.detachFromDevice()

    test_opts = poptorch.Options().deviceIterations(max(2, args.device_iterations))
    test_opts.setExecutionStrategy(strategy())
    test_data = poptorch.DataLoader(test_opts, test_set, batch_size=args.test_batch_size)
    model.eval()
    inference_model = poptorch.inferenceModel(model, test_opts)
    correct, total = 0.0, 0
    for data, labels in tqdm(test_data, desc="test"):
        output = inference_model(data)
        correct += accuracy(output, labels) * labels.shape[0] / 100.0
        total += labels.shape[0]
    inference_model.detachFromDevice()
    print(f"Accuracy on test set: {100.0 * correct / total:.2f}%")
    return 100.0 * correct / total


if __name__ == "__main__":
    main()
