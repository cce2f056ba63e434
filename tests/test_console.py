"""What a run shows on the terminal: log lines above an intact progress bar, the library's
INFO lines by default under the Trainer, and nothing printed twice."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from terminal import render, run_in_terminal

import recis_async
from recis_async import HookBus
from recis_async.events import AfterStep, BeforeStep, End
from recis_async.hooks import LoggerHook, ProgressBarHook

ROOT = Path(__file__).resolve().parent.parent
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
BAR = re.compile(r"Training: 100%\|[█#]+\| (\d+)/(\d+) \[")


def clean_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for key in [k for k in env if k.startswith("ODPS_")]:
        del env[key]
    return env


def run_script(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``code`` in a fresh interpreter (logging unconfigured); output kept as bytes, so
    carriage returns survive."""
    script = tmp_path / "script.py"
    tests = str(ROOT / "tests")  # for toy.py
    script.write_text(f"import sys\nsys.path.insert(0, {tests!r})\n" + textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
    )


def assert_lines_apart_from_the_bar(lines: list[str], log_marker: str, steps: int) -> None:
    """Every log line starts a row of its own; the bar is drawn once, complete, at the end."""
    logged = [line for line in lines if log_marker in line]
    assert logged, lines
    for line in logged:
        assert line.startswith(log_marker) or re.match(STAMP, line), line
        assert "Training:" not in line, line
    bars = [line for line in lines if "Training:" in line]
    assert len(bars) == 1, bars
    match = BAR.match(bars[0])
    assert match and match.groups() == (str(steps), str(steps)), bars[0]


TRAIN_SCRIPT = """
    import sys, time, anyio, torch
    from toy import Model, batches
    from recis_async import Trainer, TrainingArguments
    from recis_async.hooks import ProgressBarHook

    class Slow(Model):
        def forward(self, batch):
            time.sleep(0.02)  # the bar redraws between log lines
            return super().forward(batch)

    model = Slow()
    trainer = Trainer(
        model,
        TrainingArguments(train_steps=60, log_steps=10, save_steps=None),
        train_dataset=batches(60),
        hooks=[ProgressBarHook(mininterval=0.01)],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )
    anyio.run(trainer.train)
"""


# ---------------------------------------------------------------------- the progress bar
@pytest.mark.anyio
async def test_log_lines_sit_above_the_bar_in_the_bars_stream() -> None:
    """A console handler writing where the bar draws goes through tqdm while the bar is
    shown, and gets its own stream back when the bar closes."""
    screen = io.StringIO()
    handler = logging.StreamHandler(screen)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    log = logging.getLogger("test_console.bar")
    log.setLevel(logging.INFO)
    try:
        async with HookBus() as bus:
            bus.add_hook(ProgressBarHook(total=12, file=screen, mininterval=1e-9))
            bus.add_hook(LoggerHook(log_step=3, logger=log))
            for step in range(12):
                await bus.publish(BeforeStep(global_step=step))
                await bus.publish(AfterStep(global_step=step, samples=4, metrics={"loss": 0.5}))
                if step == 7:
                    log.info("a line of the application")
        assert handler.stream is screen
    finally:
        root.removeHandler(handler)
    lines = render(screen.getvalue().encode(), columns=150, rows=60, newline_is_crlf=True)
    assert_lines_apart_from_the_bar(lines, "LOG ", 12)
    assert sum("<mode=train>" in line for line in lines) == 4
    assert sum(line == "LOG a line of the application" for line in lines) == 1


@pytest.mark.slow
def test_train_ctr_in_a_terminal_keeps_the_bar_intact(tmp_path: Path) -> None:
    """``python examples/train_ctr.py`` in a pseudo-terminal: the rendered screen has every
    log line (and what torch's C++ prints while profiling) on rows of their own and one
    complete bar."""
    steps = 200
    status, raw = run_in_terminal(
        [
            sys.executable,
            "examples/train_ctr.py",
            "--steps",
            str(steps),
            "--output-dir",
            str(tmp_path),
        ],
        env=clean_env(),
        cwd=ROOT,
    )
    lines = render(raw, columns=120, rows=400)
    assert status == 0, "\n".join(lines)
    assert_lines_apart_from_the_bar(lines, " INFO recis_async.", steps)
    assert any("<mode=train> <gstep=199>" in line for line in lines), lines
    for line in lines:  # torch's own output (profiler start/stop) starts its own row too
        if "profiler_st" in line or "CPUAllocator" in line:
            assert line.startswith(("USDT", "[W")), line


def test_bar_with_stderr_redirected_to_a_file(tmp_path: Path) -> None:
    """stderr to a file: the bar's redraws are carriage returns, and every log line still
    begins a line of its own once the file is shown in a terminal."""
    proc = run_script(TRAIN_SCRIPT, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = proc.stderr
    assert raw.count(b"\r") > 10  # the bar really was drawn, again and again
    lines = render(raw, columns=150, rows=100, newline_is_crlf=True)
    assert_lines_apart_from_the_bar(lines, " INFO recis_async.", 60)
    assert sum("<mode=train>" in line for line in lines) == 6
    for line in raw.decode().split("\n"):  # in the file: each begins after a carriage return
        if "<mode=train>" in line:
            assert re.match(rf"{STAMP} INFO", line.rpartition("\r")[2]), repr(line)


# ---------------------------------------------------------------------- logging by default
def test_trainer_shows_info_lines_when_logging_is_unconfigured(tmp_path: Path) -> None:
    proc = run_script(
        """
        import logging, sys, anyio, torch
        from toy import Model, batches
        from recis_async import Trainer, TrainingArguments

        model = Model()
        trainer = Trainer(model, TrainingArguments(train_steps=20, log_steps=10, save_steps=None),
                          train_dataset=batches(20),
                          dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None))
        anyio.run(trainer.train)
        assert logging.getLogger().handlers == []  # the root logger is untouched
        print("ok")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.decode().splitlines() if "<mode=train>" in line]
    assert len(lines) == 2, proc.stderr
    for line, step in zip(lines, (9, 19), strict=True):
        prefix = rf"{STAMP} INFO recis_async\.hooks\.logger: <mode=train> <gstep={step}> "
        assert re.match(prefix + r"<lstep=\d+> <qps=[\d.]+> <sps=[\d.]+> <loss=", line), line


def test_configured_logging_is_left_alone(tmp_path: Path) -> None:
    """An application that configured logging decides: at WARNING no INFO line shows."""
    proc = run_script(
        """
        import logging, sys, anyio, torch
        from toy import Model, batches
        from recis_async import Trainer, TrainingArguments

        logging.basicConfig(level=logging.WARNING)
        model = Model()
        trainer = Trainer(model, TrainingArguments(train_steps=20, log_steps=10, save_steps=None),
                          train_dataset=batches(20),
                          dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None))
        anyio.run(trainer.train)
        library = logging.getLogger("recis_async")
        assert library.handlers == [] and library.propagate and library.level == logging.NOTSET
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert b"INFO" not in proc.stderr and b"<mode=train>" not in proc.stderr


@pytest.mark.parametrize("root_level", ["INFO", "WARNING"])
def test_logging_configured_after_the_default_prints_each_line_once(
    tmp_path: Path, root_level: str
) -> None:
    """The Trainer's default handler steps aside once the application configures the root
    logger: the second run's lines appear once, in the application's format and level."""
    proc = run_script(
        """
        import logging, sys, anyio, torch
        from toy import Model, batches
        from recis_async import Trainer, TrainingArguments

        def run():
            model = Model()
            trainer = Trainer(model, TrainingArguments(train_steps=10, log_steps=10, save_steps=None),
                              train_dataset=batches(10),
                              dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None))
            anyio.run(trainer.train)

        run()
        logging.basicConfig(level=sys.argv[1], format="APP %(name)s %(message)s")
        run()
        """,
        tmp_path,
        root_level,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.decode().splitlines() if "<mode=train>" in line]
    first = [line for line in lines if re.match(rf"{STAMP} INFO recis_async.hooks.logger", line)]
    app = [line for line in lines if line.startswith("APP recis_async.hooks.logger <mode=train>")]
    assert len(first) == 1
    assert len(app) == (1 if root_level == "INFO" else 0)
    assert len(lines) == len(first) + len(app)


@pytest.mark.anyio
async def test_enable_logging_for_an_own_loop() -> None:
    stream = io.StringIO()
    library = logging.getLogger("recis_async")
    recis_async.enable_logging("DEBUG", stream=stream)
    try:
        recis_async.enable_logging("INFO", stream=stream)  # replaced, not added
        assert len(library.handlers) == 1 and library.level == logging.INFO
        assert not library.propagate  # the application's own handlers print nothing twice
        async with HookBus() as bus:
            bus.add_hook(LoggerHook(log_step=2))
            for step in range(4):
                await bus.publish(AfterStep(global_step=step, samples=2))
        logging.getLogger("recis_async.bus").debug("not shown at INFO")
    finally:
        recis_async.disable_logging()
    assert library.handlers == [] and library.propagate and library.level == logging.NOTSET
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1].split(" <qps")[0] for line in lines] == [
        "<mode=train> <gstep=1> <lstep=1>",  # counted by the hook: the loop passes none
        "<mode=train> <gstep=3> <lstep=3>",
    ]
    assert all(re.match(rf"{STAMP} INFO recis_async\.hooks\.logger: ", line) for line in lines)


def test_enable_logging_names_a_bad_level() -> None:
    with pytest.raises(ValueError, match=r"enable_logging\(level=...\): expected DEBUG.*'LOUD'"):
        recis_async.enable_logging("LOUD")
    with pytest.raises(TypeError, match=r"enable_logging\(level=...\).*got 2.5"):
        recis_async.enable_logging(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"enable_logging\(stream=...\)"):
        recis_async.enable_logging(stream="stderr")  # type: ignore[arg-type]
    assert logging.getLogger("recis_async").handlers == []


@pytest.mark.anyio
async def test_bar_and_handlers_restored_when_end_runs_out_of_time() -> None:
    """An End subscriber that overruns ``flush_timeout`` ahead of the bar does not leave the
    bar drawn and the console handlers writing through tqdm after the bus closed."""
    screen = io.StringIO()
    handler = logging.StreamHandler(screen)
    root = logging.getLogger()
    root.addHandler(handler)
    bar = ProgressBarHook(total=3, file=screen, mininterval=1e-9)
    try:
        with pytest.raises(recis_async.HookError, match="flush_timeout"):
            async with HookBus(flush_timeout=0.2) as bus:

                async def slow_end(event: object) -> None:
                    await anyio.sleep(30)

                bus.subscribe(End, slow_end, priority="HIGHEST")
                bus.add_hook(bar)
                for step in range(3):
                    await bus.publish(BeforeStep(global_step=step))
                    await bus.publish(AfterStep(global_step=step, samples=1, metrics={}))
        assert handler.stream is screen
        assert bar._bar is None
    finally:
        root.removeHandler(handler)
