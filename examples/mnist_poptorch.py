"""An unmodified PopTorch script: MNIST as Graphcore's PopTorch MNIST demo trains it.

It says `import poptorch`, as a script written for IPUs does; run it through the
alias, which makes `import poptorch` give poptorch_lite for that run. A short run
(one epoch on 10,000 images, a few minutes on a 2-core CPU), then the demo's full one
(10 epochs, about 2 hours there):
    poptorch-lite run examples/mnist_poptorch.py --data-dir ../shared/data --epochs 1 --limit 10000
    poptorch-lite run examples/mnist_poptorch.py --data-dir ../shared/data
(`python -m poptorch_lite run ...` is the same.)

Defaults are the demo's: micro-batches of 8, 50 device iterations per call,
test batches of 80, SGD at 0.03, 10 epochs. The model is the demo's two
convolution blocks and two dense layers with dropout, wrapped with its loss in a
second module, as the demo does. The bar shows the epoch's mean loss and accuracy
over every micro-batch trained (outputMode All returns each one's); the test runs
one batch of 80 per call, so all 10,000 test images are scored.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torchvision
from tqdm import tqdm

try:
    import poptorch
except ModuleNotFoundError:
    sys.exit("No module named 'poptorch': without an IPU, run this script with "
             "`poptorch-lite run examples/mnist_poptorch.py ...` (see its docstring)")

parser = argparse.ArgumentParser(description="MNIST training in PopTorch",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=8, help="batch size for training")
parser.add_argument("--device-iterations", type=int, default=50, help="device iterations per call")
parser.add_argument("--test-batch-size", type=int, default=80, help="batch size for testing")
parser.add_argument("--epochs", type=int, default=10, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.03, help="learning rate")
parser.add_argument("--data-dir", default=os.environ.get("MNIST_DATA", "mnist_data"),
                    help="folder holding MNIST/ (downloaded there if missing); "
                         "$MNIST_DATA if set, else mnist_data")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")


class Block(nn.Module):
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
        self.layer1 = Block(1, 32, 3, 2)
        self.layer2 = Block(32, 64, 3, 2)
        self.layer3 = nn.Linear(1600, 128)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = nn.Dropout(0.5)
        self.layer4 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(x)).view(-1, 1600)
        x = self.layer3_dropout(self.layer3_act(self.layer3(x)))
        return self.layer4(x)


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, loss_inputs=None):
        output = self.model(args)
        if loss_inputs is None:
            return output
        return output, self.loss(output, loss_inputs)


def accuracy(predictions, labels):
    return (predictions.argmax(1) == labels).float().mean().item() * 100.0


def mnist(args, train):
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(), torchvision.transforms.Normalize((0.1307,), (0.3081,))])
    try:
        data = torchvision.datasets.MNIST(args.data_dir, train=train, download=True,
                                          transform=transform)
    except (RuntimeError, OSError) as exc:
        raise SystemExit(f"MNIST is not in {args.data_dir!r} and could not be downloaded "
                         f"({exc}); offline, pass --data-dir ../shared/data") from exc
    return torch.utils.data.Subset(data, range(args.limit)) if args.limit else data


if __name__ == "__main__":
    args = parser.parse_args()
    torch.manual_seed(0)

    opts = poptorch.Options().deviceIterations(args.device_iterations)
    opts.outputMode(poptorch.OutputMode.All)  # each micro-batch's outputs and loss, for the bar
    training_data = poptorch.DataLoader(opts, mnist(args, True), batch_size=args.batch_size,
                                        shuffle=True, drop_last=True)
    model = Network()
    training_model = poptorch.trainingModel(
        TrainingModelWithLoss(model), opts,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=args.lr))

    for epoch in tqdm(range(args.epochs), desc="epochs"):
        bar = tqdm(training_data, desc="batches", leave=False)
        sum_loss = sum_acc = 0.0
        for k, (data, labels) in enumerate(bar, 1):
            preds, losses = training_model(data, labels)
            sum_loss += losses.mean().item()  # the mean over the call's micro-batches
            sum_acc += accuracy(preds, labels)
            bar.set_postfix({"epoch mean loss": f"{sum_loss / k:.4f}",
                             "epoch accuracy": f"{sum_acc / k:.2f}%"})
    training_model.detachFromDevice()

    test_set = mnist(args, False)
    test_data = poptorch.DataLoader(poptorch.Options(), test_set,
                                    batch_size=args.test_batch_size, drop_last=True)
    inference_model = poptorch.inferenceModel(model)
    sum_acc = 0.0
    for data, labels in tqdm(test_data, desc="test batches", leave=False):
        sum_acc += accuracy(inference_model(data), labels)
    inference_model.detachFromDevice()
    scored = len(test_data) * args.test_batch_size
    if scored < len(test_set):
        print(f"(scored {scored} of the {len(test_set)} test images: whole batches of "
              f"{args.test_batch_size} only)")
    print(f"Accuracy on test set: {sum_acc / len(test_data):.2f}%")
