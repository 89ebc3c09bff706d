"""MNIST with the Keras face, following the steps of Graphcore's IPU Keras tutorial.

Run (offline, with the shared data):
    python examples/keras_mnist.py --data-dir ../shared/data
Run (with internet; torchvision downloads MNIST into ./data):
    python examples/keras_mnist.py
Two replicas, or the conv net as a 2-stage pipeline:
    python examples/keras_mnist.py --data-dir ../shared/data --replicas 2
    python examples/keras_mnist.py --data-dir ../shared/data --pipeline --schedule interleaved

The tutorial's steps: load the data and trim it with ``make_divisible`` so that
every epoch is a whole number of executions; build the model (here the conv net
of examples/mnist.py as a ``keras.Sequential`` of torch layers); inside an
``IPUStrategy`` scope when there are replicas; optionally assign its layers to
two pipeline stages; ``compile`` with ``steps_per_execution``; ``fit``; then
compile again with the test set's steps per execution and ``evaluate``.
"""

import time

import torch
import torch.nn as nn

from poptorch_lite import keras
from mnist import ConvLayer, example_parser, open_mnist

parser = example_parser(__doc__)
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=32, help="batch size (per replica)")
parser.add_argument("--steps-per-execution", type=int, default=24,
                    help="steps (batches, all replicas' together) per execution")
parser.add_argument("--replicas", type=int, default=1, help="copies of the model (or pipeline)")
parser.add_argument("--pipeline", action="store_true", help="split the model into 2 stages")
parser.add_argument("--schedule", default="grouped",
                    choices=("grouped", "interleaved", "sequential"),
                    help="pipeline schedule, with --pipeline")
parser.add_argument("--gradient-accumulation", type=int, default=4,
                    help="batches per optimizer step and replica, with --pipeline")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


def load_data(data_dir, limit):
    """MNIST as float tensors in [0, 1] with a channel axis, and integer labels."""
    def arrays(train):
        ds = open_mnist(data_dir, train)
        x, y = ds.data[:, None].float() / 255.0, ds.targets
        return (x[:limit], y[:limit]) if limit else (x, y)
    return arrays(True), arrays(False)


def make_divisible(number, divisor):
    """The tutorial's trimming: the largest multiple of ``divisor`` up to ``number``."""
    return number - number % divisor


def create_model():
    """The tutorial's conv net as Keras layers; softmax probabilities out, as in Keras."""
    return keras.Sequential([
        ConvLayer(1, 10, 5, 2), ConvLayer(10, 20, 5, 2), nn.Flatten(),
        nn.Linear(320, 256, bias=False), nn.ReLU(), nn.Linear(256, 10), nn.Softmax(1)])


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_data(args.data_dir, args.limit)
    stages = 2 if args.pipeline else 1
    per_step = args.gradient_accumulation if args.pipeline else 1

    # An execution runs steps_per_execution steps of batch_size samples, all replicas'
    # together (steps_per_execution / replicas on each): trim both sets to a whole number
    # of executions.
    spe = args.steps_per_execution
    train_len = make_divisible(len(x_train), args.batch_size * spe)
    test_spe = 5 * args.replicas * stages  # inference: at least a batch per stage and replica
    test_len = make_divisible(len(x_test), args.batch_size * test_spe)
    x_train, y_train = x_train[:train_len], y_train[:train_len]
    x_test, y_test = x_test[:test_len], y_test[:test_len]

    config = keras.IPUConfig()
    config.auto_select_ipus = args.replicas * stages
    config.configure_ipu_system()  # the process's IPU system, which IPUStrategy() uses
    strategy = keras.IPUStrategy()
    with strategy.scope():
        model = create_model()
        if args.pipeline:
            model.set_pipeline_stage_assignment([0, 0, 0, 1, 1, 1, 1])
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=args.gradient_accumulation,
                pipeline_schedule=keras.PipelineSchedule.parse(args.schedule))
            model.print_pipeline_stage_assignment_summary()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=spe)
        print(f"effective batch: {args.batch_size} x {per_step} accumulation x {args.replicas} "
              f"replicas = {args.batch_size * per_step * args.replicas} per step, "
              f"{args.batch_size * spe} per execution "
              f"(steps_per_execution {spe}: {spe // args.replicas} steps on each replica)")
        start = time.perf_counter()
        history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs)
        elapsed, seen = time.perf_counter() - start, len(x_train) * args.epochs
        print("loss per epoch: " + ", ".join(f"{v:.4f}" for v in history.history["loss"]))
        print(f"trained on {seen} images in {elapsed:.1f} s ({seen / elapsed:.0f} samples/s)")

        # The tutorial compiles again for the test set, with its own steps per execution;
        # "adam" again keeps the trained optimizer.
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=test_spe)
        start = time.perf_counter()
        _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size)
        elapsed = time.perf_counter() - start
    print(f"tested on {len(x_test)} images in {elapsed:.1f} s ({len(x_test) / elapsed:.0f} "
          f"samples/s)")
    print(f"Accuracy on test set: {100.0 * accuracy:.2f}%")
    return 100.0 * accuracy


if __name__ == "__main__":
    main()
