"""State across stages: buffers and parameters that the forward writes, read in other stages.

[Note: state across stages]
A forward may write a buffer in place (an EMA, a counter, a queue) or a parameter
(``nn.Embedding(max_norm=...)`` renormalises its weight in place, under no_grad:
``embedding_renorm_``) and read it in another stage. Plain PyTorch runs one micro-batch
after another, so each read sees the writes of the micro-batches before it and of its own
ops before the read, and nothing else. A pipeline runs stages of different micro-batches at
once, and with separate memories (``useIpuModel``, GPUs) each IPU computes with its own copy
of the buffer or parameter: a stage that read the state itself would see whatever the
writing stage had done by then, other micro-batches' writes included, or never see the
write at all.

So the partition follows every buffer the trace saw change, and every parameter an op
writes (the op's schema says so), through its aliases (views of it, in-place results), to
the stages that write it and those that read it:

- **One writer, read after it.** The writing stage s returns a snapshot of the state after
  its last write, a ``clone`` per micro-batch, and every later stage that reads the state
  reads the snapshot instead (a view it takes is taken of the snapshot). The snapshot is a
  value between stages like any other ([Note: partition] in ``partition``): it crosses
  memories, streams and processes, a recompute keeps it, and for a parameter its gradient
  flows back through the boundary into s and on into the parameter's home, as a tied
  weight's does. (A buffer is state, not a weight: its snapshot carries no gradient to
  other processes, [Note: value info] in ``value_info``; plain PyTorch could not take one
  through it past the first micro-batch, [Note: buffers written in forward] in
  ``runtime/stage_work``.)
- **Read before its writer, or written by several stages.** Micro-batch i's read in stage t
  then needs micro-batch i-1's write in a later stage. Only a schedule that runs one action
  at a time, micro-batch after micro-batch (Sequential: ``ShardedExecution`` and the phased
  strategies), on stages that compute with one tensor of the state, does that arithmetic.
  There each stage reads and writes the state itself (an alias of it that another stage
  made is made again in the stage that uses it, so a write lands in the state, not in a
  copy of a boundary value); elsewhere the compile step refuses the model
  (``runtime/compiling.check_shared_state``), naming the state, its stages and the fixes.
  :attr:`Partition.shared_state <poptorch_lite.compiler.partition.Partition>` lists them.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from .subgraphs import base_op


def _bound(node: fx.Node):
    """``(argument schema, given value)`` of each argument of ``node``, by position and name."""
    schema = getattr(base_op(node.target), "_schema", None)
    if schema is None:
        return None, ()
    pairs = list(zip(schema.arguments, node.args))
    pairs += [(a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs]
    return schema, pairs


def aliased_input(node: fx.Node) -> Optional[fx.Node]:
    """The input whose memory ``node``'s result is (a view, an in-place result), or None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:  # an item of a view op's list (split, unbind)
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    schema, pairs = _bound(node)
    returned = schema.returns[0].alias_info if schema is not None and schema.returns else None
    if returned is None:
        return None
    for arg, given in pairs:
        if isinstance(given, fx.Node) and arg.alias_info is not None and \
                set(arg.alias_info.before_set) & set(returned.before_set):
            return given
    return None


def written(node: fx.Node) -> list:
    """The inputs that ``node`` writes in place (its schema marks them ``(a!)``)."""
    _, pairs = _bound(node)
    return [given for arg, given in pairs if isinstance(given, fx.Node)
            and arg.alias_info is not None and arg.alias_info.is_write]


def follow_state(gm: fx.GraphModule, runs: list, source_name: dict,
                 mutated_buffers: frozenset) -> dict:
    """Give later stages a snapshot of state written in forward ([Note: state across stages]).

    Rewrites ``gm`` and the node lists of ``runs`` (``(ipu, nodes, blocks)`` per stage, in
    order) in place.

    Args:
        source_name: placeholder -> its value name (``param:...``, ``buffer:...``, ...).
        mutated_buffers: the buffers the trace saw change.

    Returns:
        ``{value name: (writing stages, other stages reading it, whether the writes are
        known)}`` of the state that several stages write, or that a stage reads before its
        writer: what only a one-at-a-time schedule on one memory runs as plain PyTorch does.
        Where no op says it writes the state (native_batch_norm's statistics), every stage
        that uses it may.
    """
    stage_of = {n: s for s, (_, nodes, _) in enumerate(runs) for n in nodes}
    root: dict = {}  # node -> the state placeholder whose memory it is
    for n in gm.graph.nodes:
        if n.op == "placeholder" and source_name[n].startswith(("param:", "buffer:")):
            root[n] = n
        elif n in stage_of:
            a = aliased_input(n)
            if a is not None and a in root:
                root[n] = root[a]
    writes: dict = {}  # state -> the nodes that write it
    for n in stage_of:
        for w in written(n):
            if w in root:
                writes.setdefault(root[w], []).append(n)
    shared = {}
    for p in [p for p in root if root[p] is p]:
        if p not in writes and source_name[p].split(":", 1)[1] not in mutated_buffers:
            continue
        family = [n for n in root if root[n] is p]
        if len({stage_of[u] for n in family for u in (n, *n.users) if u in stage_of}) > 1:
            _made_locally(gm, runs, stage_of, root, p)
        writing = writes.get(p, [])  # the nodes that write it
        touch = sorted({stage_of[u] for n in root if root[n] is p for u in n.users
                        if u in stage_of and (root.get(u) is not p or u in writing)})
        # A write no schema announces (native_batch_norm's statistics): every stage may write.
        writers = sorted({stage_of[n] for n in writing}) or touch
        if not touch:
            continue
        if len(writers) == 1 and touch[0] >= writers[0]:
            _snapshot(gm, runs, stage_of, root, p, source_name[p], writers[0], writing)
        elif len(touch) > 1:
            shared[source_name[p]] = (tuple(writers), tuple(t for t in touch if t not in writers),
                                      bool(writing))
    return shared


def _again(gm: fx.GraphModule, n: fx.Node, p: fx.Node, here: fx.Node, made: dict,
           place: Callable) -> fx.Node:
    """``n``, an alias of state ``p``, made again of ``here`` instead of ``p``: an in-place
    result is its input's memory itself, a view is taken again, and ``place`` puts it in
    the graph (``place(make)`` calls ``make()`` where it belongs). ``made`` holds what is made."""
    if n is p:
        return here
    if n not in made:
        base = aliased_input(n)
        of = _again(gm, base, p, here, made, place)
        if base in written(n):  # an in-place result
            made[n] = of
        else:
            made[n] = place(lambda: gm.graph.create_node(
                "call_function", n.target, tuple(of if a is base else a for a in n.args),
                {k: of if v is base else v for k, v in n.kwargs.items()}))
            made[n].meta.update(n.meta)
    return made[n]


def _made_locally(gm: fx.GraphModule, runs: list, stage_of: dict, root: dict,
                  p: fx.Node) -> None:
    """Make each alias of state ``p`` that a stage uses but another stage made again in the
    stage that uses it (at its start), from ``p``; then drop the views that no stage uses
    any more."""
    family = [n for n in root if root[n] is p and n is not p]
    made: dict = {}  # stage -> its aliases of p

    def at_start(t: int):
        def place(make):
            first = runs[t][1][0]
            with gm.graph.inserting_before(first):
                view = make()
            runs[t][1].insert(runs[t][1].index(first), view)
            stage_of[view], root[view] = t, p
            return view
        return place

    for n in family:
        for u in list(n.users):
            t = stage_of.get(u)
            if t is not None and stage_of.get(n) != t:
                here = made.setdefault(t, {m: m for m in family if stage_of.get(m) == t})
                u.replace_input_with(n, _again(gm, n, p, p, here, at_start(t)))
    for n in reversed(list(gm.graph.nodes)):  # views that only fed other stages
        if root.get(n) is p and n is not p and not n.users and not written(n):
            runs[stage_of.pop(n)][1].remove(n)
            del root[n]
            gm.graph.erase_node(n)


def _snapshot(gm: fx.GraphModule, runs: list, stage_of: dict, root: dict, p: fx.Node,
              name: str, s: int, written: list) -> None:
    """Stage s clones state ``p`` after its last write, once per micro-batch, and everything
    after that reads the clone: later ops of s and the later stages (``p``'s views are taken
    again of the clone)."""
    nodes = runs[s][1]
    at = max(nodes.index(n) for n in written) if written else len(nodes) - 1
    reads = [u for u in (*nodes[at + 1:], *(n for _, ns, _ in runs[s + 1:] for n in ns))
             if any(root.get(a) is p for a in u.all_input_nodes)]
    if not reads:
        return  # the last write is the last word
    before = set(nodes[:at + 1]) | {p}
    with gm.graph.inserting_after(nodes[at]):
        snap = gm.graph.create_node("call_function", torch.ops.aten.clone.default, (p,),
                                    name=f"{name.split(':', 1)[1].replace('.', '_')}_snapshot")
    snap.meta["val"] = p.meta.get("val")
    snap.meta["stack_trace"] = nodes[at].meta.get("stack_trace")
    placed = [snap]

    def after_the_last(make):  # the views of the snapshot follow it, in order
        with gm.graph.inserting_after(placed[-1]):
            placed.append(make())
        return placed[-1]

    made: dict = {}
    for u in reads:
        for n in list(u.all_input_nodes):
            if root.get(n) is p and n in before:
                u.replace_input_with(n, _again(gm, n, p, snap, made, after_the_last))
    nodes[at + 1:at + 1] = placed
    for n in placed:
        stage_of[n], root[n] = s, None
