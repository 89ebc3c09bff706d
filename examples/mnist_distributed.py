"""MNIST trained by several processes at once, written as a PopTorch script run by torchrun.

Run (offline, with the shared data; 2 processes on this machine):
    torchrun --nproc_per_node 2 examples/mnist_distributed.py --data-dir ../shared/data
Run on 2 hosts (the same command on each, --node_rank 0 and 1):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr HOST0 \
        --master_port 29500 examples/mnist_distributed.py

The network is examples/mnist_pipelined.py's, in its 2-stage pipeline. Every process
runs the pipeline on its own shard of the data (poptorch.DataLoader splits the
dataset); gradients are averaged over all processes before each optimizer
step, so one step sees batch x accumulation x replicas x processes images.
Process 0 alone shows progress, evaluates and prints.
"""

import time

from tqdm import tqdm

import poptorch_lite as poptorch
from mnist import RunningMean, accuracy, datasets, example_parser
from mnist_pipelined import Network, strategy

parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
parser.add_argument("--gradient-accumulation", type=int, default=4,
                    help="micro-batches per optimizer step (>= 3 for a 2-stage pipeline)")
parser.add_argument("--replicas", type=int, default=1, help="replicas in each process")
parser.add_argument("--stages", type=int, default=2, choices=(2, 4), help="pipeline stages")
parser.add_argument("--schedule", default="grouped",
                    choices=("grouped", "interleaved", "sequential", "gpipe"),
                    help="pipeline schedule (see docs/TUTORIAL.md)")
parser.add_argument("--recompute", action="store_true", help="recompute every stage")
parser.add_argument("--device-iterations", type=int, default=10,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference micro-batch size")
parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


def main(argv=None):
    args = parser.parse_args(argv)
    train_set, test_set = datasets(args.data_dir, args.limit)

    main_process = poptorch.is_main_process()  # process 0 prints, evaluates and writes

    # Rank and process count come from torchrun's RANK and WORLD_SIZE.
    opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.replicationFactor(args.replicas)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.setExecutionStrategy(strategy(args))
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True)
    P = opts.Distributed.numProcesses
    if main_process:
        print(f"effective batch: {args.batch_size} x {args.gradient_accumulation} accumulation x "
              f"{args.replicas} replica{'s' if args.replicas > 1 else ''} x {P} processes = "
              f"{args.batch_size * args.gradient_accumulation * args.replicas * P} per step, "
              f"{train_data.combinedBatchSize * P} per call ({args.device_iterations} steps)")

    model = Network()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)

    start, seen = time.perf_counter(), 0
    for epoch in range(1, args.epochs + 1):
        train_data.set_epoch(epoch)  # a new shuffle, the same in every process
        bar = tqdm(train_data, desc=f"epoch {epoch}/{args.epochs}", disable=not main_process)
        running = RunningMean()
        for data, labels in bar:
            output, losses = training_model(data, labels)  # every micro-batch's
            seen += data.shape[0] * P
            bar.set_postfix(running.add(losses, output, labels))
    elapsed = time.perf_counter() - start
    training_model.detachFromDevice()
    if not main_process:
        return None
    print(f"trained on {seen} images in {elapsed:.1f} s ({seen / max(elapsed, 1e-9):.0f} images/s)")

    test_opts = poptorch.Options().deviceIterations(max(2, args.device_iterations))
    test_opts.Distributed.disable()  # process 0 evaluates the whole test set alone
    test_opts.setExecutionStrategy(strategy(args))
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
