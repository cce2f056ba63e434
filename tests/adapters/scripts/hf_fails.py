"""A Hugging Face job with this library's hooks whose model fails at step 3, run without
``with callback:`` around ``trainer.train()`` (the ``Trainer`` tells no callback it failed).

    python hf_fails.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers_support as ps  # noqa: E402

from recis_async.adapters.transformers import RecisTrainerCallback  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    hooks, _, _ = ps.job_hooks(out)
    ps.Net.fail_at = 3
    ps.hf_job(out, RecisTrainerCallback(hooks), rows=ps.ROWS * 10)


if __name__ == "__main__":
    main()
