"""Accuracy of every MNIST example with its defaults, and mnist.py's wall time against plain PyTorch.

Run (takes a while: every example trains on all of MNIST):
    python benchmarks/mnist_accuracy.py --data-dir ../shared/data

Each example runs in its own process with its default options and epochs
(the bars: >= 97.5% test accuracy within 2 epochs; the conv-net examples
>= 98.5% within 3). In the same run, the training of examples/mnist.py is
written again in plain PyTorch (``--plain``: the same model, initial weights,
batch, optimizer, data order and test loop, with no poptorch_lite) and both
processes are timed, alternating, ``--repeats`` times each. With ``--jobs N``
N runs share the machine at once (mnist.py and its plain twin then run side by
side, under the same load). The figures go to docs/PERFORMANCE.md.
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = {  # example: (epochs of its defaults, the bar in %)
    "mnist.py": (3, 98.5),
    "mnist_replicated.py": (3, 98.5),
    "mnist_pipelined.py": (3, 98.5),
    "mnist_splits.py": (2, 97.5),
    "mnist_mlp_pipeline.py": (2, 97.5),
    "keras_mnist.py": (3, 98.5),
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data-dir", default=os.environ.get("MNIST_DATA", str(ROOT.parent / "shared" / "data")))
parser.add_argument("--repeats", type=int, default=1, help="timed runs of mnist.py and of plain PyTorch")
parser.add_argument("--only", nargs="*", default=list(EXAMPLES), help="examples to run")
parser.add_argument("--jobs", type=int, default=1,
                    help="runs at a time (a pair of mnist.py and plain PyTorch then shares the machine)")
parser.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS for every run (0: torch's default)")
parser.add_argument("--plain", action="store_true", help="(internal) run the plain-PyTorch mnist.py")


def plain_mnist(data_dir):
    """examples/mnist.py's defaults, as a plain PyTorch script (prints the same lines)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from tqdm import tqdm

    import mnist  # the example's model, data and argument defaults; its loops are not used
    args = mnist.parser.parse_args(["--data-dir", data_dir])
    torch.manual_seed(args.seed)
    train_set, test_set = mnist.datasets(args.data_dir, args.limit)
    model = mnist.Network()
    model.train()
    train_data = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                                             drop_last=True,
                                             generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)
    start, seen = time.perf_counter(), 0
    for epoch in range(1, args.epochs + 1):
        if epoch > 1:
            scheduler.step()
        bar = tqdm(train_data, desc=f"epoch {epoch}/{args.epochs}")
        for data, labels in bar:
            optimizer.zero_grad()
            output, loss = model(data, labels)
            loss.backward()
            optimizer.step()
            seen += data.shape[0]
            bar.set_postfix(loss=f"{loss.item():.4f}", accuracy=f"{mnist.accuracy(output, labels):.1f}%")
    elapsed = time.perf_counter() - start
    print(f"trained on {seen} images in {elapsed:.1f} s ({seen / elapsed:.0f} samples/s)")
    model.eval()
    correct, total = 0.0, 0
    with torch.no_grad():
        for data, labels in tqdm(torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size,
                                                             drop_last=True), desc="test"):
            correct += mnist.accuracy(model(data), labels) * labels.shape[0] / 100.0
            total += labels.shape[0]
    print(f"Accuracy on test set: {100.0 * correct / total:.2f}%")


def start(command, args):
    """Start ``command`` on the data folder (``args.threads`` intra-op threads if given) and
    a thread that waits for it, so that its wall time ends when it does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    run = {"bars": tempfile.TemporaryFile(), "start": time.perf_counter()}
    # tqdm bars go to a file, so that a run never blocks on a full pipe
    process = subprocess.Popen([sys.executable, *command, "--data-dir", args.data_dir],
                               stdout=subprocess.PIPE, stderr=run["bars"], text=True, cwd=ROOT, env=env)

    def wait():
        run["stdout"] = process.communicate()[0]
        run["end"], run["returncode"] = time.perf_counter(), process.returncode
    run["waiter"] = threading.Thread(target=wait)
    run["waiter"].start()
    return run


def finish(label, run):
    """Wait for a started run; return (wall s, training s, accuracy)."""
    run["waiter"].join()
    if run["returncode"]:
        run["bars"].seek(0)
        sys.exit(f"{label} failed:\n{run['bars'].read()[-3000:].decode()}")
    trained = re.search(r"trained on \d+ images in ([0-9.]+) s", run["stdout"])
    accuracy = re.search(r"Accuracy on test set: ([0-9.]+)%", run["stdout"])
    return run["end"] - run["start"], float(trained.group(1)), float(accuracy.group(1))


def main():
    args = parser.parse_args()
    if args.plain:
        return plain_mnist(args.data_dir)
    runs = []  # (label, key, command): mnist.py and its plain twin alternate, repeats times
    for r in range(args.repeats):
        pair = [("plain PyTorch mnist.py", "plain", [__file__, "--plain"]),
                ("mnist.py", "mnist.py", ["examples/mnist.py"])]
        runs += pair if r % 2 == 0 else pair[::-1]
    runs += [(name, name, [f"examples/{name}"]) for name in args.only if name != "mnist.py"]
    if "mnist.py" not in args.only:
        runs = runs[2 * args.repeats:]
    results = []
    for k in range(0, len(runs), args.jobs):  # args.jobs runs at a time, finished together
        batch = [(label, key, start(command, args)) for label, key, command in runs[k:k + args.jobs]]
        results += [(label, key, *finish(label, started)) for label, key, started in batch]

    print(f"{'example':24} {'epochs':>6} {'accuracy':>9} {'bar':>6} {'wall s':>7} {'training s':>10}")
    walls, trains = {"mnist.py": [], "plain": []}, {"mnist.py": [], "plain": []}
    for label, key, wall, train, accuracy in results:
        epochs, bar = EXAMPLES["mnist.py" if key == "plain" else key]
        verdict = "" if key == "plain" else ("met" if accuracy >= bar else "MISSED")
        print(f"{label:24} {epochs:>6} {accuracy:>8.2f}% {bar:>5}% {wall:>7.1f} {train:>10.1f}  {verdict}")
        if key in walls:
            walls[key].append(wall)
            trains[key].append(train)
    if walls["plain"]:
        wall = statistics.median(w / p for w, p in zip(walls["mnist.py"], walls["plain"]))
        train = statistics.median(w / p for w, p in zip(trains["mnist.py"], trains["plain"]))
        print(f"mnist.py / plain PyTorch: wall time {wall:.3f}x, training loop {train:.3f}x "
              f"(median of {len(walls['plain'])} paired runs; the bar is <= 1.10x)")


if __name__ == "__main__":
    main()
