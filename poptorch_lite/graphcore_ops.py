"""The custom ops Graphcore's applications call, implemented on torch ([Note: custom ops]).

Each follows the op's own source in graphcore/examples (its PopART op and Poplar codelets) or
PopART's documentation, cited beside it; ``custom_ops`` registers them from the start
(:data:`SHIPPED`), keyed ``(domain, name, version or None)``.

- ``ai.graphcore`` ``CopyTensor`` (YOLOv4) and ``RemapCE`` (MAE, GPT-2, Conformer): copies.
- ``com.acme`` ``ExpMovAvg`` (DINO): the teacher's weights, averaged from the student's after
  each optimizer step ([Note: after-step averages] in ``runtime/after_step``).
- ``ai.graphcore`` ``Nms`` (YOLOv4): greedy multi-class non-maximum suppression with a
  fixed-size output (:func:`nms`).
- ``ai.graphcore`` ``Ctc`` (Conformer): PopART's CTC loss, with its second output, the loss's
  gradient with respect to the log-probabilities (:func:`ctc`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compiler import markers
from .errors import CustomOpError
from .runtime import after_step


def _copy(x: torch.Tensor, **attributes) -> torch.Tensor:
    """A copy of ``x``; its gradient passes through unchanged."""
    return x.clone()


def _exp_mov_avg(student: torch.Tensor, teacher: torch.Tensor, factor: torch.Tensor,
                 **attributes) -> torch.Tensor:
    """DINO's ``ExpMovAvg``: after the step, ``teacher = factor * teacher + (1 - factor) *
    student`` ([Note: after-step averages] in ``runtime/after_step``); returns the teacher as
    it is now."""
    what = "custom_op 'ExpMovAvg' of domain 'com.acme'"
    if not markers.is_tracing():
        raise CustomOpError(
            f"{what} averages a teacher's weights after the optimizer's step of a wrapped "
            f"training model; outside one there is no step. Average after your own "
            f"optimizer.step(): teacher.mul_(f).add_(student * (1 - f)) under torch.no_grad()")
    if markers.training_tracer() is None:
        raise CustomOpError(
            f"{what} averages after the optimizer's step, and an inference model has none; "
            f"wrap the model with poptorch.trainingModel, or leave the op out of inference")
    if not (isinstance(student, torch.nn.Parameter) and isinstance(teacher, torch.nn.Parameter)):
        raise CustomOpError(
            f"{what} takes [student parameter, teacher parameter, factor], got "
            f"{type(student).__name__} and {type(teacher).__name__}: pass the parameters "
            f"themselves (module.weight), not values computed from them")
    if student.shape != teacher.shape or factor.numel() != 1:
        raise CustomOpError(
            f"{what}: the student {tuple(student.shape)} and teacher {tuple(teacher.shape)} "
            f"must have one shape, and the factor {tuple(factor.shape)} one element (one "
            f"micro-batch's)")
    after_step.AVERAGE(factor, student, teacher)
    return teacher.detach().clone()


# -- Nms (vision/yolo_v4/pytorch/utils/custom_ops/nms: nms.cpp nmsMulti, codelet.cpp) -------

@torch.library.custom_op("poptorch_lite::nms", mutates_args=())
def _nms_op(scores: torch.Tensor, boxes: torch.Tensor, threshold: float, score_threshold: float,
            num_detections: int, sigma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    B, N, C = scores.shape
    K = num_detections
    work = scores.detach().clone().reshape(B, N * C)
    lowest = torch.finfo(work.dtype).min  # the codelets' -numeric_limits<T>::max()
    indices = torch.full((B, K), -1, dtype=torch.long, device=scores.device)
    top_scores = torch.zeros((B, K), dtype=scores.dtype, device=scores.device)
    top_boxes = torch.zeros((B, K, 4), dtype=boxes.dtype, device=boxes.device)
    classes = torch.full((B, K), torch.iinfo(torch.int32).max, dtype=torch.int32,
                         device=scores.device)
    lengths = torch.full((B, K), K, dtype=torch.int32, device=scores.device)
    rows = torch.arange(B, device=scores.device)
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])  # [B, N]
    for i in range(K):  # ConditionVertex: go on while every batch's last best passed
        best, at = work.max(dim=1)  # the first of equal maxima
        box = boxes[rows, at // C]  # [B, 4]
        cls = at % C
        work[rows, at] = lowest
        kept = best > score_threshold
        indices[kept, i] = (at // C)[kept]
        top_scores[kept, i] = best[kept]
        classes[kept, i] = cls[kept].to(torch.int32)
        top_boxes[kept, i] = box[kept]
        lengths[~kept & (lengths[:, i] == K), i] = i
        # NmsMultiVertex: the best's class, in every box still above the score threshold
        where = (rows[:, None], torch.arange(N, device=scores.device), cls[:, None])
        same = work.view(B, N, C)[where]
        w = (torch.minimum(boxes[..., 2], box[:, None, 2]) -
             torch.maximum(boxes[..., 0], box[:, None, 0])).float().clamp(min=0)
        h = (torch.minimum(boxes[..., 3], box[:, None, 3]) -
             torch.maximum(boxes[..., 1], box[:, None, 1])).float().clamp(min=0)
        inter = w * h
        best_area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        iou = inter / (area.float() + best_area.float()[:, None] - inter)
        live = same > score_threshold
        if sigma == 0.0:
            same = torch.where(live & (iou > threshold), torch.full_like(same, lowest), same)
        else:
            same = torch.where(live, same * torch.exp(-(iou * iou) / sigma).to(same.dtype), same)
        work.view(B, N, C)[where] = same
        if not bool(kept.all()):
            break
    return indices, top_scores, top_boxes, classes, lengths.min(dim=1).values


@_nms_op.register_fake
def _nms_shapes(scores, boxes, threshold, score_threshold, num_detections, sigma):
    B, K = scores.shape[0], num_detections
    return (scores.new_empty((B, K), dtype=torch.long), scores.new_empty((B, K)),
            boxes.new_empty((B, K, 4)), scores.new_empty((B, K), dtype=torch.int32),
            scores.new_empty((B,), dtype=torch.int32))


def nms(scores: torch.Tensor, boxes: torch.Tensor, threshold: float = 0.5,
        scoreThreshold: float = 0.0, numDetections: int = 100, sigma: float = 0.0,
        useGather: int = 0, **attributes) -> list:
    """YOLOv4's ``Nms``: greedy non-maximum suppression over ``scores [B, N, C]`` and ``boxes
    [B, N, 4]`` (x1, y1, x2, y2), as its ``nmsMulti``: up to ``numDetections`` times, take each
    batch's best (box, class) score; keep it where it is above ``scoreThreshold``; then, in
    that class, drop every box whose IoU with it is above ``threshold`` (with ``sigma`` > 0,
    scale its score by exp(-IoU²/sigma) instead). The loop ends at the first round in which
    some batch's best is not above ``scoreThreshold``. ``useGather`` only chooses the IPU's
    kernel.

    Returns:
        ``[indices (long, -1 where empty), scores (0), boxes (0), classes (int32, INT32_MAX),
        detections per batch (int32)]``, each ``numDetections`` wide; a batch still finding
        boxes when another ran out counts ``numDetections``, as the codelets count it.
    """
    if scores.dim() != 3 or boxes.dim() != 3 or boxes.shape[:2] != scores.shape[:2] \
            or boxes.shape[2] != 4:
        raise CustomOpError(f"custom_op 'Nms': scores must be [batch, boxes, classes] and boxes "
                            f"[batch, boxes, 4], got {tuple(scores.shape)} and "
                            f"{tuple(boxes.shape)}")
    if not 0 < int(numDetections) <= scores.shape[1] or not float(threshold) > 0:
        raise CustomOpError(f"custom_op 'Nms': numDetections ({numDetections}) must be between 1 "
                            f"and the number of boxes ({scores.shape[1]}), and threshold "
                            f"({threshold}) above 0, as the op asserts")
    return list(_nms_op(scores, boxes, float(threshold), float(scoreThreshold),
                        int(numDetections), float(sigma)))


# -- Ctc (PopART's ai.graphcore Ctc, as speech/conformer calls it) ----------------------------

_REDUCTIONS = {"Sum": "sum", "Mean": "mean", "None": "none"}


def ctc(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
        target_lengths: torch.Tensor, reduction: str = "Mean", blank: int = 0,
        outDataType: str = "UNDEFINED", enableReducedClassesInLabel=False,
        **attributes) -> list:
    """PopART's ``Ctc``: ``[loss, gradient of the loss with respect to log_probs]`` for
    ``log_probs [T, N, C]`` (log-softmax), ``targets [N, S]`` and the lengths, with PopART's
    reductions (``"Sum"``, ``"Mean"``: each sequence's loss over its target length, then
    averaged, as torch's ``ctc_loss`` reduces; ``"None"``). The loss is torch's
    ``F.ctc_loss``, computed in float32 for 16-bit inputs and returned in ``log_probs``'
    dtype (``outDataType`` names another); its gradient trains through autograd.
    ``enableReducedClassesInLabel`` only chooses the IPU's kernel.
    """
    if reduction not in _REDUCTIONS:
        raise CustomOpError(f"custom_op 'Ctc': reduction must be one of {sorted(_REDUCTIONS)}, "
                            f"got {reduction!r}")
    dtypes = {"FLOAT": torch.float32, "FLOAT16": torch.float16}
    out = dtypes.get(str(outDataType).upper(), log_probs.dtype)
    lp = log_probs.float() if log_probs.dtype in (torch.float16, torch.bfloat16) else log_probs
    targets, il, tl = targets.long(), input_lengths.long(), target_lengths.long()
    loss = F.ctc_loss(lp, targets, il, tl, blank=int(blank), reduction=_REDUCTIONS[reduction])
    with torch.no_grad():  # the second output: d loss / d log_probs, not trained through
        nll, alpha = torch.ops.aten._ctc_loss(lp.detach(), targets, il, tl, int(blank), False)
        per = torch.ones_like(nll)
        if reduction == "Mean":
            per = per / tl.clamp(min=1).to(per.dtype) / nll.shape[0]
        grad = torch.ops.aten._ctc_loss_backward(per, lp.detach(), targets, il, tl, nll, alpha,
                                                 int(blank), False)
    return [loss.to(out), grad.to(log_probs.dtype)]


SHIPPED = {
    # vision/yolo_v4: a copy that PopART may not elide (its gradient is the identity)
    ("ai.graphcore", "CopyTensor", None): _copy,
    # vision/mae, nlp/gpt2: the same values laid out again across the IPU's tiles for the
    # matmul that follows (fwd_grain_size, ...: layout attributes, nothing to compute)
    ("ai.graphcore", "RemapCE", None): _copy,
    # vision/dino: the teacher's weights, an average of the student's after each step
    ("com.acme", "ExpMovAvg", None): _exp_mov_avg,
    # vision/yolo_v4: non-maximum suppression with a fixed-size output
    ("ai.graphcore", "Nms", None): nms,
    # speech/conformer: PopART's CTC loss
    ("ai.graphcore", "Ctc", None): ctc,
}
