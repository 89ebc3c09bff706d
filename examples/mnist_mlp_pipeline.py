"""MNIST with a 4-layer MLP in a training pipeline, after Graphcore's popxl pipelining tutorial.

Run (offline, with the shared data):
    python examples/mnist_mlp_pipeline.py --data-dir ../shared/data
With recomputation (stash only each stage's input, recompute in the backward):
    python examples/mnist_mlp_pipeline.py --data-dir ../shared/data --recompute

The model: fc1, fc2, fc3 (512 units, GELU) and fc4 (10 logits), Adam.

How the tutorial's pipeline maps here. popxl builds three pipeline stages on
two IPUs: (1) fc1, fc2 forward on IPU 0; (2) fc3, fc4, the loss and their
backward on IPU 1; (3) fc2, fc1 backward, back on IPU 0 where their weights
live. poptorch_lite runs a stage's forward and backward on the same stream,
so the same work is two stages here: stage 0 = fc1, fc2 on IPU 0 (stream 0),
stage 1 = fc3, fc4 and the loss on IPU 1 (stream 1). popxl's third stage is
stage 0's backward action, which runs on stream 0 between its forwards of
later micro-batches. With the interleaved (1F1B) schedule, stream 0
alternates "fc1, fc2 forward of micro-batch i" and "fc2, fc1 backward of
micro-batch i-1" in the steady state, while stream 1 runs forward and
backward of fc3, fc4 and the loss: the tutorial's three stages, on two streams.
"""

import torch
import torch.nn as nn

import poptorch_lite as poptorch
from mnist import datasets, example_parser, test, train

parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=2, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
parser.add_argument("--gradient-accumulation", type=int, default=8,
                    help="micro-batches per optimizer step (>= 3 for 2 stages)")
parser.add_argument("--device-iterations", type=int, default=10,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--schedule", default="interleaved",
                    choices=("grouped", "interleaved", "sequential", "gpipe"), help="pipeline schedule")
parser.add_argument("--recompute", action="store_true",
                    help="keep only stage inputs and recompute activations in the backward")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference micro-batch size")
parser.add_argument("--lr", type=float, default=0.001, help="Adam learning rate of the first epoch")
parser.add_argument("--lr-decay", type=float, default=0.1, help="learning rate factor after each epoch")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 512)
        self.fc4 = nn.Linear(512, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        x = x.flatten(1)
        with poptorch.Block("fc1_fc2", ipu_id=0):
            x = nn.functional.gelu(self.fc2(nn.functional.gelu(self.fc1(x))))
        with poptorch.Block("fc3_fc4", ipu_id=1):
            x = self.fc4(nn.functional.gelu(self.fc3(x)))
            return x if labels is None else (x, self.loss(x, labels))


def options(args, device_iterations):
    """Stage 0 (fc1, fc2) on IPU 0 and stage 1 (fc3, fc4, loss) on IPU 1."""
    opts = poptorch.Options().deviceIterations(device_iterations).randomSeed(args.seed)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("fc1_fc2").ipu(0).recompute(args.recompute),
        poptorch.Stage("fc3_fc4").ipu(1).recompute(args.recompute), schedule=args.schedule))
    return opts


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.data_dir, args.limit)

    opts = options(args, args.device_iterations)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True,
                                     generator=torch.Generator().manual_seed(args.seed))
    print(f"effective batch: {args.batch_size} x {args.gradient_accumulation} accumulation = "
          f"{args.batch_size * args.gradient_accumulation} per step")
    model = MLP()
    model.train()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=args.lr)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    train(training_model, train_data, args.epochs, scheduler)  # prints the training samples/s
    training_model.detachFromDevice()
    # Prints the inference samples/s; inference needs deviceIterations >= 2 stages.
    return test(model, test_set, args.test_batch_size, options(args, max(2, args.device_iterations)))


if __name__ == "__main__":
    main()
