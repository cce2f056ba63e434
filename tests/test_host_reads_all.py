"""The step never reads the device (issue 23): with every built-in hook on, around the Trainer
and around a hand-written loop, no ordinary step reads a tensor's value on the host, and the
log/save/eval boundaries read a small, bounded number.

``HostReads`` (a ``TorchFunctionMode``: ``item``, ``tolist``, ``numpy``, ``cpu``, ``to`` the
CPU, ``__float__``, ``__int__``, ``__bool__``, ``__index__``, ``__array__``, ``__format__``)
counts the reads the event loop's thread makes; a :class:`~all_hooks.Where` hook labels them
with the step or boundary they belong to.  On a GPU each such read waits for every queued
kernel; on the CPU it is the same call, so this suite sees what a GPU run would pay.  Reads in
worker threads (a window read off the step) are not counted: they do not hold the step.

Written so that a hook added later fails here until it is either put on the bus
(``all_hooks.every_hook``) or excluded with a reason (``all_hooks.EXCLUDED``).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import torch
from all_hooks import (
    EPOCHS,
    EVAL_BATCHES,
    EXCLUDED,
    ROWS,
    STEPS,
    CtrModel,
    Where,
    built_in_hooks,
    every_hook,
    optimizer,
    ordinary,
    own_loop,
    trainer,
)
from host_reads import HostReads, Read
from odps_server import OdpsServer, sink_config

from recis_async import HookBus

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent

# A boundary may read each window's values once on the loop's thread (a log line's numbers,
# say): the two metrics and two tracked values, a few hooks showing them.  More than this
# many reads at one boundary is a per-step cost moved, not a window read.
BOUNDARY_BUDGET = 8

# Reads of the id map, which lives on the host by design (issue 23: ids come from the loader
# on the host; the rows are on the module's device): probing and inserting ids reads host
# ids and host slot numbers, which costs no device synchronization.  Exempt by file and
# function (None: the whole file); a read of the rows (on the device) would show in the GPU
# tests, which count real synchronizations (tests/test_gpu.py).
HOST_SIDE: dict[str, frozenset[str] | None] = {
    "recis_async/nn/slot_map.py": None,
    "recis_async/nn/free_slots.py": None,
    "recis_async/nn/_host.py": None,  # each read there checks that its tensor is on the CPU
    "recis_async/nn/hashtable.py": frozenset({"lookup_slots", "_insert_admitted", "_take"}),
}


def _host_side(read: Read, functions: dict[str, list[tuple[int, int, str]]]) -> bool:
    """Whether ``read`` is one of the id map's (``HOST_SIDE``)."""
    path, _, line = read.source.rpartition(":")
    for suffix, names in HOST_SIDE.items():
        if path.endswith("/" + suffix):
            if names is None:
                return True
            if path not in functions:
                functions[path] = _functions(path)
            return any(a <= int(line) <= b and f in names for a, b, f in functions[path])
    return False


def _functions(path: str) -> list[tuple[int, int, str]]:
    """Every function of a source file: (first line, last line, name)."""
    tree = ast.parse(Path(path).read_text())
    return [
        (node.lineno, node.end_lineno or node.lineno, node.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def _report(reads: list[Read]) -> str:
    """One line per read place: how many, the call, where in the source, at which labels."""
    by_place: dict[tuple[str, str, tuple[str, ...]], list[Any]] = {}
    for r in reads:
        by_place.setdefault((r.name, r.source, r.callers), []).append(r.where)
    lines = []
    for (name, source, callers), wheres in sorted(by_place.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(map(str, sorted(set(wheres), key=str)[:4]))
        lines.append(f"  {len(wheres):3d} x {name:<10} {_short(source)}  at {shown} ...")
        lines.extend(f"                 called from {_short(c)}" for c in callers[:3])
    return "\n".join(lines)


def _short(place: str) -> str:
    """A source place relative to the checkout."""
    return place.replace(str(ROOT) + "/", "")


def check(reads: HostReads, where: Where) -> None:
    """0 reads on ordinary steps; at most ``BOUNDARY_BUDGET`` at any one boundary."""
    seen = [w for w in where.seen if ordinary(w)]
    assert len({w for w in seen if w[0] == "train"}) == 12, where.seen  # the steps ran
    evaluated = {w for w in seen if w[0] == "eval" and w[2] < EVAL_BATCHES}  # (then OutOfData)
    assert len(evaluated) == EPOCHS * EVAL_BATCHES, where.seen
    functions: dict[str, list[tuple[int, int, str]]] = {}
    counted = [r for r in reads.reads if r.where is not None and not _host_side(r, functions)]
    on_steps = [r for r in counted if ordinary(r.where)]
    per_boundary = Counter(r.where for r in counted if not ordinary(r.where))
    over = {w: n for w, n in per_boundary.items() if n > BOUNDARY_BUDGET}
    assert not on_steps and not over, (
        f"{len(on_steps)} host reads on {len({r.where for r in on_steps})} ordinary steps "
        f"(expected 0); boundaries over {BOUNDARY_BUDGET} reads: {over}\n"
        f"reads on ordinary steps:\n{_report(on_steps)}\n"
        f"reads at boundaries:\n{_report([r for r in counted if not ordinary(r.where)])}"
    )


def test_every_built_in_hook_is_counted(tmp_path: Path) -> None:
    """Each built-in hook is on the bus of the tests below, or excluded with a reason."""
    model = CtrModel()
    config = {"project": "p", "end_point": "http://127.0.0.1:9", "table_name": "t",
              "access_id": "a", "access_key": "k"}  # fmt: skip
    on_bus = {type(h).__name__ for h in every_hook(tmp_path, model, optimizer(model), config)}
    missing = built_in_hooks() - on_bus - set(EXCLUDED)
    assert not missing, (
        f"built-in hooks neither on the bus of the host-read proof nor excluded: "
        f"{sorted(missing)}: add them to all_hooks.every_hook() (or, with the reason, to "
        f"all_hooks.EXCLUDED)"
    )
    assert not set(EXCLUDED) & on_bus, set(EXCLUDED) & on_bus


def _check_outputs(tmp: Path, server: OdpsServer, steps_traced: int) -> None:
    """The hooks really ran: every traced row arrived in both sinks, checkpoints exist."""
    assert ds.dataset(tmp / "trace" / "proof").to_table().num_rows == steps_traced * ROWS
    assert server.committed("proof", "dt=1").num_rows == steps_traced * ROWS
    assert sorted(p.name for p in (tmp / "ckpt").glob("checkpoint-*.pt"))


async def test_no_host_read_on_a_step_of_the_trainer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reads = HostReads()
    where = Where(reads)
    with OdpsServer("proof_proj") as server:
        model = CtrModel(record=True)
        opt = optimizer(model)
        hooks = every_hook(tmp_path, model, opt, sink_config(server, "proof", "dt=1"))
        run = trainer(model, opt, [where, *hooks], tmp_path)
        with reads:
            await run.train_and_evaluate()
        _check_outputs(tmp_path, server, STEPS + EPOCHS * EVAL_BATCHES)
    check(reads, where)


async def test_no_host_read_on_a_step_of_an_own_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reads = HostReads()
    where = Where(reads)
    with OdpsServer("proof_proj") as server:
        model = CtrModel()
        opt = optimizer(model)
        hooks = every_hook(tmp_path, model, opt, sink_config(server, "proof", "dt=1"))
        with reads:
            async with HookBus(handle_signals=False) as bus:
                for hook in [where, *hooks]:
                    bus.add_hook(hook)
                await own_loop(bus, model, opt)
        _check_outputs(tmp_path, server, STEPS + EPOCHS * EVAL_BATCHES)
    check(reads, where)
