"""The fuzzer's reference: a program of the grammar run by plain PyTorch, a call at a time.

:func:`plain` does the arithmetic the contract names ([Note: the fuzzer's oracle] in
fuzz_check, which compares poptorch_lite's calls with what it yields): D optimizer steps per
call, each the summed backward of G·R micro-batches, per-replica buffers, poptorch.optim's
loss scaling, Python's random as the traces draw it. The helpers that both sides share
(the data of a call, the model from one seed, the seeds of Python, numpy and torch, the
state a call may change) are here too.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import sys
from typing import Optional

import numpy as np
import torch

from poptorch_lite.compiler import rng

import fuzz_refusals
from fuzz_config import Config
from fuzz_grammar import Program, build, loss_of, outputs_of, structure, writes_buffers
from models import microbatch_seeds


class Invalid(Exception):
    """Plain PyTorch cannot run the program's first call: not an example."""


def batch_size(config: Config, call: int) -> int:
    """The micro-batch size of call ``call`` (one more in the second with ``vary_batch``)."""
    return config.B + (config.vary_batch and call == 1)


def data(config: Config, call: int):
    """Call ``call``'s inputs and labels (the same on both sides)."""
    g = torch.Generator().manual_seed(1000 + call)
    n = batch_size(config, call) * config.D * config.G * config.R * (
        config.processes if config.spread == "replicas" else 1)
    x = torch.randn(n, 6, generator=g).to(getattr(torch, config.dtype))
    return x, torch.randint(0, 4, (n,), generator=g)


def model(ns: dict, config: Config):
    """The program's model, its optimizer and its scheduler, from one seed."""
    torch.manual_seed(0)
    net = ns["Net"]().to(getattr(torch, config.dtype))
    opt = ns["make_optimizer"](net)
    return net, opt, ns["make_scheduler"](opt) if "make_scheduler" in ns else None


def _seeds(config: Config, own: Optional[torch.Generator], call: int) -> list:
    """Each micro-batch's seed: a run per step, of G·R micro-batches, when training; one run
    of every micro-batch in inference ([Note: micro-batch RNG])."""
    runs, m = (1, config.D * config.R) if config.inference else (config.D, config.G * config.R)
    if own is not None:
        return [rng.microbatch_seed(b, i) for b in rng.draw_bases(runs, own) for i in range(m)]
    torch.manual_seed(100 + call)
    return microbatch_seeds(runs, m)


def seed_host(call: int) -> None:
    """Seed torch, Python and numpy as both sides do before call ``call`` (and its edits)."""
    torch.manual_seed(100 + call)
    random.seed(call)
    np.random.seed(call)


def _generators(net) -> dict:
    return {n: g.get_state() for n, g in vars(net).items() if isinstance(g, torch.Generator)}


def _clone(tree):
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t), tree)


def state(net, opt, x) -> dict:
    """Everything a call may change that the user sees (torch's generator aside: the plain
    side seeds each micro-batch)."""
    kind, keys, pos, *_ = np.random.get_state()
    model = dict(net.state_dict())
    model.update({f"{n} (not persistent)": b for n, b in net.named_buffers() if n not in model})
    return {"model": _clone(model), "optimizer": _clone(opt.state_dict()),
            "input": x.clone(), "python random": torch.tensor(random.getstate()[1]),
            "numpy random": torch.tensor([*keys.tolist(), pos]),
            "generators": _clone(_generators(net)), "flags": _flags(net)}


def _flags(net) -> dict:
    """Each module's ``training`` and each parameter's ``requires_grad``, as numbers."""
    flags = {f"{n or 'model'}.training": torch.tensor(float(m.training))
             for n, m in net.named_modules()}
    flags.update({f"{n}.requires_grad": torch.tensor(float(p.requires_grad))
                  for n, p in net.named_parameters()})
    return flags


def _plain_call(program: Program, procs: list, x, y, config: Config, seeds: list,
                call: int) -> tuple:
    """One call's D steps in plain PyTorch; returns (per-output values, last step's grads):
    those of each process where ``procs`` holds several ([Note: the fuzzer's processes] in
    fuzz_check: each its own model, replicas, batch; the gradients summed over them).
    The autocast around the call (``Config.autocast``) is around each forward, as PyTorch
    asks (one around a whole call would reuse its casts of the weights after a step)."""
    m, P = config.G * config.R, len(procs)
    b = len(x) // (config.D * m * P)
    per_output = [[[] for _ in range(10)] for _ in range(P)]
    chunks = list(zip(x.chunk(P), y.chunk(P)))  # each process's own batch, [D, G, R, B]
    # an inference call is one run of every micro-batch: on the twin, one copy of all rows
    whole = (x.clone(), y.clone()) if config.device == "gpu_twin" and config.inference else None
    hosts = [(random.getstate(), np.random.get_state())] * P  # each process's own Python
    for d in range(config.D):
        if not config.inference:
            for proc in procs:
                proc.opt.zero_grad(set_to_none=True)
        step = slice(d * m * b, (d + 1) * m * b)
        for p, (proc, (xp, yp)) in enumerate(zip(procs, chunks)):
            if P > 1:
                random.setstate(hosts[p][0])
                np.random.set_state(hosts[p][1])
            result = _plain_step(program, proc, config, call, xp, yp, whole, step, seeds, d,
                                 per_output[p])
            if P > 1:
                hosts[p] = (random.getstate(), np.random.get_state())
        if P > 1:  # the host's: process 0's
            random.setstate(hosts[0][0])
            np.random.set_state(hosts[0][1])
        if whole is not None:  # a forward's write to its input reaches the caller's
            x[step].copy_(whole[0][step])
        if config.inference:
            continue
        if P > 1:  # the all-reduce: every process steps the sum of all of theirs
            for ps in zip(*(proc.net.parameters() for proc in procs)):
                if ps[0].grad is not None:
                    total = sum((q.grad for q in ps[1:]), ps[0].grad.clone())
                    for q in ps:
                        q.grad = total.clone()
        for proc in procs:
            _plain_update(proc.opt, proc.net, m * P if config.reduction == "mean" else 1)
        if P > 1 and config.sharded:
            _owners_chunks(procs)
    outputs = [[_merged(v, config) for v in per if v] for per in per_output]
    grads = [_step_grads(proc, config) for proc in procs]
    return (outputs[0], grads[0]) if P == 1 else (outputs, grads), structure(result)


def _owners_chunks(procs: list) -> None:
    """With the optimizer's state sharded over the processes, each stepped weight becomes,
    in every process, what each element's owner stepped: process k owns the k-th chunk of
    ceil(L/P) elements of the flattened weight, as torch's ZeroRedundancyOptimizer
    broadcasts each owner's partition (a weight the forward writes, each process its own
    way, leaves every process the owners' values)."""
    P = len(procs)
    stepped = {id(p) for g in procs[0].opt.param_groups for p in g["params"]}
    with torch.no_grad():
        for ps in zip(*(proc.net.parameters() for proc in procs)):
            if id(ps[0]) in stepped and ps[0].grad is not None:
                c = -(-ps[0].numel() // P)
                owned = torch.cat([q.reshape(-1)[k * c:(k + 1) * c] for k, q in enumerate(ps)])
                for q in ps:
                    q.copy_(owned.view_as(q))


def _plain_update(opt, net, mean_over: int) -> None:
    """The step: the gradients divided as the reduction divides, clipped, one optimizer step."""
    scale = getattr(opt, "loss_scaling", 1.0)  # poptorch.optim's: the loss's, undone here
    divisor = mean_over * scale
    if divisor != 1:
        for p in net.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
    clip = getattr(opt, "max_grad_norm", None)  # poptorch.optim's: the norm of what it steps
    if clip is not None and math.isfinite(clip):
        torch.nn.utils.clip_grad_norm_(
            [p for g in opt.param_groups for p in g["params"] if p.grad is not None], clip)
    opt.step()


def _step_grads(proc, config: Config) -> dict:
    """The gradients the last step used, of the parameters the optimizer holds."""
    in_optimizer = {id(p) for g in proc.opt.param_groups for p in g["params"]}
    return {n: None if p.grad is None else p.grad.clone() for n, p in proc.net.named_parameters()
            if id(p) in in_optimizer and not config.inference}


def _plain_step(program: Program, proc, config: Config, call: int, x, y, whole, step, seeds,
                d: int, per_output: list):
    """A process's micro-batches of step ``d``: their forwards and backwards, the gradients
    left summed in ``.grad``, the outputs appended to ``per_output``."""
    net, replicas, draws = proc.net, proc.replicas, proc.draws
    scale = getattr(proc.opt, "loss_scaling", 1.0)  # poptorch.optim's: the loss's
    buffers = dict(net.named_buffers())
    m, b = config.G * config.R, len(x) // (config.D * config.G * config.R)
    if whole is not None:
        xs, ys = whole[0][step], whole[1][step]
    elif config.device == "gpu_twin":  # [Note: the twin's inputs] in fuzz_check
        xs, ys = x[step].clone(), y[step].clone()
    else:
        xs, ys = x[step], y[step]
    for j in range(m):
        k, r = d * m + j, j % config.R
        if replicas:  # broadcastBuffers(False): replica r's own buffers
            with torch.no_grad():
                for name, t in buffers.items():
                    replicas[0][name] = t.clone()
                    t.copy_(replicas[r][name])
        torch.manual_seed(seeds[k])
        xk, yk = xs[j * b:(j + 1) * b], ys[j * b:(j + 1) * b]
        with config.ambient(call), draws.forward(b) if draws else contextlib.nullcontext(), \
                _inference_session() if config.inference else contextlib.nullcontext():
            result = net(xk, y=yk) if config.keyword else net(xk, yk)
        if not config.inference:
            loss = loss_of(program, result)
            loss.backward(torch.full_like(loss, scale))
        for i, t in enumerate(outputs_of(result)):
            per_output[i].append(t.detach().clone())
        if replicas:
            with torch.no_grad():
                for name, t in buffers.items():
                    replicas[r][name] = t.clone()
                    t.copy_(replicas[0][name])
    if config.device == "gpu_twin" and whole is None:  # the caller's, as after a step
        x[step].copy_(xs)
    return result


@contextlib.contextmanager
def _inference_session():
    """An inference model's forward: no gradients, and every dropout the identity whatever
    the module's flag, as PopTorch's inference session runs one ([Note: inference session]
    in poptorch_lite/compiler/trace_modes.py): ``F.dropout`` (``nn.Dropout``'s, and
    ``nn.MultiheadAttention``'s on its own path) and attention's ``dropout_p``; and an encoder
    layer under a CPU autocast runs its separate ops, as the wrapper's does (W-LITE-20)."""
    functional = torch.nn.functional
    dropout, attention = functional.dropout, functional.scaled_dot_product_attention

    def identity(input, p=0.5, training=True, inplace=False):
        return input

    def no_dropout(*args, **kwargs):
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        return attention(*args, **kwargs)
    # Under a CPU autocast an encoder layer runs its separate ops, not its fused kernel,
    # which cannot be traced there (W-LITE-20, in [Note: fused fast paths])
    overrides, encoder = torch.overrides.has_torch_function, \
        torch.nn.TransformerEncoderLayer.forward.__code__

    def has_torch_function(args):
        return overrides(args) or (sys._getframe(1).f_code is encoder
                                   and torch.is_autocast_enabled("cpu"))
    functional.dropout, functional.scaled_dot_product_attention = identity, no_dropout
    torch.overrides.has_torch_function = has_torch_function
    try:
        with torch.no_grad():
            yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = dropout, attention
        torch.overrides.has_torch_function = overrides


class _TracedDraws:
    """Python's and numpy's random as the wrapped side's traces draw them (W-LITE-13): the
    first forward of a program draws for real, as its trace does, and every later forward
    of that program gets the same numbers. A program is what the wrapper keys one by: the
    micro-batch size, the parameters' requires_grad, the autocast around the call, the
    train/eval flags of the submodules whose forward reads theirs (a dropout's, a
    normalisation's, an LSTM's), the plain attributes the forward reads (the grammar's
    ``temperature``, a dropout module's ``p``), every module's hooks and own ``forward``,
    and the functions the forward calls from its attributes (the grammar's ``act``)."""

    def __init__(self, net, training: bool = True):
        # an inference model traces again for no parameter's requires_grad
        self.net, self.params, self.drawn = net, tuple(net.parameters()) if training else (), {}
        self.reads = hasattr(net, "temperature")  # the temperature feature's (anneal may set
        # one the forward never reads)
        self.moded = [m for m in net.modules() if m is not net and "training" in getattr(
            getattr(type(m).forward, "__code__", None), "co_names", ())]

    @contextlib.contextmanager
    def forward(self, batch: int):
        modules = list(self.net.modules())
        python = (tuple(tuple(getattr(m, table)) for m in modules for table in (
            "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")),
            tuple(vars(m).get("forward") for m in modules),
            tuple(v for m in modules for k, v in vars(m).items() if k.startswith("act")),
            tuple(m.p for m in modules if isinstance(m, torch.nn.Dropout)))
        key = (batch, tuple(p.requires_grad for p in self.params),
               torch.is_autocast_enabled("cpu"), tuple(m.training for m in self.moded),
               self.net.temperature if self.reads else None, python)
        drawn = self.drawn.get(key)
        if drawn is None:  # this program's trace: real draws, recorded
            drawn = self.drawn[key] = []
            replay = None
        else:
            replay = iter(drawn)
        real = [(random, "random", random.random), (np.random, "rand", np.random.rand)]

        def as_traced(draw):
            def once(*args, **kwargs):
                if replay is not None:
                    return next(replay)
                drawn.append(draw(*args, **kwargs))
                return drawn[-1]
            return once
        for module, name, draw in real:
            setattr(module, name, as_traced(draw))
        try:
            yield
        finally:
            for module, name, draw in real:
                setattr(module, name, draw)


#: Edits after which every replica holds the host's buffers: a copy to the device (a
#: re-attach copies too, and so does the wrapper's load_state_dict, which ends in
#: copyWeightsToDevice as PopTorch's does) has one value to copy, the host's.
_TO_DEVICE = {"detach_attach", "copy_weights", "wrapper_load"}


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


class _Process:
    """One process's plain PyTorch: its model, optimizer and scheduler, its replicas' buffers
    (where there are several and the forward writes some), its replayed Python draws."""

    def __init__(self, program: Program, ns: dict, config: Config):
        self.net, self.opt, self.sched = model(ns, config)
        # normalisations' statistics are per replica whatever broadcastBuffers says
        self.replicas = [{n: b.clone() for n, b in self.net.named_buffers()}
                         for _ in range(config.R)] \
            if config.R > 1 and writes_buffers(program) else []
        self.draws = _TracedDraws(self.net, not config.inference) \
            if fuzz_refusals.warns(program) else None


def plain(program: Program, config: Config):
    """The plain PyTorch side, a call at a time: yields what each wrapped call must equal (see
    the Note), the user's edits run before the next; stops where plain PyTorch cannot go on.
    With ``config.processes``, each process's is ``per_process``'s ([Note: the fuzzer's
    processes] in fuzz_check).

    Raises:
        Invalid: the first call fails: the program is wrong in plain PyTorch.
    """
    ns = build(program)
    try:
        procs = [_Process(program, ns, config) for _ in range(
            config.processes if config.spread == "replicas" else 1)]
    except Exception as e:  # noqa: BLE001: plain PyTorch cannot build it
        raise Invalid(f"{type(e).__name__}: {e}") from e
    net = procs[0].net
    own = None if config.random_seed is None else torch.Generator().manual_seed(config.random_seed)
    on_gpu = config.device == "cuda"  # the GPU check: plain PyTorch on the GPU too
    wrapped = net.training
    if on_gpu:
        net.cuda()
        for b in procs[0].replicas:
            b.update({n: t.cuda() for n, t in b.items()})
    for call in range(config.calls):
        x, y = data(config, call)
        if on_gpu:
            x, y = x.cuda(), y.cuda()
        seeds = _seeds(config, own, call)
        seed_host(call)
        # The forward's self.training is the wrapper's, as wrapped; the submodules' are the
        # user's ([Note: train and eval modes] in poptorch_lite/runtime/compiled.py)
        users = [proc.net.training for proc in procs]
        for proc in procs:
            proc.net.training = wrapped
        try:
            (outputs, grads), returned = _plain_call(program, procs, x, y, config, seeds, call)
        except Exception as e:  # the program itself is wrong in plain PyTorch
            if call == 0:
                raise Invalid(f"{type(e).__name__}: {e}") from e
            return
        finally:
            for proc, flag in zip(procs, users):
                proc.net.training = flag
        if len(procs) == 1:
            yield dict(state(net, procs[0].opt, x), outputs=outputs, grads=grads,
                       returned=returned)
        else:
            yield dict(per_process=[dict(state(proc.net, proc.opt, xp), outputs=out, grads=g)
                                    for proc, xp, out, g in zip(procs, x.chunk(len(procs)),
                                                                outputs, grads)],
                       returned=returned)
        for proc in procs:
            seed_host(1000 + call)
            try:
                ns["between_calls"](proc.net, proc.opt, proc.sched, None, call)
            except Exception:  # noqa: BLE001: an edit plain PyTorch refuses ends the example
                return
            if proc.replicas and {e.kind for e in program.edits if e.call == call} & _TO_DEVICE:
                proc.replicas[:] = [{n: b.clone() for n, b in proc.net.named_buffers()}
                                    for _ in proc.replicas]
