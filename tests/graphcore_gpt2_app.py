"""Graphcore's GPT-2 application (graphcore/examples, nlp/gpt2/pytorch) on poptorch_lite, against
its own CPU reference: the training loop of its ``tests/cpu_ipu_test.py::test_ipu_cpu_match``,
with closer checks (every step's loss and, at the end, every weight, where the app's test
compares losses within 1%).

The application side is the app's ``GPT2Wrapper``, unmodified: its ``OptimizedGPT2Attention``,
the LM head as a ``SerializedLinear`` (``poptorch.serializedMatMul``, tied to the embedding),
a recomputation checkpoint in every layer, ``BeginBlock`` per layer with the embedding and the
head back on IPU 0, and ``poptorch.optim.AdamW``. The reference is the app's ``cpu_wrapper``
with ``torch.optim.AdamW``, each step the mean of the micro-batches' gradients.

Not part of the suite: the app pins transformers 4.26.1, older than the ``hf`` extra's, and
imports horovod, wandb and graphcore's examples-utils at the top (stand-ins are made here;
a single-process run never calls them). In a venv of its own that reuses the project's torch::

    pip install transformers==4.26.1 'tokenizers<0.14' tfrecord
    python -m poptorch_lite run tests/graphcore_gpt2_app.py EXAMPLES/nlp/gpt2/pytorch sharded
    python -m poptorch_lite run tests/graphcore_gpt2_app.py EXAMPLES/nlp/gpt2/pytorch pipelined

``sharded`` is the app's test (``ShardedExecution(AutoStage.AutoIncrement)``, one micro-batch a
step); ``pipelined`` is how the app trains (``PipelinedExecution(AutoStage.AutoIncrement)``),
here with 10 micro-batches a step (5 stages need 9). Prints each step's losses and the
largest weight difference; exits 1 if a loss differs by more than 1e-5 or a weight by more
than 1e-4.
"""

import os
import sys
import tempfile

STUBS = {  # imported at the top of the app's modules; a single-process run calls none of them
    "horovod/__init__.py": "",
    "horovod/torch.py": "def init(): pass\ndef rank(): return 0\ndef size(): return 1\n",
    "wandb.py": "def init(*a, **k): pass\ndef log(*a, **k): pass\n",
    "examples_utils/__init__.py": "def load_lib(*a, **k): return None\n",
}


def stand_ins() -> str:
    root = tempfile.mkdtemp(prefix="gpt2_app_stubs_")
    for path, text in STUBS.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    return root


def main(app: str, strategy: str) -> int:
    sys.path[:0] = [app, os.path.join(app, "tests"), stand_ins()]
    import poptorch  # poptorch_lite, through `python -m poptorch_lite run`
    import torch
    from transformers import GPT2Config

    from arguments import set_args
    from cpu_ipu_test import cpu_wrapper
    from train_gpt2 import GPT2Wrapper

    torch.manual_seed(0)
    args = set_args("--batch-size 1 --embedding-serialization-factor 2 --layers-per-ipu 1 3 "
                    "--matmul-proportion 0.2 0.2 --recompute-checkpoint-every-layer True".split())
    config = GPT2Config.from_json_file(os.path.join(app, "config", "config.json"))
    config.attn_pdrop = config.embd_pdrop = config.resid_pdrop = 0.0
    config.summary_first_dropout = 0.0
    config.activation_function = "gelu"
    config.n_layer, config.n_embd, config.n_head = 4, 256, 2
    config.vocab_size, config.n_positions = 20256, 128
    opts = poptorch.Options().deviceIterations(1)
    if strategy == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.AutoIncrement))
        opts.Training.gradientAccumulation(1)
    else:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
        opts.Training.gradientAccumulation(10)
    opts.outputMode(poptorch.OutputMode.Final)
    opts.randomSeed(1234)
    model_cpu = cpu_wrapper(config=config).train()
    model_app = GPT2Wrapper(args, config).train()
    model_app.load_state_dict(model_cpu.state_dict())
    optimizer_cpu = torch.optim.AdamW(model_cpu.parameters(), lr=0.001)
    optimizer_app = poptorch.optim.AdamW(model_app.model.parameters(), lr=0.001, loss_scaling=1.0)
    trained = poptorch.trainingModel(model_app, opts, optimizer=optimizer_app)
    G = opts.Training.gradient_accumulation
    tokens = torch.randint(0, config.vocab_size, (G, 129))
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    worst_loss = 0.0
    for step in range(6):
        optimizer_cpu.zero_grad()
        for k in range(G):
            loss = model_cpu(inputs[k:k + 1], labels[k:k + 1])[0]
            loss.backward()
        for p in model_cpu.parameters():
            if p.grad is not None:
                p.grad.div_(G)
        optimizer_cpu.step()
        app_loss = float(trained(inputs, labels)[0])
        worst_loss = max(worst_loss, abs(app_loss - float(loss)))
        print(f"step {step}: plain {float(loss):.6f}  poptorch_lite {app_loss:.6f}")
    trained.copyWeightsToHost()
    reference = model_cpu.state_dict()
    worst_weight = max((v.float() - reference[k].float()).abs().max().item()
                       for k, v in model_app.state_dict().items() if k in reference)
    print(f"{strategy}: largest loss difference {worst_loss:.2e}, "
          f"largest weight difference {worst_weight:.2e}")
    return int(worst_loss > 1e-5 or worst_weight > 1e-4)


if __name__ == "__main__":
    sys.exit(main(os.path.abspath(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "sharded"))
