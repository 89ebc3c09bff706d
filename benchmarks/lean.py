"""The lean call: a wrapped model's one-step program called through the per-call mechanisms its
runtime keeps, and none of its layers (issue 47 F).

``lean_call(wrapped, optimizer, x, y)`` returns a function that takes one optimizer step
of ``wrapped``'s one-stage program on ``(x, y)``: the input signature, the attribute and
host-edit checks, collection paused, grad mode, the Ctrl-C handler, the host gradients kept,
the random snapshot, base and stream, and the step bound to the homes, around the stage
graph, autograd's engine and ``optimizer.step()``. It is a measurement, not a runtime: it
reads the runtime's own objects, and leaves out what a one-stage step of a model without
buffers does not use (the per-run undo of buffers, the timeline, the stash's byte counts, the
outputs' merge). Before returning it checks that one lean call and one wrapped call, from the
same state, leave the same weights and momenta to the bit, and exits otherwise.

``machinery.py --conv16`` runs it in one process beside plain, bare and the wrapped model;
``tax.py --lean`` in a process of its own, taking turns with plain and the wrapped model.
"""

import gc

import torch

from poptorch_lite.compiler import rng
from poptorch_lite.compiler.casting import ambient_autocast
from poptorch_lite.runtime import update
from poptorch_lite.runtime.split_backward import run_backward


def lean_call(wrapped, optimizer, x, y):
    """A call of ``wrapped``'s one-step program through the mechanisms its runtime keeps per
    call and none of its layers (the module docstring), after checking that it leaves the
    weights and momenta that a wrapped call leaves from the same state. ``wrapped`` has been
    called: its one program is compiled."""
    (program,) = wrapped._programs.values()  # a measurement: it reads the runtime's own objects
    (stage,), reads = program.partition.stages, program.partition.reads
    weights = wrapped._state.weights
    params = list(weights.params.values())
    positions = {n: k for k, n in enumerate(stage.inputs)}
    graph, loss_at = stage.module, stage.outputs.index(program.executor.work.loss)
    args = [None if n.startswith("input:") else weights.param(n.split(":", 1)[1], stage.ipu)
            for n in stage.inputs]
    signature = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype, ambient_autocast())

    def lean():
        if (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype, ambient_autocast()) != signature \
                or not reads.same() or weights.edits():
            raise RuntimeError("lean: the call is not the one it was made for")
        paused = gc.isenabled()
        gc.disable()
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        held = weights.hold_host_grads()
        guard = update.CtrlC.install()
        try:
            torch.default_generator.clone_state()  # what a failed call would rewind to
            stream = rng.Stream(rng.microbatch_seed(rng.draw_bases(1)[0], 0))
            for p in params:
                p.grad = None
            args[positions["input:0"]], args[positions["input:1"]] = x, y
            with rng.use(stream):
                outs = graph(*args)
            loss = outs[loss_at]
            run_backward([loss], [torch.full_like(loss, 1.0)])
            with weights.stepping():
                optimizer.step()
            return [o.detach() for o in outs]
        finally:
            if guard is not None:
                guard.uninstall(ended_normally=True)
            weights.give_back_host_grads(held)
            torch._C._set_grad_enabled(grad)
            if paused:
                gc.enable()

    same_step(wrapped, lean, params, optimizer, x, y)
    return lean


def same_step(wrapped, lean, params, optimizer, x, y):
    """Refuse a lean call whose step differs from the wrapped call's, from the same weights,
    momenta and random state."""
    def snapshot():
        return ([p.detach().clone() for p in params],
                [optimizer.state[p]["momentum_buffer"].clone() if optimizer.state[p] else None
                 for p in params], torch.get_rng_state())

    def restore(saved):
        with torch.no_grad():
            for p, v, m in zip(params, saved[0], saved[1]):
                p.copy_(v)
                if m is not None:
                    optimizer.state[p]["momentum_buffer"].copy_(m)
        torch.set_rng_state(saved[2])
        wrapped.copyWeightsToDevice()

    start = snapshot()
    lean()
    by_lean = snapshot()
    restore(start)
    wrapped(x, y)
    by_lite = snapshot()
    for a, b in zip(by_lean[0] + by_lean[1], by_lite[0] + by_lite[1]):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            raise SystemExit("lean: its step differs from the wrapped model's")
