"""Small models and a plain-PyTorch reference that does the same arithmetic."""

from __future__ import annotations

import copy
import threading
import time
import warnings

import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.compiler import rng

from patience import limit


class BlockMLP(torch.nn.Module):
    """Four Linear layers split into 1, 2 or 4 blocks on IPUs 0.. (or on ``ipus``, one per
    block: repeated IPUs make virtual stages), with a cross-entropy loss."""

    def __init__(self, blocks: int = 2, width: int = 8, classes: int = 4, dropout: float = 0.0,
                 batchnorm: bool = False, ipus=None):
        super().__init__()
        self.ipus = tuple(range(blocks)) if ipus is None else tuple(ipus)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.head = torch.nn.Linear(width, classes)
        self.bn = torch.nn.BatchNorm1d(width) if batchnorm else None
        self.drop = torch.nn.Dropout(dropout) if dropout else None
        self.blocks = blocks

    def forward(self, x, y):
        per = 4 // self.blocks
        for k, layer in enumerate(list(self.layers) + [self.head]):
            if k % per == 0:
                poptorch.Block.start(f"b{k // per}", ipu_id=self.ipus[k // per])
            if layer is self.head:
                if self.bn is not None:
                    x = self.bn(x)
                if self.drop is not None:
                    x = self.drop(x)
                out = layer(x)
            else:
                x = torch.relu(layer(x))
        return out, F.cross_entropy(out, y)


def data(n: int, width: int = 8, classes: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)


def microbatch_seeds(D: int, m: int) -> list:
    """The seed each micro-batch's random ops start from in D runs of m micro-batches.

    poptorch_lite draws one base per run from the default generator and seeds
    micro-batch i of the run with ``microbatch_seed(base, i)`` ([Note: micro-batch RNG]);
    call this right after the same ``torch.manual_seed`` as the wrapped model's call.
    """
    seeds = []
    for _ in range(D):
        base = rng.draw_base()
        seeds += [rng.microbatch_seed(base, i) for i in range(m)]
    return seeds


def reference_training(model, optimizer, x, y, D: int, G: int, R: int, mean: bool = True,
                       seeds=None):
    """Plain PyTorch: D steps, each the summed backward of G·R micro-batches, then /G·R (Mean).

    Micro-batch k of the combined batch is [D, G, R, B] order (POPTORCH_REFERENCE §1).
    With ``seeds``, micro-batch k's forward starts with ``torch.manual_seed(seeds[k])``.
    The micro-batches run on the model's device (see :func:`twin`); what it returns is on
    the host. Returns (per-micro-batch outputs, per-micro-batch losses, last step's grads).
    """
    F_ = D * G * R
    b = x.shape[0] // F_
    dev = next(model.parameters()).device
    outs, losses = [], []
    for d in range(D):
        optimizer.zero_grad(set_to_none=True)
        for j in range(G * R):
            k = d * G * R + j
            if seeds is not None:
                torch.manual_seed(seeds[k])
            out, loss = model(x[k * b:(k + 1) * b].to(dev), y[k * b:(k + 1) * b].to(dev))
            loss.backward()
            outs.append(out.detach().cpu())
            losses.append(loss.detach().cpu())
        if mean:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(G * R)
        optimizer.step()
    grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
    return outs, losses, grads


def replicas_training(copies, optimizer, x, y, D: int, G: int, seeds=None):
    """Plain PyTorch as R = len(copies) independent replicas: micro-batch k of the combined
    batch ([D, G, R, B] order) runs on copy k % R, with that copy's buffers (its own batch
    statistics and running statistics); each step sums every copy's gradients into copy 0,
    divides by G·R, steps ``optimizer`` (copy 0's) and gives the other copies its weights.

    Returns (per-micro-batch outputs, per-micro-batch losses, last step's grads), as
    :func:`reference_training`.
    """
    R = len(copies)
    b = x.shape[0] // (D * G * R)
    dev = next(copies[0].parameters()).device
    outs, losses = [], []
    for d in range(D):
        for c in copies:
            c.zero_grad(set_to_none=True)
        for j in range(G * R):
            k = d * G * R + j
            if seeds is not None:
                torch.manual_seed(seeds[k])
            out, loss = copies[j % R](x[k * b:(k + 1) * b].to(dev), y[k * b:(k + 1) * b].to(dev))
            loss.backward()
            outs.append(out.detach().cpu())
            losses.append(loss.detach().cpu())
        with torch.no_grad():
            for ps in zip(*(c.parameters() for c in copies)):
                used = [p.grad for p in ps if p.grad is not None]
                ps[0].grad = sum(used) / (G * R) if used else None
        optimizer.step()
        with torch.no_grad():
            for ps in zip(*(c.parameters() for c in copies)):
                for p in ps[1:]:
                    p.copy_(ps[0])
    grads = {n: None if p.grad is None else p.grad.cpu() for n, p in copies[0].named_parameters()}
    return outs, losses, grads


def twin(model, device: str = "cpu"):
    """A deep copy to serve as the plain-PyTorch reference, on the test's ``device``'s kind:
    a CUDA run is compared with plain PyTorch on the GPU (its dropout masks come from the
    CUDA generator), the CPU and the IPU Model with plain PyTorch on the CPU."""
    return copy.deepcopy(model).to("cuda" if device == "cuda" else "cpu")


def workers() -> list:
    """The stream worker threads alive now (named ``poptorch_lite-ipu<k>_<n>``)."""
    return [t for t in threading.enumerate() if t.name.startswith("poptorch_lite-ipu")]


def exited(timeout: float = 60.0) -> bool:
    """Whether every worker has exited, waiting up to ``limit(timeout)`` for it
    (tests/support/patience.py); after garbage collection they exit on their own."""
    deadline = time.monotonic() + limit(timeout)
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    return workers() == []


def on_device(opts, device):
    """Put every IPU of ``opts`` on the test's ``device``: "cpu", "cuda", "ipu_model" (the
    CPU, with a memory per IPU: ``Options.useIpuModel(True)``) or "gpu_twin" (the GPU twin's
    device, ``gpu_twin.TWIN``; conftest installs the twin for such a test)."""
    opts.set_ipu_devices({"ipu_model": "cpu", "gpu_twin": "cpu:0"}.get(device, device))
    if device == "ipu_model":
        opts.useIpuModel(True)
    return opts


_TRACES: dict = {}


def shared_traces(monkeypatch):
    """Let the wrappers of a test share one trace per model structure and call signature.

    A matrix compiles the same model (a fresh copy per configuration) on the same one
    micro-batch signature many times: only the schedule, accumulation, replication and
    optimizer differ, and none of them changes what is traced. The first compile of a
    (model structure, modes, signature, autocast, execution strategy, training) traces; later ones
    get a deep copy of that partition (each wrapper rewrites its own graphs for its
    devices). Only for models whose forward depends on nothing but their structure and
    plain attributes (``BlockMLP``); a test that checks what tracing warns must not use it.
    """
    import poptorch_lite.runtime.compiling as program
    from poptorch_lite.compiler.casting import ambient_autocast
    traced = program.partition

    def key(model, modes, args, kwargs, strategy, training, generic=False, replica_values=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        signature = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad)
                          if isinstance(t, torch.Tensor) else repr(t) for t in leaves)
        state = tuple((n, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                      for n, t in model.state_dict(keep_vars=True).items())
        plain = tuple(sorted((k, v) for k, v in vars(model).items()
                             if isinstance(v, (bool, int, float, str, type(None)))))
        flags = tuple(modes.get(m, m.training) for m in model.modules())  # as traced
        return (type(model), repr(model), plain, state, flags, signature, ambient_autocast(),
                repr(strategy), training, generic, repr(sorted((replica_values or {}).items())))

    def partition(model, modes, args, kwargs, strategy, training, generic=False,
                  replica_values=None):
        k = key(model, modes, args, kwargs, strategy, training, generic, replica_values)
        if k not in _TRACES:
            _TRACES[k] = traced(model, modes, args, kwargs, strategy, training, generic,
                                replica_values=replica_values)
        with warnings.catch_warnings():  # torch 2.11 deprecates copying its LeafSpec this way
            warnings.simplefilter("ignore", FutureWarning)
            return copy.deepcopy(_TRACES[k])
    monkeypatch.setattr(program, "partition", partition)


def pairwise(rows: list) -> list:
    """The rows of a matrix that cover every pair of values of every two factors in it.

    Greedy and deterministic: each pick is the first row that covers the most pairs not
    yet covered. A full matrix runs on one device; the others run this covering subset,
    since what differs between devices (memories, streams, copies) meets every value of
    every factor, and every pair of them, there.

    >>> pairwise([(a, b, c) for a in (1, 2) for b in (1, 2) for c in (1, 2)])
    [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)]
    """
    def pairs(r):
        return {(i, r[i], j, r[j]) for i in range(len(r)) for j in range(i + 1, len(r))}
    need = set().union(*map(pairs, rows))
    chosen = []
    while need:
        best = max(rows, key=lambda r: len(pairs(r) & need))
        chosen.append(best)
        need -= pairs(best)
    return chosen


# -- models that shape their own gradients ([Note: gradients the forward shapes]) ----------

class RoundThrough(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledBackward(torch.autograd.Function):
    """The identity whose backward scales by ``k`` (a gradient reversal layer for k < 0)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


def scaled_backward(x, scale, **attributes):
    """PopTorch's ``custom_op`` "ScaledBackward" of domain "poptorch_lite_test" ([Note: custom
    ops]): :class:`ScaledBackward`, its ``scale`` an attribute."""
    return ScaledBackward.apply(x, scale)


poptorch.register_custom_op("ScaledBackward", "poptorch_lite_test", scaled_backward)


class OwnLinear(torch.autograd.Function):
    """A linear layer with a hand-written backward that doubles its weight's gradient."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, 2 * g.t() @ x, g.sum(0)


class NoisyRound(torch.autograd.Function):
    """Dropout then a straight-through round: a Function that draws random numbers."""

    @staticmethod
    def forward(ctx, x):
        keep = torch.rand_like(x) > 0.3
        ctx.save_for_backward(keep)
        return torch.where(keep, x.round(), torch.zeros_like(x))

    @staticmethod
    def backward(ctx, g):
        keep, = ctx.saved_tensors
        return g * keep


@torch.library.custom_op("poptorch_lite_test::thirds_grad", mutates_args=())
def thirds_grad(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose registered backward divides the gradient by 3."""
    return x.clone()


@thirds_grad.register_fake
def _(x):
    return torch.empty_like(x)


thirds_grad.register_autograd(lambda ctx, g: g / 3)


class CallsAModule(torch.autograd.Function):
    """A Function handed a module: refused, since its node cannot give it the stage's weights."""

    @staticmethod
    def forward(ctx, x, layer):
        return layer(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _ema_update(model, x):
    with torch.no_grad():  # a teacher's EMA: the buffer follows a weight, outside autograd
        model.ema.mul_(0.9).add_(model.layers[0].weight, alpha=0.1)
    return x + model.ema.mean()


def _clamped(x):
    y = x * 1.0
    with torch.no_grad():
        y.clamp_(-0.2, 0.2)  # written without history: the gradient passes unmasked
    return y


def _hooked(x):
    x = x * 1.0
    x.register_hook(lambda g: g * 3)
    return x


def _gradient_penalty(m, x):
    """WGAN-GP's penalty: a gradient taken in the forward (``create_graph=True``) and
    trained through, its inner backward's saved activations included."""
    y = torch.tanh(x @ m.layers[2].weight.t())
    g, = torch.autograd.grad(y.sum(), x, create_graph=True)
    return x + (g.norm(dim=1, keepdim=True) - 1) ** 2


def _clamped_weight(m, x):
    """WGAN's clipping done in the forward: a weight written in place without history, before
    the layer reads it (the trace must put it back: the call clamps it)."""
    with torch.no_grad():
        m.layers[2].bias.clamp_(-0.05, 0.05)
    return x


# What the third layer's input goes through, per kind: stops, own gradient code, hooks.
GRAD_CODE = {
    "clamped_weight": _clamped_weight,
    "gradient_penalty": _gradient_penalty,
    "detach": lambda m, x: x.detach(),
    "data": lambda m, x: x.data * 2,
    "no_grad": lambda m, x: _no_grad_tanh(x),
    "no_grad_inplace": lambda m, x: _clamped(x),
    "ema_buffer": _ema_update,
    "straight_through": lambda m, x: RoundThrough.apply(x * 4) / 4,
    "reversal": lambda m, x: ScaledBackward.apply(x, -10.0),
    "own_backward": lambda m, x: OwnLinear.apply(x, m.layers[1].weight, m.layers[1].bias),
    "random_function": lambda m, x: NoisyRound.apply(x * 4) / 4,
    "custom_op": lambda m, x: thirds_grad(x),
    "module_hooks": lambda m, x: x,     # GradCodeMLP.install_hooks
    "parameter_hook": lambda m, x: x,
    "library_detach": lambda m, x: x * F.gumbel_softmax(x, tau=0.5, hard=True),
    "hook": lambda m, x: _hooked(x),
    "hook_on_stage_input": lambda m, x: (x.register_hook(lambda g: g * -2), x)[1],
    "checkpoint_reentrant": lambda m, x: torch.utils.checkpoint.checkpoint(
        torch.tanh, x, use_reentrant=True),
    "checkpoint": lambda m, x: torch.utils.checkpoint.checkpoint(torch.tanh, x,
                                                                 use_reentrant=False),
}


def _no_grad_tanh(x):
    with torch.no_grad():
        return torch.tanh(x)


class GradCodeMLP(BlockMLP):
    """:class:`BlockMLP` whose third layer's input goes through ``GRAD_CODE[kind]``, and
    whose first layer's input is halved in place (``x.mul_(0.5)``: the caller sees it)
    when ``edit_input``. Blocks of 2 and 4 put that point at a stage's start; a hook of
    the kind "hook" then sits on the value another stage made; with 1 block it is inside."""

    def __init__(self, kind: str, blocks: int = 2, edit_input: bool = False):
        super().__init__(blocks)
        self.kind, self.edit_input = kind, edit_input
        self.register_buffer("ema", torch.zeros(8, 8))

    def install_hooks(self) -> "GradCodeMLP":
        """The hooks registered outside forward, for the kinds that have them (a deep copy
        keeps a module's hooks but not a parameter's: install after copying)."""
        if self.kind == "module_hooks":
            self.layers[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
            self.head.register_full_backward_pre_hook(lambda m, go: (go[0] * 3,))
        if self.kind == "parameter_hook":
            self.layers[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return self

    def forward(self, x, y):
        if self.edit_input:
            x.mul_(0.5)
        per = 4 // self.blocks
        for k, layer in enumerate(list(self.layers) + [self.head]):
            if k % per == 0:
                poptorch.Block.start(f"b{k // per}", ipu_id=self.ipus[k // per])
            if k == 2:
                x = GRAD_CODE[self.kind](self, x)
            if layer is self.head:
                out = layer(x)
            else:
                x = torch.relu(layer(x))
        return out, F.cross_entropy(out, y)


def trained_grads(wrapper) -> dict:
    """The gradient each parameter's last step used, on the host: a training call leaves the
    host ``.grad`` as the user left it ([Note: host gradients] in ``runtime/weights``)."""
    return {n: None if g is None else g.detach().cpu()
            for n, g in wrapper._weights.last_grads.items()}
