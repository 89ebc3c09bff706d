"""One of 2 processes training with and without the sharded optimizer state
(tests/distributed/test_sharding.py; [Note: sharded optimizer state]).

    python sharding_script.py OUT_DIR     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

For every configuration of ``CONFIGS`` the same model (widths 7 and 3, so that no
weight divides into 2 chunks evenly) trains STEPS steps twice from the same weights
on this process's data: with its state whole, then sharded
(``useReplicatedTensorSharding(True)``). Writes ``OUT_DIR/rank<r>.pt``: per
configuration both runs' losses, weights and optimizer state (the sharded run's
state as this process holds it, and gathered whole from both processes), and the
optimizer-state bytes this process holds in each, and for ``ANCHORED`` the gradients the
last step used, read back by their anchors; a host ``opt.step()`` after each of the "sgd"
runs; then a checkpoint saved after 3 sharded steps, loaded into a fresh sharded model,
continuing for 2; then process 0's ``optimizer.state_dict()`` loaded in both processes.
"""

import os
import sys

import torch
import torch.distributed as dist

import poptorch_lite as poptorch

from models import BlockMLP, data

STEPS, G, B, WIDTH, CLASSES = 5, 2, 3, 7, 3

# name -> (optimizer, replicas in the process, offloaded, clipping)
CONFIGS = {
    "sgd": ("sgd", 1, False, False),
    "adam-clip": ("adam", 1, False, True),
    "adamw-two-replicas": ("adamw", 2, False, False),
    "rmsprop-offloaded": ("rmsprop", 1, True, False),
    "adam-als": ("adam-als", 1, False, False),
    "poptorch-sgd": ("poptorch-sgd", 1, False, False),
    "lamb": ("lamb", 1, False, False),
    "lamb-float16-state": ("lamb16", 1, False, False),
    "adam-large": ("adam", 1, False, False),
}
# widths other than WIDTH: 512 makes 1 MB weights, which go on their own, in place
WIDTHS = {"adam-large": 512}
# every gradient anchored (Gradient___<name>): gathered whole at each sharded step
ANCHORED = {"adam-clip", "adam-large"}


def optimizer(kind, params, clip):
    norm = 0.05 if clip else float("inf")
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
        "adam": lambda: poptorch.optim.Adam(params, lr=0.01, max_grad_norm=norm),
        "adamw": lambda: torch.optim.AdamW(params, lr=0.01),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
        "adam-als": lambda: torch.optim.Adam(params, lr=0.01),
        "poptorch-sgd": lambda: poptorch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                   use_combined_accum=True,
                                                   velocity_scaling=2.0),
        "lamb": lambda: poptorch.optim.LAMB(params, lr=0.01),
        # moments in float16: LAMB's other step (optim/precision.py)
        "lamb16": lambda: poptorch.optim.LAMB(params, lr=0.01,
                                              first_order_momentum_accum_type=torch.float16),
    }[kind]()


def wrap(name, sharded):
    kind, R, offloaded, clip = CONFIGS[name]
    torch.manual_seed(3)
    model = BlockMLP(1, width=WIDTHS.get(name, WIDTH), classes=CLASSES)
    opts = poptorch.Options().deviceIterations(1).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    location = poptorch.TensorLocationSettings().useReplicatedTensorSharding(sharded)
    if offloaded:
        location.useOnChipStorage(False)
    opts.TensorLocations.setOptimizerLocation(location)
    if kind == "adam-als":  # automatic loss scaling: its check of the gradients is sharded
        opts.Training.setAutomaticLossScaling(True)
    if name in ANCHORED:
        for n, _ in model.named_parameters():
            opts.anchorTensor(n, f"Gradient___{n}")
    opt = optimizer(kind, model.parameters(), clip)
    return model, opt, poptorch.trainingModel(model, opts, opt)


def anchored(model, wrapped):
    return {n: wrapped.getAnchoredTensor(n).clone() for n, _ in model.named_parameters()}


def host_step(opt):
    """The user's optimizer stepped on the host: the refusal's text (None if it stepped),
    and whether its state is as it was."""
    before = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    try:
        opt.step()
        refused = None
    except poptorch.OptimizerError as e:
        refused = str(e)
    after = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return refused, all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def batch(name, step, rank):
    R = CONFIGS[name][1]
    return data(B * G * R, width=WIDTHS.get(name, WIDTH), classes=CLASSES,
                seed=100 * step + rank)


def state_of(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
            for p, s in opt.state.items()}


def whole(model, state):
    """Each chunked state tensor of ``state`` gathered from both processes into the weight's
    shape (what an unsharded process holds)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {}
        for key, value in state.get(name, {}).items():
            if value.dim() == 0:
                out[name][key] = value
                continue
            c = -(-p.numel() // 2)
            mine = torch.zeros(c, dtype=value.dtype)
            mine[:value.numel()] = value
            both = [torch.zeros(c, dtype=value.dtype) for _ in range(2)]
            dist.all_gather(both, mine)
            out[name][key] = torch.cat(both)[:p.numel()].view_as(p)
    return out


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))


def train(name, sharded, steps=range(STEPS), wrapped=None):
    model, opt, wrapped = wrapped or wrap(name, sharded)
    rank = int(os.environ["RANK"])
    losses = [wrapped(*batch(name, s, rank))[1].clone() for s in steps]
    wrapped.copyWeightsToHost()
    return model, opt, wrapped, losses


def main(out):
    rank = int(os.environ["RANK"])
    results = {}
    for name in CONFIGS:
        plain_model, plain_opt, w, plain_losses = train(name, False)
        plain_grads = anchored(plain_model, w) if name in ANCHORED else None
        w.destroy()
        model, opt, w, losses = train(name, True)
        chunked = state_of(model, opt)
        results[name] = {
            "losses": (plain_losses, losses),
            "params": ({k: v.clone() for k, v in plain_model.state_dict().items()},
                       {k: v.clone() for k, v in model.state_dict().items()}),
            "state": (state_of(plain_model, plain_opt), whole(model, chunked)),
            "bytes": (state_bytes(plain_opt), state_bytes(opt)),
            "grads": (plain_grads, anchored(model, w) if name in ANCHORED else None),
        }
        w.destroy()
        if name == "sgd":  # the chunks' owner steps on the host: refused, nothing changed
            results["host step"] = (host_step(plain_opt), host_step(opt))
    # a checkpoint of the sharded state, resumed in a fresh sharded model
    name = "adam-clip"
    path = os.path.join(out, "ckpt.pt")
    _, _, w, _ = train(name, True, range(3))
    poptorch.save_checkpoint(path, w)
    w.destroy()
    dist.barrier()  # every process's chunks are written
    fresh = wrap(name, True)
    poptorch.load_checkpoint(path, fresh[2])
    model, _, w, resumed = train(name, True, range(3, STEPS), fresh)
    results["resumed"] = {"losses": resumed,
                          "params": {k: v.clone() for k, v in model.state_dict().items()},
                          "files": sorted(os.listdir(out))}
    w.destroy()
    # Graphcore's BERT: optimizer.state_dict() saved on instance 0 alone, loaded by every
    # instance; process 1 must not step process 0's chunks
    _, opt, w, _ = train(name, True, range(3))
    if rank == 0:
        torch.save(opt.state_dict(), os.path.join(out, "opt.pt"))
    w.destroy()
    dist.barrier()
    model, opt, wrapped = wrap(name, True)
    opt.load_state_dict(torch.load(os.path.join(out, "opt.pt"), weights_only=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        wrapped(*batch(name, 3, rank))
        refused = None
    except poptorch.OptimizerError as e:
        refused = str(e)
    results["rank 0's state everywhere"] = (refused, all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()))
    wrapped.destroy()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
