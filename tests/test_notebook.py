"""A notebook, as its user runs it: top-level ``await`` in a Jupyter kernel (driven by
nbclient), interrupted with the kernel's interrupt (SIGINT to the kernel, what the toolbar's
stop button sends).  The bus stops at the next step boundary and closes, the rows are
delivered, the cell ends with ``KeyboardInterrupt`` (not ``SystemExit``), and the kernel lives
on for the next cell."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent

LOOP = """
import itertools, time
import numpy as np
from recis_async import HookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

published = []

async def main():
    async with HookBus(flush_timeout=30) as bus:
        bus.add_hook(TraceHook(ParquetSink(OUT, "t", rank=0), ["id"], ["bigint"]))
        for step in itertools.count():
            await bus.publish(BeforeStep(global_step=step))
            add_to_trace("id", np.arange(step * 8, step * 8 + 8))
            await bus.publish(AfterStep(global_step=step, samples=8))
            published.append(step)
            if step == 10:
                open(OUT + "/ready", "w").close()
            if bus.should_stop:
                break
            time.sleep(0.002)

await main()
"""

CHECK = """
import pyarrow.dataset as ds
ids = ds.dataset(OUT + "/t", format="parquet").to_table()["id"].to_pylist()
print(len(published), sorted(ids) == list(range(len(published) * 8)))
"""


def test_a_kernel_interrupt_stops_the_bus_and_keeps_the_kernel(tmp_path: Path) -> None:
    cells = [f"OUT = {str(tmp_path)!r}", textwrap.dedent(LOOP), textwrap.dedent(CHECK)]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3")
    ready = tmp_path / "ready"

    def interrupt_when_ready() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(client.km.provisioner.process.pid, signal.SIGINT)  # the stop button

    with client.setup_kernel(cwd=str(tmp_path)):
        client.execute_cell(nb.cells[0], 0)
        pressing = threading.Thread(target=interrupt_when_ready, daemon=True)
        pressing.start()
        client.execute_cell(nb.cells[1], 1)
        pressing.join()
        client.execute_cell(nb.cells[2], 2)

    loop_out = nb.cells[1].outputs
    errors = [o for o in loop_out if o.output_type == "error"]
    assert [e.ename for e in errors] == ["KeyboardInterrupt"], loop_out
    logged = "".join(o.get("text", "") for o in loop_out if o.output_type == "stream")
    assert logged.count("SIGINT received: stopping at the next step boundary") == 1, logged
    check = "".join(o.get("text", "") for o in nb.cells[2].outputs if o.output_type == "stream")
    steps, complete = check.split()
    assert int(steps) >= 11 and complete == "True", nb.cells[2].outputs
