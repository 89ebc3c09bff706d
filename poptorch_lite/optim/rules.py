"""Update rules torch lacks: AdamW without bias correction, TensorFlow's RMSprop, LAMB."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from .extras import _positive


def _closure_loss(closure: Callable | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(group: dict[str, Any]) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) pairs of a group, the gradient negated when maximize=True."""
    for p in group["params"]:
        if p.grad is not None:
            yield p, (-p.grad if group.get("maximize", False) else p.grad)


def _stepped_state(state: dict, p: torch.Tensor, **buffers: Callable) -> dict:
    """A parameter's state, created with ``buffers`` on first use, its step incremented."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state.update({name: make(p) for name, make in buffers.items()})
    state["step"] += 1
    return state


@torch.no_grad()
def _adamw_step_without_bias_correction(opt: torch.optim.Optimizer,
                                        closure: Callable | None) -> Any:
    """One AdamW update without bias correction (the formulas in ``optim.AdamW``'s docstring)."""
    loss = _closure_loss(closure)
    for group in opt.param_groups:
        (beta1, beta2), lr = group["betas"], group["lr"]
        for p, grad in _with_grads(group):
            state = _stepped_state(opt.state[p], p, exp_avg=torch.zeros_like,
                                   exp_avg_sq=torch.zeros_like)
            p.mul_(1 - lr * group["weight_decay"])
            m = state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            v = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-lr)
    return loss


@torch.no_grad()
def _rmsprop_tf_step(opt: torch.optim.Optimizer, closure: Callable | None) -> Any:
    """One update of TensorFlow's RMSprop (the formulas in ``optim.RMSprop``'s docstring)."""
    loss = _closure_loss(closure)
    for group in opt.param_groups:
        alpha, eps, lr, momentum = group["alpha"], group["eps"], group["lr"], group["momentum"]
        buffers = {"square_avg": torch.ones_like}  # TF: the squares start at 1
        if momentum > 0:
            buffers["momentum_buffer"] = torch.zeros_like
        if group["centered"]:
            buffers["grad_avg"] = torch.zeros_like
        for p, grad in _with_grads(group):
            state = _stepped_state(opt.state[p], p, **buffers)
            if group["weight_decay"] != 0:
                grad = grad.add(p, alpha=group["weight_decay"])
            s = state["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
            if group["centered"]:
                a = state["grad_avg"].mul_(alpha).add_(grad, alpha=1 - alpha)
                denom = s.addcmul(a, a, value=-1).add_(eps).sqrt_()
            else:
                denom = s.add(eps).sqrt_()
            if momentum > 0:  # TF: lr goes inside the momentum buffer
                p.sub_(state["momentum_buffer"].mul_(momentum).addcdiv_(grad, denom, value=lr))
            else:
                p.addcdiv_(grad, denom, value=-lr)
    return loss


def _lamb_init(opt: torch.optim.Optimizer, params: Any, lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, max_weight_norm: float = 65500.0) -> None:
    """LAMB's per-group defaults and their checks, as torch's constructors do them."""
    if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"invalid hyper-parameters lr={lr}, eps={eps}, weight_decay="
                         f"{weight_decay}, betas={betas}: lr, eps, weight_decay must be >= 0 "
                         "and betas in [0, 1)")
    max_weight_norm = _positive("max_weight_norm", max_weight_norm, allow_inf=True)
    torch.optim.Optimizer.__init__(opt, params, dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm))


@torch.no_grad()
def _lamb_step(opt: torch.optim.Optimizer, closure: Callable | None) -> Any:
    """One LAMB update (the formulas in ``optim.LAMB``'s docstring)."""
    loss = _closure_loss(closure)
    chunks = []  # (p, u, group) of chunks of weights: [Note: LAMB on chunks]
    for group in opt.param_groups:
        beta1, beta2 = group["betas"]
        for p, grad in _with_grads(group):
            state = _stepped_state(opt.state[p], p, exp_avg=torch.zeros_like,
                                   exp_avg_sq=torch.zeros_like)
            m = state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            v = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            t = state["step"].item()
            bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if opt.bias_correction else (1.0, 1.0)
            u = (m / bc1) / (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
            u.add_(p, alpha=group["weight_decay"])
            if lamb_chunk_norms(opt) is not None:
                chunks.append((p, u, group))
                continue
            r1, r2 = p.norm().clamp(max=group["max_weight_norm"]), u.norm()  # phi(||p||)
            trust = lamb_trust(r1, r2)
            p.sub_(u * (group["lr"] * trust))
    lamb_apply_chunks(opt, chunks, float32=False)
    return loss


def lamb_trust(r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """LAMB's trust ratio ``phi(||p||) / ||u||``, 1 where either norm is 0.

    Example:
        >>> float(lamb_trust(torch.tensor(2.0), torch.tensor(4.0))), float(
        ...     lamb_trust(torch.tensor(0.0), torch.tensor(4.0)))
        (0.5, 1.0)
    """
    return torch.where((r1 == 0) | (r2 == 0), torch.ones_like(r1), r1 / r2)


def lamb_chunk_norms(opt) -> Callable | None:
    """The norm hook of a LAMB optimizer stepping chunks of weights, or None.

    [Note: LAMB on chunks]
    LAMB's trust ratio is the norm of a whole weight over the norm of its whole update.
    Where each process steps only a chunk of every weight ([Note: sharded optimizer state]
    in ``distributed/sharding.py``), the sharded step sets ``opt._chunk_norms`` for the
    step: given ``[(chunk, ||p_chunk||², ||u_chunk||²), ...]`` it returns each weight's
    whole squares, summed over the processes. LAMB then updates every chunk's moments
    first, asks once (every process asks, also with no chunk), and applies the trust
    ratios. Without the hook each weight is updated at once, as before.
    """
    return getattr(opt, "_chunk_norms", None)


def lamb_apply_chunks(opt, chunks: list, float32: bool) -> None:
    """The second half of LAMB on chunks ([Note: LAMB on chunks]): the whole norms, then
    ``p -= lr · trust · u`` for each chunk."""
    hook = lamb_chunk_norms(opt)
    if hook is None:
        return
    squares = hook([(p, (p.float() ** 2).sum(), (u.float() ** 2).sum()) for p, u, _ in chunks])
    for (p, u, group), (p2, u2) in zip(chunks, squares):
        trust = lamb_trust(p2.sqrt().clamp(max=group["max_weight_norm"]), u2.sqrt())
        if float32:
            p.sub_((u.float() * (group["lr"] * trust)).to(p.dtype))
        else:
            p.sub_(u * (group["lr"] * trust))
