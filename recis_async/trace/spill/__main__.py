"""``python -m recis_async.spill``: look into trace spill files and deliver them from a shell.

``inspect FILE [--json]`` shows what a spill file holds; ``replay FILE --parquet ROOT`` or
``replay FILE --odps-config cfg.json`` delivers it exactly once (see
:func:`recis_async.spill.replay_spill`).  Exit status: 0 done; 1 with a one-line reason on
stderr (missing or unreadable file, refused configuration, sink failure); 2 usage error;
130 interrupted.  A failed or interrupted replay is continued by running it again.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..base import Sink, parse_partition
from ..odps import ENV_ACCESS_ID, ENV_ACCESS_KEY, OdpsSink
from ..parquet import ParquetSink
from . import SpillFile, read_journal, read_spill, replay_spill

__all__ = ["main"]

PROG = "python -m recis_async.spill"

_DESCRIPTION = """\
Look into and deliver trace spill files (*.arrows).

A TraceHook / TraceToOdpsHook keeps the rows it could not deliver (the sink failed, or the
close deadline passed) in a spill file under its spill_dir (./trace_spill by default).
'inspect' shows what a file holds; 'replay' delivers every row of it exactly once and then
removes it. A replay that fails or is interrupted (Ctrl-C, a crash) can be run again: it
continues where it stopped and sends nothing twice.

examples:
  %(prog)s inspect trace_spill/trace_odps_proj.ctr-20261122T101500-1a2b3c4d.arrows
  %(prog)s replay  FILE --parquet ./traces
  %(prog)s replay  FILE --parquet ./traces --table ctr --partition dt=20261122
  %(prog)s replay  FILE --odps-config odps.json

exit status: 0 done, 1 failed (one line on stderr says why), 2 bad usage, 130 interrupted
"""

_REPLAY_EPILOG = f"""\
--odps-config names a JSON file with TraceToOdpsHook's config keys: project, end_point,
table_name, and optionally partition, tunnel_endpoint, access_id, access_key. Leave the
access keys out of the file to take them from the {ENV_ACCESS_ID} and
{ENV_ACCESS_KEY} environment variables. Credentials are never printed.

--table and --partition default to the table and partition the rows were meant for (the
spill file records them), and override the config file's table_name and partition.
"""


class _Failure(Exception):
    """A reason to stop with exit status 1, printed as one line."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        if args.command == "inspect":
            _inspect(args.file, as_json=args.json)
        else:
            _replay(args)
    except _Failure as exc:
        print(f"spill {args.command}: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"spill {args.command}: interrupted; run the same command again to continue "
            "(nothing is delivered twice)",
            file=sys.stderr,
        )
        return 130
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="show the fields, batches, rows, reason and in-doubt uploads of a spill file",
        description="Show what a spill file holds: its fields and types, its batches and "
        "rows, why they were spilled, uploads whose outcome was unknown (settled before "
        "anything is sent again), and what an earlier replay already delivered.",
    )
    inspect.add_argument("file", metavar="FILE", type=Path, help="a spill file (*.arrows)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead")
    replay = commands.add_parser(
        "replay",
        help="deliver every row of a spill file exactly once, then remove it",
        description="Deliver every row of a spill file exactly once, to Parquet files or an\n"
        "ODPS table, then remove the file. Run it again after a failure or an interruption:\n"
        "it continues where it stopped and sends nothing twice.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("file", metavar="FILE", type=Path, help="a spill file (*.arrows)")
    target = replay.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--parquet",
        metavar="ROOT",
        type=Path,
        help="write Parquet files under ROOT/TABLE/k=v/ (readable by pyarrow and pandas)",
    )
    target.add_argument(
        "--odps-config",
        metavar="JSON",
        type=Path,
        help="upload to the ODPS (MaxCompute) table this JSON config names",
    )
    replay.add_argument("--table", help="the table to write (default: the spill file's)")
    replay.add_argument(
        "--partition",
        metavar="K=V[,K=V]",
        help="the partition, e.g. dt=20261122,hour=10 (default: the spill file's)",
    )
    for sub in (inspect, replay):
        sub.add_argument(
            "-v", "--verbose", action="store_true", help="log progress to stderr as well"
        )
    return parser


def _configure_logging(verbose: bool) -> None:
    """Quiet by default (the result and any failure are one line each); ``-v``: INFO logs."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    else:
        logging.basicConfig(handlers=[logging.NullHandler()])


# ------------------------------------------------------------------------------ inspect


def _inspect(path: Path, *, as_json: bool) -> None:
    spill = _load(path)
    done, tokens = _journal(path)
    batches: list[dict[str, Any]] = [
        {
            "seq": e.batch.seq,
            "rows": e.batch.rows,
            "in_doubt": None if e.batch.seq in done else tokens.get(e.batch.seq, e.in_doubt),
            "replayed": e.batch.seq in done,
        }
        for e in spill.entries
    ]
    if as_json:
        print(
            json.dumps(
                {
                    "path": str(spill.path),
                    "created": spill.created,
                    "sink": spill.sink,
                    "reason": spill.reason,
                    "fields": [
                        {"name": f, "type": t}
                        for f, t in zip(spill.fields, spill.types, strict=True)
                    ],
                    "batches": batches,
                    "rows": spill.rows,
                    "in_doubt": [b["in_doubt"] for b in batches if b["in_doubt"]],
                    "replayed_batches": sorted(done),
                    "replayed_rows": sum(b["rows"] for b in batches if b["replayed"]),
                },
                indent=2,
            )
        )
        return
    width = max(len(f) for f in spill.fields)
    lines = [
        f"file      {spill.path}",
        f"created   {spill.created or '(not recorded)'}",
        f"sink      {spill.sink or '(not recorded)'}",
        f"reason    {spill.reason or '(not recorded)'}",
        f"fields    {len(spill.fields)}",
        *(f"          {f:<{width}}  {t}" for f, t in zip(spill.fields, spill.types, strict=True)),
        f"batches   {len(batches)}, {spill.rows} rows",
        "          seq        rows  status",
    ]
    for b in batches:
        status = (
            "delivered by an earlier replay"
            if b["replayed"]
            else f"in doubt: {b['in_doubt']} (settled before anything is sent again)"
            if b["in_doubt"]
            else "to deliver"
        )
        lines.append(f"          {b['seq']:<6} {b['rows']:>8}  {status}")
    if done:
        left = sum(1 for b in batches if not b["replayed"])
        lines.append(
            f"replayed  {len(done)} of {len(batches)} batches; run replay again for the "
            f"other {left}"
        )
    print("\n".join(lines))


# ------------------------------------------------------------------------------- replay


def _replay(args: argparse.Namespace) -> None:
    path: Path = args.file
    spill = _load(path)
    table, partition = _destination(spill.sink)
    if args.table is not None:
        table = args.table
    if args.partition is not None:
        partition = args.partition or None
    sink: Sink
    try:
        if args.parquet is not None:
            if table is None:
                raise _Failure(
                    f"{path}: the spill file does not say which table its rows were for; "
                    "give --table"
                )
            sink = ParquetSink(args.parquet, table, partition, rank=0)
        else:
            config = _odps_config(args.odps_config)
            if args.table is not None or "table_name" not in config:
                config["table_name"] = table
            if args.partition is not None or "partition" not in config:
                config["partition"] = partition
            sink = OdpsSink({k: v for k, v in config.items() if v is not None})
    except ValueError as exc:
        raise _Failure(str(exc)) from None
    try:
        report = replay_spill(path, sink)
    except Exception as exc:  # the sink's error, scrubbed of credentials by the sink
        done, _ = _journal(path)
        cause = str(exc) if str(exc).startswith(sink.name) else f"{sink.name}: {exc}"
        raise _Failure(
            f"{cause}; {len(done)} of {len(spill.entries)} batches are delivered (recorded "
            "in the journal), run the same command again to deliver the rest"
        ) from None
    present = f", {report.present} already present" if report.present else ""
    earlier = f", {report.skipped} by an earlier replay" if report.skipped else ""
    print(
        f"delivered {report.delivered} batch(es) ({report.rows} rows) to {sink.name}"
        f"{present}{earlier}; removed {path}"
    )


def _destination(sink: str) -> tuple[str | None, str | None]:
    """The table and partition a spill file's sink description names, if it names them:
    ``odps:project.table[/k=v,...]`` or ``parquet:root/table[/k=v/...]``."""
    kind, _, where = sink.partition(":")
    try:
        if kind == "odps":
            names, _, spec = where.partition("/")
            table = names.rpartition(".")[2]
            parse_partition(spec or None)
            return table or None, spec or None
        if kind == "parquet":
            parts = list(Path(where).parts)
            keys: list[str] = []
            while parts and "=" in parts[-1]:
                keys.insert(0, parts.pop())
            parse_partition(",".join(keys))
            return (parts[-1] if parts else None), ",".join(keys) or None
    except ValueError:
        pass
    return None, None


def _odps_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _Failure(f"{path}: cannot read the ODPS config: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:  # its message quotes no content
        raise _Failure(
            f"{path}: expected a JSON object, got invalid JSON ({exc.msg} at line "
            f"{exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(config, Mapping):
        raise _Failure(f"{path}: expected a JSON object, got a JSON {type(config).__name__}")
    return dict(config)


# ------------------------------------------------------------------------------ helpers


def _load(path: Path) -> SpillFile:
    if not path.exists():
        raise _Failure(f"{path}: no such file (a replay that finished removes its file)")
    if path.is_dir():
        raise _Failure(f"{path}: is a directory, expected a spill file (*.arrows)")
    try:
        spill = read_spill(path)
    except Exception as exc:  # the system's, or pyarrow's for a damaged or foreign file
        if isinstance(exc, OSError) and exc.errno is not None:
            raise _Failure(f"{path}: cannot read: {exc.strerror or exc}") from None
        raise _Failure(
            f"{path}: not a readable recis_async spill file ({type(exc).__name__}: {exc})"
        ) from None
    if not spill.entries:
        raise _Failure(f"{path}: the spill file holds no batches")
    return spill


def _journal(path: Path) -> tuple[set[int], dict[int, str]]:
    try:
        return read_journal(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _Failure(
            f"{path}.journal: cannot read the replay journal ({type(exc).__name__}: {exc})"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
