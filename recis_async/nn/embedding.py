"""DynamicEmbedding: bags of ids (padded or offset-encoded) combined by sum or mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ._device import host_to
from ._host import any_set, int_at
from .autograd import sum_bags
from .hashtable import HashTable, Initializer
from .policy_spec import AdmitHook, FilterHook
from .registry import DEFAULT_POLICIES, PolicyRegistry

__all__ = ["EmbeddingOption", "DynamicEmbedding"]

_COMBINERS = ("sum", "mean")


@dataclass(frozen=True)
class EmbeddingOption:
    """Configuration of one :class:`DynamicEmbedding` (validated on construction).

    ``shared_name`` names the table (logs, stats).  Sharing one table between features
    means using the same ``DynamicEmbedding`` module for them: there is no process-wide
    table registry.
    """

    embedding_dim: int
    shared_name: str
    combiner: Literal["sum", "mean"] = "sum"
    admit_hook: AdmitHook | None = None
    filter_hook: FilterHook | None = None
    initializer: Initializer | None = None
    dtype: torch.dtype = torch.float32
    policies: PolicyRegistry = DEFAULT_POLICIES
    sparse: bool = False

    def __post_init__(self) -> None:
        if type(self.embedding_dim) is not int or self.embedding_dim <= 0:
            raise ValueError(
                f"EmbeddingOption.embedding_dim: expected an int > 0, got {self.embedding_dim!r}"
            )
        if not isinstance(self.shared_name, str) or not self.shared_name:
            raise ValueError(
                f"EmbeddingOption.shared_name: expected a non-empty str, got {self.shared_name!r}"
            )
        if self.combiner not in _COMBINERS:
            raise ValueError(
                f"EmbeddingOption.combiner: expected one of {', '.join(_COMBINERS)}, "
                f"got {self.combiner!r}"
            )
        if self.admit_hook is not None and not isinstance(self.admit_hook, AdmitHook):
            raise ValueError(
                f"EmbeddingOption.admit_hook: expected an AdmitHook or None, "
                f"got {type(self.admit_hook).__name__}"
            )
        if self.filter_hook is not None and not isinstance(self.filter_hook, FilterHook):
            raise ValueError(
                f"EmbeddingOption.filter_hook: expected a FilterHook or None, "
                f"got {type(self.filter_hook).__name__}"
            )
        if self.initializer is not None and not callable(self.initializer):
            raise ValueError(
                f"EmbeddingOption.initializer: expected a callable or None, "
                f"got {type(self.initializer).__name__}"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"EmbeddingOption.dtype: expected a floating torch.dtype, got {self.dtype!r}"
            )
        if not isinstance(self.policies, PolicyRegistry):
            raise ValueError(
                f"EmbeddingOption.policies: expected a PolicyRegistry, "
                f"got {type(self.policies).__name__}"
            )
        if type(self.sparse) is not bool:
            raise ValueError(f"EmbeddingOption.sparse: expected a bool, got {self.sparse!r}")


class DynamicEmbedding(nn.Module):
    """Looks bags of ids up in a :class:`HashTable` and combines each bag into one row.

    Inputs (``forward``):

    * ``ids`` 2-D ``[batch, max_len]`` padded with ``-1`` (or with an explicit boolean
      ``mask``, True = real id, which lets ``-1`` be an id);
    * ``ids`` 1-D with ``offsets`` (1-D, the start of each bag, as ``nn.EmbeddingBag``);
    * ``ids`` 1-D alone: one row per id, uncombined.

    ``sum`` adds the rows of a bag; ``mean`` divides by the number of ids in the bag (ids
    without a row count, as zero rows).  Empty bags give zeros.

    Ids, offsets and masks are read on the host (the table's id map is there); the rows and
    the output are on the module's device (``.to(device)``), reached by one non-blocking copy
    of each lookup's indices.

    Args:
        option: the table's shape, policies and combiner (:class:`EmbeddingOption`).

    Raises:
        TypeError: an ``option`` that is not an :class:`EmbeddingOption`.
    """

    def __init__(self, option: EmbeddingOption) -> None:
        super().__init__()
        if not isinstance(option, EmbeddingOption):
            raise ValueError(
                f"DynamicEmbedding.option: expected an EmbeddingOption, got {type(option).__name__}"
            )
        self.option = option
        self.table = HashTable(
            [option.embedding_dim],
            dtype=option.dtype,
            initializer=option.initializer,
            admit_hook=option.admit_hook,
            filter_hook=option.filter_hook,
            name=option.shared_name,
            policies=option.policies,
            sparse=option.sparse,
        )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """See :meth:`HashTable.attach_optimizer`."""
        self.table.attach_optimizer(optimizer)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        admit_hook: AdmitHook | None = None,
    ) -> torch.Tensor:
        ids = self.table._check_ids(ids)
        if isinstance(offsets, torch.Tensor) and offsets.device.type != "cpu":
            offsets = offsets.cpu()  # read on the host, as the ids are
        if isinstance(mask, torch.Tensor) and mask.device.type != "cpu":
            mask = mask.cpu()
        if offsets is not None:
            flat, lengths, offsets = self._from_offsets(ids, offsets, mask)
        elif ids.dim() == 2:
            flat, lengths, offsets = self._from_padded(ids, mask)
        elif ids.dim() == 1 and mask is None:
            return self.table(ids, admit_hook=admit_hook)
        else:
            raise ValueError(
                f"ids: expected a 2-D padded tensor, or 1-D with optional offsets, got shape "
                f"{tuple(ids.shape)}" + (" with a mask" if mask is not None else "")
            )
        return self._combine(flat, lengths, offsets, admit_hook)

    @staticmethod
    def _from_offsets(
        ids: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mask is not None:
            raise ValueError(
                "mask: expected None with offsets (offset-encoded ids have no padding)"
            )
        if ids.dim() != 1:
            raise ValueError(f"ids: expected 1-D with offsets, got shape {tuple(ids.shape)}")
        if (
            not isinstance(offsets, torch.Tensor)
            or offsets.dim() != 1
            or offsets.is_floating_point()
        ):
            raise ValueError(f"offsets: expected a 1-D integer tensor, got {offsets!r:.80}")
        offsets = offsets.to(torch.int64)
        n = ids.numel()
        if offsets.numel() == 0:
            raise ValueError("offsets: expected at least one bag, got an empty tensor")
        if int_at(offsets, 0) != 0:
            raise ValueError(f"offsets: expected offsets[0] == 0, got {int_at(offsets, 0)}")
        ends = torch.cat([offsets[1:], torch.tensor([n])])
        lengths = ends - offsets
        if any_set(lengths < 0):
            raise ValueError(f"offsets: expected non-decreasing values <= len(ids) = {n}")
        return ids, lengths, offsets

    @staticmethod
    def _from_padded(
        ids: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mask is None:
            valid = ids != -1
        else:
            if (
                not isinstance(mask, torch.Tensor)
                or mask.dtype != torch.bool
                or mask.shape != ids.shape
            ):
                raise ValueError(
                    f"mask: expected a bool tensor of shape {tuple(ids.shape)}, got {mask!r:.80}"
                )
            valid = mask
        lengths = valid.sum(1)
        offsets = torch.cumsum(lengths, 0) - lengths
        return ids[valid], lengths, offsets

    def _combine(
        self,
        flat: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        admit_hook: AdmitHook | None,
    ) -> torch.Tensor:
        table = self.table
        bags = lengths.numel()
        slots, known = table.lookup_slots(flat, admit_hook)
        if known is None:
            kept_lengths, kept_offsets = lengths, offsets
        else:  # rows of unknown ids are zeros: leave them out of the sum
            slots = slots[known]
            bag = torch.repeat_interleave(torch.arange(bags), lengths)
            kept_lengths = torch.bincount(bag[known], minlength=bags)
            kept_offsets = torch.cumsum(kept_lengths, 0) - kept_lengths
        bag_of = torch.repeat_interleave(
            torch.arange(bags), kept_lengths, output_size=slots.numel()
        )
        mean = self.option.combiner == "mean"
        moved = host_to(
            table.device, slots, kept_offsets, bag_of, *([lengths.clamp(min=1)] if mean else [])
        )
        out = sum_bags(table.weight, moved[0], moved[1], moved[2], table)
        if mean:
            out = out / moved[3].unsqueeze(1).to(out.dtype)
        return out
