"""A training loop on the bus with a buffering service, for the signal tests.

    python preempt_loop.py OUT_DIR [--slow-close]

Prints ``ready`` after 5 steps.  The service keeps every step's row in memory and writes them
to ``OUT_DIR/rows.jsonl`` when closed; with ``--slow-close`` its close takes 60 s unless it is
cancelled, in which case it spills the rows to ``OUT_DIR/spill.jsonl``.  ``End``'s status goes
to ``OUT_DIR/end.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from recis_async import Hook, HookBus
from recis_async.events import AfterStep, BeforeStep, End


class RowService:
    name = "rows"

    def __init__(self, out: Path, slow_close: bool) -> None:
        self.out = out
        self.slow_close = slow_close
        self.rows: list[dict[str, int]] = []
        self._closed = anyio.Event()

    async def run(self) -> None:
        await self._closed.wait()

    async def aclose(self, deadline: float) -> None:
        print("closing", flush=True)
        try:
            if self.slow_close:
                await anyio.sleep(60)
            _write(self.out / "rows.jsonl", self.rows)
        except anyio.get_cancelled_exc_class():
            _write(self.out / "spill.jsonl", self.rows)
            raise
        finally:
            self._closed.set()

    def stats(self) -> Mapping[str, Any]:
        return {"rows": len(self.rows)}


def _write(path: Path, rows: list[dict[str, int]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


class Rows(Hook):
    def __init__(self, out: Path, slow_close: bool) -> None:
        self.service = RowService(out, slow_close)
        self.out = out

    def attach(self, bus: HookBus) -> None:
        bus.start_service(self.service)

    def after_step(self, event: AfterStep) -> None:
        self.service.rows.append({"step": event.global_step})

    def end(self, event: End) -> None:
        (self.out / "end.json").write_text(json.dumps({"status": event.status}))


async def main(out: Path, slow_close: bool) -> None:
    async with HookBus(flush_timeout=30) as bus:
        bus.add_hook(Rows(out, slow_close))
        for step in itertools.count():
            await bus.publish(BeforeStep(global_step=step))
            time.sleep(0.005)  # the "compute" of a step
            await bus.publish(AfterStep(global_step=step, samples=1))
            if step == 5:
                print("ready", flush=True)
            if bus.should_stop:
                print(f"stopped after step {step}", flush=True)
                break


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--slow-close", action="store_true")
    parser.add_argument("--backend", default="asyncio")
    args = parser.parse_args()
    anyio.run(main, args.out, args.slow_close, backend=args.backend)
