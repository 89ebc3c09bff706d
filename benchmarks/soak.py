"""Long runs hold nothing back: resources before, after a warm-up, and at the end of a soak.

    python benchmarks/soak.py            # the full soak (PERFORMANCE.md; ~10 min on 2 cores)
    python benchmarks/soak.py --short    # the suite's version (tests/test_benchmarks.py)

Phases, each through the public API only:

- ``tiny``: 20,000 calls of PopTorch's user-guide tiny model (Linear(6, 2), CrossEntropyLoss,
  SGD), one wrapper;
- ``wrappers``: 200 wrappers made, trained for two calls and destroyed, round robin over every
  schedule (zero_bubble and its virtual stages included), with and without recomputation,
  with and without replication;
- ``loaders``: a Sync and an Async ``poptorch.DataLoader`` (two worker processes each), 50
  epochs each;
- ``interrupts``: Ctrl-C (a SIGINT to the main thread) in a training loop, twice per schedule:
  at a random moment (in the loader, between calls or inside a call); in ``--short``, which the
  suite runs, from code points instead (an optimizer step, the loader loading a row), so that
  no verdict depends on the machine's speed. The loop stops (within 5 s in the full soak), the
  model is as after its last completed optimizer step, and once the script's own clean-up ran
  (``destroy``, ``terminate``) no thread or worker is left;
- ``processes``: 20 pipelines whose two stages run in two processes, started with torchrun;
  each process reports its own figures, and the run must end with status 0.

Printed at the start, after a warm-up (one of each, which makes torch's thread pools and the
library's lazily built state), and at the end: resident memory, Python threads, OS threads,
open file descriptors and child processes. Targets: threads, files and child processes back to
their warm-up values; resident memory within 5% of its warm-up value (the full run; the short
run's phases are too short for memory to settle, so it prints memory without a target). The
exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch_lite as poptorch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))
from patience import limit  # noqa: E402  (the suite's one setting for limits against a hang)

SCHEDULES = ["sequential", "grouped", "interleaved", "gpipe", "zero_bubble"]
FULL = {"tiny": 20000, "wrappers": 200, "epochs": 50, "interrupts": 2, "pipelines": 20}
SHORT = {"tiny": 200, "wrappers": 10, "epochs": 2, "interrupts": 1, "pipelines": 2}
RSS_TOLERANCE = 0.05


def resources() -> dict:
    """This process's figures: resident MiB, Python and OS threads, open fds, children.
    Exited children are reaped first (``multiprocessing.active_children``): torch 2.11's
    DataLoader leaves workers it shut down unjoined when Ctrl-C lands in it, and each holds
    a pipe until multiprocessing next starts a process."""
    multiprocessing.active_children()
    status = pathlib.Path("/proc/self/status").read_text()
    field = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    field = {k: v.split()[0] for k, v in field.items() if v.split()}
    children = 0  # live ones: an exited child not yet reaped holds nothing
    for task in os.listdir("/proc/self/task"):
        try:
            pids = pathlib.Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            children += stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return {"rss_mib": int(field["VmRSS"]) / 1024, "py_threads": threading.active_count(),
            "os_threads": int(field["Threads"]), "files": len(os.listdir("/proc/self/fd")),
            "children": children}


def missed(warm: dict, end: dict, memory: bool) -> list[str]:
    """The targets ``end`` misses against ``warm``."""
    out = [f"{k}: {warm[k]} after the warm-up, {end[k]} at the end"
           for k in ("py_threads", "os_threads", "files", "children") if end[k] > warm[k]]
    if memory and end["rss_mib"] > warm["rss_mib"] * (1 + RSS_TOLERANCE):
        out.append(f"rss_mib: {warm['rss_mib']:.1f} after the warm-up, {end['rss_mib']:.1f} at "
                   f"the end (+{end['rss_mib'] / warm['rss_mib'] - 1:.1%}, target "
                   f"+{RSS_TOLERANCE:.0%})")
    return out


# -- the models ---------------------------------------------------------------------------------

class Tiny(nn.Module):
    """PopTorch's user-guide device_iterations.py model."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 2)

    def forward(self, x, labels):
        out = self.linear(x)
        return out, F.cross_entropy(out, labels)


class Blocks(nn.Module):
    """Four blocks of Linear+ReLU on the IPUs ``ipus`` (repeats make virtual stages)."""

    def __init__(self, ipus=(0, 1, 2, 3), width=16, classes=4):
        super().__init__()
        self.ipus = ipus
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in ipus)
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels):
        for k, (layer, ipu) in enumerate(zip(self.layers, self.ipus)):
            with poptorch.Block(f"b{k}", ipu_id=ipu):
                x = torch.relu(layer(x))
                if k == len(self.ipus) - 1:
                    out = self.head(x)
                    return out, F.cross_entropy(out, labels)


def configs() -> list[tuple]:
    """(schedule, ipus, recompute, replicas): every schedule, virtual stages, recomputation
    and replication."""
    rows = [(s, (0, 1, 2, 3), r, 1) for s in SCHEDULES for r in (False, True)]
    rows += [("zero_bubble", (0, 1, 1, 0), False, 1), ("zero_bubble", (0, 1, 0, 1), True, 1)]
    rows += [(s, (0, 1, 2, 3), False, 2) for s in ("grouped", "interleaved")]
    return rows


def options(schedule, recompute=False, replicas=1, G=8, D=2) -> poptorch.Options:
    """Each block its own stage (AutoIncrement: blocks whose IPUs repeat are virtual stages)."""
    opts = poptorch.Options().deviceIterations(D).replicationFactor(replicas)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement,
                                                          schedule=schedule))
    opts.Training.gradientAccumulation(G)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)  # PopTorch's RecomputationType.Pipelined
    return opts


def batch(opts: poptorch.Options, micro: int = 2, width: int = 16, classes: int = 4):
    n = micro * opts.device_iterations * opts.replication_factor * \
        opts.Training.gradient_accumulation
    return torch.randn(n, width), torch.randint(0, classes, (n,))


# -- the phases ---------------------------------------------------------------------------------

def tiny(calls: int) -> None:
    torch.manual_seed(0)
    model = Tiny()
    wrapped = poptorch.trainingModel(model, poptorch.Options(),
                                     torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(2, 6), torch.randint(0, 2, (2,))
    for _ in range(calls):
        wrapped(x, y)
    wrapped.destroy()


def wrappers(count: int) -> None:
    rows = configs()
    for k in range(count):
        schedule, ipus, recompute, replicas = rows[k % len(rows)]
        model = Blocks(ipus)
        opts = options(schedule, recompute, replicas, G=8 if len(set(ipus)) == 4 else 4)
        wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(2):
            wrapped(*batch(opts))
        wrapped.destroy()


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((16,), float(i)), i


def loaders(epochs: int) -> None:
    for mode in (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async):
        loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), Rows(),
                                     batch_size=4, num_workers=2, mode=mode)
        for _ in range(epochs):
            seen = sorted(int(i) for _, y in loader for i in y)
            if seen != list(range(64)):
                raise SystemExit(f"{mode}: an epoch gave rows {seen}, not each of 0..63 once")
        loader.terminate()


def state(model: nn.Module, optimizer) -> tuple:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
             for k, s in optimizer.state_dict()["state"].items()})


def same(a: tuple, b: tuple) -> bool:
    (wa, oa), (wb, ob) = a, b
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and
            oa.keys() == ob.keys() and
            all(torch.equal(torch.as_tensor(oa[k][n]), torch.as_tensor(ob[k][n]))
                for k in oa for n in oa[k]))


class Slow(torch.utils.data.Dataset):
    """Rows that take ``delay`` seconds each to load: the training loop waits on its loader.
    With ``armed`` and ``ctrl_c`` (``multiprocessing.Event``s), the ``at``-th row loaded
    after the training loop armed it sends the training process a SIGINT (Ctrl-C) from the
    loader's worker process, after setting ``ctrl_c``. Armed, not by row number: the loader
    works ahead of the loop, and on a slow machine a row number could be reached while the
    first call still traces."""

    def __init__(self, data, delay, at=0, armed=None, ctrl_c=None):
        self.data, self.delay, self.at, self.armed, self.ctrl_c = data, delay, at, armed, ctrl_c
        self.loaded = 0  # rows loaded since armed, in the worker process

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        if self.armed is not None and self.armed.is_set() and not self.ctrl_c.is_set():
            self.loaded += 1
            if self.loaded == self.at:
                self.ctrl_c.set()
                os.kill(os.getppid(), signal.SIGINT)
        return self.data[i]


def interrupted_once(schedule: str, rng: random.Random, slow: bool, moment: str) -> str:
    """Train from an Async loader (``slow``: slower than the model) until a SIGINT; check
    what the issue asks; returns where it landed.

    ``moment``: "random" (the full soak), a timer at a random moment, which lands in the
    loader, between calls or inside a call as the machine's speed has it; "step" or "row"
    (the short soak, which the suite runs: no verdict of its depends on the machine's speed),
    sent from a code point: the optimizer's step of a random call (on whichever thread steps
    it), or the loader's worker process loading a random row. A Ctrl-C the loop ran past is
    told by a state: a call that starts after the one it was sent in (a step), or the third
    call after it was sent (a row: the loader's worker runs ahead of the loop)."""
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opts = options(schedule)
    steps = [state(model, optimizer)]
    handle = optimizer.register_step_post_hook(lambda *_: steps.append(state(model, optimizer)))
    wrapped = poptorch.trainingModel(model, opts, optimizer)
    n = 2 * opts.device_iterations * opts.Training.gradient_accumulation
    data = torch.utils.data.TensorDataset(torch.randn(40 * n, 16), torch.randint(0, 4, (40 * n,)))
    main = threading.main_thread().ident
    armed, row = ((multiprocessing.Event(), multiprocessing.Event()) if moment == "row"
                  else (None, None))
    loader = poptorch.DataLoader(opts, Slow(data, 0.002 if slow else 0.0,
                                            rng.randrange(n, 3 * n), armed, row),
                                 batch_size=2, num_workers=1, mode=poptorch.DataLoaderMode.Async)
    wrapped(*next(iter(loader)))  # traced: the interrupt lands in training, not in the trace
    if armed is not None:
        armed.set()
    where, calls, sent = ["loader"], [0], []
    lost = []  # a Ctrl-C the loop ran past: a second one ends it and says so
    if moment == "step":
        at = rng.randint(1, 3)  # the call whose step sends it: one of the first three

        def in_step(*_):
            if calls[0] == at and not sent:
                sent.append(at)
                signal.pthread_kill(main, signal.SIGINT)
        hook = optimizer.register_step_post_hook(in_step)

    def begin_call() -> None:
        calls[0] += 1
        if moment == "row" and row.is_set():
            sent.append(calls[0])  # the calls begun since the row sent it
        ran_past = calls[0] > sent[0] if moment == "step" and sent else len(sent) > 2
        if ran_past and not lost:
            lost.append(where[0])
            signal.pthread_kill(main, signal.SIGINT)
    if moment == "random":
        delay = rng.uniform(0.0, 0.3)
        timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
        again = threading.Timer(delay + 5.0, lambda: lost.append(where[0]) or signal.pthread_kill(
            main, signal.SIGINT))
        timer.start(), again.start()
    start = time.monotonic()
    try:
        while True:  # epochs until Ctrl-C
            for x, y in loader:
                where[0] = "call"
                begin_call()
                wrapped(x, y)
                where[0] = "loader"
    except KeyboardInterrupt as exc:
        stopped = time.monotonic() - start
        interrupt = exc
    finally:
        if moment == "random":
            timer.join()
            again.cancel()
        if moment == "step":
            hook.remove()
    handle.remove()
    if lost:
        raise SystemExit(f"{schedule}: the loop ran past a Ctrl-C ({lost[0]}); a second one "
                         f"stopped it")
    if moment == "random" and stopped > 5:
        raise SystemExit(f"{schedule}: the interrupt took {stopped:.1f} s to stop the loop")
    if not same(state(model, optimizer), steps[-1]):
        import traceback
        raise SystemExit(f"{schedule}: after a Ctrl-C ({where[0]}) the model is not as after "
                         f"its last completed step ({len(steps) - 1} steps); the interrupt:\n"
                         + "".join(traceback.format_exception(interrupt)[-6:]))
    wrapped(*batch(opts))  # it trains on after the interrupt
    wrapped.destroy()
    loader.terminate()
    return where[0]


def interrupts(rounds: int, short: bool) -> dict:
    """Per schedule, a Ctrl-C with a fast loader and one with a slow loader: at random moments,
    or (``short``) from the optimizer's step and from the loader."""
    rng, landed = random.Random(0), {}
    for _ in range(rounds):
        for schedule in SCHEDULES:
            for slow, moment in ((False, "step" if short else "random"),
                                 (True, "row" if short else "random")):
                where = interrupted_once(schedule, rng, slow, moment)
                landed[where] = landed.get(where, 0) + 1
    return landed


def processes(pipelines: int, short: bool) -> list[dict]:
    """``pipelines`` pipelines across two processes under torchrun; each process's figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    # torchrun's log folder, which it would leave in the temporary directory
    with tempfile.TemporaryDirectory(prefix="soak-torchrun-", ignore_cleanup_errors=True) as logs:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", "--log-dir", logs, __file__, "--process-worker",
                   str(pipelines)]
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=limit(300) if short else 900)
    if result.returncode != 0:
        raise SystemExit(f"torchrun ended with status {result.returncode}:\n"
                         f"{result.stderr[-3000:]}")
    figures = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("FIGURES ")]
    if len(figures) != 2:  # seen once under a loaded suite: say what torchrun printed
        raise SystemExit(f"torchrun ended with status 0 but {len(figures)} of its 2 processes "
                         f"printed their figures; its stdout:\n{result.stdout[-2000:]}\n"
                         f"its stderr:\n{result.stderr[-2000:]}")
    return figures


def process_interrupt(rng: random.Random, short: bool) -> float:
    """Ctrl-C in a terminal running torchrun (SIGINT to its process group) while its two
    processes train a pipeline for ever: every process ends within 30 s, 10 s more for
    torchrun's workers (the short soak, which the suite runs: within generous limits against
    a hang, scaled by POPTORCH_LITE_TEST_PATIENCE, tests/support/patience.py); the seconds taken."""
    ends, workers_end = (limit(120), limit(60)) if short else (30, 10)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    # torchrun's log folder, which it would leave in the temporary directory
    logs = tempfile.TemporaryDirectory(prefix="soak-torchrun-", ignore_cleanup_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "--log-dir", logs.name, __file__, "--process-worker",
               "-1"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env=env, start_new_session=True)
    try:
        while "TRAINING" not in run.stdout.readline():
            if run.poll() is not None:
                raise SystemExit("torchrun ended before its processes trained")
        time.sleep(rng.uniform(0.0, 1.0))
        start = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        run.communicate(timeout=ends)
        seconds = time.monotonic() - start
        deadline = time.monotonic() + workers_end
        while time.monotonic() < deadline:  # torchrun's workers end with it, or soon after
            try:
                os.killpg(run.pid, 0)
            except ProcessLookupError:
                return seconds
            time.sleep(0.1)
        raise SystemExit(f"processes of the interrupted torchrun are still alive after "
                         f"{workers_end:.0f} s")
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.wait()
        logs.cleanup()


def process_worker(pipelines: int) -> None:
    """One process of ``processes``: stage 0 here and stage 1 in the other process."""
    def one():
        torch.manual_seed(0)
        model = Blocks((0, 1), width=16)
        opts = options("interleaved", G=4, D=2)
        opts.Distributed.set_ipu_processes([[0], [1]])
        wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
        torch.manual_seed(1)
        for _ in range(2):
            wrapped(*batch(opts))
        wrapped.destroy()

    if pipelines < 0:  # process_interrupt: train until Ctrl-C
        print("TRAINING", flush=True)
        while True:
            one()
    figures = {"rank": int(os.environ["RANK"]), "start": resources()}
    one()
    gc.collect()
    figures["warm"] = resources()
    for _ in range(pipelines):
        one()
    gc.collect()
    figures["end"] = resources()
    print("FIGURES", json.dumps(figures), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the suite's short version")
    parser.add_argument("--process-worker", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_worker is not None:
        process_worker(args.process_worker)
        return 0
    counts = SHORT if args.short else FULL
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started as a background job: the
        signal.signal(signal.SIGINT, signal.default_int_handler)  # soak's Ctrl-Cs must land
    torch.set_num_threads(1)
    rows = [("start", resources())]
    tiny(3), wrappers(len(configs())), loaders(1)
    interrupted_once("grouped", random.Random(2), True, "row" if args.short else "random")
    gc.collect()
    rows.append(("warm-up", resources()))
    timings = {}
    for name, run in (("tiny", lambda: tiny(counts["tiny"])),
                      ("wrappers", lambda: wrappers(counts["wrappers"])),
                      ("loaders", lambda: loaders(counts["epochs"])),
                      ("interrupts", lambda: interrupts(counts["interrupts"], args.short))):
        start = time.perf_counter()
        out = run()
        timings[name] = (time.perf_counter() - start, out)
        gc.collect()
        rows.append((f"after {name}", resources()))
    start = time.perf_counter()
    workers = processes(counts["pipelines"], args.short)
    timings["processes"] = (time.perf_counter() - start, None)
    rng = random.Random(1)
    stops = [process_interrupt(rng, args.short) for _ in range(counts["interrupts"])]
    timings["process interrupts"] = (sum(stops), f"stopped in {[round(t, 1) for t in stops]} s")
    gc.collect()
    rows.append(("end", resources()))

    print(f"torch {torch.__version__}, {'short' if args.short else 'full'} soak: {counts}")
    print(f"{'when':<18}{'RSS MiB':>9}{'py thr':>8}{'OS thr':>8}{'files':>7}{'children':>10}")
    for when, r in rows:
        print(f"{when:<18}{r['rss_mib']:>9.1f}{r['py_threads']:>8}{r['os_threads']:>8}"
              f"{r['files']:>7}{r['children']:>10}")
    for name, (seconds, out) in timings.items():
        print(f"{name}: {seconds:.1f} s" + (f", Ctrl-C: {out}" if out else ""))
    problems = missed(rows[1][1], rows[-1][1], memory=not args.short)
    for w in workers:
        print(f"process {w['rank']}: RSS MiB {w['start']['rss_mib']:.1f} -> "
              f"{w['warm']['rss_mib']:.1f} -> {w['end']['rss_mib']:.1f}; threads "
              f"{w['warm']['os_threads']} -> {w['end']['os_threads']}; files "
              f"{w['warm']['files']} -> {w['end']['files']}")
        problems += [f"process {w['rank']}: {p}"
                     for p in missed(w["warm"], w["end"], memory=not args.short)]
    if len(workers) != 2:
        problems.append(f"{len(workers)} of the 2 processes reported their figures")
    print("targets met" if not problems else "MISSED:\n  " + "\n  ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
