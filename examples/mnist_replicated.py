"""MNIST on two replicas of the model, as in Graphcore's PopTorch replication tutorial.

Run (offline, with the shared data):
    python examples/mnist_replicated.py --data-dir ../shared/data
Run (with internet; torchvision downloads MNIST into ./data):
    python examples/mnist_replicated.py

The conv net of examples/mnist.py, unchanged, with ``replicationFactor(2)``:
each call's combined batch is cut into one slice per replica, every replica
computes its slice's gradients, and the replicas' gradients are averaged
before the single optimizer step they all share. So a step sees
batch-size x replicas images. On a machine with one device the replicas take
turns; the arithmetic is the same.
"""

import torch

import poptorch_lite as poptorch
from mnist import Network, datasets, example_parser, test, train

parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=16, help="batch size of one replica")
parser.add_argument("--replicas", type=int, default=2, help="replicationFactor")
parser.add_argument("--device-iterations", type=int, default=1,
                    help="optimizer steps per call of the model (steps per execution)")
parser.add_argument("--test-batch-size", type=int, default=100, help="inference batch size")
parser.add_argument("--lr", type=float, default=0.015,
                    help="SGD learning rate of the first epoch (momentum 0.9)")
parser.add_argument("--lr-decay", type=float, default=0.3, help="learning rate factor after each epoch")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.data_dir, args.limit)

    opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.replicationFactor(args.replicas)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and outputs, for the bar
    train_data = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True,
                                     generator=torch.Generator().manual_seed(args.seed))
    print(f"effective batch: {args.batch_size} x {args.replicas} replicas = "
          f"{args.batch_size * args.replicas} per step, "
          f"{train_data.combinedBatchSize} per call (deviceIterations {args.device_iterations})")

    model = Network()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    train(training_model, train_data, args.epochs, scheduler)
    training_model.detachFromDevice()
    # The replicas hold the same weights after every step: test one copy.
    return test(model, test_set, args.test_batch_size, poptorch.Options())


if __name__ == "__main__":
    main()
