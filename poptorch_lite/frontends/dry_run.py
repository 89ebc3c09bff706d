"""A dry run: call a function once to see which modules it calls, changing nothing.

[Note: dry run]
The TF1 face finds the modules of a stage function by what the function calls
(through layer functions, globals, closures or attributes of objects), and the
Keras face finds the order in which a functional model calls its layers. Both
run the code once on the first micro-batch with a global module-call hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) and keep the
modules in the order of their first call. The run leaves no trace a user could
see: it runs under ``torch.no_grad()``, the random state of the CPU (and of
every initialised CUDA device) is put back afterwards, and so are the buffers
of every module it called (a BatchNorm's running statistics and counter), their
values copied back in place, before the result is returned or an error raised.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch


@contextlib.contextmanager
def _state_restored(called: list):
    """Put back the random state, and the buffers of the modules in ``called``.

    The buffers are captured by the hook just before a module first runs (see
    :func:`module_calls`), so ``called`` holds ``(module, {name: copy})`` pairs.
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        with torch.no_grad():
            for module, saved in reversed(called):
                for name, value in saved.items():
                    owner, _, leaf = name.rpartition(".")
                    holder = module.get_submodule(owner) if owner else module
                    now = holder._buffers.get(leaf)
                    if isinstance(now, torch.Tensor) and now.shape == value.shape:
                        now.copy_(value)  # in place: views and optimizers keep seeing it
                    else:  # replaced or removed by the run: put the tensor back
                        holder._buffers[leaf] = value


def module_calls(fn: Callable, *args, **kwargs) -> tuple:
    """Run ``fn(*args, **kwargs)`` once, recording the modules it calls.

    Returns:
        ``(result, calls)``: ``calls`` lists ``(module, depth)`` in the order of each
        module's first call, ``depth`` 0 for a module called outside any other
        recorded module's forward.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> out, calls = module_calls(lambda x: layer(x) * 2, torch.ones(1, 2))
        >>> [m is layer for m, _ in calls]
        [True]
    """
    hooks = torch.nn.modules.module
    calls, seen, saved, stack = [], set(), [], []
    caller = threading.get_ident()  # the hooks are global: other threads' modules are not ours

    def pre(module, _inputs):
        if threading.get_ident() != caller:
            return
        if id(module) not in seen:
            seen.add(id(module))
            calls.append((module, len(stack)))
            saved.append((module, {n: b.detach().clone()
                                   for n, b in module.named_buffers()}))
        stack.append(module)

    def post(module, _inputs, _output):
        if threading.get_ident() == caller and stack and stack[-1] is module:
            stack.pop()

    handles = [hooks.register_module_forward_pre_hook(pre),
               hooks.register_module_forward_hook(post)]
    try:
        with _state_restored(saved), torch.no_grad():
            result = fn(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return result, calls


def outermost(calls: list) -> list:
    """The modules of ``calls`` that are not submodules of another called module, in order.

    Example:
        >>> seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _, calls = module_calls(seq, torch.ones(1, 2))
        >>> outermost(calls) == [seq]
        True
    """
    modules = [m for m, _ in calls]
    inner = set()
    for m in modules:
        inner.update(id(sub) for sub in m.modules() if sub is not m)
    return [m for m in modules if id(m) not in inner]
