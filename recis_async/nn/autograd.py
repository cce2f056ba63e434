"""Autograd functions that read table rows and route their gradients into the table.

A table grows by swapping its weight's storage for a bigger one.  Autograd records the
shape a parameter had when it was first used in a graph, so an ordinary ``F.embedding``
followed by a growth in the same step (a second lookup inserting ids) would fail in
``backward``.  These functions therefore accumulate the row gradients into
``weight.grad`` themselves, at the table's current size, and return no gradient for the
weight input.  The weight is still an input, so the output requires grad exactly when the
weight does.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

__all__ = ["GradSink", "gather_rows", "sum_bags"]


class GradSink(Protocol):
    def accumulate_grad(self, slots: torch.Tensor, rows: torch.Tensor) -> None: ...


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, slots: torch.Tensor, sink: GradSink
    ) -> torch.Tensor:
        ctx.sink = sink
        ctx.save_for_backward(slots)
        return weight.index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        (slots,) = ctx.saved_tensors
        ctx.sink.accumulate_grad(slots, grad.contiguous())
        return None, None, None


class _SumBags(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        bag_of: torch.Tensor,
        sink: GradSink,
    ) -> torch.Tensor:
        ctx.sink = sink
        ctx.save_for_backward(slots, bag_of)
        return F.embedding_bag(slots, weight, offsets, mode="sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        slots, bag_of = ctx.saved_tensors
        # contiguous first: the gradient of a sum() arrives expanded (stride 0), and
        # index_select from an expanded tensor is an order of magnitude slower
        ctx.sink.accumulate_grad(slots, grad.contiguous().index_select(0, bag_of))
        return None, None, None, None, None


def gather_rows(weight: torch.Tensor, slots: torch.Tensor, sink: GradSink) -> torch.Tensor:
    """``weight[slots]``; the gradient goes to ``sink`` when one is needed."""
    if torch.is_grad_enabled() and weight.requires_grad:
        out: torch.Tensor = _GatherRows.apply(weight, slots, sink)
        return out
    return weight.detach().index_select(0, slots)


def sum_bags(
    weight: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    bag_of: torch.Tensor,
    sink: GradSink,
) -> torch.Tensor:
    """Per bag, the sum of ``weight[slots]``; bag ``i`` starts at ``offsets[i]``.

    ``bag_of[j]`` is the bag of ``slots[j]`` (used by the backward pass).
    """
    if torch.is_grad_enabled() and weight.requires_grad:
        out: torch.Tensor = _SumBags.apply(weight, slots, offsets, bag_of, sink)
        return out
    return F.embedding_bag(slots, weight.detach(), offsets, mode="sum")
