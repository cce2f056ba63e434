"""Where a training loop is in its data, saved with every checkpoint so a resume continues there.

The :class:`~recis_async.Trainer` keeps a :class:`DataPosition` on its bus; its state (under the
``state_key`` ``"Trainer"``) goes into each checkpoint with the other hooks' states:

* ``epoch``, ``window`` and ``batches``: the pass being read and how many of its batches the
  saved steps trained on;
* ``rng`` and ``generators``: the random state the pass's iterator was created under -- torch's
  default CPU generator (a ``DataLoader`` draws its shuffling seed and its workers' seeds from
  it) and every ``torch.Generator`` of the loader, its sampler and batch sampler -- so that
  ``iter(loader)`` on resume yields the same order, ``shuffle=True`` included;
* ``rng_now``: torch's CPU generator at the save, restored once the consumed batches are
  skipped, so dropout and the like continue as in a run never stopped.

The random states are restored in single-process runs only: in a distributed run each rank has
its own and rank 0's would overwrite them (a ``DistributedSampler`` orders by its seed and the
epoch, which :meth:`DataPosition.begin_pass` sets).  CUDA generators are not saved (reading their
state is a device operation).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from .. import dist
from ..hook import Hook

__all__ = ["DataPosition", "Restored"]

logger = logging.getLogger(__name__)


class Restored(NamedTuple):
    """The position a checkpoint was taken at: resume the pass ``(epoch, window)`` after
    ``batches`` batches, with the iterator created under ``rng``/``generators``."""

    epoch: int
    window: int
    batches: int
    rng: torch.Tensor | None
    generators: list[torch.Tensor]
    rng_now: torch.Tensor | None


class DataPosition(Hook):
    """The trainer's place in its data (see the module's docstring); no event methods: the
    trainer moves it, checkpoints read it with :meth:`state_dict`.

    After a restore, :attr:`restored` holds the saved position until the trainer takes it.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.window = 0
        self.batches = 0  # batches of the current pass the completed steps trained on
        self._rng: torch.Tensor | None = None
        self._generators: list[torch.Tensor] = []
        self.restored: Restored | None = None

    @property
    def state_key(self) -> str:
        return "Trainer"

    def begin_pass(self, epoch: int, window: int, source: Any, restore: Restored | None) -> None:
        """Before ``iter(source)``: set the sampler's epoch, then record the random state the
        iterator is created under -- or, resuming this pass, put the saved one back first."""
        self.epoch, self.window, self.batches = epoch, window, 0
        for obj in _parts(source):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        generators = _generators(source)
        if restore is not None and restore.rng is not None and _single_process():
            if len(restore.generators) == len(generators):
                torch.set_rng_state(restore.rng)
                for gen, state in zip(generators, restore.generators, strict=True):
                    gen.set_state(state)
            else:
                logger.warning(
                    "the checkpoint holds %d data generator state(s), the data has %d: "
                    "its order may differ from the interrupted run's",
                    len(restore.generators),
                    len(generators),
                )
        self._rng = torch.get_rng_state()
        self._generators = [gen.get_state() for gen in generators]

    def skipped(self, batches: int, restore: Restored) -> None:
        """The consumed batches were skipped: count them and continue torch's CPU generator
        from where the checkpoint left it."""
        self.batches = batches
        if restore.rng_now is not None and _single_process():
            torch.set_rng_state(restore.rng_now)

    def end_pass(self) -> None:
        """The pass ran out of data: a save from now on resumes at the next one."""
        self.window += 1
        self.batches = 0
        self._rng, self._generators = None, []

    def end_epoch(self) -> None:
        """Every pass of the epoch ran out of data: a save resumes at the next epoch."""
        self.epoch += 1
        self.window = self.batches = 0
        self._rng, self._generators = None, []

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "window": self.window,
            "batches": self.batches,
            "rng": self._rng,
            "generators": list(self._generators),
            "rng_now": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in ("epoch", "window", "batches"):
            value = state.get(field)
            if type(value) is not int or value < 0:
                raise ValueError(
                    f"DataPosition.load_state_dict(state[{field!r}]): expected an int >= 0, "
                    f"got {value!r}"
                )
        rng, now = state.get("rng"), state.get("rng_now")
        generators = state.get("generators") or []
        for field, value in (
            ("rng", rng),
            ("rng_now", now),
            *(("generators", g) for g in generators),
        ):
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"DataPosition.load_state_dict(state[{field!r}]): expected a tensor or "
                    f"None, got {type(value).__name__}"
                )
        self.restored = Restored(
            state["epoch"], state["window"], state["batches"], rng, list(generators), now
        )

    def take_restored(self) -> Restored | None:
        """The restored position, once (``None`` when nothing was restored)."""
        restored, self.restored = self.restored, None
        return restored

    def __repr__(self) -> str:
        return f"<DataPosition epoch={self.epoch} window={self.window} batches={self.batches}>"


def _single_process() -> bool:
    return not (dist.is_initialized() and dist.get_world_size() > 1)


def _parts(source: Any) -> list[Any]:
    """The data object, its sampler, batch sampler and the batch sampler's sampler (distinct)."""
    batch_sampler = getattr(source, "batch_sampler", None)
    found: list[Any] = []
    for obj in (
        source,
        getattr(source, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if obj is not None and not any(obj is seen for seen in found):
            found.append(obj)
    return found


def _generators(source: Any) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects that order ``source`` (CPU ones)."""
    found: list[torch.Generator] = []
    for obj in _parts(source):
        gen = getattr(obj, "generator", None)
        if (
            isinstance(gen, torch.Generator)
            and gen.device.type == "cpu"
            and not any(gen is seen for seen in found)
        ):
            found.append(gen)
    return found
