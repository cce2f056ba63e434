"""MetricReportHook: throughput and step-time split from an injected clock, parameter counts,
duck-typed hash tables scanned off the step, sent to the log and to MLTrackerHook."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from recis_async import HookBus, HookError
from recis_async.events import AfterData, AfterEval, AfterStep, BeforeStep
from recis_async.hooks import MetricReportHook, MLTrackerHook, ReportArguments
from recis_async.hooks.metric_report import peak_flops
from recis_async.trackers import JsonlTracker, read_records

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


class DictTable(torch.nn.Module):
    """A tiny dynamic table: ids map to rows created on first sight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.rows: dict[int, torch.Tensor] = {}
        self.scanned_on: set[int] = set()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.rows.setdefault(int(i), torch.zeros(self.dim)) for i in ids])

    def ids_count(self) -> int:
        self.scanned_on.add(threading.get_ident())
        return len(self.rows)

    def memory_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows.values())


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = DictTable(4)
        self.item = DictTable(2)
        self.dense = torch.nn.Linear(4, 3)  # 15 parameters
        self.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)


async def _steps(bus: HookBus, clock: Clock, model: Model, steps: int) -> None:
    for g in range(steps):
        await bus.publish(BeforeStep(global_step=g))
        clock.t += 0.02  # waiting for data
        await bus.publish(AfterData(global_step=g))
        model.user(torch.tensor([g, g + 1]))
        model.item(torch.tensor([0]))
        clock.t += 0.08  # computing
        await bus.publish(AfterStep(global_step=g, samples=16))


async def test_report_to_log_and_tracker(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock, model = Clock(), Model()
    tracker = JsonlTracker(tmp_path)
    report = MetricReportHook(model, ReportArguments(interval_step=5), clock=clock)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "report", {}, tracker=tracker))
        bus.add_hook(report)
        clock.t += 30.0  # time before the first step is not part of any window
        await _steps(bus, clock, model, 10)
    assert report.last_report is not None
    step, values = report.last_report
    assert step == 9
    assert values["report/samples_per_sec"] == pytest.approx(160.0)
    assert values["report/steps_per_sec"] == pytest.approx(10.0)
    assert values["report/step_ms"] == pytest.approx(100.0)
    assert values["report/data_wait_ms"] == pytest.approx(20.0)
    assert values["report/compute_ms"] == pytest.approx(80.0)
    assert values["report/params"] == 20.0 and values["report/trainable_params"] == 15.0
    assert values["report/hashtable/user/ids"] == 11.0  # ids 0..10
    assert values["report/hashtable/user/memory_bytes"] == 11 * 4 * 4
    assert values["report/hashtable/item/ids"] == 1.0
    assert values["report/hashtable/ids"] == 12.0
    assert values["report/hashtable/memory_bytes"] == 11 * 16 + 8
    assert threading.get_ident() not in model.user.scanned_on  # scanned off the step

    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [4, 9]
    assert records[1].values == pytest.approx(values)
    logged = [r.getMessage() for r in caplog.records if r.name.endswith("metric_report")]
    assert len(logged) == 2 and "<gstep=9>" in logged[1]
    assert "<report/hashtable/user/ids=11>" in logged[1]
    assert "<report/samples_per_sec=160>" in logged[1]


async def test_without_after_data_all_time_is_compute(tmp_path: Path) -> None:
    clock = Clock()
    model = torch.nn.Linear(2, 2)
    hook = MetricReportHook(model, ReportArguments(interval_step=2, log=False), clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        for g in range(2):
            await bus.publish(BeforeStep(global_step=g))
            clock.t += 0.5
            await bus.publish(AfterStep(global_step=g, samples=1))
    assert hook.last_report is not None
    _, values = hook.last_report
    assert values["report/data_wait_ms"] == 0.0
    assert values["report/compute_ms"] == pytest.approx(500.0)
    assert values["report/params"] == 6.0
    assert not any("hashtable" in k for k in values)


async def test_eval_steps_are_not_reported(tmp_path: Path) -> None:
    hook = MetricReportHook(torch.nn.Linear(1, 1), ReportArguments(interval_step=1), clock=Clock())
    async with HookBus() as bus:
        bus.add_hook(hook)
        await bus.publish(BeforeStep(is_train=False))
        await bus.publish(AfterStep(is_train=False, samples=4))
    assert hook.last_report is None


async def test_scan_failure_raises_hook_error() -> None:
    class Broken(torch.nn.Module):
        def ids_count(self) -> int:
            raise RuntimeError("table is being resized")

        def memory_bytes(self) -> int:
            return 0

    hook = MetricReportHook(Broken(), ReportArguments(interval_step=1), clock=Clock())
    with pytest.raises(HookError, match="MetricReportHook.report"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            await bus.publish(BeforeStep())
            await bus.publish(AfterStep(samples=1))


def test_validation() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError, match="ReportArguments.interval_step: expected a positive int"
        ):
            ReportArguments(interval_step=bad)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="MetricReportHook.model: expected a torch.nn.Module, got str"
    ):
        MetricReportHook("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="report_args: expected ReportArguments, got dict"):
        MetricReportHook(torch.nn.Linear(1, 1), {"interval_step": 3})  # type: ignore[arg-type]
    assert MetricReportHook(torch.nn.Linear(1, 1)).args.interval_step == 100
    with pytest.raises(TypeError, match=r"MetricReportHook\(logger=...\): expected a logging"):
        MetricReportHook(torch.nn.Linear(1, 1), logger=print)  # type: ignore[arg-type]


async def test_real_hash_tables_in_the_report() -> None:
    from recis_async.nn import HashTable

    class Ctr(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = HashTable(8, name="user", capacity=16)
            self.item = HashTable([2, 4], name="item", capacity=16)
            self.head = torch.nn.Linear(16, 1)

    model = Ctr()
    clock = Clock()
    hook = MetricReportHook(model, ReportArguments(interval_step=3, log=False), clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        for g in range(3):
            await bus.publish(BeforeStep(global_step=g))
            model.user(torch.arange(g * 20, g * 20 + 25))  # 65 distinct ids in the end
            model.item(torch.tensor([1, 2, 3]))
            clock.t += 0.01
            await bus.publish(AfterStep(global_step=g, samples=25))
    assert hook.last_report is not None
    _, values = hook.last_report
    assert values["report/hashtable/user/ids"] == 65.0
    assert values["report/hashtable/item/ids"] == 3.0
    assert values["report/hashtable/user/memory_bytes"] == model.user.memory_bytes()
    assert values["report/hashtable/memory_bytes"] == (
        model.user.memory_bytes() + model.item.memory_bytes()
    )
    assert values["report/params"] == sum(p.numel() for p in model.parameters())


class Stack(torch.nn.Module):
    """Linear layers without activations: FLOPs known in closed form."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


async def test_flops_measured_once_and_mfu_match_the_closed_form(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stack of linear layers, batch B: forward 2*B*in*out per layer; backward the weight
    gradient (2*B*in*out) per layer and the input gradient (2*B*in*out) for every layer but
    the first (its input needs no gradient).  FLOPs counted exactly; with a given peak and a
    clock advancing 10 ms per step, MFU = FLOPs / 0.01 s / peak."""
    caplog.set_level(logging.INFO)
    dims, batch = [32, 64, 48, 16], 8
    pairs = list(zip(dims, dims[1:], strict=False))
    forward = sum(2 * batch * a * b for a, b in pairs)
    expected = 3 * forward - 2 * batch * dims[0] * dims[1]
    model, clock = Stack(dims), Clock()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    peak = 1e9
    args = ReportArguments(interval_step=4, peak_flops=peak, flops_step=1)
    hook = MetricReportHook(model, args, clock=clock)
    tracker = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "mfu", {}, tracker=tracker))
        bus.add_hook(hook)
        for g in range(12):
            await bus.publish(BeforeStep(global_step=g))
            model(torch.randn(batch, dims[0])).backward()
            opt.step()
            opt.zero_grad()
            clock.t += 0.25 if g == 1 else 0.01  # the measured step is slow: left out
            await bus.publish(AfterStep(global_step=g, samples=batch))
        await bus.publish(BeforeStep(is_train=False, global_step=12))
        clock.t += 0.004
        await bus.publish(AfterStep(is_train=False, global_step=12, samples=32))
        await bus.publish(AfterEval(global_step=12, steps=1))
    assert hook.flops_per_step == expected
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [3, 7, 11, 12]
    for r in records[1:3]:
        assert r.values["report/flops_per_step"] == expected
        assert r.values["report/flops_per_sec"] == pytest.approx(expected / 0.01, rel=1e-9)
        assert r.values["report/mfu"] == pytest.approx(expected / 0.01 / peak, rel=0.02)
        assert r.values["report/samples_per_sec"] == pytest.approx(batch / 0.01)
    assert records[0].values["report/steps_per_sec"] == pytest.approx(100.0)  # step 1 left out
    evals = records[3].values
    assert set(evals) == {
        "report/eval_samples_per_sec",
        "report/eval_steps_per_sec",
        "report/eval_step_ms",
    }
    assert evals["report/eval_samples_per_sec"] == pytest.approx(32 / 0.004)
    assert evals["report/eval_step_ms"] == pytest.approx(4.0)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("metric_report")]
    assert f"<report/mfu={expected / 0.01 / peak:.6g}>" in lines[1]


def test_peak_table_by_device_and_dtype() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494.7e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops("NVIDIA V100-SXM2-16GB", "bfloat16") is None
    assert peak_flops("a CPU", "float32") is None
    hook = MetricReportHook(torch.nn.Linear(2, 2), ReportArguments(peak_flops=5e12))
    assert hook.peak() == 5e12
    assert MetricReportHook(torch.nn.Linear(2, 2)).peak() is None  # a CPU, no peak given
    with pytest.raises(ValueError, match=r"ReportArguments\(peak_flops=...\): expected a pos"):
        ReportArguments(peak_flops=0)
    with pytest.raises(ValueError, match=r"ReportArguments\(dtype=...\)"):
        ReportArguments(dtype="int8")
    with pytest.raises(ValueError, match=r"ReportArguments\(flops_step=...\)"):
        ReportArguments(flops_step=-1)


async def test_no_host_read_on_the_step(tmp_path: Path) -> None:
    """The report reads no tensor: not on ordinary steps, not at the report (the measured
    step's FlopCounterMode reads none either)."""
    from host_reads import HostReads

    model, clock = Stack([4, 4]), Clock()
    hook = MetricReportHook(model, ReportArguments(interval_step=2, peak_flops=1e9), clock=clock)
    reads = HostReads()
    async with HookBus() as bus:
        bus.add_hook(hook)
        for g in range(6):
            with reads:
                await bus.publish(BeforeStep(global_step=g))
                model(torch.randn(2, 4)).backward()
                clock.t += 0.01
                await bus.publish(AfterStep(global_step=g, samples=2))
    assert reads.reads == []
    assert hook.last_report is not None and "report/mfu" in hook.last_report[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_gpu_windows_are_timed_with_cuda_events_without_a_sync() -> None:
    """On a GPU the window's time comes from CUDA events, read in the report's worker
    thread: the steps run under set_sync_debug_mode('error'), which raises on a sync."""
    model = Stack([256, 256]).cuda()
    hook = MetricReportHook(model, ReportArguments(interval_step=3, log=False))
    async with HookBus() as bus:
        bus.add_hook(hook)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for g in range(7):
                await bus.publish(BeforeStep(global_step=g))
                model(torch.randn(64, 256, device="cuda")).backward()
                await bus.publish(AfterStep(global_step=g, samples=64))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert hook.last_report is not None
    values = hook.last_report[1]
    assert values["report/step_ms"] > 0
    assert values["report/flops_per_step"] == 3 * 2 * 64 * 256 * 256 - 2 * 64 * 256 * 256
    assert "report/mfu" in values or hook.peak() is None
