"""What the differential fuzzer found, each as its minimal example: they always run.

Each entry is the (program, config) that Hypothesis shrank a finding to
(``python benchmarks/fuzz.py --prove`` finds and shrinks every ``fuzz_draw.PENDING`` one
again), with the PENDING key that keeps it out of the short profile while its fix is
pending. tests/test_fuzz.py runs every entry: a strict xfail while its key is in PENDING,
so that the fix landing fails it (XPASS) until the key is deleted; after that, a regression
test. Print one as Python with ``fuzz_check.describe(found.program, found.config)``.
"""

from __future__ import annotations

from typing import NamedTuple, Union

from fuzz_config import Config
from fuzz_grammar import Edit, Op, Program
from fuzz_keras import KerasConfig


class Found(NamedTuple):
    """A finding's minimal example; ``pending``: its key in ``fuzz_draw.PENDING``."""
    name: str
    pending: str
    program: Program
    config: Union[Config, KerasConfig]


FOUND = [
    # -- issue 45's findings: arithmetic after a loss function --------------------------
    Found("loss_times_two", "ce_times", Program(loss="ce_times"), Config()),
    Found("loss_divided", "ce_div", Program(loss="ce_div"), Config()),
    Found("loss_none_then_mean", "ce_none_mean", Program(loss="ce_none_mean"), Config()),
    Found("masked_mean_of_losses", "masked_mean", Program(loss="masked_mean"), Config()),
    Found("loss_plus_regularizer", "ce_plus_l2", Program(loss="ce_plus_l2"), Config()),
    # -- second-order gradients ----------------------------------------------------------
    Found("gradient_penalty", "penalty", Program(ops=(Op("penalty"),)), Config()),
    Found("gradient_in_forward", "saliency", Program(ops=(Op("saliency"),)), Config()),
    # -- edits between calls where stages hold their own copies ------------------------
    Found("data_edit_ipu_model", "data_edit&device=ipu_model",
          Program(edits=(Edit("data_edit"),)), Config(device="ipu_model")),
    Found("data_edit_gpu_twin", "data_edit&device=gpu_twin",
          Program(edits=(Edit("data_edit"),)), Config(device="gpu_twin")),
    Found("requires_grad_off_ipu_model", "freeze&device=ipu_model",
          Program(edits=(Edit("freeze"),)), Config(device="ipu_model")),
    Found("requires_grad_off_gpu_twin", "freeze&device=gpu_twin",
          Program(edits=(Edit("freeze"),)), Config(device="gpu_twin")),
    Found("requires_grad_on_ipu_model", "unfreeze_bias&device=ipu_model",
          Program(ops=(Op("frozen"),), edits=(Edit("unfreeze_bias"),)),
          Config(device="ipu_model")),
    Found("requires_grad_on_gpu_twin", "unfreeze_bias&device=gpu_twin",
          Program(ops=(Op("frozen"),), edits=(Edit("unfreeze_bias"),)),
          Config(device="gpu_twin")),
    # -- a buffer written by one stage and read by another ------------------------------
    Found("buffer_written_by_a_later_stage", "buffer_across",
          Program(stages=2, ops=(Op("buffer_across", 1, 0),)), Config(G=3)),
    Found("buffer_read_by_a_later_stage", "buffer_across",
          Program(stages=2, ops=(Op("buffer_across", 0, 1),)), Config(G=3)),
    # -- packed sequences; random numbers outside torch's default generator -------------
    Found("packed_lstm", "packed_lstm", Program(ops=(Op("packed_lstm"),)), Config()),
    Found("user_generator", "generator", Program(ops=(Op("generator"),)), Config()),
    Found("python_random", "python_random", Program(ops=(Op("python_random"),)), Config()),
    Found("numpy_random", "numpy_random", Program(ops=(Op("numpy_random"),)), Config()),
    # -- a metric computed with a loss function under no_grad ---------------------------
    Found("no_grad_metric", "metric", Program(ops=(Op("metric"),)), Config()),
    # -- beyond issue 45 ----------------------------------------------------------------
    Found("lstm_in_a_compiled_stage", "lstm&compiled=True", Program(ops=(Op("lstm"),)),
          Config(compiled=True)),
    Found("parameter_replaced_between_calls", "replace_param",
          Program(edits=(Edit("replace_param"),)), Config()),
    Found("parameter_clamped_in_forward", "weight_clip", Program(ops=(Op("weight_clip"),)),
          Config()),
    Found("python_counter_in_forward", "python_counter",
          Program(ops=(Op("python_counter"),)), Config()),
    Found("attribute_changed_between_calls", "temperature&anneal",
          Program(ops=(Op("temperature"),), edits=(Edit("anneal"),)), Config()),
    Found("batchnorm_cumulative_average", "batchnorm_cumulative",
          Program(ops=(Op("batchnorm_cumulative"),)), Config()),
    Found("host_forward_batchnorm_ipu_model", "host_forward&batchnorm&device=ipu_model",
          Program(ops=(Op("batchnorm"),), edits=(Edit("host_forward"),)),
          Config(device="ipu_model")),
    Found("host_forward_batchnorm_gpu_twin", "host_forward&batchnorm&device=gpu_twin",
          Program(ops=(Op("batchnorm"),), edits=(Edit("host_forward"),)),
          Config(device="gpu_twin")),
    Found("loss_scaling_seen_by_a_clamping_hook", "optimizer=loss_scaled&param_hook",
          Program(ops=(Op("param_hook"),), optimizer="loss_scaled"), Config()),
    Found("clipping_counts_a_parameter_outside_the_optimizer", "optimizer=clipped&groups=partial",
          Program(optimizer="clipped", groups="partial"), Config()),
    *(Found(f"replica_buffers_reset_by_{edit}_{device}",
            f"{edit}&broadcast_buffers=False&device={device}",
            Program(ops=(Op("buffer"),), edits=(Edit(edit),)),
            Config(R=2, broadcast_buffers=False, device=device))
      for edit in ("buffers_edit", "host_forward", "load_state_dict")
      for device in ("ipu_model", "gpu_twin")),
    *(Found(f"replica_buffers_reset_by_a_second_program_{device}",
            f"vary_batch=True&broadcast_buffers=False&device={device}",
            Program(ops=(Op("buffer"),)),
            Config(R=2, broadcast_buffers=False, device=device, vary_batch=True))
      for device in ("ipu_model", "gpu_twin")),
    Found("parameter_hook_on_a_module_two_stages_use", "param_hook&shared_module",
          Program(stages=2, ops=(Op("param_hook"), Op("shared_module", 0, 1))), Config(G=3)),
    Found("parameter_hook_without_gradient_compiled", "compiled=True&param_hook&stop",
          Program(ops=(Op("param_hook"), Op("stop"))), Config(compiled=True)),
    # -- found after issue 45's fixes and main's changes of design (state across stages,
    #    replicas' statistics, Python's random drawn at the trace) ----------------------
    Found("parameter_clamped_in_a_recomputed_stage", "weight_clip&recompute=True",
          Program(ops=(Op("weight_clip"),)), Config(recompute=True)),
    Found("parameter_clamped_without_gradient_compiled", "compiled=True&stop&weight_clip",
          Program(ops=(Op("stop"), Op("weight_clip"))), Config(compiled=True)),
    *(Found(f"{draw}_then_a_refusal_E_PART_10", f"{draw}&R=2",
            Program(ops=(Op("buffer"), Op(draw))), Config(R=2))
      for draw in ("python_random", "numpy_random")),
    *(Found(f"{draw}_then_a_refusal_E_PART_25", f"{draw}&buffer_across",
            Program(stages=2, ops=(Op("buffer_across", 1, 0), Op(draw))), Config(G=3))
      for draw in ("python_random", "numpy_random")),
    *(Found(f"state_snapshot_two_stages_on_{stages}_stages_gpu_twin",
            f"buffer_across&device=gpu_twin&stages={stages}",
            Program(stages=stages, ops=(Op("buffer_across", 0, 2),)),
            Config(schedule="sequential", device="gpu_twin"))
      for stages in (3, 4)),
    Found("parameter_snapshot_two_stages_on_gpu_twin", "weight_clip&shared_module&device=gpu_twin",
          Program(stages=3, ops=(Op("weight_clip"), Op("shared_module", 0, 2))),
          Config(schedule="sequential", device="gpu_twin")),
    # -- found by the 30-minute profile of 2026-11-28 ------------------------------------
    *(Found(f"parameter_clamped_in_forward_offloaded_{device}", f"weight_clip&offload=True&device={device}",
            Program(ops=(Op("weight_clip"),)), Config(device=device, offload=True))
      for device in ("ipu_model", "gpu_twin")),
    Found("gradient_penalty_through_a_checkpoint", "checkpoint&penalty",
          Program(ops=(Op("penalty"), Op("checkpoint"))), Config()),
    Found("gradient_penalty_two_stages_before_the_loss_on_gpu_twin", "penalty&device=gpu_twin",
          Program(stages=3, ops=(Op("penalty"),)), Config(G=5, device="gpu_twin")),
    Found("rmsprop_over_a_cumulative_batchnorm_rounds_alike_in_float64", "rmsprop&rounding",
          Program(stages=3, ops=(Op("batchnorm_cumulative"), Op("tied", 0, 1)),
                  optimizer="poptorch_rmsprop"), Config(G=5, D=2)),
    Found("gradient_penalty_through_a_batchnorm_a_stage_before", "batchnorm&penalty&stages=2",
          Program(stages=2, ops=(Op("penalty"), Op("batchnorm"))), Config(G=3)),
    Found("gradient_penalty_through_a_cumulative_batchnorm", "batchnorm_cumulative&penalty",
          Program(ops=(Op("penalty"), Op("batchnorm_cumulative"))), Config()),
    Found("python_counter_warned_in_every_example", "python_counter&again",
          Program(ops=(Op("python_counter"),)), Config(calls=1)),
    Found("keras_replicated_batchnorm", "keras_replicated_batchnorm",
          Program(ops=(Op("batchnorm"),)), KerasConfig(R=2)),
    Found("keras_replicated_spectral_norm", "keras_replicated_buffers",
          Program(ops=(Op("spectral_norm"),)), KerasConfig(R=2)),
    # -- found by the 20-minute profile of 2026-11-29 (seed 57): a copy into an IPU's own
    #    memory was 64-byte aligned where plain PyTorch's micro-batch view is not, and
    #    F.linear rounded otherwise ([Note: copies keep their alignment] in runtime/inputs)
    Found("input_copy_aligned_otherwise_ipu_model", "vary_batch=True&device=ipu_model",
          Program(), Config(D=2, device="ipu_model", vary_batch=True)),
    # -- found by the 14-minute profile after those fixes (seed 63): AOTAutograd made a
    #    Function's view output again outside its graph, without the Function's backward
    #    ([Note: compiled stages]: custom Functions' outputs are copies)
    Found("penalty_through_a_function_in_compiled_stages",
          "compiled=True&function&penalty&stages=3",
          Program(stages=3, ops=(Op("function", 1, 0), Op("penalty", 0, 0))),
          Config(G=5, compiled=True)),
    # -- found by the same run (seed 62): a refusal the catalogue's message did not cover
    #    (a buffer written by two stages; docs/ERRORS.md had only "written ... and read
    #    before that by" for E-PART-25/26)
    Found("state_written_by_two_stages_refused_as_catalogued", "spectral_norm&tied",
          Program(stages=2, ops=(Op("spectral_norm", 1, 0), Op("tied", 1, 0))), Config(G=3)),
    # -- found by --prove of the new skip features (seed 70), without them: a weight clip
    #    after a detach, compiled, zero bubble: the weight half gave the clipped bias the
    #    written value's gradient (zeros) where plain PyTorch gives None
    Found("weight_clip_after_a_stop_in_a_compiled_split_backward", "stop&weight_clip",
          Program(ops=(Op("stop"), Op("weight_clip"))),
          Config(schedule="zero_bubble", compiled=True)),
    # -- found by the 25-minute profile with the new features (seed 73): two splits of one
    #    value, one after a detach, read by the next stage: AOTAutograd made the views again
    #    from the wrong base and the compiled stage failed ([Note: compiled stages])
    Found("views_of_one_value_across_a_detach_compiled", "split_skip&stop",
          Program(stages=2, ops=(Op("split_skip", 0, 1), Op("stop"), Op("split_skip", 0, 1))),
          Config(G=3, compiled=True)),
    Found("transposes_of_one_value_across_a_detach_compiled", "transpose_skip&stop",
          Program(stages=2, ops=(Op("transpose_skip", 0, 1), Op("stop"),
                                 Op("transpose_skip", 0, 1))),
          Config(G=3, compiled=True)),
    # -- the same run (seed 74): the copy a forward's write to its input works on was 64-byte
    #    aligned where plain PyTorch writes the micro-batch's view ([Note: copies keep their
    #    alignment] in runtime/inputs)
    Found("input_written_in_place_rounds_as_its_view", "input_inplace&B=3&D=2",
          Program(ops=(Op("input_inplace"),)), Config(D=2, B=3)),
    # -- the next run (seed 92): a recompute started from an aligned copy of that input
    Found("recomputed_input_written_in_place_rounds_as_its_view",
          "input_inplace&recompute=True&D=2",
          Program(ops=(Op("input_inplace"),)), Config(D=2, B=3, recompute=True)),
    # -- the next run (seed 101): clipping summed the gradients' norms in the model's order
    #    where the norm of what the optimizer steps sums them in its groups' order (the
    #    batchnorm's weights come after the head in the model, before it in the groups)
    Found("clipping_sums_norms_in_the_optimizers_order",
          "batchnorm_cumulative&optimizer=clipped&groups=two",
          Program(ops=(Op("batchnorm_cumulative"),), optimizer="clipped", groups="two"),
          Config()),
    # -- the same run and seed 110: on the twin the plain side read views into the user's
    #    batch where a GPU reads the device's copy of each step's rows; the CPU kernels
    #    the twin computes with rounded the offset otherwise (the oracle's error: [Note: the
    #    twin's inputs] in fuzz_check)
    *(Found(f"twin_steps_read_the_devices_copy{'_captured' if graph else ''}{suffix}",
            f"{kinds}device=gpu_twin&graph={graph}",
            Program(ops=ops), Config(D=2, B=3, device="gpu_twin", graph=graph))
      for graph in (False, True)
      for suffix, kinds, ops in (("", "", ()),
                                 ("_written", "input_inplace&", (Op("input_inplace"),)))),
    # -- seed 120: an input's gradient penalty through a checkpoint sums in another order
    #    (5.55e-17 in float64), as a parameter's does: the oracle's tolerance rule missed it
    Found("input_penalty_through_a_checkpoint", "checkpoint&input_penalty",
          Program(ops=(Op("checkpoint"), Op("input_penalty"))), Config()),
    # -- found by hand (2026-11-30), then the grammar's new ``autocast`` factor: a call under
    #    torch.autocast after one outside it ran the first program; under it, a BatchNorm's
    #    and a LayerNorm's float32 weights were cast to the bfloat16 input's type (PopTorch's
    #    rule for mixed inputs plain PyTorch refuses, not these), and a bfloat16 dropout's
    #    native_dropout backward rounded otherwise than the decomposition plain PyTorch runs;
    #    and (seed 140) a weight used twice was cast once per use, where autocast's cache casts
    #    it once (make_fx turns the cache off)
    *(Found(f"{kind}_under_autocast", f"{kind}&autocast={when}", Program(ops=(Op(kind),)),
            Config(autocast=when, calls=3 if when == "second" else 2))
      for kind, when in (("batchnorm", "on"), ("layernorm", "on"), ("dropout", "on"),
                         ("batchnorm_cumulative", "second"), ("tied", "on"))),
    # -- found by hand (2026-11-30), then by the grammar's tensor attributes: a tensor kept as
    #    a plain attribute and replaced between calls was the trace's in every later call (an
    #    edit in place too, on a GPU); one the forward adds to was added to by the trace too,
    #    and twice per micro-batch under recomputation (now E-PART-28 there)
    Found("tensor_attribute_replaced_then_scaled", "tensor_attr&mask_replace&mask_inplace",
          Program(ops=(Op("tensor_attr"),), edits=(Edit("mask_replace"),
                                                   Edit("mask_inplace", call=1))),
          Config(calls=3, device="gpu_twin")),
    Found("tensor_attribute_counted_by_the_forward", "tensor_counter",
          Program(ops=(Op("tensor_counter"),)), Config()),
    # -- seed 141: an input's penalty with Python's random drawn in a program the temperature
    #    keys (the oracle replayed the old draw); seed 143: an input's penalty through a
    #    LayerNorm summed its second-order terms in another order (1 ulp; to the bit since
    #    seed 186's fix, below)
    Found("python_draw_in_a_program_an_attribute_keys", "python_random&temperature&anneal",
          Program(stages=2, ops=(Op("python_random"), Op("temperature")),
                  edits=(Edit("anneal"),)), Config(G=3)),
    Found("python_draw_with_an_attribute_the_forward_never_reads", "python_random&anneal",
          Program(ops=(Op("python_random"),), edits=(Edit("anneal"),)), Config()),
    Found("tensor_attribute_compiled_with_a_split_backward",
          "tensor_attr&schedule=zero_bubble&compiled=True",
          Program(ops=(Op("tensor_attr"),)), Config(schedule="zero_bubble", compiled=True)),
    Found("two_autocast_blocks_cast_the_weight_twice", "autocast&autocast",
          Program(ops=(Op("autocast"), Op("autocast"))), Config()),
    Found("input_penalty_through_a_layernorm", "input_penalty&layernorm",
          Program(ops=(Op("input_penalty"), Op("layernorm"))), Config()),
    Found("tensor_attribute_counted_under_recomputation", "tensor_counter&recompute=True",
          Program(ops=(Op("tensor_counter"),)), Config(G=3, recompute=True)),
    # -- found by the grammar's hooks and callables (2026-11-30): a forward hook registered
    #    or removed between calls, a forward patched onto a layer, and a function kept as an
    #    attribute and replaced were each the trace's in every later call
    Found("forward_hook_registered_between_calls", "hook_add",
          Program(edits=(Edit("hook_add"),)), Config()),
    Found("forward_hook_removed_between_calls", "removable_hook&hook_remove",
          Program(ops=(Op("removable_hook"),), edits=(Edit("hook_remove"),)), Config()),
    Found("forward_patched_onto_a_layer", "forward_replace",
          Program(edits=(Edit("forward_replace"),)), Config()),
    Found("activation_function_replaced", "act_attr&act_replace",
          Program(ops=(Op("act_attr"),), edits=(Edit("act_replace"),)), Config()),
    # -- seed 170: the oracle's, once hooks key programs: a Python draw replayed in the
    #    program a hook registered between calls traces again (the wrapper drew anew)
    Found("python_draw_in_a_program_a_hook_keys", "python_random&hook_add",
          Program(ops=(Op("python_random"),), edits=(Edit("hook_add"),)), Config()),
    # -- found once the fuzzer drew inference models (2026-11-30): a transformer layer in eval
    #    mode ran its separate ops where plain PyTorch runs its fused kernel (the trace's own
    #    modes declined the fast path); under a CPU autocast it now does so with W-LITE-20
    Found("encoder_layer_in_eval_mode_runs_its_fused_kernel", "transformer&eval_mode&inference",
          Program(ops=(Op("transformer"),), edits=(Edit("eval_mode"),)), Config(inference=True)),
    Found("encoder_layer_under_a_cpu_autocast", "transformer&eval_mode&inference&autocast",
          Program(ops=(Op("transformer"),), edits=(Edit("eval_mode"),)),
          Config(inference=True, autocast="on", calls=3)),
    Found("attention_kernel_under_a_cpu_autocast", "mha&eval_mode&inference&autocast",
          Program(ops=(Op("mha"),), edits=(Edit("eval_mode"),)),
          Config(inference=True, autocast="on", D=2)),
    #    ... and an inference model on separate memories left the host's embedding as it was
    #    where its forward renormalised rows in place (max_norm): the host now syncs from them
    Found("parameter_written_by_an_inference_forward", "embedding_max_norm&inference",
          Program(ops=(Op("embedding_max_norm"),)),
          Config(inference=True, R=2, device="ipu_model")),
    #    ... and the oracle's (seed 174): on the twin an inference call's one run reads its
    #    micro-batches from one copy of all rows, not a copy per step (2.98e-08, alignment)
    Found("inference_on_the_twin_reads_one_copy_of_the_call", "inference&device=gpu_twin",
          Program(), Config(inference=True, D=2, device="gpu_twin")),
    # -- the race seed 173's run left open, found again by the check that torch's generator
    #    moves by a call's bases alone: a gradient penalty through compiled attention made
    #    AOTAutograd recompute the attention's softmax in the backward with its dropout's
    #    draw, dead there; it drew outside every stream (2e-3 between runs, on streams)
    Found("compiled_backward_with_a_dead_dropout_draw", "input_penalty&mha&compiled",
          Program(stages=2, ops=(Op("input_penalty"), Op("mha"))),
          Config(schedule="sequential", compiled=True)),
    # -- seed 176: a replayed step left the user's gradient on a layer no stage reads (the
    #    host step after call 0 gave it one), and Adam's eager step after the replay moved it
    Found("replay_keeps_no_gradient_on_an_unused_layer", "unused&host_step&graph",
          Program(ops=(Op("unused"),), optimizer="adam", edits=(Edit("host_step"),)),
          Config(G=3, device="gpu_twin", graph=True, calls=4)),
    # -- seed 179: an inference replay cleared the user's gradients (that fix's first form
    #    cleared them for every replay; an eager inference run leaves them alone)
    Found("inference_replay_leaves_the_users_gradients", "host_grad&inference&graph",
          Program(stages=2, edits=(Edit("host_grad"),)),
          Config(D=2, device="gpu_twin", graph=True, calls=4, inference=True)),
    # -- seed 180, the first with processes: a pipeline over two processes sent a batch
    #    norm's saved statistics as values requiring grad, and the second stage's backward of
    #    a gradient penalty failed (no derivative for save_invstd); now autograd's own rule
    Found("saved_statistics_cross_processes_without_a_gradient", "input_penalty&batchnorm&processes",
          Program(stages=2, ops=(Op("input_penalty"), Op("batchnorm"))),
          Config(G=3, processes=2, spread="stages")),
    # -- this session's first runs with the optimizer state sharded over the processes:
    #    a Gradient___ anchor read the process's own gradient, not the reduced one the step
    #    used (the fuzzer reads the gradients through anchors where the state is sharded);
    #    and seed 184: a weight of one element (a PReLU's), which process 1 owns nothing
    #    of, made its gather require grad, and gloo's all-gather failed in the step
    Found("sharded_anchored_gradients", "sharded",
          Program(optimizer="adam"), Config(processes=2, sharded=True)),
    Found("sharded_weight_one_process_owns_nothing_of", "prelu&sharded",
          Program(ops=(Op("prelu"),), optimizer="adam"), Config(processes=2, sharded=True)),
    # -- seed 185: a pipeline over two processes whose first stage writes the call's
    #    argument in place (x.mul_(0.5)): the process that runs only the second stage left
    #    its argument as it was, where plain PyTorch writes it in every process
    Found("argument_written_in_a_pipeline_over_processes", "input_inplace&processes",
          Program(stages=2, ops=(Op("input_inplace"),)),
          Config(G=3, processes=2, spread="stages")),
    # -- seed 186: a gradient penalty over a gather, in bfloat16: the traced backward read
    #    each value autograd saved through an alias node, which moved the order in which the
    #    second-order backward summed the three gradients reaching the tanh's output
    Found("second_order_sums_in_plain_order", "input_penalty&gather&bfloat16",
          Program(ops=(Op("input_penalty"), Op("gather"))), Config(dtype="bfloat16")),
    #    the same fix explained the 1 ulp that an input's penalty with a second path to the
    #    first layer (a residual, a LayerNorm, a GroupNorm, a convolution) was allowed:
    #    those are now checked to the bit
    Found("input_penalty_with_a_residual_to_the_bit", "input_penalty&skip",
          Program(ops=(Op("input_penalty"), Op("skip"))), Config()),
    Found("input_penalty_with_a_convolution_to_the_bit", "input_penalty&conv&float64",
          Program(ops=(Op("input_penalty"), Op("conv"))), Config(dtype="float64", calls=3)),
    # -- post-accumulate hooks, new in the grammar (seed 197's proofs): where a stage's
    #    weights are copies, the copy whose .grad the step reads had none of the hooks; and
    #    with replicas in two processes, a hook registered between calls ran after the
    #    overlapped all-reduce had launched the gradient, and its edit was lost
    *(Found(f"post_accumulate_hook_{device}", f"post_accumulate_hook&device={device}",
            Program(ops=(Op("post_accumulate_hook"),)), Config(device=device))
      for device in ("ipu_model", "gpu_twin")),
    Found("post_accumulate_hook_registered_between_calls_ipu_model",
          "post_hook_add&device=ipu_model",
          Program(edits=(Edit("post_hook_add"),)), Config(device="ipu_model")),
    Found("post_accumulate_hook_registered_after_the_overlapped_all_reduce",
          "post_hook_add&processes=2",
          Program(edits=(Edit("post_hook_add"),)), Config(processes=2)),
    # -- seed 199: a compiled stage's split backward (zero bubble's I and W) ran a weight's
    #    post-accumulate hooks in its input half, where the weight has no gradient yet (the
    #    call failed on .grad None; with accumulation the hook would have seen the last
    #    micro-batch's sum); a weight with one now runs its backward whole in I, as a weight
    #    with a gradient hook did
    Found("post_accumulate_hook_in_a_compiled_split_backward",
          "post_accumulate_hook&compiled&schedule=zero_bubble",
          Program(ops=(Op("post_accumulate_hook"),)),
          Config(schedule="zero_bubble", compiled=True)),
    Found("post_accumulate_hook_registered_between_calls_compiled_split_backward",
          "post_hook_add&compiled&schedule=zero_bubble",
          Program(edits=(Edit("post_hook_add"),)),
          Config(schedule="zero_bubble", compiled=True, G=2)),
    # -- seed 201: with an accumulator of another dtype than the weight's (poptorch.optim's
    #    float32 accum_type for bfloat16 weights), each micro-batch's gradient moved into it
    #    after its backward, so a post-accumulate hook edited that micro-batch's gradient,
    #    where plain PyTorch's edits the running sum in .grad (found through the float64 run
    #    that confirms a float32 difference, which keeps poptorch.optim's float32
    #    accumulators); a weight with such a hook now sums in .grad, in its own dtype
    Found("post_accumulate_hook_with_an_accumulator_of_another_dtype",
          "post_accumulate_hook&optimizer=poptorch_sgd&dtype=bfloat16",
          Program(ops=(Op("post_accumulate_hook"),), optimizer="poptorch_sgd"),
          Config(dtype="bfloat16", G=2)),
    # -- seed 201: a pipeline over two processes whose later stage detaches its input: the
    #    gradient of that input, which the later stage never makes, is sent as zeros, so the
    #    earlier stages' weights get zero gradients where plain PyTorch's have none (Adam then
    #    keeps state for them, and a decay would move them); pending
    Found("a_detached_input_of_a_stage_in_another_process",
          "stop&processes=2&spread=stages",
          Program(stages=3, ops=(Op("stop", stage=2),)),
          Config(G=5, processes=2, spread="stages")),
    # -- the optimizer's step hooks, new in the grammar: with its state sharded over two
    #    processes, a post-hook's clip of the weights was overwritten by the chunks' gather,
    #    and a pre-hook scaled chunks of the gradients that the anchors had read whole
    Found("step_post_hook_with_a_sharded_state", "step_post_hook&sharded",
          Program(edits=(Edit("step_post_hook"),)), Config(processes=2, sharded=True)),
    Found("step_pre_hook_with_a_sharded_state", "step_pre_hook&sharded",
          Program(edits=(Edit("step_pre_hook"),)), Config(processes=2, sharded=True)),
    # -- sparse gradients, new in the grammar: exact in one process on every device; over two
    #    processes the gradient all-reduce's buckets flattened dense tensors only, and the call
    #    failed in its backward (a loud ExecutionError, where plain PyTorch sums them); now a
    #    sparse gradient is summed alone, as a sparse tensor (update.sparse_gradients)
    Found("sparse_gradients_over_two_processes", "embedding_sparse&processes=2",
          Program(ops=(Op("embedding_sparse"),)), Config(processes=2)),
    Found("sparse_gradients_over_two_processes_split_backward", "embedding_sparse&processes=2",
          Program(ops=(Op("embedding_sparse"),)), Config(processes=2, D=2,
                                                          schedule="zero_bubble")),
]
