"""What a trace changes, put back: train/eval modes, buffers, parameters, inputs, random generators.

The trace really runs the forward once ([Note: partition] in ``partition``), so everything
the forward changes as it runs is rolled back afterwards; the call's own run then changes it
once, as plain PyTorch's forward does. The user's own ``torch.Generator``s, which the graph
draws from at run time ([Note: a user's generator] in ``rng``), are found as the forward
draws from them and put back too, and so are the parameters the forward writes in place (a
``clamp_`` under ``torch.no_grad()``, ``nn.Embedding(max_norm=...)``'s renormalisation):
each is copied just before the trace's first write to it (:class:`WrittenParameters`).
"""

from __future__ import annotations

import contextlib
import traceback
import types
import weakref

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_slot

from ..errors import TraceError
from .state import aliased_input, written
from .trace_modes import _user_line


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module, modes: dict, inputs: list,
                    generators: "UserGenerators", written: "WrittenParameters"):
    """Run the trace with the train/eval flags of ``modes`` (module -> flag; the others as
    they are); undo every change it makes.

    The trace really runs the forward once, so RNG draws (torch's generators and the
    ``generators`` the forward draws from), buffer updates (BatchNorm statistics, counters)
    and in-place writes to the inputs (``x += 1``) and to tensors the modules keep as plain
    attributes (``self.count.add_(1)``) are rolled back afterwards: tracing must
    change no state ([Note: partition]); the call's own run then writes them once, as plain
    PyTorch's forward does.
    """
    generators.known = {id(g): (g, g.get_state()) for g in _reachable_generators(model)}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # the inputs, and tensors kept as plain attributes (a counter the forward adds to)
    given = [(t, version_of(t), t.detach().clone()) for t in [*inputs, *_tensor_attributes(
        model)]]
    # Which tensors each module registers: a refused forward may delete or reassign one.
    tables = {m: (list(m._buffers.items()), set(m._non_persistent_buffers_set))
              for m in model.modules()}
    current = {m: m.training for m in model.modules()}
    for m in model.modules():
        m.training = modes.get(m, m.training)
    try:
        yield {id(b): saved for b, saved in buffers}
    finally:
        for m, flag in current.items():
            m.training = flag
        for m, (table, non_persistent) in tables.items():
            if [(k, id(v)) for k, v in m._buffers.items()] != [(k, id(v)) for k, v in table]:
                for name, _ in table:
                    m.__dict__.pop(name, None)  # functional_call's restore of a deleted buffer
                m._buffers.clear()
                m._buffers.update(table)
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for t, version, saved in given:
                changed = not torch.equal(t, saved) if version is None else t._version != version
                if changed:
                    _put_back(t, saved)
            for b, saved in buffers:
                _put_back(b, saved)
                if b.grad_fn is not None and not b._is_view():
                    b.detach_()  # a write with gradients left the trace's history on it
            for p, saved in written.saved.values():
                p.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        generators.put_back()


def _tensor_attributes(model: torch.nn.Module) -> list:
    """The tensors the model's modules keep as plain attributes (not parameters or
    buffers), once each."""
    seen: dict = {}
    for m in model.modules():
        for value in vars(m).values():
            if type(value) is torch.Tensor:
                seen.setdefault(id(value), value)
    return list(seen.values())


def version_of(t: torch.Tensor):
    """``t``'s version counter; None for an inference tensor, which keeps none (one made under
    ``torch.inference_mode()``, as Lightning makes its validation and test batches)."""
    return None if t.is_inference() else t._version


def _put_back(t: torch.Tensor, saved: torch.Tensor) -> None:
    """``t.copy_(saved)``; in inference mode for an inference tensor, which is written only there."""
    if t.is_inference():
        with torch.inference_mode():
            t.copy_(saved)
    else:
        t.copy_(saved)




class WrittenParameters:
    """The parameters the forward writes in place while it is traced, each copied just
    before the first op that writes it (its node is made before the op runs), so a trace
    that writes none copies none; :func:`preserved_state` puts them back."""

    def __init__(self):
        self.saved: dict = {}  # id -> (the trace's tensor of a parameter, its value before)

    def watch(self, tracer, params: list) -> None:
        """Copy each of ``params`` (the trace's own tensors of them) before ``tracer`` records
        an op that writes it, or a view of it."""
        nodes = {}
        for t in params:
            proxy = get_proxy_slot(t, tracer, None)
            if proxy is not None:
                nodes[proxy.proxy.node] = t
        create_node, saved = tracer.create_node, self.saved

        def create(kind, target, *args, **kwargs):
            node = create_node(kind, target, *args, **kwargs)  # made before the op runs
            if kind == "call_function":
                for base in written(node):
                    while aliased_input(base) is not None:  # through its views
                        base = aliased_input(base)
                    t = nodes.get(base)
                    if t is not None and id(t) not in saved:
                        saved[id(t)] = (t, t.detach().clone())
            return node
        tracer.create_node = create


def _reachable_generators(model: torch.nn.Module) -> list:
    """The ``torch.Generator``s the model's modules hold (as attributes, or in a list, tuple
    or dict attribute) or their forwards' modules hold as globals."""
    found, spaces = [], {}
    for m in model.modules():
        for v in vars(m).values():
            found += [x for x in (v.values() if isinstance(v, dict) else v
                                  if isinstance(v, (list, tuple)) else (v,))
                      if isinstance(x, torch.Generator)]
        forward = getattr(type(m), "forward", None)
        if isinstance(forward, types.FunctionType):
            spaces[id(forward.__globals__)] = forward.__globals__
    for space in spaces.values():
        found += [v for v in space.values() if isinstance(v, torch.Generator)]
    return list({id(g): g for g in found}.values())


class UserGenerators:
    """The user's ``torch.Generator``s the forward draws from while it is traced ([Note: a
    user's generator] in ``rng``): :meth:`saw` is told of each draw's generator (by
    ``_TraceMode``), the trace puts each back as it was before its first draw, and
    :meth:`check` refuses what the graph could not replay as plain PyTorch runs it."""

    def __init__(self):
        self.known: dict = {}  # id -> (generator, state): those the model held before the trace
        self.seen: dict = {}   # id -> (weak reference, state before its first draw, line)

    def saw(self, generator: torch.Generator) -> None:
        """Note a draw from ``generator``; the first one keeps its state and line.

        Raises:
            TraceError: the forward set the state of a generator the model holds before
                drawing from it (``manual_seed``, ``set_state``).
        """
        if id(generator) in self.seen:
            return
        line = _user_line(traceback.extract_stack()[:-2])
        state = generator.get_state()
        known = self.known.get(id(generator))
        if known is not None and not torch.equal(known[1], state):
            raise TraceError(
                f"the forward sets the state of a torch.Generator (manual_seed, seed or "
                f"set_state) and then draws from it at {line}: the model is traced once, so "
                f"that Python runs once, and every micro-batch would draw on from where the "
                f"previous one stopped, where plain PyTorch sets it again in every forward. "
                f"Set it outside forward, or draw with torch's default generator (seeded per "
                f"micro-batch: torch.manual_seed before the call)")
        self.seen[id(generator)] = (weakref.ref(generator), state, line)

    def put_back(self) -> None:
        """Put every generator the model holds back as it was before the trace, and every
        other one drawn from as it was before its first draw."""
        for generator, state in self.known.values():
            generator.set_state(state)
        for key, (ref, state, _) in self.seen.items():
            generator = ref()
            if generator is not None and key not in self.known:
                generator.set_state(state)

    def check(self) -> None:
        """After the trace: refuse a generator the forward made itself.

        Raises:
            TraceError: a generator drawn from is gone once the forward returned.
        """
        for ref, _, line in self.seen.values():
            if ref() is None:
                raise TraceError(
                    f"the forward draws from a torch.Generator it makes itself, at {line}: the "
                    f"model is traced once, so it would be made once and every micro-batch "
                    f"would draw on from it, where plain PyTorch makes a fresh one in every "
                    f"forward. Make it once outside forward (in __init__: self.generator = "
                    f"torch.Generator().manual_seed(seed)), or draw with torch's default "
                    f"generator")
