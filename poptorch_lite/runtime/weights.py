"""Weights: where each parameter, its gradient and its optimizer state live, and the host copy.

[Note: weight homes]
Every parameter has a home: the IPU of the first stage that uses it (``place``).
The stage computes with the home tensor, autograd accumulates the gradient
there, and the update action steps the user's own optimizer on it:

- **Shared home.** When the home's device is the host parameter's device (and
  ``useIpuModel`` does not ask for separate memories), the home *is* the
  user's ``Parameter``: no copy exists, and the model is always current.
- **Separate home.** Otherwise the home is a leaf tensor on the home device
  (under ``useIpuModel``, a separate copy in the same CPU memory). For the
  update, :meth:`Weights.stepping` binds each host ``Parameter``'s ``.data``
  and ``.grad`` to its home (a pointer swap, no copy), so the optimizer
  creates and keeps its state on the home's device and its foreach or fused
  kernels run there; afterwards the host ``Parameter`` gets its own data back.
  The user's optimizer object stays the one they passed (``state_dict()``,
  ``param_groups``, ``setOptimizer`` and checkpoints see the same parameters).
  Nothing goes through the host per step: the host copy is *stale* until
  something reads it ([Note: weight sync] in ``host_sync``: :meth:`to_host`).
- **Offloaded** (``TensorLocations.setOptimizerLocation(
  TensorLocationSettings().useOnChipStorage(False))``): the host ``Parameter``
  is the master; the optimizer state and the update stay in host memory;
  gradients are gathered onto it before the step and the stage copies are
  refreshed after it.

A parameter that stages on other IPUs also use (tied weights) has a copy on
each of them (a *visitor*); its gradient is added into the home's at the
owner's reduction and the copy is refreshed after each step. On the CPU, IPUs
that share a memory share the tensor (autograd adds into its ``.grad`` under a
lock); on a GPU every IPU has a stream of its own, and two streams adding into
one ``.grad`` would race, so there each IPU that uses a parameter has its own
tensor even where two of them share a GPU. Every copy is
made when a program is placed, on the caller's thread, so worker threads only
read these tables. Buffers follow the same rule (the user's buffer where the
memory is shared, else a copy per IPU, and per replica with
``broadcastBuffers(False)`` or running statistics: [Note: running statistics on
replicas] in ``compiler/running_stats``); replica 0's copies are what :meth:`to_host`
brings back.

[Note: host gradients]
A training call leaves the host parameters' ``.grad`` as the user left them, as
PopTorch does (the gradients live on the device, and only the weights come back): a
host-side ``loss.backward()`` and ``optimizer.step()`` after a call add nothing of the
call's. Inside the call a shared home accumulates into the ``Parameter``'s own
``.grad`` (the first run drops what the user had there, so it never joins the sum);
afterwards the user's is put back. The gradient each parameter's last step used stays
on its home, read with ``anchorTensor(name, "Gradient___<name>")`` ([Note: anchored
tensors] in ``anchors``) or :attr:`Weights.last_grads`.

Host edits. Each host tensor's version is remembered at every sync. A host
tensor whose version moved was edited (an ``optimizer.step()`` on the host, a
``load_state_dict``, an in-place write): :meth:`to_device` pushes it, and
:meth:`to_host` never overwrites it. So training is never clobbered by a stale
host value and a visible edit always reaches the devices.

An edit through ``.data`` moves no version: once the host copy was *exposed* (read
or synced since the last push), the next call pushes all of it ([Note: weight sync]
in ``host_sync``, with what no call can see). Edits reach replica 0's buffer copies
only: the host copy is replica 0's, and replicas with buffers of their own keep theirs
(as where memories are shared); ``copyWeightsToDevice()`` gives every replica the host's.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Callable, Iterable, Optional

import torch

from .streams import arrive

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


class Weights:
    """The tensors each stage computes with, and the host copy ([Note: weight homes]).

    Args:
        model: the user's model (its parameters and buffers are the host copy).
        replicas: R.
        separate_buffers: replicas r > 0 keep their own buffers.
        separate_memories: every IPU has its own memory even where devices
            coincide (``Options.useIpuModel(True)``).
        offload: the optimizer state and update live in host memory.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> w = Weights(net, 1, False, separate_memories=True)
        >>> w.place({0: torch.device("cpu")}, [(0, ["weight", "bias"])])
        >>> w.param("weight", 0) is net.weight, torch.equal(w.param("weight", 0), net.weight)
        (False, True)
    """

    def __init__(self, model: torch.nn.Module, replicas: int, separate_buffers: bool,
                 separate_memories: bool = False, offload: bool = False):
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self._hosts = (*self.params.values(), *self.buffers.values())  # the host copy
        self._host_params = tuple(self.params.values())
        self.replicas = replicas
        self.separate_buffers = separate_buffers and replicas > 1
        self.separate_memories = separate_memories
        self.offload = offload
        self.home_of: dict = {}       # parameter name -> IPU of its home
        self.devices: dict = {}       # IPU -> torch.device
        self._use: dict = {}          # (name, ipu) -> the tensor a stage on ipu computes with
        self._copies: dict = {}       # (name, ipu) -> the copies among them (not host params)
        self._host_user: dict = {}    # name -> the one IPU on a GPU that uses the host parameter
        self._buffer_use: dict = {}   # (name, replica, ipu) -> buffer or copy
        self._buffer_copies: dict = {}
        self._replica_buffers: list = []
        self._separate_homes: list = []  # (host parameter, home) pairs that are not the same
        self._homes: tuple = ((), ())  # names, and what home(name) gives each: made by place()
        self._others: dict = {}       # name -> its users' tensors besides the stepped one
        self.written: dict = {}       # name -> the IPU whose stage writes it in forward
        self._versions: dict = {}
        self.host_stale = False       # the devices hold values the host copy lacks
        self.exposed = False          # the host copy was read or synced since the last push
        self.rebound = False          # a module's table was written since the last check
        self.last_grads: dict = {}    # name -> the gradient the last step used, on its home
        self.placements = 0           # calls of place(): which tensors the stages use may change
        self._new_replica_buffers()
        self.remember_versions()

    # -- placing ------------------------------------------------------------------------

    def place(self, devices: dict, users: Iterable[tuple]) -> None:
        """Give every parameter a home and every user IPU its tensor; make the copies now.

        Args:
            devices: IPU -> torch.device.
            users: ``(ipu, parameter names)`` per stage, in stage order (the first
                user is the home; later programs keep homes already given).
        """
        self.devices.update(devices)
        self.placements += 1
        with torch.no_grad():
            for ipu, names in users:
                for name in names:
                    self.home_of.setdefault(name, ipu)
                    if (name, ipu) not in self._use:
                        self._use[name, ipu] = self._tensor_for(name, ipu)
        self._separate_homes = [(p, self._use[n, self.home_of[n]]) for n, p in self.params.items()
                                if n in self.home_of and self._use[n, self.home_of[n]] is not p]
        self._homes = (tuple(self.home_of), tuple(map(self.home, self.home_of)))
        self._others = {}  # visitors, and the stage copies of offloaded weights
        for (name, ipu), t in self._use.items():
            if t is not self.home(name):
                self._others.setdefault(name, []).append(t)

    def _shares(self, host: torch.Tensor, ipu: int) -> bool:
        return not self.separate_memories and host.device == self.devices[ipu]

    def _tensor_for(self, name: str, ipu: int) -> torch.Tensor:
        p = self.params[name]
        if self._shares(p, ipu) and (p.device.type == "cpu"
                                     or self._host_user.setdefault(name, ipu) == ipu):
            return p
        c = p.detach().to(self.devices[ipu], copy=True).requires_grad_(p.requires_grad)
        self._copies[name, ipu] = c
        return c

    def follow_requires_grad(self) -> None:
        """Copies take their parameter's new flag ([Note: trainable parameters] in ``compiled``)."""
        for (name, _), c in self._copies.items():
            c.requires_grad_(self.params[name].requires_grad)

    def param(self, name: str, ipu: int) -> torch.Tensor:
        """The tensor that the stage on ``ipu`` computes with for parameter ``name``."""
        return self._use[name, ipu]

    def tensor_names(self) -> dict:
        """id(a tensor a stage computes with for a parameter) -> the parameter's name."""
        return {id(t): name for (name, _), t in self._use.items()}

    def home(self, name: str) -> torch.Tensor:
        """The tensor the optimizer steps for ``name`` (the host parameter when offloaded)."""
        return self.params[name] if self.offload else self._use[name, self.home_of[name]]

    def buffer(self, name: str, replica: int, ipu: int) -> torch.Tensor:
        """The buffer ``name`` of ``replica`` as the stage on ``ipu`` sees it."""
        if not self.separate_buffers:
            replica = 0  # one set of buffers, updated by the replicas in turn
        key = (name, replica, ipu)
        b = self._buffer_use.get(key)
        if b is None:
            b = self._replica_buffers[replica - 1][name] if replica else self.buffers[name]
            if not self._shares(b, ipu):
                with torch.no_grad():
                    b = b.detach().to(self.devices[ipu], copy=True)
                self._buffer_copies[key] = b
            self._buffer_use[key] = b
        return b

    def place_buffers(self, users: Iterable[tuple]) -> None:
        """Make the buffer copies of ``(ipu, buffer names)`` for every replica now."""
        for ipu, names in users:
            for name in names:
                for r in range(self.replicas):
                    self.buffer(name, r, ipu)

    # -- gradients and the step -----------------------------------------------------------

    def zero_grads(self, host: bool = True) -> None:
        """Drop the gradients of the copies, and of the host parameters with ``host``."""
        for p in self.params.values() if host else ():
            p.grad = None
        for c in self._copies.values():
            c.grad = None

    def param_tensors(self) -> list:
        """Every tensor a stage computes with for a parameter (homes, visitors' copies)."""
        return list({id(t): t for t in self._use.values()}.values())

    def stepped_on_device(self) -> None:
        """An optimizer step ran on the homes outside :meth:`stepping` (a replayed CUDA
        graph's): the host copy is stale where homes are separate."""
        if self._separate_homes:
            self.host_stale = True

    def share_hooks(self) -> None:
        """Give each copy of a parameter the host parameter's gradient hooks, as a shared home
        has them already: those of ``register_hook``, which see each gradient before it is
        added to ``.grad``, and those of ``register_post_accumulate_grad_hook``, which edit
        ``.grad`` once it has been added to (one dict of each for both, so a hook registered
        or removed between calls reaches the copies too). A post-accumulate hook is called
        with the copy, whose ``.grad`` is the one the step reads."""
        params = self.params
        for (name, _), c in self._copies.items():
            p = params[name]
            hooks = p._backward_hooks
            if c._backward_hooks is not hooks:
                c._backward_hooks = hooks
            accumulated = p._post_accumulate_grad_hooks
            if c._post_accumulate_grad_hooks is not accumulated:
                c._post_accumulate_grad_hooks = accumulated

    def hold_host_grads(self) -> tuple:
        """A training call begins: the host parameters' ``.grad`` as the user left them
        ([Note: host gradients]), for :meth:`give_back_host_grads` when it ends; the last
        call's gradients are freed before this one makes new ones."""
        params = self._host_params
        held = tuple(map(_GRAD, params))
        self.last_grads = {}
        return held

    def give_back_host_grads(self, held: tuple) -> None:
        """A training call ended: the last step's gradients in :attr:`last_grads`, the host
        parameters' ``.grad`` as :meth:`hold_host_grads` found them."""
        names, homes = self._homes
        self.last_grads = dict(zip(names, map(_GRAD, homes)))
        for p, grad in zip(self._host_params, held):
            p.grad = grad

    def shared(self) -> bool:
        """Whether any parameter has users besides its home (gradients to gather)."""
        return bool(self._others)

    def gather_grad(self, name: str) -> Optional[torch.Tensor]:
        """Add the gradients of ``name``'s other users into the one the optimizer steps."""
        target = self.home(name)
        for c in self._others.get(name, ()):
            if c.grad is not None:  # [Note: values crossing streams] in ``streams``
                g = arrive(c.grad, target.device)
                target.grad = g if target.grad is None else target.grad + g
                c.grad = None
        return target.grad

    def buffers_move(self) -> None:
        """A run is writing buffers, and parameters its forward writes in place (an
        embedding's ``max_norm``): copies in other memories are newer than the host's (a
        training call's step makes them so anyway; an inference call's does not)."""
        if self._buffer_copies or (self.written and self._separate_homes):
            self.host_stale = True

    def stepping(self):
        """While inside, each host ``Parameter`` stands for its home ([Note: weight homes]).

        Its ``.data`` and ``.grad`` are the home's, so whatever the update does
        to the host parameters (all-reduce, clipping, the optimizer's step) happens
        to the homes, on their devices. Offloaded weights, and parameters that are
        their own homes, need no binding (a context without a generator: once per step).
        """
        if self.offload:
            self._written_to_host()
            return _Exit(self._record_step)
        if not self._separate_homes:
            return _Exit(self._record_step)
        return self._bound_homes()

    def _written_to_host(self) -> None:
        """Offloaded: the values the forward wrote into a stage's copy (a ``clamp_`` under
        ``no_grad``) become the host parameter's, which the optimizer steps, as plain
        PyTorch steps the written weight (without offloading the writer's copy is its home)."""
        with torch.no_grad():
            for name, ipu in self.written.items():
                p, c = self.params[name], self._use.get((name, ipu))
                if c is not None and c is not p:
                    p.copy_(arrive(c, p.device))

    def _record_step(self, *exc) -> None:
        """The step wrote the host parameters: not a host edit."""
        params = self._host_params
        self._versions.update(zip(map(id, params), map(_VERSION, params)))  # no Python loop

    @contextlib.contextmanager
    def _bound_homes(self):
        saved = []
        try:
            for p, h in self._separate_homes:
                saved.append((p, p.data))
                p.data = h
                p.grad = h.grad
            yield
        finally:
            for p, data in saved:
                p.grad = None
                p.data = data
                self._versions[id(p)] = p._version  # the step is not a host edit
            if saved:
                self.host_stale = True

    def after_step(self) -> None:
        """The optimizer changed the weights: refresh every other user's tensor from it.

        That may be the host parameter itself (a visitor stage on the host device of a
        weight whose home is elsewhere); refreshing it is not a host edit.
        """
        if not self._others:
            return
        with torch.no_grad():
            for name, others in self._others.items():
                home = self.home(name)
                for c in others:
                    c.copy_(home)
                    if c is self.params[name]:
                        self._versions[id(c)] = c._version

    def optimizer_state_to_homes(self, optimizer: torch.optim.Optimizer) -> None:
        """Move optimizer state made elsewhere (a checkpoint, host training) to the homes."""
        for p, h in self._separate_homes:
            state = optimizer.state.get(p)
            if not state:
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != h.device:
                    state[k] = v.to(h.device)

    # -- the host copy ------------------------------------------------------------------

    def remember_versions(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Take the host tensors' versions (or only ``tensors``') as their synced ones."""
        if tensors is None:
            self._versions = {id(t): t._version for t in self._hosts}
        else:
            self._versions.update({id(t): t._version for t in tensors})

    def edited(self) -> list:
        """Host tensors written since the last sync."""
        versions = self._versions
        return [t for t in self._hosts if versions.get(id(t)) != t._version]

    def to_host(self) -> None:
        """Bring trained values back to the user's model (``copyWeightsToHost``).

        Parameters from separate homes and replica 0's buffer copies; a host tensor
        edited since the last sync keeps its edit. The host copy is then exposed
        ([Note: weight sync] in ``host_sync``).
        """
        self.exposed = True
        if not self.host_stale:
            return
        edited = {id(t) for t in self.edited()}
        with torch.no_grad():
            if not self.offload:
                for p, h in self._separate_homes:
                    if id(p) not in edited:
                        p.copy_(h)
            for (name, replica, ipu), c in self._buffer_copies.items():
                b = self.buffers[name]
                if replica == 0 and id(b) not in edited:
                    b.copy_(c)
        self.host_stale = False
        self._versions.update({id(t): t._version for t in self._hosts
                               if id(t) not in edited})

    def edits(self) -> bool:
        """Whether the host copy may hold edits the devices lack: a version moved, or it
        was exposed where copies exist ([Note: weight sync] in ``host_sync``)."""
        if self.exposed and (self._copies or self._buffer_copies):
            return True
        hosts = self._hosts  # compared in C: a call's setup runs cold ([Note: one setup per call])
        return list(map(self._versions.get, map(id, hosts))) != list(map(_VERSION, hosts))

    def to_device(self, everything: bool = True) -> None:
        """Push host values to the devices (``copyWeightsToDevice``; host edits).

        Args:
            everything: push every tensor, and give every replica the host's buffers;
                False pushes the host's edits: every tensor where the host copy was
                exposed, else those whose version moved; buffers to replica 0's copies.
        """
        pushed = None if everything or self.exposed else {id(t) for t in self.edited()}
        if everything:
            self._new_replica_buffers()
        with torch.no_grad():
            for (name, ipu), c in self._copies.items():
                p = self.params[name]
                if pushed is None or id(p) in pushed:
                    c.copy_(p)
            for (name, replica, ipu), c in self._buffer_copies.items():
                if everything:
                    c.copy_(self._replica_buffers[replica - 1][name] if replica
                            else self.buffers[name])
                elif replica == 0 and (pushed is None or id(self.buffers[name]) in pushed):
                    c.copy_(self.buffers[name])
        self.host_stale = False if everything else self.host_stale
        self.exposed = False
        self.remember_versions()

    def _new_replica_buffers(self) -> None:
        fresh = [{n: b.detach().clone() for n, b in self.buffers.items()}
                 for _ in range(self.replicas - 1)] if self.separate_buffers else []
        if self._replica_buffers:  # in place: copies and the stage tables keep pointing at them
            with torch.no_grad():
                for old, new in zip(self._replica_buffers, fresh):
                    for n, b in old.items():
                        b.copy_(new[n])
        else:
            self._replica_buffers = fresh

    # -- what a step does not commit --------------------------------------------------------

    def tensors(self, params: bool = True) -> tuple:
        """Every tensor the weights keep: the buffers, their copies and the replicas' own,
        and with ``params`` the parameters and their copies (what an undo captures)."""
        return (*((*self.params.values(), *self._copies.values()) if params else ()),
                *self.buffers.values(), *self._buffer_copies.values(),
                *itertools.chain.from_iterable(map(dict.values, self._replica_buffers)))

    def storages(self) -> set:
        """The storages of every parameter and buffer and their copies (not activations)."""
        return {t.untyped_storage().data_ptr() for t in self.tensors()}


class _Exit:
    """A context manager that calls ``exit(*exc_info)`` on the way out."""

    __slots__ = ("exit",)

    def __init__(self, exit: Callable):
        self.exit = exit

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.exit(*exc)
