"""Closer checks of Graphcore's applications (graphcore/examples) on poptorch_lite, unmodified,
than their own tests make: each app's training against its own CPU reference, with every loss
and weight compared. ``benchmarks/apps.py`` runs them, with the apps' own tests; by hand:
``python -m poptorch_lite run benchmarks/app_checks.py NAME EXAMPLES/<app> [variant]``.

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
- ``dino`` (``vision/dino/pytorch``): the app's alignment script (``script/alignment.py``
  ``process``) on ``vit_mini``, sharded over IPUs [3, 0] for one step and pipelined with
  accumulation 12, against its CPU reference (``gpu_update_teacher`` after the step; the
  pipelined one written here, the app's passing every micro-batch's temperatures to each):
  every weight of student and teacher after the step, within 1e-6 (the app's test skips a key
  whose IPU weights did not move, so a teacher that never averaged would pass it), and the
  teacher must have moved; on one intra-op thread.
- ``mae`` (``vision/mae/pytorch``): reads what the app's alignment test wrote
  (``scripts/alignment``: the first step's gradients, anchored as ``Gradient___model.<param>``)
  and fails where none was compared or one differs beyond the test's 1e-4; then trains the
  app's IPU path (``mae_vit_align_patch16``, sharded over IPUs [3, 2], the app's AdamW at lr
  0.5) for 5 steps against the same model in plain PyTorch: every loss and weight within 1e-6.
  (The app's own CPU side gathers where its IPU side multiplies by one-hot matrices, so the
  two drift apart after the first step, on any platform.)
- ``conformer``, ``clip``, ``dino-test``...: see ``benchmarks/apps.py``.

The GPT-2 and BERT checks pin older transformers than the ``hf`` extra's (4.26.1 for GPT-2;
BERT's 4.18.0 pin runs on 4.26.1 too); the apps import wandb and graphcore's examples-utils
at the top, for which stand-ins are made here (a single-process run never calls them),
Conformer torchaudio (its generated data never does), and the CNNs Horovod, whose few calls
``stand_ins/horovod`` makes on torch.distributed for their popdist path.
"""

import atexit
import os
import shutil
import sys
import tempfile

STUBS = {  # imported at the top of the app's modules; a single-process run calls none of them
    "wandb.py": "def init(*a, **k): pass\ndef log(*a, **k): pass\n",
    "examples_utils/__init__.py": "def load_lib(*a, **k): return None\n",
    # speech/conformer imports torchaudio at the top of its data pipeline, which the generated
    # data never runs, and torchaudio has no release for torch 2.14: any use of it raises
    **{f"torchaudio/{path}": "def __getattr__(name):\n    raise ImportError(f'torchaudio."
       "{name}: torchaudio stands in here (benchmarks/app_checks.py), for a run that does "
       "not use it')\n" for path in ("__init__.py", "compliance/__init__.py",
                                       "compliance/kaldi.py")},
}


def _temporary_folder(prefix: str) -> str:
    """A new folder in the temporary directory, removed when this process exits (the app's
    modules are imported from it, or it is the app's working directory, until then)."""
    root = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, root, True)
    return root


def stand_ins() -> str:
    """A folder for the front of an app's path: ``STUBS``, and ``stand_ins/``'s Horovod on
    torch.distributed and generated CIFAR-10 (its ``sitecustomize``)."""
    root = _temporary_folder("apps_stand_ins_")
    shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins"), root,
                    dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for path, text in STUBS.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    return root


def gpt2(app: str, strategy: str = "sharded") -> int:
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


def dino(app: str) -> int:
    sys.path[:0] = [app, os.path.join(app, "script"), stand_ins()]
    os.chdir(_temporary_folder("dino_alignment_"))  # the script writes ./alignment
    import torch
    import alignment
    from alignment import default_config, process

    # One intra-op thread, as each of two concurrent stages gets on two cores: a reduction's
    # partial sums follow the thread count, and the script's AdamW (lr 1.0, eps 1e-5) turns
    # a gradient's last bits into 1e-3 of a weight.
    torch.set_num_threads(1)
    app_pipeline_compare = alignment.pipeline_compare
    failed = 0
    for name, pipelined in [("sharded, one step", False), ("pipelined, accumulation 12", True)]:
        runs = {}
        for device in ("ipu", "cpu"):
            alignment.pipeline_compare = app_pipeline_compare if device == "ipu" \
                else _dino_cpu_pipeline
            config = default_config()
            config.update(arch="vit_mini", device=device, pipeline=[3, 0] if device == "ipu"
                          else None, alignment_pipeline=pipelined, output=f"./{name[:4]}",
                          ema_so=os.path.join(app, "ema", "build", "exp_avg_custom_op.so"))
            os.makedirs(config["output"], exist_ok=True)
            runs[device] = process(config)
        (source, ipu), (_, cpu) = runs["ipu"], runs["cpu"]
        worst = max((ipu[k].float() - cpu[k].float()).abs().max().item() for k in cpu)
        moved = [k for k in cpu if k.startswith("teacher") and not torch.equal(
            cpu[k], source[k])]
        followed = all(torch.equal(ipu[k], cpu[k]) or (ipu[k] - cpu[k]).abs().max() <= 1e-6
                       for k in moved)
        print(f"dino {name}: largest weight difference {worst:.1e} over {len(cpu)} tensors; "
              f"{len(moved)} teacher tensors moved on the CPU, and followed: {followed}")
        failed |= worst > 1e-6 or not moved or not followed
    return int(failed)


def _dino_cpu_pipeline(config, model, optimizer, center):
    """The CPU side of the app's ``pipeline_compare``, which gives each micro-batch's forward
    all 12 micro-batches' teacher temperatures (a shape error on any platform): here each
    gets its own, as the pipelined model's micro-batches do; one step of 12, summed."""
    import torch
    img1, img2 = torch.load(os.path.join(config["output"], "image_pipeline.pth"))
    factor = torch.ones(1) * config["momentum_teacher"]
    optimizer.zero_grad()
    for _ in range(config["ga"]):
        _, loss = model(img1, img2, factor, center, 0.04 * torch.ones(1))
        loss.backward()
    optimizer.step()
    model.gpu_update_teacher()
    return model.state_dict()


def mae(app: str) -> int:
    sys.path[:0] = [app, os.path.join(app, "scripts"), stand_ins()]
    import torch
    here = os.path.join(app, "scripts", "alignment")
    cpu = torch.load(os.path.join(here, "cpu", "cpu_grad0.pt"))
    ipu = torch.load(os.path.join(here, "ipu", "ipu_grad0.pt"))
    compared = [k for k, g in cpu.items() if g is not None and k in ipu]
    worst = max((ipu[k] - cpu[k]).abs().max().item() for k in compared) if compared else 0.0
    print(f"mae, the app's test: {len(compared)} gradients compared (of {len(cpu)} on the "
          f"CPU), the largest difference {worst:.1e}")
    failed = not compared or worst > 1e-4
    # The app's CPU side gathers the kept patches where its IPU side multiplies by one-hot
    # matrices, so after one AdamW step at lr 0.5 the two drift apart. The same model and
    # arithmetic, plainly: 5 steps of the IPU path in PyTorch against poptorch_lite's.
    import copy
    import poptorch
    from alignment import get_data
    from core import models_mae
    from options import alignment_options
    torch.manual_seed(0)
    model = models_mae.mae_vit_align_patch16(norm_pix_loss=True, pipeline=[3, 2], device="ipu",
                                             mask_ratio=0.75, half=False)
    plain = copy.deepcopy(model)
    wrapped = poptorch.trainingModel(model, alignment_options(),
                                     poptorch.optim.AdamW(model.parameters(), lr=0.5, eps=1e-5))
    optimizer = poptorch.optim.AdamW(plain.parameters(), lr=0.5, eps=1e-5)
    img, _, _, ids_restore, keep_mat, restore_mat, mask = get_data(bs=1)
    worst_loss = 0.0
    for step in range(5):
        _, loss = wrapped(img, img, ids_restore, keep_mat, restore_mat, mask)
        optimizer.zero_grad()
        _, expected = plain(img, img, ids_restore, keep_mat, restore_mat, mask)
        expected.backward()
        optimizer.step()
        worst_loss = max(worst_loss, abs(float(loss) - float(expected)))
    wrapped.copyWeightsToHost()
    reference = plain.state_dict()
    weights = max((v - reference[k]).abs().max().item() for k, v in model.state_dict().items())
    print(f"mae, its IPU path in plain PyTorch, 5 steps: largest loss difference "
          f"{worst_loss:.1e}, largest weight difference {weights:.1e}")
    return int(failed or worst_loss > 1e-6 or weights > 1e-6)


class _NoDownloads:
    """A pytest plugin for YOLOv4's tests: the COCO image they fetch is a generated one (the
    same size, a fixed seed) and the pretrained weights they load stay the model's own
    (seeded) initial ones; everything else is the app's."""

    def pytest_sessionstart(self, session):
        import io
        import numpy as np
        import requests
        from PIL import Image
        import tests.test_tools as tools

        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (427, 640, 3),
                                                                  dtype=np.uint8))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG")

        class Response:
            content, status_code = buffer.getvalue(), 200

        requests.get = lambda *args, **kwargs: Response()

        def initial_weights(model, weight_path, is_inference=True):
            if is_inference:
                model.optimize_for_inference(fuse_all_layers=False)
            return model
        tools.load_and_fuse_pretrained_weights = initial_weights


def yolo(app: str) -> int:
    """YOLOv4's NMS, model and loss tests, unmodified, with no downloads (``_NoDownloads``)."""
    sys.path[:0] = [app, stand_ins()]
    os.environ["PYTORCH_APPS_DETECTION_PATH"] = app
    os.chdir(app)
    import pytest
    return int(pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "tests/nms_test.py",
                            "tests/model_test.py", "tests/loss_test.py::TestLoss::"
                            "test_weight_update"], plugins=[_NoDownloads()]))


CHECKS = {"gpt2": gpt2, "bert": bert, "dino": dino, "mae": mae, "yolo": yolo}


if __name__ == "__main__":
    which, app = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.exit(CHECKS[which](app, *sys.argv[3:]))
