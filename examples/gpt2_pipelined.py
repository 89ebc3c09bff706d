"""A small GPT-2 (Hugging Face transformers) trained pipelined on the Python standard library's sources.

Run (offline; needs transformers: pip install -e '.[hf]'):
    python examples/gpt2_pipelined.py
Four stages with recomputation, a longer run:
    python examples/gpt2_pipelined.py --stages 4 --recompute --epochs 2

The model is transformers' own ``GPT2LMHeadModel`` built from a small config,
unchanged: ``poptorch.BeginBlock`` on the embedding module and on transformer
layers splits it into ``--stages`` blocks, one stage (IPU, here a CPU stream) each.
The tied input and output embeddings live in the first and the last stage. The
text is every ``.py`` file of the running Python's standard library, read from
disk as bytes (a vocabulary of 256), cut into windows of ``--seq-len`` bytes; a
tenth of the windows is held out. The tqdm bar shows each step's loss (the mean
over its micro-batches, which ``OutputMode.All`` returns) and a moving average of
it; the held-out loss is measured before and after training with an inference
model of the same weights (dropout off, as PopTorch's inference session runs it).
"""

import argparse
import math
import pathlib
import sys
import sysconfig
import time

import torch
from tqdm import tqdm

import poptorch_lite as poptorch

try:
    import transformers
except ImportError:
    sys.exit("examples/gpt2_pipelined.py needs transformers: pip install -e '.[hf]'")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--stages", type=int, default=2, choices=(2, 4), help="pipeline stages")
parser.add_argument("--recompute", action="store_true",
                    help="keep only stage inputs and recompute activations in the backward")
parser.add_argument("--epochs", type=int, default=1, help="passes over the training windows")
parser.add_argument("--corpus-bytes", type=int, default=2_000_000,
                    help="bytes of the standard library's sources to use")
parser.add_argument("--seq-len", type=int, default=128, help="bytes per training window")
parser.add_argument("--batch-size", type=int, default=4, help="micro-batch size (windows)")
parser.add_argument("--gradient-accumulation", type=int, default=8,
                    help="micro-batches per optimizer step (a pipeline of S stages needs >= 2S-1)")
parser.add_argument("--layers", type=int, default=4, help="transformer layers")
parser.add_argument("--width", type=int, default=128, help="embedding width")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
parser.add_argument("--limit", type=int, default=0,
                    help="use only the first N training windows (0: all); for smoke runs")
parser.add_argument("--seed", type=int, default=42, help="random seed")


def corpus(limit_bytes: int) -> tuple:
    """The standard library's .py sources as one byte tensor; (bytes, files read)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total, files = [], 0, 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or total >= limit_bytes:
            continue
        data = path.read_bytes()[:limit_bytes - total]
        chunks.append(data)
        total += len(data)
        files += 1
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long(), files


def windows(text: torch.Tensor, seq_len: int, seed: int) -> tuple:
    """Non-overlapping windows of ``seq_len`` bytes, shuffled; (training, held out)."""
    rows = text[:len(text) // seq_len * seq_len].view(-1, seq_len)
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
    held = max(1, len(rows) // 10)
    return rows[held:], rows[:held]


def build(args) -> torch.nn.Module:
    """transformers' GPT-2 from a config, annotated with one block per stage."""
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # its loss, named: transformers warns when it must guess
    if args.layers % args.stages:
        parser.error(f"--layers {args.layers} do not split into {args.stages} stages")
    per = args.layers // args.stages
    poptorch.BeginBlock(model.transformer, "stage0", ipu_id=0)  # the embeddings and layer 0..
    for s in range(1, args.stages):
        poptorch.BeginBlock(model.transformer.h[s * per], f"stage{s}", ipu_id=s)
    return model


def options(args, training: bool) -> poptorch.Options:
    stages = [poptorch.Stage(f"stage{s}").ipu(s).recompute(args.recompute)
              for s in range(args.stages)]
    opts = poptorch.Options().randomSeed(args.seed)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*stages))
    if training:
        opts.Training.gradientAccumulation(args.gradient_accumulation)
        opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss, not the last one
    else:
        opts.deviceIterations(args.gradient_accumulation)
    return opts


def held_out_loss(model, args, rows: torch.Tensor) -> float:
    """The mean loss per byte on ``rows`` (whole calls only), by an inference model."""
    opts = options(args, training=False)
    per_call = args.batch_size * args.gradient_accumulation
    rows = rows[:max(per_call, len(rows) // per_call * per_call)]
    if len(rows) < per_call:
        rows = rows.repeat(math.ceil(per_call / len(rows)), 1)[:per_call]
    inference = poptorch.inferenceModel(model, opts)
    losses = [inference(input_ids=rows[i:i + per_call], labels=rows[i:i + per_call]).loss
              for i in range(0, len(rows), per_call)]
    inference.destroy()
    return torch.cat([loss.reshape(-1) for loss in losses]).mean().item()


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    text, files = corpus(args.corpus_bytes)
    train_rows, held_rows = windows(text, args.seq_len, args.seed)
    if args.limit:
        train_rows, held_rows = train_rows[:args.limit], held_rows[:args.limit]
    print(f"corpus: {len(text)} bytes from {files} files of the standard library, "
          f"{len(train_rows)} training and {len(held_rows)} held-out windows of {args.seq_len}")

    model = build(args)
    model.train()
    opts = options(args, training=True)
    data = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(train_rows),
                               batch_size=args.batch_size, shuffle=True, drop_last=True,
                               generator=torch.Generator().manual_seed(args.seed))
    print(f"{args.stages} stages (recompute {'on' if args.recompute else 'off'}), "
          f"{sum(p.numel() for p in model.parameters())} parameters, "
          f"{args.batch_size} x {args.gradient_accumulation} = {data.combinedBatchSize} "
          f"windows per step")
    before = held_out_loss(model, args, held_rows)

    optimizer = poptorch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    training = poptorch.trainingModel(model, opts, optimizer)
    first = running = None
    steps, start = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(data, desc=f"epoch {epoch}/{args.epochs}")
        for (rows,) in bar:
            loss = training(input_ids=rows, labels=rows).loss.mean().item()  # the step's mean
            first = loss if first is None else first
            running = loss if running is None else 0.9 * running + 0.1 * loss
            steps += 1
            bar.set_postfix({"step loss": f"{loss:.3f}", "moving average": f"{running:.3f}"})
    seconds = time.perf_counter() - start
    training.destroy()
    print(f"trained {steps} steps in {seconds:.1f} s: loss {first:.3f} at the first step, "
          f"{running:.3f} at the last (moving average: 0.9 old + 0.1 new per step)")
    after = held_out_loss(model, args, held_rows)
    print(f"held-out loss: {before:.3f} before training, {after:.3f} after "
          f"({after / math.log(2):.2f} bits per byte)")


if __name__ == "__main__":
    main()
