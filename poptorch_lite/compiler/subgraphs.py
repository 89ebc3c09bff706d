"""Graph surgery for the partition: groups of a traced graph's nodes as graphs of their own.

A stage is a group of nodes, and so is each segment of a stage between recomputation
checkpoints ([Note: partition] in ``partition``): :func:`subgraphs` makes each group a
graph that takes the values it reads and returns those read after it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import markers


def written_in_place(value: fx.Node) -> bool:
    """Whether an op writes ``value`` in place, directly or through a view of it (a wrapped
    op too: ``clamp_`` under ``no_grad``)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        seen.add(v)
        for user in v.users:
            schema = getattr(base_op(user.target), "_schema", None)
            if schema is None:
                continue
            for arg, given in zip(schema.arguments, user.args):
                if given is v and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
            returns_alias = schema.returns and schema.returns[0].alias_info is not None
            if returns_alias and user.args and user.args[0] is v and user not in seen:
                stack.append(user)  # a view of v: writing it writes v
    return False


def wrap_target(op, call, prefix: str):
    """``call``, which calls ``op``, named and marked as a wrapper of it in a graph.

    Wrappers (a random stream's, grad mode's) nest; :func:`base_op` sees through them and
    :func:`rewrap` puts the same ones around another op.
    """
    name = str(op) if isinstance(op, torch._ops.OpOverload) else getattr(op, "__name__", "op")
    call.__name__ = call.__qualname__ = prefix + name.replace(".", "_")
    call.wrapped_op = op
    return call


def base_op(target):
    """The op a node's target calls, through every wrapper."""
    while hasattr(target, "wrapped_op"):
        target = target.wrapped_op
    return target


def rewrap(target, op):
    """``op`` inside the wrappers that ``target`` has around its own op."""
    if not hasattr(target, "wrapped_op"):
        return op
    return target.rewrap(rewrap(target.wrapped_op, op))


# Ops whose result holds the same values as their first argument.
_SAME_VALUES = ("alias", "detach", "clone", "view", "_to_copy", "lift_fresh", "squeeze",
                "unsqueeze", "reshape")


def aliases(n: fx.Node, target: fx.Node) -> bool:
    """Whether ``n`` is ``target`` or holds its values (a detach, clone, view, ... of it)."""
    while n is not target:
        name = getattr(n.target, "__name__", "")
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node) or \
                not any(name.startswith(op) for op in _SAME_VALUES):
            return False
        n = n.args[0]
    return True


# Pure ops whose unread results a stage graph need not compute (each costs a dispatch).
_DEAD_IF_UNUSED = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def segment_groups(nodes: list, checkpoints: set) -> list:
    """``nodes`` cut after each checkpointed value (empty groups dropped)."""
    groups: list = [[]]
    for n in nodes:
        groups[-1].append(n)
        if n in checkpoints:
            groups.append([])
    return [g for g in groups if g] or [[]]


def subgraphs(root: fx.GraphModule, groups: list, value_name, exported: set) -> list:
    """One graph per group of ``root``'s nodes, each taking the values it reads.

    A value is an output of its group's graph when it is in ``exported`` or a
    later group reads it. Returns ``(module, inputs, outputs, written_inputs)``
    per group, with value names ([Note: partition]).
    """
    group_of = {n: k for k, nodes in enumerate(groups) for n in nodes}
    result = []
    for k, nodes in enumerate(groups):
        g = fx.Graph()
        env: dict = {}
        inputs: list = []

        def arg(n: fx.Node, env=env, g=g, inputs=inputs):
            if n not in env:
                if n.op == "get_attr":
                    env[n] = g.get_attr(n.target)
                else:
                    inputs.append(value_name(n))
                    env[n] = g.placeholder(value_name(n).replace(":", "_").replace(".", "_"))
            return env[n]

        for n in nodes:
            if n.target in markers.MARKERS or (n.target in _DEAD_IF_UNUSED and not n.users
                                               and n not in exported):
                continue  # make_fx records autograd's saved-output aliases; nothing reads them
            env[n] = g.node_copy(n, arg)
        outputs = [n for n in nodes if n in env and (
            n in exported or any(group_of.get(u, k) > k for u in n.users))]
        g.output(tuple(env[n] for n in outputs))
        written = frozenset(value_name(n) for n in env
                            if value_name(n).startswith(("node:", "input:", "param:"))
                            and env[n].op == "placeholder" and written_in_place(env[n]))
        result.append((fx.GraphModule(root, g), tuple(inputs),
                       tuple(value_name(n) for n in outputs), written))
    return result
