"""Pipeline speed: poptorch_lite's schedules against plain PyTorch and torch.distributed.pipelining.

    python benchmarks/pipeline.py       # 8 x Linear(1024)+ReLU in 2 stages, micro-batch 32, m = 8
    python benchmarks/pipeline.py --model conv   # the MNIST tutorial's conv net, micro-batch 8
    python benchmarks/pipeline.py --repeats 40 --schedules interleaved,gpipe --torch-schedules 1f1b
    python benchmarks/pipeline.py --width 256 --repeats 5 --warmup 1      # a quick smoke run

``--model mlp`` (default): a balanced, compute-bound 2-stage MLP, the first half of
the Linear+ReLU layers in block "s0", the second half and the MSE loss in block
"s1". ``--model conv``: the MNIST tutorial's conv net in its 2 stages (the conv
layers; the dense layers and the NLL loss), on 28x28 images. One training step
is m micro-batches of B rows forward and backward, gradients averaged, and one
SGD step (the step is timed too). The whole process computes with one intra-op
thread, so a stage stream (a worker thread) or a rank has one core's worth.

Rows of the table:
    plain PyTorch, full batch    one forward/backward of m*B rows, one step
    plain PyTorch, micro-batched m forwards/backwards of B rows; the baseline
    plain PyTorch, both stages   each stage's m forwards/backwards on its own
      at once, 2 threads         thread, with no dependencies between them: the
                                 machine's 2-thread scaling c, and from it the
                                 attainable speed-up ideal*c/S
    poptorch_lite <schedule>     one call of the wrapped model (``--schedules``;
                                 "+recompute" recomputes every forward stage,
                                 "+compiled" compiles the stages:
                                 ``Options.compileStages``)
    poptorch_lite <schedule>     the same with a stage per process
      (2 processes)              (``Options.Distributed.set_ipu_processes``), gloo
                                 on loopback (``--process-schedules``)
    torch <schedule>             torch.distributed.pipelining, one process per
                                 stage, gloo on loopback (``--torch-schedules``)

Speed-up is over the micro-batched baseline; "of ideal" divides it by the
pipeline's ideal S*m/(m+S-1) (all stages busy except the fill and drain);
"cores" is CPU time over wall time, all threads (or all ranks) together.
Repetitions are interleaved (A, B, C, A, B, C, ...) after warm-up rounds, so
the machine's noise falls on every variant alike; each figure is a median.

The second table reads ``model.runStatistics()`` after a call (peak stashed
activations per stage, stash depth, bubble fraction and utilisation per
stream), with and without recomputation; "n/a" where poptorch_lite does not
provide it.
"""

import argparse
import copy
import concurrent.futures
import statistics
import time
import warnings

import torch
from tqdm import tqdm

import poptorch_lite as poptorch
from _pipeline_dist import (SCHEDULES as TORCH_SCHEDULES, Pipelined, Ranks, batch, local_stages,
                            loss_of, stages)

S = 2  # pipeline stages: blocks "s0" and "s1"
EXTRAS = ("recompute", "compiled")  # the suffixes of a --schedules variant
CEILING = "plain PyTorch, both stages at once, 2 threads"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="mlp", choices=("mlp", "conv"),
                    help="the MLP below, or the MNIST tutorial's conv net")
parser.add_argument("--width", type=int, default=1024, help="MLP: features of each Linear layer")
parser.add_argument("--layers", type=int, default=8, help="MLP: Linear+ReLU layers, half per stage")
parser.add_argument("--micro-batch", type=int, default=None,
                    help="rows per micro-batch (B; default 32 for the MLP, 8 for the conv net)")
parser.add_argument("--microbatches", default="4,8",
                    help="micro-batches per step (m, gradient accumulation; at least 2*S-1), "
                         "comma-separated: a table each")
parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
parser.add_argument("--warmup", type=int, default=3, help="untimed rounds of every variant first")
parser.add_argument("--schedules",
                    default="sequential,grouped,interleaved,interleaved+recompute,gpipe,zero_bubble",
                    help="poptorch_lite variants, comma-separated: a PipelineSchedule name, "
                         "optionally with +recompute and/or +compiled")
parser.add_argument("--process-schedules", default="grouped,interleaved",
                    help="poptorch_lite schedules run with a stage per process, comma-separated; "
                         "empty to skip")
parser.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES),
                    help=f"torch.distributed.pipelining schedules, comma-separated, of "
                         f"{sorted(TORCH_SCHEDULES)}; empty to skip the 2-process runs")
parser.add_argument("--timelines", action="store_true",
                    help="also print each schedule's timeline (needs runStatistics)")
parser.add_argument("--svg", default=None, metavar="DIR",
                    help="also draw each schedule's timeline as DIR/pipeline_<schedule>_m<m>.svg")


def parse_variants(text):
    """``"interleaved,gpipe+recompute"`` -> [(Interleaved, ()), (GPipe, ("recompute",))]."""
    variants = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        name, *extras = token.split("+")
        unknown = [e for e in extras if e not in EXTRAS]
        if unknown:
            parser.error(f"--schedules: unknown suffix '+{unknown[0]}' in '{token}'; the "
                         f"suffixes are {', '.join('+' + e for e in EXTRAS)}, e.g. "
                         f"'interleaved+recompute+compiled'")
        try:
            variants.append((poptorch.PipelineSchedule.parse(name),
                             tuple(e for e in EXTRAS if e in extras)))
        except poptorch.Error as e:
            parser.error(f"--schedules: {e}")
    return variants


def variant_name(schedule, extras):
    return " + ".join((schedule.value, *extras))


def wrap(base, m, schedule, extras, lr):
    """A copy of ``base`` wrapped by ``trainingModel``: m micro-batches and one SGD step a call."""
    net = copy.deepcopy(base)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(m)
    opts.setExecutionStrategy(poptorch.PipelinedExecution("s0", "s1", schedule=schedule))
    if "recompute" in extras:
        opts._Popart.set("autoRecomputation", 3)  # recompute every forward stage
    if "compiled" in extras:
        opts.compileStages(True)
    return poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=lr))


def timed(fn):
    """Wrap ``fn`` to return (wall seconds, CPU seconds of the whole process) of one call."""
    def run():
        t, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t, time.process_time() - c
    return run


def plain_steps(base, x, y, m, lr):
    """The two plain-PyTorch baselines, each on its own copy of ``base``."""
    full, micro = copy.deepcopy(base), copy.deepcopy(base)
    full_opt = torch.optim.SGD(full.parameters(), lr=lr)
    micro_opt = torch.optim.SGD(micro.parameters(), lr=lr)
    xs, ys = x.chunk(m), y.chunk(m)

    def full_step():
        full_opt.zero_grad(set_to_none=True)
        full(x, y)[1].backward()
        full_opt.step()

    def micro_step():
        micro_opt.zero_grad(set_to_none=True)
        for x_i, y_i in zip(xs, ys):
            micro(x_i, y_i)[1].backward()
        for p in micro.parameters():
            p.grad.div_(m)  # the mean over micro-batches, as poptorch_lite and torch do
        micro_opt.step()

    return full_step, micro_step


def _one_intra_op_thread():
    torch.get_num_threads()  # torch sets a new thread's count lazily: settle it, then set it
    torch.set_num_threads(1)


def ceiling_step(base, x, y, m, lr):
    """Both stages' work of one step at once on 2 plain threads, with no dependencies
    between them (stage 1 starts from precomputed inputs): what this machine can run
    concurrently at best. Divided into the micro-batched time it gives the machine's
    2-thread scaling c (2.00 on perfectly independent cores)."""
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    xs, ys = x.chunk(m), y.chunk(m)
    first, second = net.parts
    with torch.no_grad():
        hs = [first(x_i) for x_i in xs]

    def stage0():
        for x_i in xs:
            first(x_i).sum().backward()

    def stage1():
        for h_i, y_i in zip(hs, ys):
            net.loss(second(h_i.requires_grad_()), y_i).backward()

    pool = concurrent.futures.ThreadPoolExecutor(2, initializer=_one_intra_op_thread)

    def step():
        opt.zero_grad(set_to_none=True)
        for done in [pool.submit(stage0), pool.submit(stage1)]:
            done.result()
        for p in net.parameters():
            p.grad.div_(m)
        opt.step()

    return step


def measure(variants, repeats, warmup):
    """Run every variant ``warmup`` times, then ``repeats`` interleaved timed times.

    Returns:
        {label: (median wall seconds, median cores busy)}.
    """
    for _ in tqdm(range(warmup), desc="warm-up", leave=False):
        for run in variants.values():
            run()
    samples = {label: [] for label in variants}
    for _ in tqdm(range(repeats), desc="timing", leave=False):
        for label, run in variants.items():
            samples[label].append(run())
    return {label: (statistics.median(w for w, _ in v), statistics.median(c / w for w, c in v))
            for label, v in samples.items()}


def print_speed_table(results, baseline, rows_per_step, ideal):
    print(f"{'variant':<44} {'samples/s':>9} {'ms/step':>8} {'speed-up':>8} {'of ideal':>8} "
          f"{'cores':>5}")
    print(f"{'-' * 44} {'-' * 9} {'-' * 8} {'-' * 8} {'-' * 8} {'-' * 5}")
    for label, (wall, cores) in results.items():
        speed_up = results[baseline][0] / wall
        print(f"{label:<44} {rows_per_step / wall:9.1f} {wall * 1e3:8.1f} {speed_up:7.2f}x "
              f"{100 * speed_up / ideal:7.0f}% {cores:5.2f}")


def stash_rows(base, wrapped, args):
    """(name, ``runStatistics()`` or None) for every schedule in ``--schedules``, with and
    without recomputation; models not timed are built here and called twice (trace, measure).
    All None when this poptorch_lite has no ``runStatistics``."""
    has_stats = hasattr(poptorch.PoplarExecutor, "runStatistics")
    x, y = batch(args.model, args.microbatches * args.micro_batch, args.width)
    rows = []
    for schedule in dict.fromkeys(schedule for schedule, _ in wrapped):
        for extras in dict.fromkeys([(), ("recompute",)] + [e for s, e in wrapped if s == schedule]):
            model = wrapped.get((schedule, extras))
            if has_stats and model is None:
                model = wrap(base, args.microbatches, schedule, extras, args.lr)
                model(x, y)
                model(x, y)
            rows.append((variant_name(schedule, extras),
                         model.runStatistics() if has_stats else None))
    return rows


def print_stash_table(rows, show_timelines):
    def per_stage(values, fmt):
        return "/".join(fmt(v) for v in values)

    print(f"{'poptorch_lite schedule':<26} {'peak stash MiB (s0/s1)':>22} {'peak depth':>10} "
          f"{'bubble':>6} {'utilisation per stream':>22} {'F/B ms':>11}")
    print(f"{'-' * 26} {'-' * 22} {'-' * 10} {'-' * 6} {'-' * 22} {'-' * 11}")
    for name, stats in rows:
        if stats is None:
            print(f"{name:<26} {'n/a':>22} {'n/a':>10} {'n/a':>6} {'n/a':>22}")
            continue
        timeline = stats.timeline
        mib = per_stage(stats.peak_stash_bytes, lambda b: f"{b / 2**20:.1f}")
        depth = per_stage(stats.peak_stash_depth, str)
        busy = per_stage(timeline.utilisation(), lambda u: f"{100 * u:.0f}%")
        bubble = f"{100 * timeline.bubble_fraction():.0f}%"
        f_b = "/".join(f"{1e3 * statistics.median(spans):.1f}" for spans in (
            [s.end - s.start for s in timeline.spans if s.kind in kinds] for kinds in ("F", "BIW"))
            if spans)  # median action times (B: I and W apart): slower when they overlap?
        print(f"{name:<26} {mib:>22} {depth:>10} {bubble:>6} {busy:>22} {f_b:>11}")
    if any(stats is None for _, stats in rows):
        print("(n/a: this poptorch_lite has no PoplarExecutor.runStatistics() yet)")
    if show_timelines:
        for name, stats in rows:
            if stats is not None:
                print(f"\n{name}: {stats.timeline.summary()}\n{stats.timeline.render()}")


def write_svgs(rows, folder, m):
    """Each schedule's timeline as a picture (``--svg``)."""
    for name, stats in rows:
        if stats is not None:
            stats.timeline.write_svg(f"{folder}/pipeline_{name.replace(' + ', '_')}_m{m}.svg")


def build_variants(args, schedules, process_names, torch_names):
    """The timed variants, in table order, each a callable returning (wall s, CPU s).

    Returns:
        (variants, label of the baseline, the unwrapped model the copies come from,
        {(schedule, recompute): wrapped model}, the groups of ranks). The ranks start
        last, so that bad options fail before them; their start-up overlaps the warm-up.
    """
    m, B = args.microbatches, args.micro_batch
    # the same weights as the ranks' (stages() seeds), and the same batch
    base = Pipelined(stages(args.model, S, args.width, args.layers), loss_of(args.model))
    x, y = batch(args.model, m * B, args.width)
    full_step, micro_step = plain_steps(base, x, y, m, args.lr)
    baseline = f"plain PyTorch, micro-batched ({m} x {B} rows)"
    variants = {f"plain PyTorch, full batch ({m * B} rows)": timed(full_step),
                baseline: timed(micro_step),
                CEILING: timed(ceiling_step(base, x, y, m, args.lr))}
    wrapped = {}
    for schedule, extras in schedules:
        model = wrapped[(schedule, extras)] = wrap(base, m, schedule, extras, args.lr)
        variants[f"poptorch_lite {variant_name(schedule, extras)}"] = timed(
            lambda model=model: model(x, y))
    setup = dict(model=args.model, width=args.width, layers=args.layers, micro_batch=B, m=m,
                 lr=args.lr)
    groups = []
    for kind, names, label in (("lite", process_names, lambda n: f"poptorch_lite {n}"),
                               ("torch", torch_names,
                                lambda n: f"torch {TORCH_SCHEDULES[n].__name__}")):
        if names:
            ranks = Ranks(kind, names, S, **setup)
            groups.append(ranks)
            for name in names:
                variants[f"{label(name)} ({S} processes)"] = (
                    lambda name=name, ranks=ranks: ranks.step(name))
    return variants, baseline, base, wrapped, groups


def main():
    args = parser.parse_args()
    if args.micro_batch is None:
        args.micro_batch = 8 if args.model == "conv" else 32
    torch.set_num_threads(1)  # one intra-op thread per stream (and per rank)
    for m in [int(v) for v in str(args.microbatches).split(",") if v]:
        args.microbatches = m
        run(args)


def run(args):
    """The tables of one m (``args.microbatches``)."""
    m, B = args.microbatches, args.micro_batch
    schedules = parse_variants(args.schedules)
    process_names = [s.value for s, _ in parse_variants(args.process_schedules)]
    torch_names = [n.strip().lower() for n in args.torch_schedules.split(",") if n.strip()]
    unknown = [n for n in torch_names if n not in TORCH_SCHEDULES]
    if unknown:
        parser.error(f"--torch-schedules: unknown {unknown}; choose from {sorted(TORCH_SCHEDULES)}")
    if args.model == "conv":  # two stages only: no schedule that holds two per process
        torch_names = [n for n in torch_names if local_stages(n, 0, S)[1] == S]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", poptorch.PoptorchLiteWarning)
        variants, baseline, base, wrapped, groups = build_variants(args, schedules,
                                                                   process_names, torch_names)
        try:
            results = measure(variants, args.repeats, args.warmup)
        finally:
            for group in groups:
                group.close()
        stash = stash_rows(base, wrapped, args)

    ideal = S * m / (m + S - 1)
    model = (f"{args.layers} x Linear({args.width})+ReLU in {S} stages, MSE loss in the last"
             if args.model == "mlp" else
             f"the MNIST tutorial's conv net in {S} stages (conv layers; dense layers and NLL loss)")
    print(f"model: {model}; micro-batch B = {B}, m = {m} micro-batches per step ({m * B} "
          f"samples), SGD lr {args.lr:g}")
    print(f"threads: {torch.get_num_threads()} intra-op per stream/rank; median of {args.repeats} "
          f"interleaved steps after {args.warmup} warm-up rounds")
    print(f"ideal pipeline speed-up S*m/(m+S-1) = {S}*{m}/{m + S - 1} = {ideal:.2f}x "
          f"over the micro-batched baseline\n")
    print_speed_table(results, baseline, m * B, ideal)
    pop = {label: wall for label, (wall, _) in results.items() if label.startswith("poptorch_lite")}
    spread = {label: wall for label, wall in pop.items() if label.endswith("processes)")}
    here = {label: wall for label, wall in pop.items() if label not in spread}
    if spread and here:
        print(f"\nsamples/s with a stage per process / with streams in one process (best of "
              f"each): {min(here.values()) / min(spread.values()):.2f}x")
    peers = {label: wall for label, (wall, _) in results.items() if label.startswith("torch ")}
    if pop and peers:
        best, rival = min(pop, key=pop.get), min(peers, key=peers.get)
        print(f"\nsamples/s of the best poptorch_lite variant ({best.split(' ', 1)[1]}) / "
              f"the best torch schedule's ({rival.split(' ', 2)[1]}): "
              f"{peers[rival] / pop[best]:.2f}x")
    scaling = results[baseline][0] / results[CEILING][0]
    attainable = ideal * scaling / S
    print(f"this machine's 2-thread scaling on this work: c = {scaling:.2f} (2.00 = two "
          f"independent cores); attainable speed-up ideal*c/S = {attainable:.2f}x")
    if pop:
        best = min(pop, key=pop.get)
        speed_up = results[baseline][0] / pop[best]
        print(f"best poptorch_lite variant: {speed_up:.2f}x = {100 * speed_up / ideal:.0f}% of "
              f"ideal, {100 * speed_up / attainable:.0f}% of attainable")
    print()
    print_stash_table(stash, args.timelines)
    if args.svg:
        write_svgs(stash, args.svg, m)
    notes = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
    if notes:
        print("\nwarnings during the run:")
        for note in notes:
            print(f"  - {note}")


if __name__ == "__main__":
    main()
