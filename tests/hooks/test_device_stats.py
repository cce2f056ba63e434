"""DeviceStatsHook: the windows it records, read back from a JsonlTracker store and the log;
OOMObserverHook: what it does on the CPU, its snapshot plumbing, and on a GPU a real
out-of-memory error and snapshot (``gpu`` marker)."""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from recis_async import HookBus
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import DeviceStatsHook, MLTrackerHook, OOMObserverHook
from recis_async.trackers import JsonlTracker, read_records

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]

MIB = 1 << 20


async def _steps(bus: HookBus, first: int, n: int, *, hold_mib: int = 0) -> list[torch.Tensor]:
    """``n`` real training steps from ``first``; with ``hold_mib``, a tensor of that size
    is made (and written, so it is resident) during the steps and returned."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    held = [torch.ones(hold_mib * MIB // 4)] if hold_mib else []
    for g in range(first, first + n):
        await bus.publish(BeforeStep(global_step=g))
        model(torch.randn(16, 32)).pow(2).mean().backward()
        await bus.publish(AfterStep(global_step=g, samples=16))
        await bus.publish(BeforeStep(is_train=False, global_step=g))  # eval steps: not counted
        await bus.publish(AfterStep(is_train=False, global_step=g))
    return held


async def test_windows_on_global_step_to_the_tracker_and_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.hooks.device_stats")
    tracker = JsonlTracker(tmp_path)
    hook = DeviceStatsHook(every_n_steps=5)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "device", tracker=tracker))
        bus.add_hook(hook)
        await bus.publish(Start())
        await _steps(bus, 0, 5)
        held = await _steps(bus, 5, 5, hold_mib=256)  # the second window holds 256 MiB more
        rss_now = psutil.Process().memory_info().rss
        del held
        await _steps(bus, 10, 2)  # no window ends
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [4, 9]
    first, second = (r.values for r in records)
    cuda = {
        f"device/cuda/{k}"
        for k in (
            "allocated_bytes",
            "allocated_peak_bytes",
            "reserved_bytes",
            "reserved_peak_bytes",
            "alloc_retries",
            "ooms",
        )
    }
    assert set(first) == {
        "device/host/rss_bytes",
        "device/host/peak_rss_bytes",
        "device/host/cpu_seconds",
        "device/host/cpu_percent",
        *(cuda if torch.cuda.is_available() else ()),
    }  # CUDA keys only where CUDA is
    assert second["device/host/rss_bytes"] - first["device/host/rss_bytes"] > 200 * MIB
    assert second["device/host/rss_bytes"] == pytest.approx(rss_now, rel=0.05)
    assert second["device/host/peak_rss_bytes"] >= second["device/host/rss_bytes"]
    assert second["device/host/cpu_seconds"] > first["device/host/cpu_seconds"] > 0
    assert 0 < second["device/host/cpu_percent"]
    assert hook.last == (9, second)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("device_stats")]
    assert len(lines) == 2
    found = re.fullmatch(
        r"device stats <gstep=9> rss=([\d.]+)MiB peak_rss=([\d.]+)MiB cpu=\d+%"
        + (r" cuda_allocated=.*" if torch.cuda.is_available() else ""),
        lines[1],
    )
    assert found is not None, lines[1]
    assert float(found.group(1)) == pytest.approx(second["device/host/rss_bytes"] / MIB, abs=0.1)


async def test_a_resumed_run_keeps_the_cadence_of_global_step(tmp_path: Path) -> None:
    hook = DeviceStatsHook(every_n_steps=5, prefix="dev.")
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _steps(bus, 7, 9)  # steps 7..15: windows end at 9 and 14
    assert hook.last is not None and hook.last[0] == 14
    assert "dev.host/rss_bytes" in hook.last[1]


def test_constructor_checks() -> None:
    with pytest.raises(
        ValueError, match=r"DeviceStatsHook\(every_n_steps=...\): expected a positive int, got 0"
    ):
        DeviceStatsHook(0)
    with pytest.raises(
        TypeError, match=r"DeviceStatsHook\(every_n_steps=...\): expected a positive int, got 2.0"
    ):
        DeviceStatsHook(2.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"DeviceStatsHook\(prefix=...\): expected a non-empty str"
    ):
        DeviceStatsHook(prefix="")
    assert repr(DeviceStatsHook(10)) == "<DeviceStatsHook every_n_steps=10 prefix='device/'>"


# --------------------------------------------------------------------------- OOMObserverHook


async def test_oom_observer_on_the_cpu_says_so_once_and_lets_errors_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caplog.set_level(logging.INFO, logger="recis_async.hooks.device_stats")
    hook = OOMObserverHook(tmp_path)
    with pytest.raises(torch.OutOfMemoryError):
        async with HookBus() as bus:
            bus.add_hook(hook)
            await bus.publish(Start())
            await bus.publish(Start())  # said once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    assert list(tmp_path.iterdir()) == [] and hook.snapshots == []
    assert [r.getMessage() for r in caplog.records if r.name.endswith("device_stats")] == [
        "OOMObserverHook: CUDA is not available; no memory snapshots"
    ]


class History:
    """Stands in for torch.cuda.memory where CUDA is absent: the recorder's calls, and a
    snapshot file written as _dump_snapshot writes one (a pickle)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _record_memory_history(
        self, enabled: Any = "all", context: Any = "all", stacks: str = "all", max_entries: int = 0
    ) -> None:
        if enabled is not None:  # allocation stacks, Python frames only: the cheap history
            assert (context, stacks) == ("alloc", "python")
        self.calls.append(("record", enabled if enabled is None else max_entries))

    def _dump_snapshot(self, filename: str) -> None:
        self.calls.append(("dump", Path(filename).name))
        with open(filename, "wb") as f:
            pickle.dump({"segments": [], "device_traces": []}, f)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB"),  # older torch's type
    ],
)
async def test_oom_observer_dumps_on_an_out_of_memory_error_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    caplog.set_level(logging.ERROR, logger="recis_async.hooks.device_stats")
    history = History()
    hook = OOMObserverHook(tmp_path, max_entries=1000)
    hook._memory, hook._cuda = history, True
    with pytest.raises(type(error)):
        async with HookBus() as bus:
            bus.add_hook(hook)
            await bus.publish(Start())
            await bus.publish(BeforeStep(global_step=41))
            raise error
    assert history.calls == [("record", 1000), ("dump", "0-oom-41.pickle"), ("record", None)]
    assert hook.snapshots == [tmp_path / "0-oom-41.pickle"]
    with open(hook.snapshots[0], "rb") as f:
        assert "segments" in pickle.load(f)
    (line,) = caplog.messages
    assert line.startswith("OOMObserverHook: out of memory at global_step 41; memory snapshot in ")
    assert str(hook.snapshots[0]) in line
    # any other failure: no snapshot, the history is turned off at End all the same
    other, hook2 = History(), OOMObserverHook(tmp_path / "other")
    hook2._memory, hook2._cuda = other, True
    with pytest.raises(ValueError):
        async with HookBus() as bus:
            bus.add_hook(hook2)
            await bus.publish(Start())
            raise ValueError("not memory")
    assert other.calls == [("record", 100_000), ("record", None)]
    assert list((tmp_path / "other").iterdir()) == []


def test_oom_observer_checks() -> None:
    with pytest.raises(
        ValueError, match=r"OOMObserverHook\(max_entries=...\): expected a positive int, got 0"
    ):
        OOMObserverHook(max_entries=0)
    with pytest.raises(ValueError, match=r"OOMObserverHook\(output_dir=...\): expected a"):
        OOMObserverHook(output_dir="")


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_counters_with_the_peak_reset_every_window_and_no_sync(tmp_path: Path) -> None:
    torch.cuda.init()
    tracker = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "gpu", tracker=tracker))
        bus.add_hook(DeviceStatsHook(every_n_steps=2))
        await bus.publish(Start())
        torch.cuda.set_sync_debug_mode("error")  # a synchronization on the step raises
        try:
            for g in range(4):
                await bus.publish(BeforeStep(global_step=g))
                if g == 0:  # 512 MiB held during step 0 only
                    big = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
                    del big
                await bus.publish(AfterStep(global_step=g))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert tracker.run_dir is not None
    first, second = read_records(tracker.run_dir / "metrics.jsonl")
    assert (first.step, second.step) == (1, 3)
    assert first.values["device/cuda/allocated_peak_bytes"] >= 512 * MIB
    assert second.values["device/cuda/allocated_peak_bytes"] < 512 * MIB  # reset per window
    assert second.values["device/cuda/reserved_bytes"] >= 512 * MIB  # still cached
    assert second.values["device/cuda/ooms"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_real_out_of_memory_error_leaves_a_snapshot(tmp_path: Path) -> None:
    hook = OOMObserverHook(tmp_path)
    with pytest.raises(torch.OutOfMemoryError):
        async with HookBus() as bus:
            bus.add_hook(hook)
            await bus.publish(Start())
            await bus.publish(BeforeStep(global_step=3))
            keep = torch.ones(1024, device="cuda")  # something for the history to show
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
            del keep
    (snapshot,) = tmp_path.iterdir()
    assert snapshot.name == "0-oom-3.pickle"
    with open(snapshot, "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"]
    frames = [f for trace in data["device_traces"] for e in trace for f in e.get("frames", [])]
    assert any(f["filename"] == __file__ for f in frames)  # who allocated: Python frames
