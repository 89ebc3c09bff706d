"""The differential fuzzer's programs: small models drawn from a grammar, written as Python.

A :class:`Program` is data (stages, the ops each stage runs, the loss, the optimizer, the
edits a user makes between calls); :func:`source` writes it as the Python module a user
would have written, and :func:`build` executes that text. The text is the model: what a
failure prints is exactly what ran, and it runs as it stands (with ``tests/`` on the path
for the custom Functions of ``models.py``).

Every feature of the grammar is one entry of :data:`FEATURES` (forward ops, each at a
stage; some read at a second stage ``to``), :data:`LOSSES` or :data:`EDITS`, by name; the
names are what ``fuzz_draw.PENDING`` switches off and what the long profile counts.
Width 6 in, 6 hidden, 4 classes: every stage is ``h = tanh(l<s>(h))`` and then its ops;
the last stage ends with ``out = head(h)`` and the loss.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import tempfile
import textwrap
import zlib
from typing import NamedTuple

WIDTH, CLASSES = 6, 4


@dataclasses.dataclass(frozen=True)
class Op:
    """One feature of the forward: ``kind`` (a :data:`FEATURES` name) at ``stage``; those
    that act twice (a buffer written then read, a weight used again) act again at ``to``."""
    kind: str
    stage: int = 0
    to: int = 0


@dataclasses.dataclass(frozen=True)
class Edit:
    """What the user does after call ``call``: ``kind`` (an :data:`EDITS` name) to stage
    ``stage``'s parameter."""
    kind: str
    call: int = 0
    stage: int = 0


@dataclasses.dataclass(frozen=True)
class Program:
    """A small model, its loss, its optimizer and the edits between calls (see module doc).

    ``groups``: "one" param group, "two" (the head at another lr) or "partial" (the head's
    bias left out, for ``add_param_group``). ``ipus``: "distinct" (stage s on IPU s) or
    "loop" (stage s on IPU s % 2: virtual stages, ``AutoStage.AutoIncrement``). ``returns``:
    how forward returns its outputs (:data:`RETURNS`).
    """
    stages: int = 1
    ops: tuple = ()
    loss: str = "ce"
    optimizer: str = "sgd"
    groups: str = "one"
    edits: tuple = ()
    ipus: str = "distinct"
    returns: str = "tuple"

    def atoms(self) -> frozenset:
        """The grammar's names this program uses (what PENDING and the coverage count)."""
        return frozenset({o.kind for o in self.ops} | {self.loss} | {e.kind for e in self.edits}
                         | {f"optimizer={self.optimizer}", f"groups={self.groups}",
                            f"stages={self.stages}", f"ipus={self.ipus}",
                            f"returns={self.returns}"})


class Feature(NamedTuple):
    """The text one op adds: lines in ``__init__``, in forward at its stage, at its second
    stage (``read``), after the loss (``post``); and what it needs and does."""
    forward: str = ""
    init: str = ""
    read: str = ""
    post: str = ""
    imports: tuple = ()
    buffers: str = ""      # "own": forward writes a buffer of its own (replicas need
                           # broadcastBuffers(False): E-PART-10); "statistics": a
                           # normalisation's running statistics (kept per replica)
    refused: str = ""      # the docs/ERRORS.md id of the refusal it may meet (where:
                           # fuzz_refusals); "pending": any clean refusal, until its fix lands
    warned: str = ""       # the docs/ERRORS.md id of the warning it must give (W-LITE-13,
                           # W-LITE-14: where fuzz_refusals.DIFFERS says, values may differ)
    output: str = ""       # an extra output forward returns
    head: str = ""         # lines right after ``out = self.head(h)``


_STAT = f"self.register_buffer(\"stat{{i}}\", torch.zeros({WIDTH}))"
_WRITE = "with torch.no_grad():\n    self.stat{i}.mul_(0.5).add_(h.mean(0))"

# {i}: the op's index (unique names), {s}: its stage, {t}: its second stage, {p}: stage s's
# parameter that edits and hooks touch (the bias where the weight is parametrized).
FEATURES = {
    # gradient stops and shapes
    "stop": Feature("h = h.detach()"),
    "detach": Feature("h = 0.5 * h + 0.5 * h.detach()"),
    "dot_data": Feature("h = h + h.data"),
    "no_grad": Feature("with torch.no_grad():\n    scale{i} = h.abs().mean() + 1.0\n"
                       "h = h / scale{i}"),
    "inference_mode": Feature("with torch.inference_mode():\n    shift{i} = h.mean() * 0.1\n"
                              "h = h - shift{i}"),
    "no_grad_inplace": Feature("h = h * 1.0\nwith torch.no_grad():\n    h.clamp_(-0.5, 0.5)"),
    "function": Feature("h = ScaledBackward.apply(h, -0.5)",
                        imports=("from models import ScaledBackward",)),
    "straight_through": Feature("h = RoundThrough.apply(h * 4) / 4",
                                imports=("from models import RoundThrough",)),
    "custom_op": Feature("h = thirds_grad(h)", imports=("from models import thirds_grad",)),
    "poptorch_custom_op": Feature(
        "h = poptorch.custom_op([h], \"ScaledBackward\", \"poptorch_lite_test\", 1, "
        "example_outputs=[h],\n                       attributes={{\"scale\": -0.5}})[0]",
        imports=("import models",)),
    "checkpoint": Feature("h = torch.utils.checkpoint.checkpoint(torch.tanh, h, "
                          "use_reentrant=False)", imports=("import torch.utils.checkpoint",)),
    "tensor_hook": Feature("h = h * 1.0\nh.register_hook(lambda g: g * 2)"),
    "module_hook": Feature(init="self.l{s}.register_full_backward_hook(\n"
                           "    lambda m, gi, go: tuple(None if g is None else g * 0.5 "
                           "for g in gi))"),
    "pre_hook": Feature(init="self.l{s}.register_full_backward_pre_hook("
                        "lambda m, go: (go[0] * 3,))"),
    "forward_hook": Feature(init="self.l{s}.register_forward_hook(lambda m, i, o: o * 2)"),
    "param_hook": Feature(init="self.l{s}.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))"),
    # a hook on the gradient once accumulated (optimizer-in-backward's and gradient
    # compression's way in): it edits the parameter's ``.grad`` in place
    "post_accumulate_hook": Feature(init="def halve{i}(p):\n    p.grad.mul_(0.5)\n"
                                    "self.l{s}.bias.register_post_accumulate_grad_hook(halve{i})"),
    "removable_hook": Feature(init="self.handle{i} = self.l{s}.register_forward_hook("
                              "lambda m, i, o: o * 2)"),
    "frozen": Feature(init="self.l{s}.bias.requires_grad_(False)"),
    "input_inplace": Feature("x.mul_(0.5)"),
    # a penalty on the gradient with respect to the input (R1 regularization of a GAN's critic)
    "input_penalty": Feature("x = x.detach().requires_grad_()",
                             post="gx{i}, = torch.autograd.grad(out.sum(), x, create_graph=True)"
                                  "\nloss = loss + 0.1 * gx{i}.pow(2).sum()"),
    # second-order gradients: a gradient penalty, a gradient used as a value
    "penalty": Feature("anchor{i} = h",
                       post="g{i}, = torch.autograd.grad(out.sum(), anchor{i}, "
                            "create_graph=True)\nloss = loss + 0.1 * g{i}.pow(2).sum()"),
    "saliency": Feature("anchor{i} = h",
                        post="g{i}, = torch.autograd.grad(out.sum(), anchor{i}, "
                             "retain_graph=True)\nloss = loss + 0.1 * (g{i} * anchor{i}).sum()"),
    # buffers, tied weights, parametrizations
    "batchnorm_cumulative": Feature("h = self.bn{i}(h)", buffers="statistics",
                                    init=f"self.bn{{i}} = torch.nn.BatchNorm1d({WIDTH}, "
                                         "momentum=None)"),
    "shared_module": Feature(read="h = torch.tanh(self.l{s}(h))"),
    "weight_clip": Feature("with torch.no_grad():\n    self.l{s}.bias.clamp_(-0.1, 0.1)",
                           refused="E-PART-25 E-PART-26"),
    "batchnorm": Feature("h = self.bn{i}(h)", init=f"self.bn{{i}} = torch.nn.BatchNorm1d({WIDTH})",
                         buffers="statistics"),
    "buffer": Feature(_WRITE, init=_STAT, read="h = h + self.stat{i}", buffers="own"),
    "buffer_across": Feature(_WRITE, init=_STAT, read="h = h + self.stat{i}", buffers="own",
                             refused="E-PART-25 E-PART-26"),
    "counter": Feature("self.count{i} += 1\nh = h * (1 + 0.1 * self.count{i})",
                       init="self.register_buffer(\"count{i}\", torch.zeros(()))",
                       buffers="own"),
    # a buffer left out of the state dict (a step count, a cache), written in place
    "nonpersistent": Feature("self.seen{i}.add_(1)\nh = h * (1 + 0.1 * self.seen{i})",
                             init="self.register_buffer(\"seen{i}\", torch.zeros(()), "
                                  "persistent=False)", buffers="own"),
    # tensors kept as plain attributes, not buffers: read (a mask an edit replaces or
    # scales), and written in place by the forward (a counter)
    "tensor_attr": Feature("h = h * self.mask{s}", init=f"self.mask{{s}} = torch.ones({WIDTH})"),
    "tensor_counter": Feature("h = h * (1 + 0.1 * self.tally{i}.add_(1))",
                              init="self.tally{i} = torch.zeros(())", refused="E-PART-28"),
    # a buffer the forward rebinds to a new tensor (an EMA written by assignment, not in
    # place), and an embedding whose max_norm renormalises its rows in every forward
    "buffer_assign": Feature("self.ema{i} = 0.9 * self.ema{i} + 0.1 * h.mean(0).detach()\n"
                             "h = h + self.ema{i}",
                             init=f"self.register_buffer(\"ema{{i}}\", torch.zeros({WIDTH}))",
                             buffers="own", refused="E-PART-14"),
    "embedding_max_norm": Feature("h = h + self.emb{i}(y)",
                                  init=f"self.emb{{i}} = torch.nn.Embedding({CLASSES}, {WIDTH}, "
                                       "max_norm=1.0)"),
    "tied": Feature(read="h = h + 0.1 * F.linear(h, self.l{s}.weight)"),
    "weight_norm": Feature(init="self.l{s} = torch.nn.utils.parametrizations.weight_norm("
                                "self.l{s})"),
    "spectral_norm": Feature(init="self.l{s} = torch.nn.utils.parametrizations.spectral_norm("
                                  "self.l{s})", buffers="own",
                           refused="E-PART-25 E-PART-26"),
    "parametrize": Feature(init="torch.nn.utils.parametrize.register_parametrization("
                                "self.l{s}, \"weight\", Symmetric())",
                           imports=("import torch.nn.utils.parametrize",)),
    # random numbers
    "dropout": Feature("h = F.dropout(h, 0.3, self.training)"),
    "dropout_module": Feature("h = self.drop{i}(h)", init="self.drop{i} = torch.nn.Dropout(0.3)"),
    "rand_like": Feature("h = h + 0.1 * torch.rand_like(h)"),
    "generator": Feature("h = h + 0.1 * torch.randn(h.shape, generator=self.gen{i})",
                         init="self.gen{i} = torch.Generator().manual_seed(5)",
                         refused="E-OPT-41"),
    "python_random": Feature("h = h * (1 + random.random())", imports=("import random",),
                             warned="W-LITE-13"),
    "numpy_random": Feature("h = h * float(1 + np.random.rand())",
                            imports=("import numpy as np",), warned="W-LITE-13"),
    # Python values the forward reads: a tensor's, and attributes it keeps or the user sets
    "item": Feature("h = h * float(h.mean())", refused="E-PART-11"),
    "python_counter": Feature("self.steps{i} += 1\nh = h * (1 + 0.1 * self.steps{i})",
                              init="self.steps{i} = 0", warned="W-LITE-14"),
    "act_attr": Feature("h = self.act{s}(h)", init="self.act{s} = torch.tanh"),
    "temperature": Feature("h = h / self.temperature", init="self.temperature = 1.0"),
    # sequences
    "embedding": Feature("h = h + self.emb{i}(y)", init=f"self.emb{{i}} = torch.nn.Embedding("
                         f"{CLASSES}, {WIDTH})",
                         head="out = out + 0.1 * F.linear(h, self.emb{i}.weight)"),
    # sparse gradients (recommender models'), which SGD steps and Adam refuses
    "embedding_sparse": Feature("h = h + self.semb{i}(y)", init=f"self.semb{{i}} = "
                                f"torch.nn.Embedding({CLASSES}, {WIDTH}, sparse=True)"),
    "lstm": Feature("seq{i}, _ = self.lstm{i}(h.unsqueeze(1).repeat(1, 3, 1))\n"
                    "h = seq{i}[:, -1]",
                    init=f"self.lstm{{i}} = torch.nn.LSTM({WIDTH}, {WIDTH}, batch_first=True)"),
    "packed_lstm": Feature("packed{i} = pack_padded_sequence(h.unsqueeze(1).repeat(1, 3, 1), "
                           "(y % 3 + 1).cpu(),\n"
                           "                               batch_first=True, "
                           "enforce_sorted=False)\n"
                           "_, (hn{i}, _) = self.lstm{i}(packed{i})\nh = hn{i}[-1]",
                           init=f"self.lstm{{i}} = torch.nn.LSTM({WIDTH}, {WIDTH}, "
                                "batch_first=True)",
                           imports=("from torch.nn.utils.rnn import pack_padded_sequence",),
                           refused="E-PART-24"),
    "gru": Feature("seq{i}, _ = self.gru{i}(h.unsqueeze(1).repeat(1, 3, 1))\nh = seq{i}[:, -1]",
                   init=f"self.gru{{i}} = torch.nn.GRU({WIDTH}, {WIDTH}, batch_first=True)"),
    "mha": Feature("seq{i} = h.unsqueeze(1).repeat(1, 3, 1) * torch.tensor([1.0, 0.5, -1.0], "
                   "dtype=h.dtype).view(1, 3, 1)\n"
                   "att{i}, _ = self.mha{i}(seq{i}, seq{i}, seq{i})\nh = h + att{i}[:, 0]",
                   init=f"self.mha{{i}} = torch.nn.MultiheadAttention({WIDTH}, 2, dropout=0.1, "
                        "batch_first=True)"),
    "transformer": Feature("seq{i} = h.unsqueeze(1).repeat(1, 3, 1) * torch.tensor([1.0, 0.5, "
                           "-1.0], dtype=h.dtype).view(1, 3, 1)\n"
                           "h = self.enc{i}(seq{i})[:, -1]",
                           init=f"self.enc{{i}} = torch.nn.TransformerEncoderLayer({WIDTH}, 2, "
                                "dim_feedforward=8, dropout=0.1, batch_first=True)"),
    "conv": Feature("h = h + 0.1 * self.conv{i}(h.unsqueeze(1)).mean(1)",
                    init="self.conv{i} = torch.nn.Conv1d(1, 2, 3, padding=1)"),
    "attention": Feature("tokens{i} = h.reshape(-1, 2, 3)\n"
                         "h = h + F.scaled_dot_product_attention(tokens{i}, tokens{i}, "
                         "tokens{i}).reshape(-1, 6)"),
    # attention as Hugging Face models call it: dropout while training, a causal mask
    "attention_dropout": Feature("tokens{i} = h.reshape(-1, 2, 3)\n"
                                 "h = h + F.scaled_dot_product_attention(tokens{i}, tokens{i}, "
                                 "tokens{i}, dropout_p=0.2 if self.training else 0.0, "
                                 "is_causal=True).reshape(-1, 6)"),
    # activations a later stage reads again (``to`` >= ``stage``): a residual across stages,
    # views of one base (a split) and a view that is not contiguous (a transpose)
    "skip": Feature("skip{i} = h", read="h = h + skip{i}"),
    "split_skip": Feature("part{i}, rest{i} = h.split([2, 4], 1)",
                          read="h = h + torch.cat([rest{i}, part{i}], 1)"),
    "transpose_skip": Feature("ht{i} = h.t()", read="h = h + 0.5 * ht{i}.t()"),
    # a view of what a stage is given ({h}: its input), taken first thing and read later:
    # a stage whose output views its own argument
    "view_relay": Feature("relay{i} = {h}.t()", read="h = h + 0.5 * relay{i}.t()"),
    # everyday layers and modes of real models
    "relu_inplace": Feature("h = F.relu(h * 1.5 - 0.2, inplace=True)"),
    "group_norm": Feature("h = self.gn{i}(h)",
                          init=f"self.gn{{i}} = torch.nn.GroupNorm(2, {WIDTH})"),
    "bn_no_stats": Feature("h = self.bn{i}(h)", init=f"self.bn{{i}} = torch.nn.BatchNorm1d("
                                                    f"{WIDTH}, track_running_stats=False)"),
    "instance_norm": Feature(f"h = self.inorm{{i}}(h.reshape(-1, 2, 3)).reshape(-1, {WIDTH})",
                             init="self.inorm{i} = torch.nn.InstanceNorm1d(2, affine=True, "
                                  "track_running_stats=True)", buffers="statistics"),
    "prelu": Feature("h = self.prelu{i}(h)", init="self.prelu{i} = torch.nn.PReLU()"),
    "layernorm": Feature("h = self.ln{i}(h)", init=f"self.ln{{i}} = torch.nn.LayerNorm({WIDTH})"),
    "autocast": Feature("with torch.autocast(\"cpu\", dtype=torch.bfloat16):\n"
                        "    low{i} = F.linear(h, self.l{s}.weight)\n"
                        "h = h + 0.1 * low{i}.float()"),
    # what the forward returns beside the loss
    "metric": Feature(post="with torch.no_grad():\n    metric{i} = F.cross_entropy(out, y)",
                      output="metric{i}"),
    "accuracy": Feature(post="accuracy{i} = (out.argmax(1) == y).float().mean()",
                        output="accuracy{i}"),
    "prediction": Feature(post="prediction{i} = out.argmax(1)", output="prediction{i}"),
    # indexing, masks and constants the forward makes (position ids, class weights)
    "slice_inplace": Feature("h = h * 1.0\nh[:, :2] *= 2"),
    "index_put": Feature("h = h.clone()\nh[:, 0] = h[:, 1] * 0.5"),
    "arange": Feature(f"h = h + 0.01 * torch.arange({WIDTH}, dtype=h.dtype, device=h.device)"),
    "new_tensor": Feature("h = h * h.new_tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0])"),
    "gather": Feature(f"h = h + 0.1 * h.gather(1, (y % {WIDTH}).unsqueeze(1))"),
    "scatter": Feature(f"h = h.scatter_add(1, (y % {WIDTH}).unsqueeze(1), h[:, :1])"),
    "where_mask": Feature("h = torch.where((y > 1).unsqueeze(1), h, -h)"),
    "masked_softmax": Feature(f"h = h.masked_fill(torch.arange({WIDTH}, device=h.device) == 0, "
                              f"float(\"-inf\")).softmax(1) * {WIDTH}"),
    "topk": Feature("h = h + 0.1 * h.topk(2, 1).values.sum(1, keepdim=True)"),
    "cumsum": Feature(f"h = h.cumsum(1) / {WIDTH}"),
    "batch_center": Feature("h = h - h.mean(0, keepdim=True)"),
    "double_roundtrip": Feature("h = h.double().sin().to(h.dtype)"),
    "einsum": Feature("h = h + 0.1 * torch.einsum(\"bi,ji->bj\", h, self.l{s}.weight)"),
    # PopTorch's own ops that Graphcore's applications put in a forward (each is the
    # identity, or a matmul, in numbers)
    "recomputation_checkpoint": Feature("h = poptorch.recomputationCheckpoint(h)"),
    "print_tensor": Feature("h = poptorch.ipu_print_tensor(h, \"h{i}\")"),
    "nop": Feature("h = poptorch.nop(h)"),
    "available_memory": Feature("h = poptorch.set_available_memory(h * 1.0, 0.5)"),
    "serialized_matmul": Feature(
        "h = h + 0.1 * poptorch.serializedMatMul(h, self.l{s}.weight.t(), "
        "poptorch.MatMulSerializationMode.OutputChannels, 2)"),
    "for_loop": Feature("h, = poptorch.for_loop(2, lambda t: [torch.tanh(t) * 0.9], [h])"),
    "name_scope": Feature("with poptorch.NameScope(\"scope{i}\"):\n    h = torch.tanh(h)"),
    # a layer the forward never calls (a pretrained model's unused pooler): no gradient
    "unused": Feature(init=f"self.unused{{i}} = torch.nn.Linear({WIDTH}, {WIDTH})"),
}

#: Features acting at a second stage (``Op.to``; "buffer_across": another one); the rest
#: ignore ``to`` ("buffer" writes, then reads, at its own stage).
TWO_STAGE = {"buffer_across", "tied", "shared_module", "skip", "split_skip", "transpose_skip",
             "view_relay"}
#: Two-stage features whose second stage reads a value the first made: ``to`` >= ``stage``.
LATER = {"skip", "split_skip", "transpose_skip", "view_relay"}
#: Features whose forward line comes first, before stage 0 reads the input ``x``.
FIRST = {"input_inplace", "input_penalty"}
#: Features whose forward comes first in their stage, before ``h = tanh(l<s>(h))``.
AT_START = {"view_relay"}
#: Features that change l<s>'s weight into a computed one (edits then touch its bias).
PARAMETRIZED = {"weight_norm", "spectral_norm", "parametrize"}

_CE = "F.cross_entropy(out, y{})"
LOSSES = {
    "ce": "loss = " + _CE.format(""),
    "ce_sum": "loss = " + _CE.format(", reduction=\"sum\""),
    "nll": "loss = F.nll_loss(F.log_softmax(out, 1), y)",
    "mse": f"loss = F.mse_loss(out, F.one_hot(y, {CLASSES}).to(out.dtype))",
    "module_loss": "loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(out, y)",
    # arithmetic after a loss function
    "ce_times": "loss = 2 * " + _CE.format(""),
    "ce_div": "loss = " + _CE.format("") + " / 4",
    "ce_none_mean": "loss = " + _CE.format(", reduction=\"none\"") + ".mean()",
    "masked_mean": "per = " + _CE.format(", reduction=\"none\"") + "\nmask = (y > 0).float()\n"
                   "loss = (per * mask).sum() / mask.sum().clamp(min=1)",
    "ce_plus_l2": "loss = " + _CE.format("") + " + 0.5 * (self.head.weight ** 2).sum()",
    # identity_loss, all reductions
    "identity_mean": "loss = poptorch.identity_loss(" + _CE.format(", reduction=\"none\"")
                     + ", reduction=\"mean\")",
    "identity_sum": "loss = poptorch.identity_loss(" + _CE.format(", reduction=\"none\"")
                    + ", reduction=\"sum\")",
    "identity_none": "loss = poptorch.identity_loss(2 * " + _CE.format("")
                     + ", reduction=\"none\")",
    "identity_custom": "loss = poptorch.identity_loss((out - F.one_hot(y, 4).to(out.dtype))"
                       ".pow(2).mean() + 0.1 * out.abs().mean(), reduction=\"mean\")",
    "identity_none_vector": "loss = poptorch.identity_loss(" + _CE.format(", reduction=\"none\"")
                            + ", reduction=\"none\")",
    "identity_two": "loss = poptorch.identity_loss(" + _CE.format("") + " + F.mse_loss(out, "
                    f"F.one_hot(y, {CLASSES}).to(out.dtype)), reduction=\"none\")",
    # losses real programs write: a sum over the batch the forward sees, logits against
    # one-hot targets, class weights made in forward, a distillation's KL divergence
    "ce_sum_batch": "loss = " + _CE.format(", reduction=\"sum\"") + " / x.shape[0]",
    "bce": f"loss = F.binary_cross_entropy_with_logits(out, F.one_hot(y, {CLASSES}).to(out.dtype))",
    "weighted_ce": "loss = " + _CE.format(", weight=torch.tensor([1.0, 2.0, 0.5, 1.0], "
                                          "dtype=out.dtype, device=out.device)"),
    "smooth_l1": f"loss = F.smooth_l1_loss(out, F.one_hot(y, {CLASSES}).to(out.dtype))",
    "kl_div": "loss = F.kl_div(F.log_softmax(out, 1), F.softmax(out.detach() * 2, 1), "
              "reduction=\"batchmean\")",
}

# {p}: the edited stage's parameter; ``train`` is None on the plain PyTorch side.
EDITS = {
    "data_edit": "net.{p}.data.mul_(0.5)",
    "inplace_edit": "with torch.no_grad():\n    net.{p}.mul_(0.5)",
    "freeze": "net.{p}.requires_grad_(False)",
    "unfreeze": "net.{p}.requires_grad_(True)",
    "unfreeze_bias": "net.l{s}.bias.requires_grad_(True)",
    "load_state_dict": "net.load_state_dict({{k: v * 0.9 if v.is_floating_point() else v\n"
                       "                     for k, v in net.state_dict().items()}})",
    "wrapper_load": "loaded = {{k: v * 0.9 if v.is_floating_point() else v\n"
                    "          for k, v in net.state_dict().items()}}\n"
                    "(train if train is not None else net).load_state_dict(loaded)",
    "wrapper_attribute": "if train is not None:\n    train.l{s}.bias.data.mul_(0.5)\n"
                         "else:\n    net.l{s}.bias.data.mul_(0.5)",
    "buffers_edit": "with torch.no_grad():\n    for b in net.buffers():\n"
               "        b.mul_(0.5) if b.is_floating_point() else None",
    "lr": "opt.param_groups[0][\"lr\"] *= 0.5",
    "weight_decay": "opt.param_groups[0][\"weight_decay\"] = 0.01",
    "set_optimizer": "opt.param_groups[0][\"lr\"] *= 0.5\nif train is not None:\n"
                     "    train.setOptimizer(opt)",
    "add_param_group": "opt.add_param_group({{\"params\": [net.head.bias], \"lr\": 0.02}})",
    "scheduler": "sched.step()",
    "anneal": "net.temperature = 2.0",
    "replace_param": "net.{p} = torch.nn.Parameter(net.{p}.detach() * 0.5)",
    "reset_parameters": "net.l{s}.reset_parameters()",
    "momentum": "group = opt.param_groups[0]\nif \"momentum\" in group:\n"
                "    group[\"momentum\"] = 0.5\nif \"betas\" in group:\n"
                "    group[\"betas\"] = (0.5, 0.9)",
    "optimizer_reload": "opt.load_state_dict(opt.state_dict())",
    "detach_attach": "if train is not None and train.isAttachedToDevice():\n"
                     "    train.detachFromDevice()",
    "copy_weights": "if train is not None:\n    train.copyWeightsToHost()\n"
                    "    train.copyWeightsToDevice()",
    "host_step": "for p in net.parameters():\n    p.grad = torch.full_like(p, 0.5)\nopt.step()",
    "host_grad": "for p in net.parameters():\n    p.grad = torch.full_like(p, 0.5)",
    "host_forward": f"with torch.no_grad():\n    net(torch.ones(2, {WIDTH}), "
                    "torch.zeros(2, dtype=torch.long))",
    # a tensor attribute (tensor_attr's) replaced, or scaled in place
    "mask_replace": "if hasattr(net, \"mask{s}\"):\n"
                    f"    net.mask{{s}} = torch.linspace(0.5, 1.5, {WIDTH})",
    "mask_inplace": "if hasattr(net, \"mask{s}\"):\n    net.mask{s}.mul_(0.5)",
    # a parameter's tensor swapped under it (old code's loading and pruning), an initialiser
    "data_assign": "net.{p}.data = net.{p}.data * 0.5",
    "init_zeros": "torch.nn.init.zeros_(net.l{s}.bias)",
    # hooks added between calls, a layer replaced, the optimizer's state dropped
    "hook_add": "net.l{s}.register_forward_hook(lambda m, i, o: o * 0.5)",
    "post_hook_add": "def halve(p):\n    p.grad.mul_(0.5)\n"
                     "net.l{s}.weight.register_post_accumulate_grad_hook(halve)",
    # the optimizer's own hooks (torch's register_step_pre_hook and _post_hook): a weight
    # clipped after every step, as WGAN's critic is; gradients scaled before it
    "step_post_hook": "def clip(o, args, kwargs):\n    with torch.no_grad():\n"
                      "        for p in net.parameters():\n            p.clamp_(-0.2, 0.2)\n"
                      "opt.register_step_post_hook(clip)",
    "step_pre_hook": "def halve(o, args, kwargs):\n    for g in o.param_groups:\n"
                     "        for p in g[\"params\"]:\n            if p.grad is not None:\n"
                     "                p.grad.mul_(0.5)\nopt.register_step_pre_hook(halve)",
    # a checkpoint written, the model and the optimizer's state overwritten, the checkpoint
    # read back: poptorch's save_checkpoint/load_checkpoint against torch's state dicts (in
    # one process: where the processes write their own files, the examples skip it)
    "checkpoint_rewind": "if not torch.distributed.is_initialized():\n"
                         "    with tempfile.TemporaryDirectory() as folder:\n"
                         "        path = folder + \"/checkpoint.pt\"\n"
                         "        if train is not None:\n"
                         "            poptorch.save_checkpoint(path, train)\n"
                         "        else:\n"
                         "            saved = copy.deepcopy((net.state_dict(), opt.state_dict()))\n"
                         "        with torch.no_grad():\n"
                         "            for q in net.parameters():\n"
                         "                q.mul_(0.5)\n"
                         "        for st in opt.state.values():\n"
                         "            for v in st.values():\n"
                         "                if torch.is_tensor(v) and v.dim() > 0:\n"
                         "                    v.zero_()\n"
                         "        if train is not None:\n"
                         "            poptorch.load_checkpoint(path, train)\n"
                         "        else:\n"
                         "            net.load_state_dict(saved[0])\n"
                         "            opt.load_state_dict(saved[1])",
    # a parameter's storage replaced in place (pruning code), its whole tensor swapped
    # (torch.utils.swap_tensors, what Module.to does under
    # torch.__future__.set_swap_module_params_on_conversion), a state dict assigned
    "set_storage": "with torch.no_grad():\n    net.{p}.set_(net.{p}.detach().clone() * 0.5)",
    "swap_tensors": "torch.utils.swap_tensors(net.{p}, "
                    "torch.nn.Parameter(net.{p}.detach() * 0.5))",
    "assign_state_dict": "net.load_state_dict({{k: v * 0.9 if v.is_floating_point() else v\n"
                         "                     for k, v in net.state_dict().items()}}, "
                         "assign=True)",
    "backward_hook_add": "net.l{s}.register_full_backward_hook(\n"
                         "    lambda m, gi, go: tuple(None if g is None else g * 0.5 for g in gi))",
    "pre_hook_add": "net.l{s}.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))",
    "hook_remove": "for name, handle in list(vars(net).items()):\n"
                   "    if name.startswith(\"handle\"):\n        handle.remove()",
    "forward_replace": "net.l{s}.forward = lambda t, m=net.l{s}: F.linear(t, m.weight) * 0.5",
    "act_replace": "if hasattr(net, \"act{s}\"):\n    net.act{s} = torch.sigmoid",
    "dropout_p": "for m in net.modules():\n    if isinstance(m, torch.nn.Dropout):\n"
                 "        m.p = 0.1",
    "opt_state_edit": "for st in opt.state.values():\n    for v in st.values():\n"
                      "        if torch.is_tensor(v) and v.dim() > 0:\n            v.mul_(0.5)",
    "state_dict_inplace": "net.state_dict()[\"{p}\"].mul_(0.5)",
    "deepcopy_snapshot": "snapshot = copy.deepcopy(net)\nwith torch.no_grad():\n"
                         "    for q in snapshot.parameters():\n        q.mul_(0.0)\n"
                         f"    snapshot(torch.ones(2, {WIDTH}), torch.zeros(2, dtype=torch.long))",
    # a validation pass between calls, as Graphcore's CNN application runs one: eval mode,
    # an inferenceModel of the same model (the host's forward in plain PyTorch), train mode
    "validate": "net.eval()\nif train is not None:\n"
                "    val = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(4)\n"
                "        .setExecutionStrategy(poptorch.PipelinedExecution("
                "poptorch.AutoStage.AutoIncrement)))\n"
                f"    val(torch.ones(4, {WIDTH}), torch.zeros(4, dtype=torch.long))\n"
                "    val.destroy()\nelse:\n    with torch.no_grad():\n"
                "        for _ in range(4):  # one micro-batch a device iteration\n"
                f"            net(torch.ones(1, {WIDTH}), torch.zeros(1, dtype=torch.long))\n"
                "net.train()",
    "module_replace": f"net.l{{s}} = torch.nn.Linear({WIDTH}, {WIDTH})",
    "opt_state_clear": "opt.state.clear()",
    # the global random state between calls (a seed reset, a draw of the script's own, a
    # state saved and put back): the next call's draws follow it, as plain PyTorch's do
    "reseed": "torch.manual_seed(1234 + call)",
    "host_draw": "torch.randn(5)",
    "rng_rewind": "state = torch.get_rng_state()\ntorch.rand(3)\ntorch.set_rng_state(state)",
    # the host gradients (the user's again after a call), an average of the weights kept
    # beside them (swa_utils), an initialiser applied, and a round trip through float16
    # (which gives the buffers new tensors: refused as a replaced one, E-WRAP-21)
    "zero_grad_host": "opt.zero_grad(set_to_none=False)",
    "grad_assign": "net.{p}.grad = torch.ones_like(net.{p})",
    "ema_average": "ema = torch.optim.swa_utils.AveragedModel(net)\nema.update_parameters(net)",
    "apply_init": "net.apply(lambda m: torch.nn.init.zeros_(m.bias) "
                  "if isinstance(m, torch.nn.Linear) else None)",
    "half_then_float": "net.half()\nnet.float()",
    # modes: the submodules' flags are the user's ([Note: train and eval modes])
    "eval_mode": "net.eval()",
    "train_mode": "net.train()",
    "freeze_norm": "for m in net.modules():\n"
                   "    if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, "
                   "torch.nn.Dropout)):\n        m.eval()",
}

OPTIMIZERS = {
    "sgd": "torch.optim.SGD({}, lr=0.1)",
    "sgd_momentum": "torch.optim.SGD({}, lr=0.1, momentum=0.9)",
    "sgd_nesterov": "torch.optim.SGD({}, lr=0.1, momentum=0.9, nesterov=True)",
    "sgd_decay": "torch.optim.SGD({}, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)",
    "adam": "torch.optim.Adam({}, lr=0.01)",
    "adam_decay": "torch.optim.Adam({}, lr=0.01, weight_decay=0.01)",
    "rmsprop_centered": "torch.optim.RMSprop({}, lr=0.01, momentum=0.5, centered=True)",
    "adamw": "torch.optim.AdamW({}, lr=0.01)",
    "rmsprop": "torch.optim.RMSprop({}, lr=0.01)",
    # the flags users set: fused and foreach kernels, maximize (PopTorch takes torch's SGD,
    # Adam, AdamW and RMSprop: E-OPTIM-03 refuses the rest, as it does amsgrad)
    "adam_fused": "torch.optim.Adam({}, lr=0.01, fused=True)",
    "adamw_foreach": "torch.optim.AdamW({}, lr=0.01, foreach=True)",
    "sgd_maximize": "torch.optim.SGD({}, lr=0.1, momentum=0.9, maximize=True)",
    "rmsprop_fused": "torch.optim.RMSprop({}, lr=0.01, momentum=0.5, foreach=True)",
    "poptorch_sgd": "poptorch.optim.SGD({}, lr=0.1, momentum=0.9)",
    "poptorch_adam": "poptorch.optim.Adam({}, lr=0.01)",
    "poptorch_adamw": "poptorch.optim.AdamW({}, lr=0.01)",
    "poptorch_rmsprop": "poptorch.optim.RMSprop({}, lr=0.01)",
    "poptorch_lamb": "poptorch.optim.LAMB({}, lr=0.01)",
    "loss_scaled": "poptorch.optim.SGD({}, lr=0.1, momentum=0.9, loss_scaling=128.0)",
    "clipped": "poptorch.optim.SGD({}, lr=0.1, momentum=0.9, max_grad_norm=0.1)",
}
#: Edits a documented refusal may meet at the next call: edit -> its docs/ERRORS.md id (a
#: parameter or a layer replaced by another object than the one the wrapper took, as
#: ``load_state_dict(..., assign=True)`` replaces every parameter: E-WRAP-21).
REFUSABLE_EDITS = {"replace_param": "E-WRAP-21", "module_replace": "E-WRAP-21",
                   "assign_state_dict": "E-WRAP-21", "half_then_float": "E-WRAP-21"}
_GROUPS = {
    "one": "net.parameters()",
    "two": "[{\"params\": [p for n, p in net.named_parameters() if not n.startswith(\"head\")]},\n"
           "         {\"params\": net.head.parameters(), \"lr\": 0.05}]",
    "partial": "[p for n, p in net.named_parameters() if n != \"head.bias\"]",
}

_SYMMETRIC = '''
class Symmetric(torch.nn.Module):
    def forward(self, w):
        return (w + w.t()) / 2
'''


_SCHEDULER = '''def make_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


'''


#: How forward returns its outputs, as real programs do: ``(out, loss, extras...)``, the
#: loss first (``loss, out``), a dict as Hugging Face's models return one, the loss alone.
RETURNS = ("tuple", "loss_first", "dict", "loss_only")


def _returned(returns: str, extras: list) -> str:
    if returns == "loss_first":
        return "return " + ", ".join(["loss", "out"] + extras)
    if returns == "dict":
        return "return {" + ", ".join(f"\"{n}\": {n}" for n in ["out", "loss"] + extras) + "}"
    if returns == "loss_only":
        return "return loss"
    return "return " + ", ".join(["out", "loss"] + extras)


def outputs_of(result) -> list:
    """What a forward returned, in order: a dict's values, a tuple's items, or the one
    tensor."""
    if isinstance(result, dict):
        return list(result.values())
    return list(result) if isinstance(result, (tuple, list)) else [result]


def loss_of(program: Program, result):
    """The loss among what forward returned (:data:`RETURNS`)."""
    if program.returns == "dict":
        return result["loss"]
    if program.returns == "loss_only":
        return result
    return result[0 if program.returns == "loss_first" else 1]


def structure(result) -> tuple:
    """How a forward's result is laid out: a dict's keys, a tuple's length, or one tensor."""
    if isinstance(result, dict):
        return ("dict", tuple(result))
    return ("sequence", len(result)) if isinstance(result, (tuple, list)) else ("tensor",)


def param_of(program: Program, stage: int) -> str:
    """The parameter of ``stage`` that edits touch: l<s>'s weight, or its bias where the weight
    is computed by a parametrization."""
    kinds = {o.kind for o in program.ops if o.stage == stage}
    return f"l{stage}.bias" if kinds & PARAMETRIZED else f"l{stage}.weight"


def _fill(text: str, op: Op, i: int, program: Program) -> str:
    return text.format(i=i, s=op.stage, t=op.to, p=param_of(program, op.stage),
                       h="x" if op.stage == 0 else "h")


def _block(lines: list, indent: int) -> str:
    return textwrap.indent("\n".join(lines), " " * indent)


def source(program: Program) -> str:
    """The program as the Python module a user would write: ``Net``, ``make_optimizer``,
    ``make_scheduler`` and ``between_calls``."""
    imports = {"import copy", "import tempfile", "import torch", "import torch.nn.functional as F",
               "import poptorch_lite as poptorch"}
    init = [f"self.l{s} = torch.nn.Linear({WIDTH}, {WIDTH})" for s in range(program.stages)]
    init.append(f"self.head = torch.nn.Linear({WIDTH}, {CLASSES})")
    body, head, post, outputs = [], [], [], []
    for s in range(program.stages):
        ipu = s % 2 if program.ipus == "loop" else s
        body.append(f"poptorch.Block.start(\"s{s}\", ipu_id={ipu})")
        for i, op in enumerate(program.ops):
            if op.stage == s and op.kind in AT_START:
                body += _fill(FEATURES[op.kind].forward, op, i, program).split("\n")
        body.append(f"h = torch.tanh(self.l{s}({'x' if s == 0 else 'h'}))")
        for i, op in enumerate(program.ops):
            f = FEATURES[op.kind]
            if op.stage == s and f.forward and op.kind not in FIRST | AT_START:
                body += _fill(f.forward, op, i, program).split("\n")
            if f.read and (op.to if op.kind in TWO_STAGE else op.stage) == s:
                body += _fill(f.read, op, i, program).split("\n")
    for i, op in enumerate(program.ops):
        f = FEATURES[op.kind]
        imports.update(f.imports)
        if f.init:
            init += _fill(f.init, op, i, program).split("\n")
        if f.post:
            post += _fill(f.post, op, i, program).split("\n")
        if f.head:
            head += _fill(f.head, op, i, program).split("\n")
        if f.output:
            outputs.append(_fill(f.output, op, i, program))
    body += ["out = self.head(h)"] + head
    body += LOSSES[program.loss].split("\n") + post
    body.append(_returned(program.returns, outputs))
    for kind in sorted(FIRST & {o.kind for o in program.ops}, reverse=True):  # x unused yet
        body.insert(1, FEATURES[kind].forward)
    head = "\n".join(sorted(i for i in imports if i.startswith("import"))
                     + sorted(i for i in imports if i.startswith("from")))
    symmetric = _SYMMETRIC if "parametrize" in {o.kind for o in program.ops} else ""
    edits = []
    for call in sorted({e.call for e in program.edits}):
        edits.append(f"if call == {call}:")
        for e in program.edits:
            if e.call == call:
                edits += textwrap.indent(
                    EDITS[e.kind].format(p=param_of(program, e.stage), s=e.stage),
                    "    ").split("\n")
    optimizer = OPTIMIZERS[program.optimizer].format(_GROUPS[program.groups])
    scheduler = _SCHEDULER if "scheduler" in {e.kind for e in program.edits} else ""
    return f'''{head}
{symmetric}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
{_block(init, 8)}

    def forward(self, x, y):
{_block(body, 8)}


def make_optimizer(net):
    return {optimizer}


{scheduler}def between_calls(net, opt, sched, train, call):
    """The user's edits after call ``call`` (``train``: the wrapper; None in plain PyTorch)."""
{_block(edits or ["pass"], 4)}
'''


#: Where :func:`build` writes each program: a real file, as a user's model is in one (a
#: warning or a refusal names its line; generated code, ``<string>``, names none).
_FILES = tempfile.TemporaryDirectory(prefix="fuzz-programs-")


def build(program: Program) -> dict:
    """Execute :func:`source`: the namespace holding ``Net``, ``make_optimizer``,
    ``make_scheduler`` and ``between_calls``."""
    text = source(program)
    name = os.path.join(_FILES.name, f"fuzz_program_{zlib.crc32(text.encode()):08x}.py")
    if not os.path.exists(name):
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)  # for tracebacks
    namespace = {"__name__": "fuzz_program"}
    exec(compile(text, name, "exec"), namespace)  # noqa: S102: our own text
    return namespace


def writes_buffers(program: Program, kind: str = "") -> bool:
    """Whether forward changes a buffer (of ``kind``: "own" or "statistics"; any if empty)."""
    return any(FEATURES[o.kind].buffers and kind in ("", FEATURES[o.kind].buffers)
               for o in program.ops)
