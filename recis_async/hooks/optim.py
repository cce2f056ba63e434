"""Optimizer-step hooks: gradient clipping, gradient-norm and learning-rate monitoring.

:class:`ClipGradNormHook` and :class:`GradNormHook` act at ``BeforeOptimizerStep``: once per
optimizer step, on the final gradients (accumulated over the micro-steps, unscaled by AMP),
never on a micro-step whose gradients are partial.  None of them reads a tensor's value on an
ordinary step: a norm is a device tensor, added to running sums on its device; at the end of
each log window (the training steps completing ``log_steps``, ``2 * log_steps``, ... counted
on ``global_step`` by the bus, so a resumed run reports at the same steps) the sums are handed
to a background job that reads them in a worker thread, then writes one log line and sends
the values to every :class:`~recis_async.hooks.MLTrackerHook` on the bus
(``MLTrackerHook.log_metrics``, as :class:`~recis_async.hooks.MetricReportHook` does).  They do
not ride on ``AfterStep.tracked``: the window's values exist only once the boundary step's
``AfterStep`` is being delivered, and reading them there would block that step.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio.to_thread
import torch

from .._checks import boolean, logger_or, positive_int
from ..events import AfterStep, BeforeOptimizerStep
from ..hook import Hook
from ..jobs import JobQueue
from ..subscription import Filters, is_train
from .logger import format_value
from .ml_tracker import MLTrackerHook

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["ClipGradNormHook", "GradNormHook", "LearningRateHook", "send_to_trackers"]


async def send_to_trackers(
    owner: Hook, bus: HookBus | None, step: int, values: Mapping[str, Any], log: logging.Logger
) -> None:
    """Send ``values`` of ``step`` to every open :class:`MLTrackerHook` on ``bus``."""
    if bus is None:
        return
    for hook in bus.hooks:
        if not isinstance(hook, MLTrackerHook):
            continue
        if hook.accepting:
            await hook.log_metrics(step, values)
        else:
            # Services close in reverse order of start: a tracker added before this hook is
            # still open here, one added after it may already be closed.
            log.warning(
                "%s: %r is closed; values of step %d not tracked (add %s after MLTrackerHook)",
                type(owner).__name__,
                hook,
                step,
                type(owner).__name__,
            )


class _Window(NamedTuple):
    step: int
    values: Callable[[], dict[str, Any]]  # run in the worker thread: floats or tensors


class _WindowHook(Hook):
    """Reports a window's values at the steps completing ``log_steps``, ``2 * log_steps``, ...:
    read off the step in a worker thread, logged, sent to the trackers."""

    def __init__(self, log_steps: int, logger: logging.Logger | None, default: str) -> None:
        owner = type(self).__name__
        self.log_steps = positive_int(owner, "log_steps", log_steps)
        self.logger = logger_or(owner, logger, default)
        self.last_values: tuple[int, dict[str, float]] | None = None
        self.subscription_filters = {"after_step": Filters(every_step=log_steps, when=is_train)}
        self._bus: HookBus | None = None
        self._jobs: JobQueue[_Window] | None = None

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None and not self._jobs.finished.is_set():
            raise RuntimeError(f"{self!r} is already attached to a bus that is still open")
        self._bus = bus
        self._jobs = JobQueue(f"{type(self).__name__}.report", self._report, on_error="log")
        bus.start_service(self._jobs)

    async def _put(self, step: int, values: Callable[[], dict[str, Any]]) -> None:
        if self._jobs is not None:
            await self._jobs.put(_Window(step, values))

    async def _report(self, window: _Window) -> None:
        values = await anyio.to_thread.run_sync(_read, window.values)
        if not values:
            return
        self.last_values = (window.step, values)
        self.logger.info(
            "%s <gstep=%d> %s",
            type(self).__name__,
            window.step,
            " ".join(f"<{k}={format_value(v)}>" for k, v in values.items()),
        )
        await send_to_trackers(self, self._bus, window.step, values, self.logger)


def _read(compute: Callable[[], dict[str, Any]]) -> dict[str, float]:
    """The window's values as floats (a worker thread: the one read of the device)."""
    out: dict[str, float] = {}
    for key, value in compute().items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, float | int) and not isinstance(value, bool):
            out[key] = float(value)
    return out


# ---------------------------------------------------------------------------------------
# gradient norms


def _as_params(owner: str, field: str, given: Any) -> list[tuple[str, torch.Tensor]]:
    """Named parameters from a module, a mapping of name -> tensor, or an iterable of
    tensors (named by position); ``None`` gives none."""
    if given is None:
        return []
    if isinstance(given, torch.nn.Module):
        return list(given.named_parameters())
    if isinstance(given, torch.Tensor):
        given = [given]
    items = list(given.items()) if isinstance(given, Mapping) else list(enumerate(given))
    out = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{owner}({field}=...): expected a module, tensors or a dict of name -> tensor, "
                f"got {type(p).__name__} at {name!r}"
            )
        out.append((f"{field}.{name}" if isinstance(name, int) else str(name), p))
    return out


def _grad_norms(grads: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Each gradient's ``p``-norm, a device tensor each (sparse ones over their values)."""
    dense = [g for g in grads if not g.is_sparse]
    norms = list(torch._foreach_norm(dense, p)) if dense else []
    out: list[torch.Tensor] = []
    it = iter(norms)
    for g in grads:
        if g.is_sparse:
            out.append(torch.linalg.vector_norm(g.coalesce().values(), p))
        else:
            out.append(next(it))
    return out


def _on(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: non-blocking copies of those elsewhere."""
    return [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]


def _total(norms: list[torch.Tensor], p: float) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(_on(norms, norms[0].device)), p)


class _NormSums:
    """A window's norms, kept as the device tensors they are: reduced (sum and max of the
    finite ones, counts) once, at the window's end."""

    __slots__ = ("layers", "totals")

    def __init__(self) -> None:
        self.totals: list[torch.Tensor] = []
        self.layers: list[torch.Tensor] = []

    def add(self, total: torch.Tensor, layers: torch.Tensor | None) -> None:
        self.totals.append(total.detach())
        if layers is not None:
            self.layers.append(layers.detach())

    def reduce(self, prefix: str, names: list[str], max_norm: float | None) -> dict[str, Any]:
        """The window's values as device tensors (no read): mean and max of the finite
        totals, how many were not finite, how many above ``max_norm``, each layer's mean."""
        if not self.totals:
            return {}
        totals = torch.stack(_on(self.totals, self.totals[0].device)).float()
        finite = torch.isfinite(totals)
        kept = torch.where(finite, totals, torch.zeros_like(totals))
        nonfinite = (~finite).sum().float()
        values: dict[str, Any] = {
            f"{prefix}grad_norm": kept.sum() / torch.clamp(len(self.totals) - nonfinite, min=1),
            f"{prefix}grad_norm_max": kept.max(),
            f"{prefix}grad_norm_nonfinite": nonfinite,
        }
        if max_norm is not None:
            values[f"{prefix}grad_norm_clipped"] = (totals > max_norm).sum().float()
        if self.layers:
            layers = torch.stack(self.layers).float().mean(dim=0)
            for name, norm in zip(names, layers, strict=False):
                values[f"{prefix}grad_norm/{name}"] = norm
        return values


class GradNormHook(_WindowHook):
    """The total gradient norm of every optimizer step, kept on the device, reported per
    window; optionally each parameter's norm.

    At ``BeforeOptimizerStep`` it computes the ``norm_type``-norm of all gradients together
    (as ``torch.nn.utils.clip_grad_norm_`` does) and adds it to the window's sums on the
    device.  Each window reports ``{prefix}grad_norm`` (the mean over its optimizer steps),
    ``{prefix}grad_norm_max`` and ``{prefix}grad_norm_nonfinite`` (steps whose norm was inf or
    NaN, e.g. an AMP step the ``GradScaler`` skips; left out of mean and max) and, with
    ``per_layer``, ``{prefix}grad_norm/<name>`` (each parameter's mean norm).

    Args:
        parameters: a module, tensors, or a dict of name -> tensor; ``None``: every parameter
            of the optimizers the event carries.
        norm_type: the norm's order (``2.0``; ``math.inf`` for the max-norm).
        per_layer: also report each parameter's norm.
        log_steps: training steps per window.
        prefix: prepended to the reported names.
        logger: where the window's line goes.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range, named.
    """

    def __init__(
        self,
        parameters: Any = None,
        *,
        norm_type: float = 2.0,
        per_layer: bool = False,
        log_steps: int = 100,
        prefix: str = "",
        logger: logging.Logger | None = None,
    ) -> None:
        owner = type(self).__name__
        super().__init__(log_steps, logger, "recis_async.hooks.optim")
        self._params = _as_params(owner, "parameters", parameters)
        self.norm_type = _norm_type(owner, norm_type)
        self.per_layer = boolean(owner, "per_layer", per_layer)
        if not isinstance(prefix, str):
            raise TypeError(f"{owner}(prefix=...): expected a str, got {prefix!r}")
        self.prefix = prefix
        self._sums = _NormSums()
        self._layer_names: list[str] = []

    def _named(self, event: BeforeOptimizerStep) -> list[tuple[str, torch.Tensor]]:
        if self._params:
            return self._params
        named = []
        for i, opt in enumerate(event.optimizers):
            for j, group in enumerate(getattr(opt, "param_groups", ())):
                named += [(f"opt{i}.group{j}.{k}", p) for k, p in enumerate(group["params"])]
        return named

    def before_optimizer_step(self, event: BeforeOptimizerStep) -> None:
        self._measure(event)

    def _measure(self, event: BeforeOptimizerStep) -> tuple[list[torch.Tensor], Any]:
        """The step's gradients and their total norm (a device tensor, or ``None``)."""
        named = [(n, p.grad) for n, p in self._named(event) if p.grad is not None]
        grads = [g for _, g in named]
        if not grads:
            return grads, None
        norms = _grad_norms(grads, self.norm_type)
        total = _total(norms, self.norm_type)
        layers = None
        if self.per_layer:
            layers = torch.stack(_on(norms, total.device))
            self._layer_names = [n for n, _ in named]
        self._sums.add(total, layers)
        return grads, total

    async def after_step(self, event: AfterStep) -> None:
        sums, self._sums = self._sums, _NormSums()  # reduced in the worker thread
        reduce = functools.partial(sums.reduce, self.prefix, self._layer_names, self._max_norm())
        await self._put(event.global_step, reduce)

    def _max_norm(self) -> float | None:
        return None

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} norm_type={self.norm_type} per_layer={self.per_layer} "
            f"log_steps={self.log_steps}>"
        )


class ClipGradNormHook(GradNormHook):
    """Clip gradients once per optimizer step, after AMP unscaling; report the pre-clip norm.

    RecIS's hook of this name clips in ``after_backward``: on every micro-step of gradient
    accumulation, and before a ``GradScaler`` unscales (so against a scaled norm).  This one
    acts at ``BeforeOptimizerStep``, on the final unscaled gradients, so the result equals
    ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` called once before ``step``; the
    pre-clip total norm is kept on the device and reported per window as
    :class:`GradNormHook` does, with ``{prefix}grad_norm_clipped`` (how many of the window's
    optimizer steps were clipped).  ``clip_value`` also (or instead) clamps every gradient to
    ``[-clip_value, clip_value]`` after the norm clipping (``clip_grad_value_``).

    ``error_if_nonfinite=True`` raises when the total norm is inf or NaN, as
    ``clip_grad_norm_`` does: that reads the norm on every optimizer step (a device
    synchronization on a GPU), so it is off by default.

    Args:
        dense_params: a module, tensors or a dict of name -> tensor; with ``sparse_params``
            ``None`` too: every parameter of the optimizers the event carries.
        sparse_params: more of them, e.g. the hash tables' weights (sparse COO gradients are
            normed over their values).
        max_norm: the largest total norm kept; ``None``: no norm clipping (``clip_value``).
        clip_value: clamp each gradient element to this magnitude; ``None``: no clamping.
        norm_type: the norm's order, as in :class:`GradNormHook`.
        error_if_nonfinite: raise on a non-finite total norm (a read per optimizer step).
        per_layer: also report each parameter's norm.
        log_steps: training steps per window.
        prefix: prepended to the reported names.
        logger: where the window's line goes.

    Raises:
        ValueError: neither ``max_norm`` nor ``clip_value``, or one that is not positive.
        TypeError: a parameter that is not a tensor, an argument of the wrong type, named.
    """

    def __init__(
        self,
        dense_params: Any = None,
        sparse_params: Any = None,
        max_norm: float | None = None,
        *,
        clip_value: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        per_layer: bool = False,
        log_steps: int = 100,
        prefix: str = "",
        logger: logging.Logger | None = None,
    ) -> None:
        owner = type(self).__name__
        super().__init__(
            None,
            norm_type=norm_type,
            per_layer=per_layer,
            log_steps=log_steps,
            prefix=prefix,
            logger=logger,
        )
        self._params = _as_params(owner, "dense_params", dense_params) + _as_params(
            owner, "sparse_params", sparse_params
        )
        if max_norm is None and clip_value is None:
            raise ValueError(
                f"{owner}(max_norm=...): expected max_norm, clip_value or both, got neither"
            )
        self.max_norm = None if max_norm is None else _positive(owner, "max_norm", max_norm)
        self.clip_value = None if clip_value is None else _positive(owner, "clip_value", clip_value)
        self.error_if_nonfinite = boolean(owner, "error_if_nonfinite", error_if_nonfinite)

    def _max_norm(self) -> float | None:
        return self.max_norm

    def before_optimizer_step(self, event: BeforeOptimizerStep) -> None:
        grads, total = self._measure(event)
        if total is None:
            return
        if self.error_if_nonfinite and not bool(torch.isfinite(total)):  # documented read
            raise RuntimeError(
                f"{type(self).__name__}: the total {self.norm_type}-norm of the gradients at "
                f"global_step {event.global_step} is non-finite"
            )
        if self.max_norm is not None:
            # clip_grad_norm_'s arithmetic: the coefficient is clamped to 1, always applied
            coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
            _scale(grads, coef)
        if self.clip_value is not None:
            for g in grads:
                # a sparse gradient: its stored values (coalesced ones are the elements)
                (g._values() if g.is_sparse else g).clamp_(-self.clip_value, self.clip_value)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} max_norm={self.max_norm} clip_value={self.clip_value} "
            f"norm_type={self.norm_type} params={len(self._params) or 'optimizers'} "
            f"log_steps={self.log_steps}>"
        )


def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    dense = [g for g in grads if not g.is_sparse and g.device == coef.device]
    if dense:
        torch._foreach_mul_(dense, coef)
    for g in grads:
        if g.is_sparse or g.device != coef.device:
            g.mul_(coef.to(g.device, non_blocking=True))


def _positive(owner: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}({field}=...): expected a positive number, got {value!r}")
    if not (value > 0):
        raise ValueError(f"{owner}({field}=...): expected a positive number, got {value!r}")
    return float(value)


def _norm_type(owner: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}(norm_type=...): expected a number > 0 or inf, got {value!r}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{owner}(norm_type=...): expected a number > 0 or inf, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------
# learning rate


class LearningRateHook(_WindowHook):
    """Every optimizer's learning rate per param group (momentum and weight decay on request),
    reported per window.

    At each window boundary it reads the optimizers' ``param_groups``: host floats, so no
    device read on the step; a tensor-valued ``lr`` (``capturable`` optimizers) is copied and
    read in the worker thread.  The values are those the next optimizer step will use (after
    the LR scheduler stepped).  Names follow Lightning's ``LearningRateMonitor``:
    ``{prefix}lr-SGD``, ``{prefix}lr-Adam/pg1`` for a second param group, ``-1`` after a
    repeated optimizer class; ``momentum-...`` (SGD's ``momentum``, Adam's ``betas[0]``) and
    ``weight_decay-...`` likewise.

    Args:
        optimizers: an optimizer or a list of them; ``None``: those the latest
            ``BeforeOptimizerStep`` carried (the :class:`~recis_async.Trainer`'s).
        log_steps: training steps per window.
        momentum: also report momentum.
        weight_decay: also report weight decay.
        prefix: prepended to the reported names.
        logger: where the window's line goes.

    Raises:
        TypeError: an optimizer without ``param_groups``, a flag that is not a bool.
        ValueError: a ``log_steps`` below 1.
    """

    def __init__(
        self,
        optimizers: Any = None,
        *,
        log_steps: int = 100,
        momentum: bool = False,
        weight_decay: bool = False,
        prefix: str = "",
        logger: logging.Logger | None = None,
    ) -> None:
        owner = type(self).__name__
        super().__init__(log_steps, logger, "recis_async.hooks.optim")
        if optimizers is not None and not isinstance(optimizers, list | tuple):
            optimizers = [optimizers]
        self.optimizers: tuple[Any, ...] = tuple(optimizers or ())
        for i, opt in enumerate(self.optimizers):
            if not isinstance(getattr(opt, "param_groups", None), list):
                raise TypeError(
                    f"{owner}(optimizers[{i}]=...): expected an optimizer (with param_groups), "
                    f"got {type(opt).__name__}"
                )
        self.momentum = boolean(owner, "momentum", momentum)
        self.weight_decay = boolean(owner, "weight_decay", weight_decay)
        if not isinstance(prefix, str):
            raise TypeError(f"{owner}(prefix=...): expected a str, got {prefix!r}")
        self.prefix = prefix
        self._seen: tuple[Any, ...] = ()

    def before_optimizer_step(self, event: BeforeOptimizerStep) -> None:
        self._seen = event.optimizers  # used when none were given

    def values(self) -> dict[str, Any]:
        """The current values, by name (floats; a tensor ``lr`` as a copy of it)."""
        values: dict[str, Any] = {}
        names: dict[str, int] = {}
        for opt in self.optimizers or self._seen:
            base = type(opt).__name__
            n = names[base] = names.get(base, -1) + 1
            name = base if n == 0 else f"{base}-{n}"
            groups = opt.param_groups
            for j, group in enumerate(groups):
                suffix = f"/pg{j}" if len(groups) > 1 else ""
                picks = [("lr", group.get("lr"))]
                if self.momentum:
                    betas = group.get("betas")
                    picks.append(("momentum", betas[0] if betas else group.get("momentum")))
                if self.weight_decay:
                    picks.append(("weight_decay", group.get("weight_decay")))
                for what, value in picks:
                    if isinstance(value, torch.Tensor):
                        value = value.detach().clone()
                    if value is not None:
                        values[f"{self.prefix}{what}-{name}{suffix}"] = value
        return values

    async def after_step(self, event: AfterStep) -> None:
        values = self.values()
        await self._put(event.global_step, lambda: values)

    def __repr__(self) -> str:
        given = ", ".join(type(o).__name__ for o in self.optimizers) or "from events"
        return f"<LearningRateHook optimizers=[{given}] log_steps={self.log_steps}>"
