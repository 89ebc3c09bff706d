"""The work one forward of a graph does, counted without running it.

It decides whether compiling a stage pays ([Note: compiled stages] in ``compiled_stages``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import rng
from .subgraphs import base_op


def work(gm: fx.GraphModule, args: tuple) -> tuple:
    """``(FLOPs, elements)`` of one forward of ``gm`` on ``args``' shapes: its matmul and
    conv FLOPs, and the elements of every value its ops produce; run on fake tensors, so
    nothing is computed and nothing changes.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda x, w: x @ w.t())(torch.ones(2, 4), torch.ones(3, 4))
        >>> work(gm, (torch.ones(2, 4), torch.ones(3, 4)))  # 2*4*3 multiply-adds; w.t(), x @ w.t()
        (48, 18)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import flop_registry  # FlopCounterMode's own table

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    counts = [0, 0]

    # Not FlopCounterMode: its module hooks are global, and fire in the stages that other
    # threads run meanwhile.
    class _Count(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function":
                op = base_op(n.target)
                count = flop_registry.get(getattr(op, "overloadpacket", None))
                if count is not None:
                    a, kw = self.fetch_args_kwargs_from_env(n)
                    counts[0] += int(count(*a, **kw, out_val=out))
                counts[1] += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
            return out

    with rng.use(None), torch.no_grad(), mode:
        _Count(gm).run(*fake)
    forget_real_tensors(mode)
    return counts[0], counts[1]


def forget_real_tensors(mode) -> None:
    """Empty the tables in which the fake-tensor mode ``mode`` describes the real tensors it
    made fakes of. Each holds a weak reference to every parameter it saw, for as long as
    the mode lives (in reference cycles, until Python's collector runs; or kept by a
    compiled stage's graphs), and ``torch.utils.swap_tensors`` refuses a tensor that has
    one (``Module.to()`` under torch.__future__'s swap of parameters on conversion; plain
    PyTorch's ``torch.compile`` keeps none). Nothing reads them once the fakes are made."""
    describer = getattr(getattr(getattr(mode, "fake_tensor_converter", None),
                                "meta_converter", None), "describer", None)
    for name in ("lookup_tensor", "lookup_storage"):
        table = getattr(describer, name, None)
        if table is not None:
            table.clear()
