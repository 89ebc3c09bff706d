"""Optimizer state in PopTorch's dtypes: the update rules, each state tensor in its own dtype.

[Note: optimizer state dtypes]
PopTorch's optimizers store each state tensor in the dtype their arguments name, whatever the
parameter's dtype (PopART's optimizers: pt:python/optim.py, popart willow/src/popx/op/
adamupdaterx.cpp), and default to float32. torch's optimizers keep state in the parameter's
dtype, so a float16 model trained with torch's AdamW keeps float16 moments: the second moment
underflows, eps (1e-8) rounds to 0 and the first update divides 0 by 0. PopTorch's arithmetic:

- Adam, AdamW, LAMB: ``exp_avg`` (m) in ``first_order_momentum_accum_type``, ``exp_avg_sq``
  (v) in ``second_order_momentum_accum_type``; each moment takes the gradient cast to its own
  dtype. The update ``u = cast(m / bc1, v's dtype) / (sqrt(v / bc2) + eps)`` is computed in
  v's dtype (float32 with PopTorch's default), then cast to the parameter's dtype, where
  decoupled weight decay is added (``u + weight_decay * p``) and ``p -= lr * u`` is applied.
  LAMB's norms are float32.
- RMSprop: ``square_avg`` in ``first_order_momentum_accum_type``, ``grad_avg`` (centered) in
  ``second_order_momentum_accum_type``, ``momentum_buffer`` in float32 (PopART's Adaptive
  optimizer: accl1, accl2, accl3 = FLOAT); the update is computed in float32 when any of
  them is.
- SGD: ``momentum_buffer`` in ``velocity_accum_type`` (ignored, as PopTorch does, with
  ``use_combined_accum=True``); the step is taken in the parameter's dtype.

When every state dtype equals the parameter's (float32 models with the defaults), torch's own
step runs, bit for bit; the rules here run only when they differ. The gradient reaching the
step is in the parameter's dtype (the accumulator, in ``accum_type``, is cast once after the
reduction: [Note: gradient arithmetic] in ``update``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .rules import lamb_apply_chunks, lamb_chunk_norms, lamb_trust

_F32 = torch.float32


def state_dtypes(opt: Any) -> dict[str, torch.dtype]:
    """The dtype of each state tensor ``opt`` keeps ([Note: optimizer state dtypes]).

    Example:
        >>> from poptorch_lite.optim import AdamW
        >>> p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        >>> state_dtypes(AdamW([p]))
        {'exp_avg': torch.float32, 'exp_avg_sq': torch.float32}
    """
    groups = opt.param_groups
    if isinstance(opt, torch.optim.SGD):
        used = any(g["momentum"] for g in groups) and not opt.use_combined_accum
        return {"momentum_buffer": opt.velocity_accum_type} if used else {}
    if isinstance(opt, torch.optim.RMSprop):
        dtypes = {"square_avg": opt.first_order_momentum_accum_type}
        if any(g["centered"] for g in groups):
            dtypes["grad_avg"] = opt.second_order_momentum_accum_type
        if any(g["momentum"] > 0 for g in groups):
            dtypes["momentum_buffer"] = _F32
        return dtypes
    return {"exp_avg": opt.first_order_momentum_accum_type,
            "exp_avg_sq": opt.second_order_momentum_accum_type}


def differs(opt: Any) -> bool:
    """Whether a state dtype differs from some parameter's: then torch's step would keep the
    wrong precision, and the rules here run.

    Example:
        >>> from poptorch_lite.optim import AdamW
        >>> differs(AdamW(torch.nn.Linear(2, 1).parameters()))
        False
    """
    dtypes = set(state_dtypes(opt).values())
    return any(d != p.dtype for group in opt.param_groups for p in group["params"]
               for d in dtypes)


def _grads(group: dict) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    for p in group["params"]:
        if p.grad is not None:
            yield p, (-p.grad if group.get("maximize", False) else p.grad)


def _state(opt: Any, p: torch.Tensor, dtypes: dict, init: Optional[dict] = None) -> dict:
    """``p``'s state, its tensors made in their dtypes on first use, its step incremented."""
    state = opt.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=_F32)
        for name, dtype in dtypes.items():
            fill = (init or {}).get(name, 0.0)
            state[name] = torch.full_like(p, fill, dtype=dtype, memory_format=torch.preserve_format)
    for name, dtype in dtypes.items():  # state made by torch's step keeps the parameter's
        if state[name].dtype != dtype:
            state[name] = state[name].to(dtype)
    state["step"] += 1
    return state


def keep_loaded_dtypes(opt: Any, state_dict: dict) -> None:
    """After torch's ``load_state_dict`` (which casts state to each parameter's dtype), put
    back the loaded tensors whose dtype is the one ``opt`` keeps that state in."""
    dtypes = state_dtypes(opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    for index, saved in state_dict["state"].items():
        state = opt.state.get(params[index]) if index < len(params) else None
        for name, tensor in saved.items():
            if state is not None and name in state and torch.is_tensor(tensor) and \
                    dtypes.get(name) == tensor.dtype:
                state[name] = tensor.to(state[name].device, copy=True)


def _closure(closure: Optional[Callable]) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


@torch.no_grad()
def adam_step(opt: Any, closure: Optional[Callable], decoupled: bool, bias_correction: bool,
              lamb: bool = False) -> Any:
    """One Adam (L2 weight decay), AdamW (decoupled) or LAMB update, state in its dtypes."""
    loss = _closure(closure)
    dtypes = state_dtypes(opt)
    chunks = []  # LAMB on chunks of weights: [Note: LAMB on chunks] in ``rules``
    for group in opt.param_groups:
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        wd = group["weight_decay"]
        for p, g in _grads(group):
            state = _state(opt, p, dtypes)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if wd and not decoupled:  # Adam: L2 regularisation, in the parameter's dtype
                g = g.add(p, alpha=wd)
            g1, g2 = g.to(m.dtype), g.to(v.dtype)
            m.mul_(beta1).add_(g1, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g2, g2, value=1 - beta2)
            t = state["step"].item()
            bc1, bc2 = (1 - beta1 ** t, 1 - beta2 ** t) if bias_correction else (1.0, 1.0)
            u = (m / bc1).to(v.dtype).div_((v / bc2).sqrt_().add_(eps)).to(p.dtype)
            if decoupled and wd:
                u.add_(p, alpha=wd)
            if lamb and lamb_chunk_norms(opt) is not None:
                chunks.append((p, u, group))
            elif lamb:
                trust = lamb_trust(p.float().norm().clamp(max=group["max_weight_norm"]),
                                   u.float().norm())
                p.sub_((u.float() * (lr * trust)).to(p.dtype))
            else:
                p.add_(u, alpha=-lr)
    if lamb:
        lamb_apply_chunks(opt, chunks, float32=True)
    return loss


@torch.no_grad()
def rmsprop_step(opt: Any, closure: Optional[Callable], tf_variant: bool) -> Any:
    """One RMSprop update (torch's, or TensorFlow's), state in its dtypes."""
    loss = _closure(closure)
    dtypes = state_dtypes(opt)
    for group in opt.param_groups:
        alpha, eps, lr, momentum = group["alpha"], group["eps"], group["lr"], group["momentum"]
        wanted = {"square_avg": dtypes["square_avg"]}
        if momentum > 0:
            wanted["momentum_buffer"] = dtypes["momentum_buffer"]
        if group["centered"]:
            wanted["grad_avg"] = dtypes["grad_avg"]
        for p, g in _grads(group):
            state = _state(opt, p, wanted, {"square_avg": 1.0 if tf_variant else 0.0})
            if group["weight_decay"]:
                g = g.add(p, alpha=group["weight_decay"])
            s = state["square_avg"]
            gs = g.to(s.dtype)
            s.mul_(alpha).addcmul_(gs, gs, value=1 - alpha)
            compute = torch.promote_types(s.dtype, state.get("momentum_buffer", s).dtype)
            if group["centered"]:
                a = state["grad_avg"]
                a.mul_(alpha).add_(g.to(a.dtype), alpha=1 - alpha)
                compute = torch.promote_types(compute, a.dtype)
                var = s.to(compute).addcmul(a.to(compute), a.to(compute), value=-1)
            else:
                var = s.to(compute, copy=True)
            denom = var.add_(eps).sqrt_() if tf_variant else var.sqrt_().add_(eps)
            ratio = g.to(compute) / denom
            if momentum > 0:
                b = state["momentum_buffer"]
                if tf_variant:  # lr inside the momentum buffer
                    b.mul_(momentum).add_(ratio.to(b.dtype), alpha=lr)
                    p.sub_(b.to(p.dtype))
                else:
                    b.mul_(momentum).add_(ratio.to(b.dtype))
                    p.add_(b.to(p.dtype), alpha=-lr)
            else:
                p.add_(ratio.to(p.dtype), alpha=-lr)
    return loss


@torch.no_grad()
def sgd_step(opt: Any, closure: Optional[Callable]) -> Any:
    """One SGD update with the momentum buffer in ``velocity_accum_type``."""
    loss = _closure(closure)
    dtype = state_dtypes(opt)["momentum_buffer"]
    for group in opt.param_groups:
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        for p, g in _grads(group):
            if group["weight_decay"]:
                g = g.add(p, alpha=group["weight_decay"])
            if momentum:
                state = opt.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:  # torch: the first buffer is the gradient itself
                    buf = state["momentum_buffer"] = g.to(dtype).clone()
                else:
                    buf.mul_(momentum).add_(g.to(dtype), alpha=1 - dampening)
                g = g.add(buf.to(g.dtype), alpha=momentum) if group["nesterov"] \
                    else buf.to(g.dtype)
            p.add_(g, alpha=-lr)
    return loss
