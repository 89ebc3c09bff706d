"""Pipeline stages in other processes: what crosses them, sent and received on torch.distributed.

The design is [Note: stages in other processes] in ``distributed/__init__.py``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..compiler import rng
from ..compiler.value_info import ValueInfo
from ..errors import ChannelError
from .schedule import Action, Kind


def _lost(what: str, peer: int, exc: BaseException, timeout: float) -> ChannelError:
    """The error of a message that went astray.

    Example:
        >>> str(_lost("receiving x of micro-batch 0 from", 1, TimeoutError("late"), 30))[:70]
        'receiving x of micro-batch 0 from process 1 failed: TimeoutError: late'
    """
    return ChannelError(
        f"{what} process {peer} failed: {type(exc).__name__}: {_first_line(exc)}. Process "
        f"{peer} failed or exited (see its own error), or did not answer within the "
        f"collective timeout of {timeout:g} s (POPTORCH_LITE_DIST_TIMEOUT)")


class Messages:
    """One run's messages to and from the stages in other processes, and what this process
    knows of the run's outcome ([Note: stages in other processes] in ``distributed``)."""

    __slots__ = ("inbox", "outbox", "shapes", "sends", "posted", "failed", "remote_failure")

    def __init__(self):
        self.inbox: dict = {}     # (stage, i) -> {value name: tensor} from another process
        self.outbox: dict = {}    # (stage, i) -> {value name: gradient} for another process
        self.shapes: dict = {}    # (stage, i, name) -> the shape of a received dynamic value
        self.sends: list = []     # (work, tensor, peer, what) of the messages sent, until received
        self.posted: dict = {}    # action -> the receives posted for it ahead of time
        self.failed = None        # (action, exception): the first action that raised here
        self.remote_failure = None  # (rank, description): a process that failed this run


class Channels:
    """The messages between this process's stages and those of other processes.

    Args:
        partition: the program's stages (the whole model).
        processes: ``distributed.Processes`` (layout, groups, timeout).
        devices: IPU -> torch.device of this process's IPUs.
        training: whether gradients travel back.
        random: whether the model has random ops (their streams travel).

    Every process builds the channels of a program at the same point (its first
    call with that input signature): the device kinds are exchanged and the process
    groups made, collectively.
    """

    def __init__(self, partition, processes, devices: dict, training: bool, random: bool):
        layout = processes.layout
        self.processes, self.layout = processes, layout
        self.partition = partition
        self.training = training
        stages = partition.stages
        self.position = [layout.position_of(st.ipu) for st in stages]
        kinds = processes.gather({ipu: dev.type for ipu, dev in devices.items()})
        producer = {name: s for s, st in enumerate(stages) for name in st.outputs}
        edges: dict = {}  # (s, t) -> the value names stage t reads from stage s
        for t, st in enumerate(stages):
            for name in st.inputs:
                s = producer.get(name)
                if s is not None and self.position[s] != self.position[t]:
                    edges.setdefault((s, t), []).append(name)
            if random and t > 0 and self.position[t - 1] != self.position[t]:
                edges.setdefault((t - 1, t), [])  # the random stream travels on
        self.random = random
        self.edges = {}
        for (s, t), names in sorted(edges.items()):
            cuda = kinds.get(stages[s].ipu) == kinds.get(stages[t].ipu) == "cuda" and \
                "nccl" in str(dist.get_backend()).lower()
            for k in range(layout.pipelines):  # every process makes every group
                ranks = (layout.rank_of(k, self.position[s]), layout.rank_of(k, self.position[t]))
                processes.group(ranks, f"values {s}>{t}")
                if training:
                    processes.group(ranks, f"gradients {t}>{s}")
            self.edges[s, t] = _Edge(s, t, names, [partition.values[n] for n in names],
                                     torch.device("cuda") if cuda else torch.device("cpu"),
                                     layout.rank_of(layout.pipeline, self.position[s]),
                                     layout.rank_of(layout.pipeline, self.position[t]))
        # The returned values each position computes, sent at the end of a run (``settle``);
        # weights and values of data-dependent shape are broadcast after it instead.
        producer_position = {name: self.position[s] for name, s in producer.items()}
        self.settled = [[] for _ in range(layout.n)]
        for name in dict.fromkeys(o for o in partition.outputs if isinstance(o, str)):
            info = partition.values.get(name)
            if name in producer_position and info is not None and not info.dynamic:
                self.settled[producer_position[name]].append((name, info))
        self.settled_names = {name for names in self.settled for name, _ in names}
        # Receives are posted ahead of their actions unless a value's shape depends on the
        # data (its header must arrive first, so every receive waits for its turn).
        self.ahead = not any(info.dynamic for e in self.edges.values() for info in e.infos)
        mine = layout.position
        self.into = [[e for e in self.edges.values() if e.t == t and self.position[t] == mine]
                     for t in range(len(stages))]
        self.out_of = [[e for e in self.edges.values() if e.s == s and self.position[s] == mine]
                       for s in range(len(stages))]
        # The inputs of each stage that another process computes (``stage_work`` takes
        # them from the run's inbox and sends their gradients back).
        self.remote_inputs = [frozenset(n for e in self.into[t] for n in e.names)
                              for t in range(len(stages))]
        # Weights used by stages in several processes (tied weights): each of those
        # processes steps its own copy with the gradient summed over all of them.
        users: dict = {}
        for s, st in enumerate(stages):
            for name in st.param_names:
                users.setdefault(name, set()).add(self.position[s])
        shared: dict = {}
        for name, positions in users.items():
            if len(positions) > 1:
                shared.setdefault(tuple(sorted(positions)), []).append(name)
        # Where each returned value is computed, and the weights whose norm this process
        # counts when clipping: those whose first user runs here.
        first = {}
        for s, st in enumerate(stages):
            for name in st.inputs:
                first.setdefault(name, s)
        self.output_owner = {}
        for name in (o for o in partition.outputs if isinstance(o, str)):
            s = producer.get(name, first.get(name))  # computed, or a weight returned
            if s is not None and not name.startswith("input:"):
                self.output_owner[name] = self.position[s]
        # The call's arguments that a stage writes in place ([Note: edited arguments] in
        # ``stage_work``), with the position whose stage writes each: the pipeline's other
        # processes receive the written rows after each run, as plain PyTorch writes
        # the argument in every process.
        self.edited_inputs = sorted({(int(n.split(":", 1)[1]), self.position[s])
                                     for s, st in enumerate(stages) for n in st.written_inputs
                                     if n.startswith("input:")})
        self.counted = frozenset(n.split(":", 1)[1] for n, s in first.items()
                                 if n.startswith("param:") and self.position[s] == mine)
        # Each parameter and buffer: the position of the first process whose stage uses it.
        self.weight_owner = {n.split(":", 1)[1]: self.position[s] for n, s in first.items()
                             if n.startswith(("param:", "buffer:"))}
        self.tied = []  # (ranks, names) of the weights this process shares
        for positions, names in sorted(shared.items()):
            for k in range(layout.pipelines):
                ranks = tuple(layout.rank_of(k, j) for j in positions)
                processes.group(ranks, "tied")
                if k == layout.pipeline and mine in positions:
                    self.tied.append((ranks, names))

    # -- around an action ------------------------------------------------------------------

    def receives(self, a: Action) -> bool:
        """Whether ``a`` waits for messages from other processes."""
        if a.kind is Kind.FORWARD:
            return bool(self.into[a.stage])
        return a.kind.input_grads and any(
            info.differentiable for e in self.out_of[a.stage] for info in e.infos)

    def post(self, a: Optional[Action], run) -> None:
        """Post the receives of ``a`` ahead of time, so that a message arrives while this
        stream still computes (a receive posted only when its action starts waits out the
        sender's whole hand-over). A program with values of data-dependent shape receives
        each in turn, in :meth:`before`."""
        if a is None or a in run.messages.posted:
            return
        i = a.microbatch
        posted = run.messages.posted[a] = []
        if a.kind is Kind.FORWARD:
            for e in self.into[a.stage]:
                for name, info in zip(e.names, e.infos):
                    posted.append((e.values, e.src, info, e.device, name,
                                   f"{name} of micro-batch {i} (stage {e.s})", e))
                if self.random and e.s == e.t - 1:
                    posted.append((e.values, e.src, _RNG, e.device, None,
                                   f"the random stream of micro-batch {i} (stage {e.s})", e))
        elif a.kind.input_grads:
            for e in self.out_of[a.stage]:
                for name, info in zip(e.names, e.infos):
                    if info.differentiable:
                        posted.append((e.gradients, e.dst, info, e.device, name,
                                       f"the gradient of {name} of micro-batch {i} (stage {e.t})",
                                       e))
        if not self.ahead:  # a header first: receive every value in turn, in before()
            return
        run.messages.posted[a] = [(*item, self._irecv(item[0], item[1], item[2], item[3], item[5]))
                         for item in posted]

    def before(self, a: Action, run) -> None:
        """Receive what ``a`` needs from other processes (its stage's inputs, or the
        gradients of its outputs)."""
        if a.kind is not Kind.FORWARD and not a.kind.input_grads:
            return
        self.post(a, run)
        i = a.microbatch
        for key, src, info, device, name, what, e, *pending in run.messages.posted.pop(a):
            t = self._wait(*pending[0], what) if pending else self._recv(key, src, info, device,
                                                                      what)
            if a.kind is Kind.FORWARD:
                if name is None:  # the micro-batch's random stream
                    run.rng[i] = rng.unpack(t)
                    continue
                if self.training and info.differentiable:
                    t.requires_grad_(True)
                run.messages.inbox.setdefault((e.t, i), {})[name] = t
                if info.dynamic:
                    run.messages.shapes[e.t, i, name] = tuple(t.shape)
            else:
                value = run.values[i].get(name)
                if run.messages.failed is None and value is not None and value.requires_grad:
                    grads = run.grads[i]
                    t = t.to(value.device)
                    grads[name] = t if name not in grads else grads[name] + t

    def after(self, a: Action, run) -> None:
        """Send what ``a`` made for other processes (zeros if this process failed)."""
        i = a.microbatch
        if a.kind is Kind.FORWARD:
            for e in self.out_of[a.stage]:
                for name, info in zip(e.names, e.infos):
                    self._send(e.values, e.dst, run.values[i].get(name), info, e.device, run,
                               f"{name} of micro-batch {i} (stage {e.t})")
                if self.random and e.t == e.s + 1:
                    self._send(e.values, e.dst, rng.pack(run.rng[i]), _RNG, e.device, run,
                               f"the random stream of micro-batch {i} (stage {e.t})")
        elif a.kind.input_grads:
            made = run.messages.outbox.pop((a.stage, i), {})
            for e in self.into[a.stage]:
                for name, info in zip(e.names, e.infos):
                    if info.differentiable:
                        shape = run.messages.shapes.get((e.t, i, name), info.shape)
                        self._send(e.gradients, e.src, made.get(name), info, e.device, run,
                                   f"the gradient of {name} of micro-batch {i} (stage {e.s})",
                                   shape)

    def clip_grad_norm_(self, params: dict, max_norm: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients of ``params`` (name ->
        parameter: those the optimizer holds, in its groups' order), which the pipeline's
        processes hold between them: each process takes the norm of each gradient it counts
        (a weight used in several processes counts in the first) as torch does
        (``_norms``), :meth:`clip_coefficient` makes the coefficient, and each process
        scales its own gradients."""
        counted = [n for n in params if n in self.counted and params[n].grad is not None]
        norms = dict(zip(counted, _norms([params[n].grad for n in counted])))
        coef = self.clip_coefficient(params, max_norm, norms)
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))

    def clip_coefficient(self, params: dict, max_norm: float, norms: dict) -> torch.Tensor:
        """What ``clip_grad_norm_`` scales the gradients of ``params`` by, from ``norms``
        (name -> the norm of its whole gradient, of the weights this process counts).

        Each process puts its norms at their weights' places in a vector; one sum over
        the processes fills it (each place has one non-zero term, so the sum is exact),
        and every process then takes the norm of the norms as ``clip_grad_norm_`` does
        over one process's list (on the CPU, where torch takes it on the first
        gradient's device). With every gradient on the CPU and of one dtype that is one
        process's arithmetic bit for bit.
        """
        names = list(params)
        places = torch.zeros(2, len(names))  # row 0: the norms; row 1: which are there
        for k, n in enumerate(names):
            if n in self.counted and n in norms:
                places[0, k], places[1, k] = norms[n].cpu(), 1.0
        places = self.processes.pipeline_sum(places)
        return clip_coefficient(places[0][places[1] > 0], max_norm)

    def reduce_tied(self, params: dict) -> None:
        """Sum the gradients of weights used in several processes over those processes."""
        for ranks, names in self.tied:
            tensors = [params[n] for n in names if params[n].requires_grad]
            for p in tensors:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.processes.all_reduce([p.grad for p in tensors],
                                      self.processes.group(ranks, "tied"),
                                      "summing the gradients of weights used in several processes")

    def finish(self, run) -> None:
        """Wait until every message this run sent has been received."""
        sends, run.messages.sends = run.messages.sends, []
        for work, _, dst, what in sends:
            try:
                work.wait()
            except Exception as exc:
                raise _lost(f"sending {what} to", dst, exc, self.processes.timeout) \
                    from exc

    # -- the messages ----------------------------------------------------------------------

    def _send(self, key: tuple, dst: int, t: Optional[torch.Tensor], info, device: torch.device,
              run, what: str, shape: Optional[tuple] = None) -> None:
        # a process that failed this run sends zeros, so that its peers are not left waiting
        if t is None or (run.messages.failed is not None and info is not _RNG):
            t = torch.zeros(shape or info.shape, dtype=info.dtype, device=device)
        else:
            t = t.detach().to(device).contiguous()
        if info.dynamic:
            self._post(key, dst, torch.tensor(t.shape, dtype=torch.int64, device=device), run,
                       what)
        self._post(key, dst, t, run, what)

    def _post(self, key: tuple, dst: int, t: torch.Tensor, run, what: str) -> None:
        try:
            run.messages.sends.append((dist.isend(t, dst, group=self.processes.group(*key)), t,
                                        dst, what))
        except Exception as exc:
            raise _lost(f"sending {what} to", dst, exc, self.processes.timeout) from exc

    def _recv(self, key: tuple, src: int, info, device: torch.device, what: str) -> torch.Tensor:
        """Receive one value now (after its shape, for a value of data-dependent shape)."""
        shape = info.shape
        if info.dynamic:
            header = torch.empty(len(info.shape), dtype=torch.int64, device=device)
            self._wait(src, self._post_recv(key, src, header, what), header, what)
            shape = tuple(header.tolist())
        t = torch.empty(shape, dtype=info.dtype, device=device)
        return self._wait(src, self._post_recv(key, src, t, what), t, what)

    def _irecv(self, key: tuple, src: int, info, device: torch.device, what: str) -> tuple:
        """``(src, work, tensor)`` of a receive of a value of fixed shape, posted now."""
        t = torch.empty(info.shape, dtype=info.dtype, device=device)
        return src, self._post_recv(key, src, t, what), t

    def _post_recv(self, key: tuple, src: int, t: torch.Tensor, what: str):
        try:
            return dist.irecv(t, src, group=self.processes.group(*key))
        except Exception as exc:
            raise _lost(f"receiving {what} from", src, exc, self.processes.timeout) from exc

    def _wait(self, src: int, work, t: torch.Tensor, what: str) -> torch.Tensor:
        try:
            work.wait()  # at most the group's timeout
        except Exception as exc:
            raise _lost(f"receiving {what} from", src, exc, self.processes.timeout) from exc
        return t

    # -- the end of a run ------------------------------------------------------------------

    def settle(self, run, failure: Optional[str], result: Callable) -> Optional[tuple]:
        """Close a run in every process of the pipeline: each sends each of the others one
        message with its outcome and the returned values it computed (of the micro-batches
        ``run.kept``), and the processes agree whether any of them failed.

        Returns:
            ``(rank, description)`` of the first process that failed, or None (then
            ``run.results`` holds the returned values computed elsewhere too).
        """
        me, kept = self.layout.position, run.kept
        sizes = {j: 8 + sum(_padded(info) for _, info in self.settled[j]) * len(kept)
                 for j in range(self.layout.n)}
        out = torch.zeros(sizes[me], dtype=torch.uint8)
        out[0] = failure is not None
        at = 8
        for name, info in self.settled[me]:
            for i in kept:
                value = result(run, i, name) if failure is None else None
                if value is not None:
                    piece = value.detach().reshape(-1).contiguous().view(torch.uint8)
                    out[at:at + piece.numel()] = piece
                at += _padded(info)
        inbound = {j: torch.empty(sizes[j], dtype=torch.uint8)
                   for j in range(self.layout.n) if j != me}
        # One batch on the pipeline's group (one thread, the streams are done): a send to
        # and a receive from each peer, one message each way, so none can be mistaken.
        group = self.processes.pipeline_group()
        try:
            works = dist.batch_isend_irecv([
                dist.P2POp(op, buf, self._rank(j), group) for j, receive in inbound.items()
                for op, buf in ((dist.isend, out), (dist.irecv, receive))])
            for work in works:
                work.wait()
        except Exception as exc:
            raise _lost("exchanging the run's outcome and outputs with", self._rank(
                min(inbound)), exc, self.processes.timeout) from exc
        seen = any(bool(buf[0]) for buf in inbound.values())
        outcome = self.processes.agree(failure, seen)
        if outcome is None:
            for j, buf in inbound.items():
                at = 8
                for name, info in self.settled[j]:
                    for i in kept:
                        n = info.numel * info.dtype.itemsize
                        run.results[i][name] = buf[at:at + n].view(info.dtype).reshape(info.shape)
                        at += _padded(info)
        return outcome

    def _rank(self, position: int) -> int:
        return self.layout.rank_of(self.layout.pipeline, position)

    # -- outputs ---------------------------------------------------------------------------

    def share_edited(self, run) -> None:
        """Broadcast the call's arguments that a stage wrote in place from the process that
        runs it to the pipeline's others, every micro-batch's rows in one message through
        host memory (``run.edited``: each process then copies them back into the caller's
        tensor)."""
        me, n = self.layout.position, len(run.inputs)
        for key, position in self.edited_inputs:
            like = run.inputs[0][key]
            if position == me:  # (the stage may have written them in a GPU's memory)
                stacked = torch.stack([run.edited[i, key].detach() for i in range(n)]).cpu()
            else:
                stacked = torch.empty((n, *like.shape), dtype=like.dtype)
            self.processes.pipeline_broadcast(
                stacked.view(torch.uint8) if stacked.dtype == torch.bool else stacked, position)
            if position != me:
                for i in range(n):
                    run.edited[i, key] = stacked[i]

    def share_outputs(self, run, names: list, result: Callable, weights) -> None:
        """Broadcast the returned values that the end-of-run messages do not carry (weights
        the model returns, values of data-dependent shape) from the process that has them to
        the pipeline's others.

        Args:
            run: the run (``run.results`` receives the values computed elsewhere).
            names: the output value names, in the partition's order.
            result: ``(run, i, name)`` -> the value, where it was computed.
            weights: the ``Weights`` (the shapes of returned weights).
        """
        me, keep = self.layout.position, run.kept
        for name in dict.fromkeys(n for n in names if n not in self.settled_names):
            position = self.output_owner.get(name)
            if position is None or not keep:
                continue
            info = self.partition.values.get(name)
            if info is None:  # a parameter or buffer the model returns
                kind, _, key = name.partition(":")
                t = weights.params[key] if kind == "param" else weights.buffers[key]
                info = ValueInfo(tuple(t.shape), t.dtype, False, False)
            if info.dynamic:  # a header and the value, per micro-batch
                for i in keep:
                    mine = result(run, i, name) if position == me else None
                    header = (torch.tensor(mine.shape, dtype=torch.int64) if mine is not None
                              else torch.empty(len(info.shape), dtype=torch.int64))
                    self.processes.pipeline_broadcast(header, position)
                    value = mine if mine is not None else torch.empty(
                        tuple(header.tolist()), dtype=info.dtype)
                    self.processes.pipeline_broadcast(value.contiguous(), position)
                    run.results[i][name] = value
                continue
            if position == me:
                stacked = torch.stack([result(run, i, name) for i in keep])
            else:
                stacked = torch.empty((len(keep), *info.shape), dtype=info.dtype)
            self.processes.pipeline_broadcast(stacked, position)
            for slot, i in enumerate(keep):
                run.results[i][name] = stacked[slot]


def _padded(info) -> int:
    """Bytes of one value in an end-of-run message, padded so that every value is aligned."""
    return -(-info.numel * info.dtype.itemsize // 8) * 8


class _Edge:
    """The messages between stage s and stage t (in another process) in this pipeline.

    Its groups are asked for at each use, not held ([Note: process groups at exit] in
    ``distributed/processes.py``)."""

    def __init__(self, s, t, names, infos, device, src, dst):
        self.s, self.t, self.names, self.infos, self.device = s, t, names, infos, device
        self.src, self.dst = src, dst          # the ranks of stage s's and stage t's processes
        self.values = ((src, dst), f"values {s}>{t}")       # Processes.group's arguments
        self.gradients = ((src, dst), f"gradients {t}>{s}")


class _PackedStream:
    """The ``ValueInfo`` of a packed random stream (``rng.pack``)."""

    shape = (rng.PACKED_BYTES,)
    dtype = torch.uint8
    differentiable = False
    dynamic = False


_RNG = _PackedStream()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def clip_coefficient(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s factor for gradients of these norms: the norm of the norms,
    ``min(1, max_norm / (total + 1e-6))``.

    Example:
        >>> float(clip_coefficient(torch.tensor([3.0, 4.0]), 1.0))  # total 5
        0.19999995827674866
    """
    total = torch.linalg.vector_norm(norms) if len(norms) else torch.tensor(0.0)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _norms(grads: list) -> list:
    """Each gradient's 2-norm as ``torch.nn.utils.clip_grad_norm_`` takes it: one
    ``_foreach_norm`` per device where torch's foreach kernels run there, else one
    ``vector_norm`` each (the CPU)."""
    by_device: dict = {}
    for k, g in enumerate(grads):
        by_device.setdefault((g.device, g.dtype), []).append(k)
    out: list = [None] * len(grads)
    for (device, _), ks in by_device.items():
        group = [grads[k] for k in ks]
        if device.type in _FOREACH_DEVICES:
            norms = torch._foreach_norm(group, 2.0)
        else:
            norms = [torch.linalg.vector_norm(g, 2.0) for g in group]
        for k, norm in zip(ks, norms):
            out[k] = norm
    return out


# torch.utils._foreach_utils._get_foreach_kernels_supported_devices(): where
# clip_grad_norm_ takes the norms with _foreach_norm (never the CPU)
_FOREACH_DEVICES = frozenset({"cuda", "xpu"})
