"""The fuzzer's oracle: a program run by plain PyTorch and by poptorch_lite, call by call.

[Note: the fuzzer's oracle]
:func:`check` builds the program twice from the same seed and runs ``config.calls``
calls on each side, the user's ``between_calls`` edits after each. The plain side does
the arithmetic the contract names (``models.reference_training``'s, generalized to any
outputs and to per-replica buffers): D optimizer steps per call, each the summed backward
of G·R micro-batches (a loss's gradient is ones, so ``identity_loss(..., "none")`` trains
as its sum), divided by G·R under ``ReductionType.Mean``; micro-batch k of the combined
batch in [D, G, R, B] order, its random ops seeded with ``models.microbatch_seeds`` (or
``Options.randomSeed``'s own generator); with ``broadcastBuffers(False)`` each replica
keeps its own buffers, the host's are replica 0's (a host edit is replica 0's) and a copy to
the device (``copyWeightsToDevice``, a re-attach) gives every replica the host's. Both sides
seed torch, Python and numpy the same before each call and before each edit. A program
plain PyTorch cannot run is :class:`Invalid` (its first call fails) or ends early (a later
call or edit fails).

Each wrapped call must then be **exact**: every output of every micro-batch, the gradient
each step used (``models.trained_grads``) for every parameter the optimizer holds, the
host ``.grad`` left as the user left it (None, or what an edit put there), every weight
and buffer, the optimizer's
state and hyper-parameters, the input (a forward may edit it in place), and the random
state of Python, numpy and the model's own generators. Or it is a **refusal** (a
``poptorch_lite.Error``) that changed nothing of that (model, optimizer, input, random
states), and one the program makes acceptable (:func:`fuzz_grammar.refusable`, or
replicas of a model writing buffers without ``broadcastBuffers(False)``: E-PART-10).
Or it is **warned**: values that differ where the program has a feature that cannot be
made exact and says so (:func:`fuzz_grammar.warned`: a Python attribute the forward
changes, W-LITE-14), and the run issued that warning (each run warns afresh: the oracle
clears ``warn_once``'s memory for it). Anything else is a :class:`Finding`: a difference,
an unexpected or unclean refusal, a crash (an exception that is not a
``poptorch_lite.Error``).

Tolerance (:meth:`Config.tolerance`): 0, bit for bit, where the arithmetic is the same (one
stage, one micro-batch per step, eager stages); elsewhere |got - want| <= 1e-5 + 1e-5 |want|
elementwise in float32 (sums across micro-batches, stages and replicas in another order;
compiled stages' reassociation). Rounding differences grow where the model amplifies them (a
BatchNorm over two samples turns one ulp into 1e-4), so a float32 difference smaller than
1e-3 counts only if the same example run in float64 (with torch's own optimizer for
poptorch.optim's, whose accumulators stay float32) differs too, beyond 1e-7: rounding
vanishes there, a semantic difference does not.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import re
import traceback
import warnings
from typing import Optional

import numpy as np
import torch

import poptorch_lite as poptorch
from poptorch_lite import errors
from poptorch_lite.compiler import compiled_stages, rng
from poptorch_lite.runtime import gpu

from fuzz_config import Config
from fuzz_grammar import Program, build, refusable, source, warned, writes_buffers
from gpu_twin import TwinGpu
from models import microbatch_seeds, trained_grads

class Invalid(Exception):
    """Plain PyTorch cannot run the program's first call: not an example."""


class Finding(AssertionError):
    """A silent difference, an unexpected or unclean refusal, or a crash."""


def describe(program: Program, config: Config) -> str:
    """What a finding prints: the model as code, the options, the loop, and all as data."""
    args = "x, y=y" if config.keyword else "x, y"
    sched = "make_scheduler(opt)" if "make_scheduler" in source(program) else "None"
    return (f"{source(program)}\n# options\n{config.code(program)}\n\n"
            f"# the calls (plain PyTorch: the same arithmetic, micro-batch by micro-batch)\n"
            f"net = Net()\nopt, sched = make_optimizer(net), {sched}\n"
            f"train = poptorch.trainingModel(net, opts, opt)\n"
            f"for call in range({config.calls}):  # x: {config.D * config.G * config.R} "
            f"micro-batches of {config.B}\n"
            f"    out = train({args})\n    between_calls(net, opt, sched, train, call)\n\n"
            f"# as data (tests/fuzz_found.py)\n{program!r}\n{config!r}\n")


@contextlib.contextmanager
def _running(config: Config):
    """Run the wrapped side; yields the warnings it issues (each warned of afresh)."""
    saved, once = compiled_stages.PAYS_FROM, set(errors._warned)
    compiled_stages.PAYS_FROM = 0  # tiny stages: compile them anyway (conftest's fixture)
    errors._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if config.device == "gpu_twin":
                with gpu.installed(TwinGpu()):
                    yield caught
            else:
                yield caught
    finally:
        compiled_stages.PAYS_FROM = saved
        errors._warned.clear()
        errors._warned.update(once)


def _batch(config: Config, call: int) -> int:
    return config.B + (config.vary_batch and call == 1)


def _data(config: Config, call: int):
    g = torch.Generator().manual_seed(1000 + call)
    n = _batch(config, call) * config.D * config.G * config.R
    x = torch.randn(n, 6, generator=g).to(getattr(torch, config.dtype))
    return x, torch.randint(0, 4, (n,), generator=g)


def _model(ns: dict, config: Config):
    """The program's model, its optimizer and its scheduler, from one seed."""
    torch.manual_seed(0)
    net = ns["Net"]().to(getattr(torch, config.dtype))
    opt = ns["make_optimizer"](net)
    return net, opt, ns["make_scheduler"](opt) if "make_scheduler" in ns else None


def _seeds(config: Config, own: Optional[torch.Generator], call: int) -> list:
    m = config.G * config.R
    if own is not None:
        return [rng.microbatch_seed(b, i) for b in rng.draw_bases(config.D, own) for i in range(m)]
    torch.manual_seed(100 + call)
    return microbatch_seeds(config.D, m)


def _seed_host(call: int) -> None:
    torch.manual_seed(100 + call)
    random.seed(call)
    np.random.seed(call)


def _generators(net) -> dict:
    return {n: g.get_state() for n, g in vars(net).items() if isinstance(g, torch.Generator)}


def _clone(tree):
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t), tree)


def _state(net, opt, x) -> dict:
    """Everything a call may change that the user sees (torch's generator aside: the plain
    side seeds each micro-batch)."""
    kind, keys, pos, *_ = np.random.get_state()
    return {"model": _clone(dict(net.state_dict())), "optimizer": _clone(opt.state_dict()),
            "input": x.clone(), "python random": torch.tensor(random.getstate()[1]),
            "numpy random": torch.tensor([*keys.tolist(), pos]),
            "generators": _clone(_generators(net))}


def _plain_call(net, opt, x, y, config: Config, seeds: list, replicas: list) -> tuple:
    """One call's D steps in plain PyTorch; returns (per-output values, last step's grads)."""
    m = config.G * config.R
    b = len(x) // (config.D * m)
    per_output = [[] for _ in range(10)]
    buffers = dict(net.named_buffers())
    for d in range(config.D):
        opt.zero_grad(set_to_none=True)
        for j in range(m):
            k, r = d * m + j, j % config.R
            if replicas:  # broadcastBuffers(False): replica r's own buffers
                with torch.no_grad():
                    for name, t in buffers.items():
                        replicas[0][name] = t.clone()
                        t.copy_(replicas[r][name])
            torch.manual_seed(seeds[k])
            xk, yk = x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]
            result = net(xk, y=yk) if config.keyword else net(xk, yk)
            loss = result[1]
            loss.backward(torch.ones_like(loss))
            for i, t in enumerate(result):
                per_output[i].append(t.detach().clone())
            if replicas:
                with torch.no_grad():
                    for name, t in buffers.items():
                        replicas[r][name] = t.clone()
                        t.copy_(replicas[0][name])
        if config.reduction == "mean":
            for p in net.parameters():
                if p.grad is not None:
                    p.grad.div_(m)
        clip = getattr(opt, "max_grad_norm", None)  # poptorch.optim's: the norm of what it steps
        if clip is not None and math.isfinite(clip):
            torch.nn.utils.clip_grad_norm_(
                [p for g in opt.param_groups for p in g["params"] if p.grad is not None], clip)
        opt.step()
    outputs = [_merged(v, config) for v in per_output if v]
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()
             if id(p) in in_optimizer}
    return outputs, grads


#: Edits after which every replica holds the host's buffers: a copy to the device (a
#: re-attach copies too) has one value to copy, the host's, as PopTorch's has.
_TO_DEVICE = {"detach_attach", "copy_weights"}


def _merged(values: list, config: Config) -> torch.Tensor:
    """One output of a call's micro-batches as the call returns it (POPTORCH_REFERENCE §3):
    All: every micro-batch; Final: each replica's last; Sum: each replica's sum. A scalar per
    micro-batch becomes a vector of them (a 0-dim tensor when there is one), a batch of rows
    their rows end to end. Micro-batch k is replica k % R's ([D, G, R, B] order)."""
    if config.output_mode != "All":
        R = config.R
        mine = [values[r::R] for r in range(R)]
        values = [v[-1] if config.output_mode == "Final" else sum(v[1:], v[0]) for v in mine]
    if values[0].dim() == 0:
        return torch.stack(values).reshape(-1 if len(values) > 1 else ())
    return torch.cat(values)


def plain(program: Program, config: Config):
    """The plain PyTorch side, a call at a time: yields what each wrapped call must equal (see
    the Note), the user's edits run before the next; stops where plain PyTorch cannot go on.

    Raises:
        Invalid: the first call fails: the program is wrong in plain PyTorch.
    """
    ns = build(program)
    try:
        net, opt, sched = _model(ns, config)
    except Exception as e:  # noqa: BLE001: plain PyTorch cannot build it
        raise Invalid(f"{type(e).__name__}: {e}") from e
    own = None if config.random_seed is None else torch.Generator().manual_seed(config.random_seed)
    replicas = []
    if config.R > 1 and not config.broadcast_buffers and writes_buffers(program):
        replicas = [{n: b.clone() for n, b in net.named_buffers()} for _ in range(config.R)]
    for call in range(config.calls):
        x, y = _data(config, call)
        seeds = _seeds(config, own, call)
        _seed_host(call)
        try:
            outputs, grads = _plain_call(net, opt, x, y, config, seeds, replicas)
        except Exception as e:  # the program itself is wrong in plain PyTorch
            if call == 0:
                raise Invalid(f"{type(e).__name__}: {e}") from e
            return
        yield dict(_state(net, opt, x), outputs=outputs, grads=grads)
        _seed_host(1000 + call)
        try:
            ns["between_calls"](net, opt, sched, None, call)
        except Exception:  # noqa: BLE001: an edit plain PyTorch refuses ends the example
            return
        if replicas and {e.kind for e in program.edits if e.call == call} & _TO_DEVICE:
            replicas[:] = [{n: b.clone() for n, b in net.named_buffers()} for _ in replicas]


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
        a, b = got.detach().cpu(), want.detach().cpu()
        if not a.is_floating_point():
            return [] if torch.equal(a, b) else [f"{what}: {a.tolist()} != {b.tolist()}"]
        bad = ~((a - b).abs() <= tol + tol * b.abs()) & ~(a.isnan() & b.isnan())
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
             host_grads: dict) -> list:
    """What differs after a wrapped call (``host_grads``: the ``.grad`` the user left)."""
    got = _state(net, opt, x)
    grads = trained_grads(train)
    used = {n: grads.get(n) for n in want["grads"]}
    found = _differences("outputs", list(result) if isinstance(result, (tuple, list))
                         else [result], want["outputs"], tol)
    found += _differences("the gradient the step used", used, want["grads"], tol)
    found += _differences("the host .grad (as the user left it)", _host_grads(net), host_grads,
                          0.0)
    for key in ("model", "optimizer", "input", "python random", "numpy random", "generators"):
        found += _differences(key, got[key], want[key], tol)
    return [f"call {call}: {d}" for d in found]


def _refusal(program: Program, config: Config, error: Exception, call: int, before: dict,
             after: dict) -> list:
    """What is wrong with a refusal: it changed state, or nothing makes it acceptable."""
    found = [f"call {call}: refused with {type(error).__name__}, but it changed {d}"
             for k in before for d in _differences(k, after[k], before[k], True)]
    replicas = config.R > 1 and config.broadcast_buffers and writes_buffers(program)
    if not (refusable(program) or replicas):
        found.append(f"call {call}: refused a program that should run: "
                     f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    return found


_TORCH_TWIN = {"poptorch_sgd": "sgd_momentum", "poptorch_adam": "adam"}


def check(program: Program, config: Config) -> str:
    """Run ``program`` both ways under ``config`` (see [Note: the fuzzer's oracle]).

    A float32 difference where sums run in another order is confirmed in float64 before it
    counts: rounding that the model amplifies (a BatchNorm over two samples) vanishes there,
    a semantic difference does not.

    Returns:
        "exact", "rounding" (float32 only), "refused: <error class>" or "warned: <features>".

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
        if not _run(twin, dataclasses.replace(config, dtype="float64"))[1]:
            return "rounding"
    if found:
        raise Finding("\n".join(found[:8]) + "\n\n" + describe(program, config))
    return outcome


def _run(program: Program, config: Config) -> tuple:
    """(outcome, what is wrong, whether it is only numbers that differ, by less than 1e-3)."""
    expected = plain(program, config)
    tol = config.tolerance(program)
    outcome, found, compared = "exact", [], False
    with _running(config) as caught:
        want = next(expected)  # raises Invalid before anything is built or wrapped
        ns = build(program)
        net, opt, sched = _model(ns, config)
        train = None
        try:
            train = poptorch.trainingModel(net, config.options(program), opt)
            for call in range(config.calls):
                x, y = _data(config, call)
                _seed_host(call)
                before = dict(_state(net, opt, x), torch_random=torch.get_rng_state())
                host_grads = _host_grads(net)
                try:
                    result = train(x, y=y) if config.keyword else train(x, y)
                except (errors.ExecutionError, errors.UnrecoverableError) as e:
                    found = [f"call {call}: failed while running, where plain PyTorch runs: "
                             f"{_where(e)}"]
                    break
                except poptorch.Error as e:
                    after = dict(_state(net, opt, x), torch_random=torch.get_rng_state())
                    found = _refusal(program, config, e, call, before, after)
                    outcome = f"refused: {type(e).__name__}"
                    break
                found = _compare(call, train, net, opt, x, result, want, tol, host_grads)
                compared = bool(found)
                want = next(expected, None)
                if found or want is None:
                    break
                _seed_host(1000 + call)
                ns["between_calls"](net, opt, sched, train, call)
        except poptorch.Error as e:
            found = [f"refused outside a call: {_where(e)}"]
        except Exception as e:  # noqa: BLE001: a crash is what we are looking for
            found = [f"crashed: {_where(e)}"]
        finally:
            if train is not None:
                train.destroy()
    told = [k for k, text in warned(program).items()
            if any(text in str(w.message) for w in caught)]
    if compared and told:  # differences a warning owns up to, as PopTorch's own are
        outcome, found = f"warned: {', '.join(told)}", []
    sizes = [float(m.group(1)) for f in found for m in [re.search(r"differs by (\S+) ", f)] if m]
    return outcome, found, bool(found) and len(sizes) == len(found) and max(sizes) < 1e-3


def _where(error: BaseException) -> str:
    """An exception, its cause, and the innermost frame that raised it."""
    cause = error.__cause__ or error
    frame = traceback.extract_tb(cause.__traceback__)[-1:] if cause.__traceback__ else []
    at = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    text = f"{type(error).__name__}: {str(error).splitlines()[0][:400] if str(error) else ''}"
    if cause is not error:
        text += f"; caused by {type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
    return text + at
