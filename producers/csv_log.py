"""The impression log of ``driftline traffic --csv`` (or ``--parquet``) and its map file: rows -> requests.

The log is a CSV or a Parquet file with one row per impression (an item shown in a request). Rows sharing a request
id form one request whose candidates are their items; the rows whose action columns are set are
its actions (:mod:`producers.csv_traffic` sends them: ``/rank``, then ``/actions``).

The map file (TOML) says which column is what::

    [columns]
    request = "impression_id"  # rows sharing it are one /rank (absent: each row is one request)
    item = "item"              # required
    item_ids = "string"        # "int" (the default, as a feature's ids) or "string" (hashed)
    user = "user"              # optional; user_ids as item_ids
    event_time = "ts"          # optional (absent: serving stamps now); its unit:
    event_time_unit = "s"      # "ms" (the default), "s", or "iso" (ISO 8601, e.g. 2026-11-20T10:00:00Z)
    action_time = "click_ts"   # optional: when the actions happened (absent: the request's time)
    position_base = 1          # optional: the log's first place is 1 (a position feature counts from 0)

    [actions]                  # action type = column: 1, true, yes or a positive number means it happened
    click = "clicked"

    [features]                 # feature = column, its spec from the project file (--config) ...
    device = "device_type"
    # ... or given here, for a log replayed without a project file (column: the feature's name
    # when left out)
    pos = { column = "position", source = "position", kind = "sparse", ids = "int" }

A position feature (``source = "position"``) is sent as the log gives it: where the item was shown
when the log was written (serving scores and logs it as given).

Features whose columns carry their own names can be listed instead of mapped one by one (their
specs from the project file): ``features = ["device", "pos"]`` at the top of the file.

    [csv]
    list_separator = "|"       # optional: split a sparse feature's cell into several ids

A Parquet log's cells are typed: :func:`parquet_rows` reads them as the CSV's text (a missing or
NaN value is an empty cell; a list cell is a multi-id sparse feature, joined with
``list_separator``, "|" when the map sets none; a timestamp column is written in the map's
``event_time_unit``), so the same map reads both.

A request's context features (``context`` and ``user`` sources) are read from its first row.
``--rebase`` shifts every event time so the log's last event is now: serving refuses event times
older than ``event_time.max_past_s`` (a week), which an old log has.

>>> spec = MapFile.model_validate({"columns": {"request": "rid", "item": "item", "item_ids": "string"},
...                                "actions": {"click": "clicked"},
...                                "features": {"pos": {"column": "pos", "source": "candidate"}}})
>>> rows = [{"rid": "a", "item": "x", "pos": "0", "clicked": "1"}, {"rid": "a", "item": "y", "pos": "1", "clicked": ""},
...         {"rid": "b", "item": "x", "pos": "0", "clicked": "0"}]
>>> reqs = requests_of(rows, spec, spec.feature_specs(None))
>>> [(r.key, [c["item_id"] for c in r.candidates], r.actions) for r in reqs]
[('a', ['x', 'y'], [('x', 'click', None)]), ('b', ['x'], [])]
>>> reqs[0].candidates[1]["features"]
{'pos': 1}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from driftline.client import InvalidInput
from driftline.project import FeatureSpec

__all__ = ["MapFile", "Request", "load_map", "parquet_rows", "rebase", "requests_of", "too_old"]

_TRUE = frozenset({"true", "yes", "y", "t"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Columns(_Strict):
    item: str
    item_ids: Literal["int", "string"] = "int"
    request: str | None = None
    user: str | None = None
    user_ids: Literal["int", "string"] = "int"
    event_time: str | None = None
    event_time_unit: Literal["ms", "s", "iso"] = "ms"
    action_time: str | None = None
    #: the number the log gives its first place: a position feature counts from 0 (the top), so a
    #: log that counts from 1 says 1 and its positions are sent one lower
    position_base: Literal[0, 1] = 0


class InlineFeature(_Strict):
    """A feature declared in the map file itself: a :class:`FeatureSpec` plus its column."""

    column: str | None = None  # None: the feature's own name
    source: Literal["context", "candidate", "user", "item", "position"]
    kind: Literal["sparse", "dense"] = "sparse"
    ids: Literal["int", "string"] = "int"


class CsvOptions(_Strict):
    list_separator: str | None = None


class MapFile(_Strict):
    """The map file's content (see the module docstring)."""

    columns: Columns
    actions: dict[str, str] = {}
    features: dict[str, str | InlineFeature] | list[str] = {}
    csv: CsvOptions = CsvOptions()

    def feature_specs(self, project: Sequence[FeatureSpec] | None) -> list[tuple[FeatureSpec, str]]:
        """(spec, column) of each mapped feature; a bare column name takes its spec from ``project``,
        and so does a listed feature, read from the column of its own name.

        >>> spec = MapFile.model_validate({"columns": {"item": "item"}, "features": ["device"]})
        >>> spec.feature_specs([FeatureSpec(name="device", source="context")])[0][1]
        'device'
        >>> spec = MapFile.model_validate({"columns": {"item": "item"}, "features": {"pos": {"source": "candidate"}}})
        >>> spec.feature_specs(None)[0][1]
        'pos'
        """
        known = {f.name: f for f in project or ()}
        entries = {name: name for name in self.features} if isinstance(self.features, list) else self.features
        out = []
        for name, entry in entries.items():
            if isinstance(entry, InlineFeature):
                out.append((FeatureSpec(name=name, **entry.model_dump(exclude={"column"})), entry.column or name))
            elif name in known:
                out.append((known[name], entry))
            else:
                raise InvalidInput(f"map file: feature {name!r} is not in the project's features "
                                   + ("(pass --config FILE, or give it inline: {column = ..., source = ..., kind = ..., ids = ...})"
                                      if project is None else f"({', '.join(sorted(known)) or 'none'})"))
        return out


def load_map(path: Path) -> MapFile:
    import tomllib

    try:
        return MapFile.model_validate(tomllib.loads(Path(path).read_text()))
    except (tomllib.TOMLDecodeError, ValidationError) as err:
        raise InvalidInput(f"map file {path}: {err}") from None


@dataclass
class Request:
    """One ``/rank`` of the log and the actions that followed it."""

    key: str
    event_time_ms: int | None
    user: str | int | None
    context: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    actions: list[tuple[str | int, str, int | None]] = field(default_factory=list)  # (item, type, time)


def _cell(row: Mapping[str, str], column: str, line: int) -> str:
    try:
        return (row[column] or "").strip()
    except KeyError:
        raise InvalidInput(f"line {line}: no column {column!r} (columns: {', '.join(row)})") from None


def _id(text: str, ids: str, what: str, line: int) -> str | int:
    if ids == "string":
        return text
    try:
        return int(text)
    except ValueError:
        raise InvalidInput(f"line {line}: {what} {text!r} is not an int (say {what}_ids = \"string\" to hash it)") from None


def _value(spec: FeatureSpec, text: str, separator: str | None, line: int) -> Any:
    """A cell as the client takes it: None (empty), a float (dense), ids (sparse; a list when split)."""
    if not text:
        return None
    try:
        if spec.kind == "dense":
            return float(text)
        parts = [p.strip() for p in text.split(separator)] if separator else [text]
        ids = [p if spec.hashed else int(p) for p in parts if p]
        return ids if separator else ids[0]
    except ValueError:
        raise InvalidInput(f"line {line}: feature {spec.name!r}: {text!r} is not "
                           + ("a number" if spec.kind == "dense" else "an int (declare ids = \"string\" to hash it)")) from None


def _shifted(value: Any, base: int) -> Any:
    """A position (one id, or ids of a split cell) counted from ``base``, counted from 0.

    >>> _shifted(1, 1), _shifted([3, 4], 1)
    (0, [2, 3])
    """
    return [v - base for v in value] if isinstance(value, list) else value - base


def _happened(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    try:
        return float(text) > 0
    except ValueError:
        return False


def _time(text: str, unit: str, line: int) -> int | None:
    """A cell's event time in Unix milliseconds (None: empty).

    >>> _time("2026-11-20T10:00:00Z", "iso", 2), _time("2026-11-20T10:00:00", "iso", 2), _time("1795168800", "s", 2)
    (1795168800000, 1795168800000, 1795168800000)
    """
    if not text:
        return None
    if unit == "iso":
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidInput(f"line {line}: event time {text!r} is not ISO 8601") from None
        # a time without a zone is UTC (a log's local time would move with the machine replaying it)
        return int((when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp() * 1000)
    try:
        t = float(text)
    except ValueError:
        raise InvalidInput(f"line {line}: event time {text!r} is not a number ({unit})") from None
    return int(t * 1000) if unit == "s" else int(t)


def requests_of(rows: Iterable[Mapping[str, str]], spec: MapFile,
                features: Sequence[tuple[FeatureSpec, str]]) -> list[Request]:
    """The log's requests, in event-time order (the file's order for equal times or no time column)."""
    cols = spec.columns
    by_key: dict[str, Request] = {}
    context_specs = [(f, c) for f, c in features if f.source in ("context", "user")]
    # (a position is the log's: where the item was shown then, sent as given)
    candidate_specs = [(f, c) for f, c in features if f.source in ("candidate", "item", "position")]
    sep = spec.csv.list_separator
    for line, row in enumerate(rows, start=2):  # line 1 is the header
        key = _cell(row, cols.request, line) if cols.request else str(line)
        when = _time(_cell(row, cols.event_time, line), cols.event_time_unit, line) if cols.event_time else None
        request = by_key.get(key)
        if request is None:
            user = _cell(row, cols.user, line) if cols.user else ""
            request = by_key[key] = Request(
                key, when, _id(user, cols.user_ids, "user", line) if user else None,
                {f.name: _value(f, _cell(row, c, line), sep, line) for f, c in context_specs})
        item = _id(_cell(row, cols.item, line), cols.item_ids, "item", line)
        values = {f.name: _value(f, _cell(row, c, line), sep, line) for f, c in candidate_specs}
        for f, _c in candidate_specs:
            if f.source == "position" and cols.position_base and values[f.name] is not None:
                values[f.name] = _shifted(values[f.name], cols.position_base)
        request.candidates.append({"item_id": item, "features": values})
        acted = cols.action_time and _time(_cell(row, cols.action_time, line), cols.event_time_unit, line)
        request.actions += [(item, kind, acted or None) for kind, column in spec.actions.items()
                            if _happened(_cell(row, column, line))]
    requests = list(by_key.values())
    if cols.event_time:
        requests.sort(key=lambda r: r.event_time_ms or 0)
    return requests


def parquet_rows(path: Path, spec: MapFile, batch_rows: int = 65_536) -> Iterator[dict[str, str]]:
    """A Parquet log's rows as :func:`requests_of` reads a CSV's: each cell as its text.

    >>> import pyarrow as pa, pyarrow.parquet as pq, tempfile
    >>> table = pa.table({"item": ["x", None], "ts": pa.array([datetime(2026, 11, 20, 10), None], pa.timestamp("ms")),
    ...                   "tags": [[1, 2], []], "price": [0.5, float("nan")], "clicked": [True, False]})
    >>> path = Path(tempfile.mkdtemp()) / "log.parquet"; pq.write_table(table, path)
    >>> spec = MapFile.model_validate({"columns": {"item": "item", "event_time": "ts", "event_time_unit": "s"}})
    >>> list(parquet_rows(path, spec))
    [{'item': 'x', 'ts': '1795168800', 'tags': '1|2', 'price': '0.5', 'clicked': 'true'}, {'item': '', 'ts': '', 'tags': '', 'price': '', 'clicked': 'false'}]
    """
    import pyarrow.parquet as pq

    cols = spec.columns
    unit = {c: cols.event_time_unit for c in (cols.event_time, cols.action_time) if c}
    separator = spec.csv.list_separator or "|"
    try:
        source = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for an unreadable file: one clear error
        raise InvalidInput(f"{path}: not a readable Parquet file ({err})") from None
    for batch in source.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            yield {column: _text(value, unit.get(column, "iso"), separator) for column, value in row.items()}


def _text(value: Any, unit: str, separator: str) -> str:
    """One typed Parquet cell as a CSV cell's text (a timestamp in ``unit``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):  # a timestamp without a zone is UTC, as in _time
        ms = int((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp() * 1000)
        return value.isoformat() if unit == "iso" else str(ms // 1000 if unit == "s" else ms)
    if isinstance(value, date):
        return _text(datetime(value.year, value.month, value.day), unit, separator)
    if isinstance(value, (list, tuple)):
        return separator.join(_text(v, unit, separator) for v in value if v is not None)
    return str(value)


def rebase(requests: Sequence[Request], now_ms: int) -> None:
    """Shift every event time (requests and actions alike) so the log's last event is ``now_ms``.

    >>> log = [Request("a", 1_000, None, {}, actions=[("x", "click", 5_000)]), Request("b", 3_000, None, {})]
    >>> rebase(log, 100_000); [(r.event_time_ms, r.actions) for r in log]
    [(96000, [('x', 'click', 100000)]), (98000, [])]
    """
    times = [t for r in requests for t in (r.event_time_ms, *(a[2] for a in r.actions)) if t is not None]
    if not times:
        return
    shift = now_ms - max(times)
    for r in requests:
        if r.event_time_ms is not None:
            r.event_time_ms += shift
        r.actions = [(item, kind, t + shift if t is not None else None) for item, kind, t in r.actions]


def too_old(requests: Sequence[Request], now_ms: int, max_past_s: float) -> str | None:
    """Why serving would refuse the log's oldest requests (``event_time.max_past_s``), or None:
    said once, before a replay sends thousands of requests that all come back 422.

    >>> log = [Request("a", 0, None, {}), Request("b", 10 * 86_400_000, None, {})]
    >>> too_old(log, 10 * 86_400_000, 7 * 86_400) # doctest: +NORMALIZE_WHITESPACE
    'the log spans 10.0 days up to 0.0 days ago: serving refuses events older than 7.0 days
    (event_time.max_past_s = 604800); raise it above 864001 (a project file: [settings.event_time] max_past_s)'
    >>> too_old(log, 10 * 86_400_000, 11 * 86_400) is None
    True
    """
    times = [r.event_time_ms for r in requests if r.event_time_ms is not None]
    if not times or now_ms - min(times) <= max_past_s * 1000:
        return None
    day = 86_400_000
    need = int((now_ms - min(times)) / 1000) + 1
    return (f"the log spans {(max(times) - min(times)) / day:.1f} days up to {(now_ms - max(times)) / day:.1f} days "
            f"ago: serving refuses events older than {max_past_s * 1000 / day:.1f} days "
            f"(event_time.max_past_s = {max_past_s:g}); raise it above {need} "
            "(a project file: [settings.event_time] max_past_s)")
