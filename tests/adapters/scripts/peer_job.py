"""A framework's job with this library's hooks through its adapter, run until stopped.

    python peer_job.py lightning|transformers|ignite OUT_DIR [WRITE_DELAY_S]

The hooks of ``peers_support.job_hooks`` (trace to Parquet, tracker, logger, NaN check) on a
long single-epoch job; prints ``ready`` after 10 steps.  The interrupt test presses Ctrl-C in
its terminal and then counts what the hooks delivered.  ``WRITE_DELAY_S``: each Parquet write
takes that much longer (``peers_support.SlowDisk``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers_support as ps  # noqa: E402

from recis_async.hook import Hook  # noqa: E402


class Ready(Hook):
    def after_step(self, event: Any) -> None:
        if event.is_train and event.global_step == 10:
            print("ready", flush=True)


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    hooks, _, _ = ps.job_hooks(out, Ready(), write_delay=delay)
    ps.run_job(framework, out, hooks, rows=ps.ROWS * 200_000)
    print("finished without a stop", flush=True)


if __name__ == "__main__":
    main()
