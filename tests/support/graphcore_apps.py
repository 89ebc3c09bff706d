"""Graphcore's applications (graphcore/examples) on poptorch_lite, unmodified, against their own
CPU references: the training loops of their ``tests/cpu_ipu_test.py::test_ipu_cpu_match``, with
checks at least as close as theirs.

- ``gpt2`` (``nlp/gpt2/pytorch``; ``sharded`` or ``pipelined``): the app's ``GPT2Wrapper`` (its
  ``OptimizedGPT2Attention``, the LM head as a ``SerializedLinear`` (``poptorch.serializedMatMul``)
  tied to the embedding, a recomputation checkpoint in every layer, ``BeginBlock`` per layer
  with the embedding and the head back on IPU 0, ``poptorch.optim.AdamW``) against its
  ``cpu_wrapper`` with ``torch.optim.AdamW``, each step the mean of the micro-batches'
  gradients. ``sharded`` is the app's test (``ShardedExecution(AutoStage.AutoIncrement)``, one
  micro-batch a step); ``pipelined`` is how the app trains (``PipelinedExecution``), here with
  10 micro-batches a step (5 stages need 9). Every step's loss and, at the end, every weight
  are compared (the app's test: the loss within 1%); exits 1 past 1e-5 (loss) or 1e-4 (weight).
- ``bert`` (``nlp/bert/pytorch``): ``PipelinedBertForPretraining(config).parallelize()`` with the
  app's own options (``get_options``: pipelined, AutoIncrement, accumulation 10, its PopART
  settings) against the same model unparallelized in ``torch.optim.AdamW``, both embedding
  serializations and recomputation settings of the app's test, whose check (every step's
  loss within 1e-6) is kept; the token ids are fixed instead of the tokenizer's download.

- ``conformer`` (``speech/conformer/pytorch``): the app's own ``tests/test_forward_grad.py``,
  unmodified, under pytest: subsampling, convolution and layer-norm modules trained one SGD
  step, their gradients read back as anchored tensors (``anchorTensor("Gradient___...")``,
  ``getAnchoredTensor``) and compared with the CPU's within 1e-5, with the outputs.
- ``clip`` (``multimodal/CLIP/pytorch``): the app's own ``tests/cpu_ipu_test.py``, unmodified,
  under pytest: ``CLIP(config).parallelize()`` over 8 IPUs (``PipelinedExecution(AutoStage.
  SameAsIpu)``, accumulation 15, its feature-queue buffers) against the CPU model in
  ``torch.optim.AdamW`` for 10 steps, every loss within its 1e-6.

Not part of the suite: the apps pin older transformers than the ``hf`` extra's (4.26.1 for
GPT-2; BERT's 4.18.0 pin runs on 4.26.1 too) and import horovod, wandb and graphcore's
examples-utils at the top (stand-ins are made here; a single-process run never calls them).
In a venv of its own that reuses the project's torch::

    pip install transformers==4.26.1 'tokenizers<0.14' tfrecord scipy pyyaml pandas ftfy regex
    python -m poptorch_lite run tests/support/graphcore_apps.py gpt2 EXAMPLES/nlp/gpt2/pytorch sharded
    python -m poptorch_lite run tests/support/graphcore_apps.py gpt2 EXAMPLES/nlp/gpt2/pytorch pipelined
    python -m poptorch_lite run tests/support/graphcore_apps.py bert EXAMPLES/nlp/bert/pytorch
    python -m poptorch_lite run tests/support/graphcore_apps.py conformer EXAMPLES/speech/conformer/pytorch
    python -m poptorch_lite run tests/support/graphcore_apps.py clip EXAMPLES/multimodal/CLIP/pytorch
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


def gpt2(app: str, strategy: str) -> int:
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


def bert(app: str) -> int:
    sys.path[:0] = [app, stand_ins()]
    import poptorch
    import torch
    from transformers import BertConfig

    from args import parse_bert_args
    from ipu_options import get_options
    from modeling import PipelinedBertForPretraining

    failed = 0
    for recompute, serialization in [(False, 1), (True, 5)]:  # the app's test's parameters
        torch.manual_seed(0)
        config = BertConfig(**vars(parse_bert_args(
            "--config unit_test --lr-schedule constant --layers-per-ipu 0 3 --vocab-size 30400 "
            "--micro-batch-size 10 --device-iterations 1 --gradient-accumulation 10 "
            "--enable-half-partials False --optimizer AdamW --learning-rate 0.001".split())))
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        config.recompute_checkpoint_every_layer = recompute
        config.embedding_serialization_factor = serialization
        opts = get_options(config)
        opts.outputMode(poptorch.OutputMode.Final)
        model_cpu = PipelinedBertForPretraining(config).train()
        model_app = PipelinedBertForPretraining(config).parallelize().train()
        model_app.load_state_dict(model_cpu.state_dict())
        optimizer_cpu = torch.optim.AdamW(model_cpu.parameters(), lr=0.001)
        optimizer_app = poptorch.optim.AdamW(model_app.parameters(), lr=0.001, loss_scaling=1.0)
        trained = poptorch.trainingModel(model_app, opts, optimizer=optimizer_app)
        g = torch.Generator().manual_seed(3)
        length, masks = config.sequence_length, config.mask_tokens
        one = (torch.randint(1000, 2000, (1, length), generator=g),  # input_ids
               torch.ones(1, length, dtype=torch.long),  # attention_mask
               torch.zeros(1, length, dtype=torch.long),  # token_type_ids
               torch.randint(0, length, (1, masks), generator=g),  # masked_lm_positions
               torch.randint(0, config.vocab_size, (1, masks), generator=g),  # labels
               torch.zeros(1, 1, dtype=torch.long))  # next_sentence_label
        rows = config.micro_batch_size
        worst = 0.0
        for step in range(10):
            optimizer_cpu.zero_grad()
            for _ in range(rows):
                loss = model_cpu(*one)[0]
                loss.div(rows).backward()
            optimizer_cpu.step()
            app_loss = float(trained(*(t.repeat(rows, 1) for t in one))[0])
            worst = max(worst, abs(app_loss - float(loss)))
            print(f"step {step}: plain {float(loss):.7f}  poptorch_lite {app_loss:.7f}")
        trained.copyWeightsToHost()
        reference = model_cpu.state_dict()
        # With serialization, the app's SerializedLinear decoder has a bias of its own (loaded
        # from the tied one), so transformers' cls.predictions.bias is left unused by its
        # forward, on an IPU as here: the trained bias is the decoder's.
        unused = {"cls.predictions.bias"} if serialization > 1 else set()
        weights = max((v.float() - reference[k].float()).abs().max().item()
                      for k, v in model_app.state_dict().items() if k not in unused)
        trained.destroy()
        print(f"recomputation {recompute}, embedding serialization {serialization}: largest "
              f"loss difference {worst:.1e}, largest weight difference {weights:.1e}")
        failed |= worst > 1e-6 or weights > 1e-4
    return int(failed)


APP_TESTS = {"conformer": "tests/test_forward_grad.py", "clip": "tests/cpu_ipu_test.py"}


def app_test(app: str, test: str) -> int:
    """The app's own test, unmodified, under pytest in this process (``import poptorch`` is
    poptorch_lite here)."""
    sys.path[:0] = [app, stand_ins()]
    os.chdir(app)  # the tests write their log files where they run
    import pytest
    return int(pytest.main(["-q", "-s", "-p", "no:cacheprovider", test]))


if __name__ == "__main__":
    which, app = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.exit(gpt2(app, sys.argv[3] if len(sys.argv) > 3 else "sharded") if which == "gpt2"
             else bert(app) if which == "bert" else app_test(app, APP_TESTS[which]))
