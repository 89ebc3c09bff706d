"""The fuzzer's oracle: a program run by plain PyTorch and by poptorch_lite, call by call.

[Note: the fuzzer's oracle]
:func:`check` builds the program twice from the same seed and runs ``config.calls``
calls on each side, the user's ``between_calls`` edits after each. The plain side
(``fuzz_plain``) does the arithmetic the contract names (``models.reference_training``'s,
generalized to any outputs and to per-replica buffers): D optimizer steps per call, each
the summed backward of G·R micro-batches (a loss's gradient is ones, times
poptorch.optim's ``loss_scaling``, so ``identity_loss(..., "none")`` trains as its sum and
gradient hooks see scaled gradients, as under torch.amp's GradScaler), divided by
``loss_scaling`` and by G·R under ``ReductionType.Mean`` before clipping and the step;
micro-batch k of the combined batch in [D, G, R, B] order, its random ops seeded with
``models.microbatch_seeds`` (or ``Options.randomSeed``'s own generator). With replicas,
each keeps its own buffers wherever the model writes some: a normalisation's running
statistics whatever ``broadcastBuffers`` says ([Note: running statistics on replicas] in
poptorch_lite/compiler/running_stats.py), a buffer of the model's own under
``broadcastBuffers(False)`` (with True it is refused: E-PART-10); the host's are replica
0's (a host edit is replica 0's) and a copy to the device (``copyWeightsToDevice``, a
re-attach) gives every replica the host's. Both sides seed torch, Python and numpy the
same before each call and before each edit. A number the forward draws from Python's or
numpy's random is drawn at the trace and reused, as PopTorch does (W-LITE-13): the plain
side draws it in the first forward of each program (a micro-batch size and a set of
trainable parameters: what the wrapper traces again for) from the state the trace draws
from, and replays it in every later forward of that program, so those examples are
compared in full as well. The forward's own ``self.training`` is the wrapper's flag as
wrapped and the submodules' are the user's ([Note: train and eval modes] in
poptorch_lite/runtime/compiled.py), so the plain side runs each call with the model's own
flag as it was before the first. A program plain PyTorch cannot run is :class:`fuzz_plain.Invalid`
(its first call fails) or ends early (a later call or edit fails).

[Note: the twin's inputs]
On a GPU a step's inputs are a copy made for the device (poptorch_lite's GPU path moves a
run's micro-batches in one transfer, each reading its rows of it; a plain loop moves each
step's batch with ``.to(device)``), a fresh allocation where plain PyTorch on the CPU reads
views into the user's batch. torch's CPU kernels round by where a tensor starts in its
64-byte line ([Note: copies keep their alignment] in poptorch_lite/runtime/inputs), and the
twin computes with them, so on the twin the plain side reads each step's micro-batches from
a copy of that step's rows too (an inference call's, one run of every micro-batch, from a
copy of all its rows), and a forward's write to them reaches the caller's batch after the
step, as poptorch_lite's copy back does. That is the arithmetic a GPU does; the
rounding a CPU kernel adds to an offset is not a GPU's, and a captured step's static slots
could not keep per-run offsets anyway.

[Note: the fuzzer's processes]
With ``Config.processes`` = P > 1 (the long profile draws it: ``fuzz_draw.PROCESSES_ONE_IN``)
the wrapped side runs in P processes started as torchrun starts them (gloo on loopback,
``tests/support/fuzz_processes.py``), each with R replicas and its own batch: the call's
rows split in P, [D, G, R, B] within each. The plain side is what a user of torch's DDP
runs: P copies of the model, each with its optimizer, its replicas' buffers and its batch,
every copy's micro-batches seeded as in one process ([Note: micro-batch RNG]: the same seeds
in every process), the gradients of a step summed over the copies, then each copy's step.
Each process checks itself against its copy (its outputs, its input, its model, whose
buffers and in-forward writes are its own) and what each finds is named by its rank.
With ``Config.sharded`` the optimizer's state is sharded over the P processes
(``useReplicatedTensorSharding``): process k holds its chunk of each state tensor,
compared with the same chunk of its copy's whole state (``_chunks``); and after each step
every copy's weights are the owners' chunks (``fuzz_plain._owners_chunks``: a weight the
forward writes, each process its own way, then holds each owner's values, as under torch's
ZeroRedundancyOptimizer).
With ``Config.spread`` = "stages" the processes are one pipeline's
(``Options.Distributed.set_ipu_processes``: the IPUs split in two): each reads the whole
batch and must return what one process does; after ``copyWeightsToHost`` (which every
process calls) each holds every weight; each holds the gradients and the optimizer's state
of its own stages only, which are compared, and every gradient a step used must be in one.

Each wrapped call must then be **exact**: every output of every micro-batch, the gradient
each step used (``models.trained_grads``) for every parameter the optimizer holds, the
host ``.grad`` left as the user left it (None, or what an edit put there), every weight
and buffer (those left out of the state dict too), each module's ``training`` and each
parameter's ``requires_grad``, the optimizer's state and hyper-parameters, the input (a
forward may edit it in place), and the random state of Python, numpy and the model's own
generators. torch's default generator must have moved by the call's bases alone (one draw
per run, or none: [Note: micro-batch RNG]), so a draw outside every micro-batch's stream
shows (the plain side seeds each micro-batch, so that state is not compared with its); and
what each call returned must still hold its values after the later calls. A
program that draws from Python's or numpy's random must also have warned W-LITE-13 at the
line of the draw on its first call (outcome "warned"). A program whose forward changes a
Python attribute must warn W-LITE-14 at the line of the write, and then its values may
differ (PopTorch runs that Python once too; ``fuzz_refusals.DIFFERS``). Or it is a
**refusal** (a ``poptorch_lite.Error``) that changed nothing of that (model, optimizer,
input, random states), and a documented one (its class and its docs/ERRORS.md message)
where the library says it applies (``fuzz_refusals``: E-PART-10, 11, 24, 25, 26, 27,
E-WRAP-21, E-OPT-41; any clean refusal only for a feature whose fix is pending). Anything
else is a :class:`Finding`: a difference, a missing warning, an unexpected or unclean
refusal, a crash (an exception that is not a ``poptorch_lite.Error``).

Tolerance (:meth:`Config.tolerance`): 0, bit for bit, where the arithmetic is the same (one
stage, one micro-batch per step, eager stages); elsewhere |got - want| <= 1e-5 + 1e-5 |want|
elementwise in float32 (sums across micro-batches, stages and replicas in another order;
compiled stages' reassociation), 1e-4 for stages Inductor compiled (its fused kernels). Rounding differences grow where the model amplifies them (a
BatchNorm over two samples turns one ulp into 1e-4; a model whose weights blow up, 4e7 after
four steps of gradient penalties summed over 7 micro-batches, turns them into 6e-3), so a
float32 difference in numbers alone counts only if the same example run in float64 (with
torch's own optimizer for poptorch.optim's, whose accumulators stay float32) differs too,
beyond 1e-7, at the same call or an earlier one: rounding vanishes there (a model that blows
up may diverge in float64 too, calls later), a semantic difference does not. One limit:
``torch.autocast`` casts no float64 tensor, so an example under autocast (``Config.autocast``)
is checked to the bit where it is exact and otherwise within float32's rule before its
float64 run drops the casts; its bfloat16 roundings, which fp32 sums in another order move
by an ulp, cannot be told from a wrong cast there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import traceback
import warnings
from typing import Optional

import torch

import poptorch_lite as poptorch
from poptorch_lite import errors
from poptorch_lite.compiler import compiled_stages, rng
from poptorch_lite.distributed.sharding import CHUNK
from poptorch_lite.runtime import gpu

import fuzz_plain
import fuzz_refusals
from fuzz_config import Config
from fuzz_grammar import Program, build, outputs_of, source, structure
from fuzz_plain import Invalid, plain
from gpu_twin import TwinGpu
from models import trained_grads

class Finding(AssertionError):
    """A silent difference, an unexpected or unclean refusal, or a crash."""


def describe(program: Program, config: Config) -> str:
    """What a finding prints: the model as code, the options, the loop, and all as data."""
    args = "x, y=y" if config.keyword else "x, y"
    sched = "make_scheduler(opt)" if "make_scheduler" in source(program) else "None"
    return (f"{source(program)}\n# options\nnet = Net()\n{config.code(program)}\n\n"
            f"# the calls (plain PyTorch: the same arithmetic, micro-batch by micro-batch)\n"
            f"opt, sched = make_optimizer(net), {sched}\n"
            f"train = poptorch.trainingModel(net, opts, opt)\n"
            f"for call in range({config.calls}):  # x: {config.D * config.G * config.R} "
            f"micro-batches of {config.B}\n"
            f"    out = train({args})\n    between_calls(net, opt, sched, train, call)\n\n"
            f"# as data (tests/support/fuzz_found.py)\n{program!r}\n{config!r}\n")


@contextlib.contextmanager
def _running(config: Config):
    """The wrapped side's surroundings; yields the warnings it gives (W-LITE-13's and
    W-LITE-14's once-per-line records forgotten, so that every example's first trace warns)."""
    saved, warned = compiled_stages.PAYS_FROM, set(errors._warned)
    compiled_stages.PAYS_FROM = 0  # tiny stages: compile them anyway (conftest's fixture)
    errors._warned.difference_update({k for k in warned if k.startswith(
        ("trace.python_random", "trace.python_attribute"))})
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            if config.device == "gpu_twin":
                with gpu.installed(TwinGpu()):
                    yield records
            else:
                yield records
    finally:
        compiled_stages.PAYS_FROM = saved
        errors._warned.update(warned)


def _differences(what: str, got, want, tol: float) -> list:
    """Where ``got`` and ``want`` differ beyond the tolerance, as readable lines."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{what}: keys {sorted(map(str, got.keys())) if isinstance(got, dict) else got}"
                    f" != {sorted(map(str, want.keys()))}"]
        return [d for k in want for d in _differences(f"{what}[{k!r}]", got[k], want[k], tol)]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{what}: {got!r} != {want!r}"]
        return [d for i, (a, b) in enumerate(zip(got, want))
                for d in _differences(f"{what}[{i}]", a, b, tol)]
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
            return [f"{what}: {_kind(got)}, plain PyTorch has {_kind(want)}"]
        if got.shape != want.shape or got.dtype != want.dtype:
            return [f"{what}: shape {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} "
                    f"{want.dtype}"]
        if got.layout != want.layout:  # a sparse gradient where plain PyTorch's is sparse
            return [f"{what}: layout {got.layout}, plain PyTorch has {want.layout}"]
        a, b = got.detach().cpu(), want.detach().cpu()
        if a.is_sparse:  # compared as the values they sum to (duplicates added)
            a, b = a.to_dense(), b.to_dense()
        if not a.is_floating_point():
            if torch.equal(a, b):
                return []
            if a.numel() <= 8:
                return [f"{what}: {a.tolist()} != {b.tolist()}"]
            at = int((a != b).flatten().nonzero()[0])  # a random state: where it moved
            return [f"{what}: {int((a != b).sum())} of {a.numel()} values differ (first at "
                    f"{at}: {a.flatten()[at].item()} != {b.flatten()[at].item()})"]
        # equal infinities are equal (their difference is NaN), and so are two NaNs
        bad = ~((a - b).abs() <= tol + tol * b.abs()) & ~(a.isnan() & b.isnan()) & (a != b)
        if bad.any():
            return [f"{what}: differs by {(a - b).abs().max().item():.3g} "
                    f"({int(bad.sum())} of {a.numel()} values; tolerance {tol:g})"]
        return []
    return [] if got == want else [f"{what}: {got!r} != {want!r}"]


def _kind(value) -> str:
    return (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
            else repr(value))


def _host_grads(net) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}


def _compare(call: int, train, net, opt, x, result, want: dict, tol: float,
             host_grads: dict, held: Optional[set] = None, shard: Optional[tuple] = None) -> list:
    """What differs after a wrapped call (``host_grads``: the ``.grad`` the user left). With
    ``held`` (a process of a pipeline's), only the gradients this process's stages compute
    are compared, and their names are added to ``held``. With ``shard`` = (k, N), process
    k of N holds its chunk of each optimizer state the size of its weight (``_chunks``)."""
    grads = trained_grads(train) if want["grads"] else {}
    wanted = want["grads"]
    if held is not None:  # every weight to every process, as the user asks for them
        train.copyWeightsToHost()
        grads = {n: g for n, g in grads.items() if g is not None}
        held.update(grads)
        wanted = {n: g for n, g in wanted.items() if n in grads}
    got = fuzz_plain.state(net, opt, x)
    used = {n: grads.get(n) for n in wanted}
    found = [] if structure(result) == want["returned"] else [
        f"returned {structure(result)}, plain PyTorch {want['returned']}"]
    found += _differences("outputs", outputs_of(result), want["outputs"], tol)
    found += _differences("the gradient the step used", used, wanted, tol)
    if held is not None:  # the optimizer's state of this process's stages' weights
        names = {id(p): n for n, p in net.named_parameters()}
        mine = {i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
                if names.get(id(p)) in grads}
        got = dict(got, optimizer=_state_of(got["optimizer"], mine))
        want = dict(want, optimizer=_state_of(want["optimizer"], mine))
    if shard is not None:  # [Note: sharded optimizer state] in distributed/sharding.py
        want = dict(want, optimizer=_chunks(want["optimizer"], opt, *shard))
    found += _differences("the host .grad (as the user left it)", _host_grads(net), host_grads,
                          0.0)
    for key in ("model", "optimizer", "input", "python random", "numpy random", "generators",
                "flags"):
        found += _differences(key, got[key], want[key], tol)
    return [f"call {call}: {d}" for d in found]


def _state_of(optimizer: dict, indices: set) -> dict:
    """An optimizer's state dict with the state of the parameters at ``indices`` alone."""
    return dict(optimizer, state={i: v for i, v in optimizer["state"].items() if i in indices})


def _chunks(optimizer: dict, opt, k: int, N: int) -> dict:
    """Plain PyTorch's optimizer state dict as process ``k`` of ``N`` holds it with the
    state sharded: each state tensor the shape of its weight, flattened and cut into N
    chunks of ceil(L/N) elements, the k-th, with the key that says whose they are
    (``sharding.CHUNK``); scalars whole; none for a weight with no k-th chunk."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, values in optimizer["state"].items():
        p = params[i]
        c = -(-p.numel() // N)
        start = min(k * c, p.numel())
        end = min(start + c, p.numel())
        if start == end:  # a weight too small to reach process k: it holds no state of it
            continue
        state[i] = {key: v.flatten()[start:end]
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape else v
                    for key, v in values.items()}
        if any(torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape
               for v in state[i].values()):  # and whose chunks they are
            state[i][CHUNK] = (k, N, start, end)
    return dict(optimizer, state=state)


def _stray_draws(call: int, config: Config, before: torch.Tensor) -> list:
    """Whether torch's default generator moved during a call by anything but the bases of
    its runs ([Note: micro-batch RNG]: each run draws one, unless it draws nothing at all,
    from the model's own generator under ``randomSeed``). A draw outside every micro-batch's
    stream (a compiled backward's dead dropout) lands there, and moves a later call's
    masks, or another stream's where it ran during a swap."""
    after = torch.get_rng_state()
    if torch.equal(after, before):
        return []
    runs = 1 if config.inference else config.D
    g = torch.Generator()
    g.set_state(before)
    rng.draw_bases(runs, g)
    if config.random_seed is None and torch.equal(after, g.get_state()):
        return []
    return [f"call {call}: torch's default generator moved by more than the call's "
            f"{runs if config.random_seed is None else 0} draws of its runs' bases: a random "
            "op drew outside the micro-batches' streams"]


def _refusal(program: Program, config: Config, error: Exception, call: int, before: dict,
             after: dict) -> list:
    """What is wrong with a refusal: it changed state, or nothing makes it acceptable."""
    found = [f"call {call}: refused with {type(error).__name__}, but it changed {d}"
             for k in before for d in _differences(k, after[k], before[k], True)]
    ok = fuzz_refusals.acceptable(program, config)
    if fuzz_refusals.accepted(error, ok) is None:
        found.append(f"call {call}: refused a program that should run (acceptable here: "
                     f"{sorted(ok) or 'none'}): {type(error).__name__}: "
                     f"{str(error).splitlines()[0][:300]}")
    return found


_TORCH_TWIN = {"poptorch_sgd": "sgd_momentum", "poptorch_adam": "adam", "poptorch_adamw": "adamw",
               "poptorch_rmsprop": "rmsprop"}


def check(program: Program, config: Config) -> str:
    """Run ``program`` both ways under ``config`` (see [Note: the fuzzer's oracle]).

    A float32 difference where sums run in another order is confirmed in float64 before it
    counts: rounding that the model amplifies (a BatchNorm over two samples) vanishes there,
    a semantic difference does not.

    Returns:
        "exact", "rounding" (float32 only), "warned: <id>" (exact, with the warning a
        Python draw in forward must give) or "refused: <id>".

    Raises:
        Invalid: plain PyTorch cannot run it.
        Finding: the difference, refusal or crash, with the program and options.
    """
    outcome, found, numeric = _run(program, config)
    if found and numeric and config.dtype == "float32" and config.tolerance(program) > 0:
        # poptorch.optim keeps its accumulators in float32 (accum_type): torch's own
        # optimizer, the same arithmetic, keeps float64 in float64
        twin = dataclasses.replace(program, optimizer=_TORCH_TWIN.get(program.optimizer,
                                                                      program.optimizer))
        wide = _run(twin, dataclasses.replace(config, dtype="float64"))[1]
        first, first_wide = _first_call(found), _first_call(wide)
        if not wide or (first is not None and first_wide is not None and first_wide > first):
            return "rounding"  # float64 is clean where float32 first differed
    if found:
        raise Finding("\n".join(found[:8]) + "\n\n" + describe(program, config))
    return outcome


def _run(program: Program, config: Config, rank: Optional[int] = None) -> tuple:
    """(outcome, what is wrong, whether it is only numbers that differ). With
    ``config.processes`` > 1 the wrapped side runs in that many processes (:func:`_in_processes`),
    each ``rank`` of which runs this with its share of the data ([Note: the fuzzer's
    processes])."""
    if config.processes > 1 and rank is None:
        return _in_processes(program, config)
    P = config.processes if config.spread == "replicas" else 1  # the processes' own batches
    whole = dataclasses.replace(config, R=config.R * P)  # every replica, for refusals

    def mine(t):  # this process's own batch of the call's ([Note: the fuzzer's processes])
        return t if P == 1 else t.chunk(P)[rank]
    expected = plain(program, config)
    tol = config.tolerance(program)
    outcome, found = "exact", []
    # a pipeline's processes each hold its stages' gradients: together, every one
    held = set() if config.processes > 1 and config.spread == "stages" else None
    asked: set = set()  # ... of the gradients the steps used
    with _running(config) as records:
        want = next(expected)  # raises Invalid before anything is built or wrapped
        ns = build(program)
        net, opt, sched = fuzz_plain.model(ns, config)
        train, returned = None, []
        try:
            opts = config.options(program, net)
            train = poptorch.inferenceModel(net, opts) if config.inference \
                else poptorch.trainingModel(net, opts, opt)
            for call in range(config.calls):
                x, y = map(mine, fuzz_plain.data(config, call))
                if P > 1:  # this process's model, its micro-batches' outputs, its input
                    want = dict(want["per_process"][rank], returned=want["returned"])
                fuzz_plain.seed_host(call)
                before = dict(fuzz_plain.state(net, opt, x), torch_random=torch.get_rng_state())
                host_grads = _host_grads(net)
                try:
                    with config.ambient(call):
                        result = train(x, y=y) if config.keyword else train(x, y)
                except (errors.ExecutionError, errors.UnrecoverableError) as e:
                    found = [f"call {call}: failed while running, where plain PyTorch runs: "
                             f"{_where(e)}"]
                    break
                except poptorch.Error as e:
                    after = dict(fuzz_plain.state(net, opt, x), torch_random=torch.get_rng_state())
                    found = _refusal(program, whole, e, call, before, after)
                    ok = fuzz_refusals.acceptable(program, whole)
                    outcome = f"refused: {fuzz_refusals.accepted(e, ok) or type(e).__name__}"
                    break
                found += _compare(call, train, net, opt, x, result, want, tol, host_grads,
                                  held, (rank, P) if config.sharded else None)
                asked.update(n for n, g in want["grads"].items() if g is not None)
                found += _stray_draws(call, config, before["torch_random"])
                returned.append((call, outputs_of(result), fuzz_plain._clone(outputs_of(result))))
                warns = fuzz_refusals.warns(program)
                if call == 0 and warns:  # the trace warned?
                    missing = fuzz_refusals.missing_warnings(program, records)
                    outcome = "warned: " + ", ".join(sorted(warns))
                    if warns & fuzz_refusals.DIFFERS:  # values the warning owns up to
                        found = missing
                        break
                    found += missing
                want = next(expected, None)
                if (found and config.processes == 1) or want is None:  # processes go on together
                    break
                fuzz_plain.seed_host(1000 + call)
                ns["between_calls"](net, opt, sched, train, call)
        except poptorch.Error as e:
            found = [f"refused outside a call: {_where(e)}"]
        except Exception as e:  # noqa: BLE001: a crash is what we are looking for
            found = [f"crashed: {_where(e)}"]
        finally:
            if train is not None:
                train.destroy()
    if not found:  # what a call returned is the user's: later calls leave it as it was
        found = [f"call {call}: {d}, after the later calls" for call, got, kept in returned
                 for d in _differences("what the call returned", got, kept, 0.0)]
    sizes = [float(m.group(1)) for f in found for m in [re.search(r"differs by (\S+) ", f)] if m]
    numeric = bool(found) and len(sizes) == len(found)
    if rank is not None:  # a process's: and the gradients it held
        return outcome, found, numeric, held, asked
    return outcome, found, numeric


def _in_processes(program: Program, config: Config) -> tuple:
    """:func:`_run` in ``config.processes`` processes started as torchrun starts them
    (``tests/support/fuzz_processes.py``): what each found, named by its rank."""
    import pickle
    import tempfile

    import processes
    with tempfile.TemporaryDirectory(prefix="fuzz-processes-") as out:
        example = pathlib.Path(out) / "example.pkl"
        example.write_bytes(pickle.dumps((program, config)))
        ran = processes.start(pathlib.Path(__file__).with_name("fuzz_processes.py"),
                              [example, out], config.processes, timeout=300)
        results = []
        for rank, (code, _, stderr) in enumerate(ran):
            done = pathlib.Path(out) / f"rank{rank}.pkl"
            if code != 0 or not done.exists():
                return "crashed", [f"rank {rank} exited {code}: {stderr[-1500:]}"], False
            results.append(pickle.loads(done.read_bytes()))
    if any(isinstance(r, Invalid) for r in results):
        raise next(r for r in results if isinstance(r, Invalid))
    found = [f"rank {rank}: {f}" for rank, (_, fs, *_) in enumerate(results) for f in fs]
    if not found and results[0][3] is not None and not results[0][0].startswith("refused"):
        # every gradient a step used, in a process
        held = set().union(*(r[3] for r in results))
        found = [f"the gradient the step used[{n!r}] is in no process"
                 for n in sorted(results[0][4] - held)]
    return results[0][0], found, all(r[2] for r in results if r[1])


def _first_call(found: list):
    """The first call whose numbers differ ("call N: ..."), None where a line names none."""
    calls = [re.match(r"call (\d+): ", f) for f in found]
    return None if not calls or not all(calls) else min(int(m.group(1)) for m in calls)


def _where(error: BaseException) -> str:
    """An exception, its cause, and the innermost frame that raised it."""
    cause = error.__cause__ or error
    frame = traceback.extract_tb(cause.__traceback__)[-1:] if cause.__traceback__ else []
    at = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    text = f"{type(error).__name__}: {str(error).splitlines()[0][:400] if str(error) else ''}"
    if cause is not error:
        text += f"; caused by {type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
    return text + at
