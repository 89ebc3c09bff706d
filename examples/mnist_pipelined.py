"""MNIST with the conv net split into pipeline stages, as in Graphcore's PopTorch pipelining tutorial.

Run (offline, with the shared data):
    python examples/mnist_pipelined.py --data-dir ../shared/data
Four stages, 1F1B, recomputation, two replicas, and a timeline to look at:
    python examples/mnist_pipelined.py --data-dir ../shared/data --stages 4 \\
        --schedule interleaved --recompute --replicas 2 --trace trace.json
A picture of the pipeline (an SVG Gantt chart) of one step:
    python examples/mnist_pipelined.py --data-dir ../shared/data --device-iterations 1 \\
        --trace pipeline.svg
Each stage in a process of its own (one per GPU is the norm; here CPU processes):
    torchrun --nproc_per_node 2 examples/mnist_pipelined.py --data-dir ../shared/data

The network of examples/mnist.py, annotated with four blocks: B1 and B2 (the
conv layers), B3 (the hidden dense layer) and B4 (the output layer and the
loss). With ``--stages 2`` B1, B2 run on IPU 0 and B3, B4 on IPU 1; with
``--stages 4`` each block is a stage. Each stage runs on its own stream (a
worker thread on the CPU), and the stages work on different micro-batches at
the same time. ``--trace`` writes the timeline of the last call, as a picture
(``.svg``) or for chrome://tracing and ui.perfetto.dev (``.json``), and prints
it as ASCII. Under torchrun the stages spread over ``--pipeline-processes``
processes (all of them by default) with
``opts.Distributed.set_ipu_processes``; more processes than that make
data-parallel copies of the pipeline. Process 0 alone shows progress and prints.
"""

import torch
import torch.nn as nn

import poptorch_lite as poptorch
from mnist import ConvLayer, datasets, example_parser, test, train

parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
parser.add_argument("--gradient-accumulation", type=int, default=8,
                    help="micro-batches per optimizer step (a pipeline of S stages needs >= 2S-1)")
parser.add_argument("--device-iterations", type=int, default=10,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--stages", type=int, default=2, choices=(2, 4), help="pipeline stages")
parser.add_argument("--schedule", default="grouped",
                    choices=("grouped", "interleaved", "sequential", "gpipe", "zero_bubble"),
                    help="pipeline schedule (see docs/TUTORIAL.md)")
parser.add_argument("--recompute", action="store_true",
                    help="keep only stage inputs and recompute activations in the backward")
parser.add_argument("--replicas", type=int, default=1, help="copies of the whole pipeline")
parser.add_argument("--pipeline-processes", type=int, default=0,
                    help="under torchrun: processes one pipeline's stages spread over "
                         "(0: all of them)")
parser.add_argument("--trace", default="",
                    help="write the last call's timeline to this file: .svg a picture, else JSON")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference micro-batch size")
parser.add_argument("--lr", type=float, default=0.05,
                    help="SGD learning rate of the first epoch (momentum 0.9)")
parser.add_argument("--lr-decay", type=float, default=0.3, help="learning rate factor after each epoch")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


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


def strategy(args):
    """The blocks grouped into ``args.stages`` stages, one IPU (stream) each."""
    groups = [("B1", "B2"), ("B3", "B4")] if args.stages == 2 else [("B1",), ("B2",), ("B3",), ("B4",)]
    stages = [poptorch.Stage(*blocks).ipu(s).recompute(args.recompute)
              for s, blocks in enumerate(groups)]
    return poptorch.PipelinedExecution(*stages, schedule=args.schedule)


def spread(opts, args):
    """Under torchrun: the stages' IPUs dealt in blocks over a pipeline's processes."""
    W = opts.Distributed.numProcesses  # torchrun's WORLD_SIZE; 1 without torchrun
    n = args.pipeline_processes or W
    if W == 1 or n == 1:
        return 1
    if args.stages % n or W % n:
        parser.error(f"{args.stages} stages do not split over {n} processes per pipeline, or "
                     f"{W} processes into pipelines of {n}; pass --pipeline-processes")
    per = args.stages // n
    opts.Distributed.set_ipu_processes([list(range(j * per, (j + 1) * per)) for j in range(n)])
    return W // n


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.data_dir, args.limit)

    opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.replicationFactor(args.replicas)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.setExecutionStrategy(strategy(args))
    pipelines = spread(opts, args)  # data-parallel pipelines over the processes
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True,
                                     generator=torch.Generator().manual_seed(args.seed))
    per_step = args.batch_size * args.gradient_accumulation * args.replicas * pipelines
    across = f" x {pipelines} pipelines" if pipelines > 1 else ""
    shares = f"; {train_data.combinedBatchSize} per pipeline" if pipelines > 1 else ""
    if poptorch.is_main_process():
        print(f"effective batch: {args.batch_size} x {args.gradient_accumulation} accumulation x "
              f"{args.replicas} replicas{across} = {per_step} per step, "
              f"{train_data.combinedBatchSize * pipelines} per call (deviceIterations "
              f"{args.device_iterations}{shares})")

    model = Network()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    train(training_model, train_data, args.epochs, scheduler, pipelines)
    if args.trace and poptorch.is_main_process():
        timeline = training_model.runStatistics().timeline
        if args.trace.endswith(".svg"):
            timeline.write_svg(args.trace)
        else:
            timeline.write_chrome_trace(args.trace)
        print(timeline.render(width=96))
        print(timeline.summary())
        print(f"timeline of the last call written to {args.trace}")
    training_model.detachFromDevice()

    # Inference needs deviceIterations >= stages to fill the pipeline.
    test_opts = poptorch.Options().deviceIterations(max(args.stages, args.device_iterations))
    test_opts.setExecutionStrategy(strategy(args))
    spread(test_opts, args)  # each pipeline tests its share of the test set
    return test(model, test_set, args.test_batch_size, test_opts)


if __name__ == "__main__":
    main()
