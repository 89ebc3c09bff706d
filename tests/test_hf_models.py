"""Hugging Face transformers models wrap unchanged ([Note: an export-style trace] in tracing).

Small models from a config, split in two stages with ``BeginBlock`` on a layer, trained
pipelined against plain PyTorch doing the same micro-batches (dropout included: each
micro-batch's random stream is seeded as the wrapper seeds it), with padding that differs
between micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch

import poptorch_lite as poptorch

from models import microbatch_seeds

transformers = pytest.importorskip("transformers")

G = 4  # micro-batches per step: >= 3, the minimum of a 2-stage pipeline in training
ROWS = 2  # per micro-batch
SEQ, VOCAB = 12, 48


def gpt2(**overrides):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4,
                                     n_head=2, bos_token_id=0, eos_token_id=0,
                                     **{"use_cache": False, **overrides})
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def batch(kind: str, seed: int):
    """One call's inputs: micro-batch 0 unpadded, the others padded by different amounts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (G * ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    for k in range(1, G):
        mask[k * ROWS:(k + 1) * ROWS, SEQ - 2 * k:] = 0
    if kind == "gpt2":
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, 3, (G * ROWS,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def microbatch(inputs: dict, k: int) -> dict:
    return {name: t[k * ROWS:(k + 1) * ROWS] for name, t in inputs.items()}


@pytest.mark.parametrize("kind,split,recompute", [("gpt2", "transformer.h.2", True),
                                                   ("bert", "bert.encoder.layer.2", False)])
def test_trains_pipelined_as_plain_pytorch(kind, split, recompute):
    """Losses, logits, gradients and the weights after each step, with dropout in train mode."""
    model = gpt2() if kind == "gpt2" else bert()
    model.train()
    ref = copy.deepcopy(model)
    poptorch.BeginBlock(model.get_submodule(split), "second", ipu_id=1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.2))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    losses = []
    for step in range(2):
        inputs = batch(kind, seed=step)
        torch.manual_seed(100 + step)
        out = wrapped(**inputs)
        torch.manual_seed(100 + step)
        seeds = microbatch_seeds(1, G)
        ref_opt.zero_grad()
        ref_losses, ref_logits = [], []
        for k in range(G):
            torch.manual_seed(seeds[k])
            o = ref(**microbatch(inputs, k))
            o.loss.backward()
            ref_losses.append(o.loss.detach())
            ref_logits.append(o.logits.detach())
        for p in ref.parameters():
            p.grad.div_(G)
        ref_opt.step()
        assert type(out).__name__ == type(o).__name__
        torch.testing.assert_close(out.loss, torch.stack(ref_losses), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.logits, torch.cat(ref_logits), atol=1e-5, rtol=0)
        losses.append(out.loss)
        params = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n].grad, p.grad, atol=1e-5, rtol=0, msg=n)
            torch.testing.assert_close(params[n].detach(), p.detach(), atol=1e-5, rtol=0, msg=n)
    assert not torch.equal(losses[0], losses[1])


def test_gpt2_inference_of_a_train_mode_model_equals_plain_eval():
    """An inference session runs dropout as the identity ([Note: inference session])."""
    model = gpt2(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    model.train()
    poptorch.BeginBlock(model.transformer.h[2], "second", ipu_id=1)
    wrapped = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(G))
    inputs = batch("gpt2", seed=5)
    del inputs["labels"]
    out = wrapped(**inputs)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        expected = torch.cat([ref(**microbatch(inputs, k)).logits for k in range(G)])
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)
    assert model.training  # the user's flags are untouched


def test_gpt2_key_value_cache_is_refused_by_name_until_registered_with_pytree():
    """With ``use_cache`` the output holds a DynamicCache, which pytree cannot walk: it would be
    the trace's cache at every call, so it is refused. Registered with pytree (transformers'
    own export support), it comes back with each call's keys and values."""
    from transformers.cache_utils import DynamicCache
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    model = gpt2(use_cache=True).eval()
    poptorch.BeginBlock(model.transformer.h[2], "second", ipu_id=1)
    opts = poptorch.Options().deviceIterations(2)
    if torch.utils._pytree.tree_flatten(DynamicCache())[1].is_leaf():  # not yet registered
        with pytest.raises(poptorch.TraceError, match=r"returns a transformers\.cache_utils\."
                                                      r"DynamicCache that holds tensors"):
            poptorch.inferenceModel(model, opts)(input_ids=torch.randint(1, VOCAB, (4, SEQ)))
    register_dynamic_cache_export_support()
    wrapped = poptorch.inferenceModel(model, opts)
    for seed in (1, 2):
        ids = torch.randint(1, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))
        out = wrapped(input_ids=ids)
        with torch.no_grad():
            ref = model(input_ids=ids)
        assert type(out.past_key_values) is DynamicCache
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
        for got, want in zip(out.past_key_values.layers, ref.past_key_values.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)
