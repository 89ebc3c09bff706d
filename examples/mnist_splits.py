"""MNIST with an MLP whose pipeline stages are chosen at run time, as in Graphcore's TF1 pipelining tutorial.

Run (offline, with the shared data):
    python examples/mnist_splits.py --data-dir ../shared/data --splits dense128 dense64
Run on one stage (no splits):
    python examples/mnist_splits.py --data-dir ../shared/data --splits
The same stages as TF1's pipeline of stage functions (the tutorial's step 4):
    python examples/mnist_splits.py --data-dir ../shared/data --splits dense128 dense64 --functional

The model is an MLP of named layers: flatten, dense256, dense128, dense64,
dense32, logits (then the loss). ``--splits A B`` starts a new stage at layer
A and another at layer B (``poptorch.split_at``), so ``--splits dense128
dense64`` gives three stages: flatten+dense256 | dense128 | dense64 ... logits.
The script prints the layers, then the stages the compiled model runs.

``--functional`` builds the stages as TF1's tutorial does instead: the layers
are grouped into one stage per split, and ``poptorch.pipeline`` pipelines the
stage list (``repeat_count`` = device iterations, ``gradient_accumulation_count``
= accumulation). Both routes give the same numbers.
"""

from collections import OrderedDict

import torch
import torch.nn as nn

import poptorch_lite as poptorch
from mnist import datasets, example_parser, test, train

parser = example_parser(__doc__)
parser.add_argument("--splits", nargs="*", default=["dense128", "dense64"],
                    help="layers that start a new pipeline stage")
parser.add_argument("--epochs", type=int, default=2, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
parser.add_argument("--gradient-accumulation", type=int, default=5,
                    help="micro-batches per optimizer step (a pipeline of S stages needs >= 2S-1)")
parser.add_argument("--device-iterations", type=int, default=10,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--schedule", default="grouped",
                    choices=("grouped", "interleaved", "sequential", "gpipe"), help="pipeline schedule")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference micro-batch size")
parser.add_argument("--lr", type=float, default=0.02,
                    help="SGD learning rate of the first epoch (momentum 0.9)")
parser.add_argument("--lr-decay", type=float, default=0.3, help="learning rate factor after each epoch")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--functional", action="store_true",
                    help="build the stages as TF1's stage functions (poptorch.pipeline)")


class MLP(nn.Module):
    """flatten, dense256, dense128, dense64, dense32 (ReLU after each dense layer), logits."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense256 = nn.Linear(784, 256)
        self.dense128 = nn.Linear(256, 128)
        self.dense64 = nn.Linear(128, 64)
        self.dense32 = nn.Linear(64, 32)
        self.logits = nn.Linear(32, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        x = self.flatten(x)
        for dense in (self.dense256, self.dense128, self.dense64, self.dense32):
            x = torch.relu(dense(x))
        x = self.logits(x)
        return x if labels is None else (x, self.loss(x, labels))


def options(args, device_iterations):
    """Pipelined options for ``len(args.splits) + 1`` stages, one per IPU (stream)."""
    opts = poptorch.Options().deviceIterations(device_iterations).randomSeed(args.seed)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu,
                                                          schedule=args.schedule))
    return opts


def functional_stages(model, splits):
    """The TF1 tutorial's step 4: the layers in order, a new stage at each split."""
    names = [name for name, _ in model.named_children() if name != "loss"]
    unknown = [name for name in splits if name not in names]
    if unknown:
        parser.error(f"--splits {' '.join(unknown)}: no such layer; the layers are {names}")
    stages = [{}]
    for name in names:
        if name in splits:
            stages.append({})
        stages[-1][name] = getattr(model, name)
        if name.startswith("dense"):
            stages[-1][f"relu{name[5:]}"] = nn.ReLU()
    return [nn.Sequential(OrderedDict(layers)) for layers in stages]


def training_model(args, model, optimizer):
    """``model`` annotated with ``split_at`` and wrapped, or (``--functional``) TF1's pipeline."""
    if args.functional:
        pipe = poptorch.pipeline(
            functional_stages(model, args.splits),
            gradient_accumulation_count=args.gradient_accumulation,
            repeat_count=args.device_iterations, optimizer=optimizer, loss=model.loss,
            pipeline_schedule=args.schedule, outfeed_loss=False,
            options=poptorch.Options().randomSeed(args.seed))
        return pipe.training_model  # PopTorch's API: compile, setOptimizer, runStatistics
    poptorch.split_at(model, args.splits)  # stage k+1 starts at args.splits[k], on IPU k+1
    opts = options(args, args.device_iterations)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    return poptorch.trainingModel(model, opts, optimizer)


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.data_dir, args.limit)
    model = MLP()
    print("layers: " + ", ".join(name for name, _ in model.named_children() if name != "loss"))
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = training_model(args, model, optimizer)
    train_data = poptorch.DataLoader(trainer.options, train_set, batch_size=args.batch_size,
                                     shuffle=True,
                                     generator=torch.Generator().manual_seed(args.seed))
    print(f"effective batch: {args.batch_size} x {args.gradient_accumulation} accumulation = "
          f"{args.batch_size * args.gradient_accumulation} per step")
    data, labels = next(iter(train_data))
    trainer.compile(data, labels)
    print(f"stages ({len(args.splits) + 1}):")
    print(poptorch.stage_summary(trainer))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    train(trainer, train_data, args.epochs, scheduler)
    trainer.detachFromDevice()
    # Inference needs deviceIterations >= stages to fill the pipeline.
    return test(model, test_set, args.test_batch_size,
                options(args, max(args.device_iterations, len(args.splits) + 1)))


if __name__ == "__main__":
    main()
