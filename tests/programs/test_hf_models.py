"""Hugging Face transformers models wrap unchanged ([Note: an export-style trace] in tracing).

Small models from a config, split in two stages with ``BeginBlock`` on a layer, trained
pipelined against plain PyTorch doing the same micro-batches (dropout included: each
micro-batch's random stream is seeded as the wrapper seeds it), with padding that differs
between micro-batches. Llama, T5 and BART keep the library's defaults (``use_cache=True``):
their key/value caches come back rebuilt at every call ([Note: container subclasses] in
compiler/structures.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import poptorch_lite as poptorch

from models import microbatch_seeds, trained_grads

transformers = pytest.importorskip("transformers")

G = 4  # micro-batches per step: >= 3, the minimum of a 2-stage pipeline in training
ROWS = 2  # per micro-batch
SEQ, VOCAB = 12, 48


def seeded(model_class, config):
    """``model_class(config)`` with the weights every test starts from."""
    torch.manual_seed(0)
    return model_class(config)


def gpt2(**overrides):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4,
                                     n_head=2, bos_token_id=0, eos_token_id=0,
                                     **{"use_cache": False, **overrides})
    return seeded(transformers.GPT2LMHeadModel, config)


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=3)
    return seeded(transformers.BertForSequenceClassification, config)


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    return seeded(transformers.LlamaForCausalLM, config)


def t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    return seeded(transformers.T5ForConditionalGeneration, config)


def bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32)
    return seeded(transformers.BartForConditionalGeneration, config)


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5, "bart": bart}


def batch(kind: str, seed: int):
    """One call's inputs: micro-batch 0 unpadded, the others padded by different amounts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (G * ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    for k in range(1, G):
        mask[k * ROWS:(k + 1) * ROWS, SEQ - 2 * k:] = 0
    if kind in ("gpt2", "llama"):
        labels = ids.masked_fill(mask == 0, -100)
    elif kind == "bert":
        labels = torch.randint(0, 3, (G * ROWS,), generator=g)
    else:  # an encoder-decoder: the decoder's targets
        labels = torch.randint(1, VOCAB, (G * ROWS, SEQ // 2), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def joined(outputs: list) -> list:
    """The leaves of each micro-batch's output, joined as ``OutputMode.All`` returns them."""
    columns = zip(*(torch.utils._pytree.tree_leaves(o) for o in outputs))
    return [torch.stack(c) if c[0].dim() == 0 else torch.cat(c) for c in columns]


def assert_same_output(out, ref_outputs: list) -> None:
    """Every leaf (loss, logits, each cache tensor) and the type of every node, as plain."""
    got, want = torch.utils._pytree.tree_flatten(out), torch.utils._pytree.tree_flatten(ref_outputs[0])
    assert str(got[1]) == str(want[1])
    for a, b in zip(got[0], joined(ref_outputs), strict=True):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=0)


def microbatch(inputs: dict, k: int) -> dict:
    return {name: t[k * ROWS:(k + 1) * ROWS] for name, t in inputs.items()}


SPLITS = {"gpt2": "transformer.h.2", "bert": "bert.encoder.layer.2", "llama": "model.layers.2",
          "t5": "decoder", "bart": "model.decoder"}


@pytest.mark.parametrize("kind,recompute", [("gpt2", True), ("bert", False), ("llama", False),
                                            ("t5", True), ("bart", False)])
def test_trains_pipelined_as_plain_pytorch(kind, recompute):
    """Losses, logits, caches, gradients and the weights after each step, with dropout in train
    mode; Llama, T5 and BART with the library's defaults (their caches returned)."""
    model, split = MODELS[kind](), SPLITS[kind]
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
        ref_outputs = []
        for k in range(G):
            torch.manual_seed(seeds[k])
            ref_outputs.append(ref(**microbatch(inputs, k)))
            ref_outputs[-1].loss.backward()
        for p in ref.parameters():
            p.grad.div_(G)
        ref_opt.step()
        assert type(out) is type(ref_outputs[0])
        assert_same_output(out, ref_outputs)
        losses.append(out.loss)
        params, grads = dict(model.named_parameters()), trained_grads(wrapped)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads.get(n), p.grad, atol=1e-5, rtol=0, msg=n)
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


@pytest.mark.parametrize("kind", ["llama", "t5", "bart"])
def test_inference_with_the_default_cache_equals_plain_eval(kind):
    """``use_cache=True`` (the default): a ``DynamicCache`` (Llama) or an ``EncoderDecoderCache``
    (T5, BART) comes back at every call with that call's keys and values, never the trace's."""
    model = MODELS[kind]()
    poptorch.BeginBlock(model.get_submodule(SPLITS[kind]), "second", ipu_id=1)
    wrapped = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(G))
    ref = copy.deepcopy(model).eval()
    for seed in (1, 2):
        inputs = batch(kind, seed)
        labels = inputs.pop("labels")
        if kind != "llama":
            inputs["decoder_input_ids"] = labels
        out = wrapped(**inputs)
        with torch.no_grad():
            ref_outputs = [ref(**microbatch(inputs, k)) for k in range(G)]
        cache = out["cache"]
        assert type(cache) is type(ref_outputs[0]["cache"])
        assert type(cache).__name__ == ("DynamicCache" if kind == "llama" else "EncoderDecoderCache")
        assert_same_output(out, ref_outputs)


def test_batch_encoding_passed_whole_is_walked_as_a_dict():
    """A tokenizer's ``BatchEncoding`` (a ``UserDict``) as the model's one input is split and
    rebuilt per micro-batch as PopTorch does a dict."""

    class Tokenized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = llama()

        def forward(self, encoding):
            assert isinstance(encoding, transformers.BatchEncoding)
            return self.lm(**encoding).logits

    model = Tokenized().eval()
    wrapped = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(G))
    inputs = batch("llama", seed=3)
    del inputs["labels"]
    out = wrapped(transformers.BatchEncoding(inputs))
    with torch.no_grad():
        expected = torch.cat([model(transformers.BatchEncoding(microbatch(inputs, k)))
                              for k in range(G)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
