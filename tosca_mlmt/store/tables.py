"""The two tables of a snapshot (episodes, turns) and the typed records they hold.

``snapshot`` owns the folder (atomic publish, reading), ``manifest`` the id and ``verify`` the
checks; this module only maps ``Episode``/``Turn`` records to Arrow tables and back, including
turns files written before a column existed, and digests a table's values for the id.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tosca_mlmt.records import Episode, FeedbackSpan, Turn
from tosca_mlmt.tasks.base import Problem

EPISODE_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("problem_id", pa.string()), ("task", pa.string()), ("split", pa.string()),
    ("sample", pa.int32()), ("question", pa.string()), ("answer", pa.string()), ("problem_meta", pa.string()),
    ("r1", pa.float64()), ("r_final", pa.float64()), ("rewards", pa.list_(pa.float64())),
    ("strategies", pa.list_(pa.int32())), ("strategy_names", pa.list_(pa.string())), ("n_turns", pa.int32()),
])
TURN_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("problem_id", pa.string()), ("turn_index", pa.int32()), ("round", pa.int32()),
    ("role", pa.string()), ("kind", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()),
    ("text", pa.string()), ("reward", pa.float64()), ("correct", pa.bool_()), ("extracted", pa.string()),
    ("info", pa.string()), ("strategy", pa.int32()), ("strategy_name", pa.string()),
    ("behaviour_prob", pa.float64()), ("behaviour_probs", pa.list_(pa.float64())),
    ("q_values", pa.list_(pa.float64())), ("state_len", pa.int32()),
    ("feedback_span", pa.list_(pa.int32())), ("truncated", pa.bool_()),
])
# Columns added after format 2 was first written: older files lack them and read as these
# defaults (their feedback span is still in ``info``, where the runner used to put it).
LATE_TURN_COLUMNS = {"feedback_span": None, "truncated": False}
# Written into both files, outside the id (see verify.py): rows read or concatenated from
# several snapshots by any parquet reader still say where they came from.
SNAPSHOT_ID = "snapshot_id"
_TURN_FIELDS = [f.name for f in TURN_SCHEMA
                if f.name not in ("episode_id", "problem_id", "turn_index", "info", "feedback_span")]


def episodes_to_tables(episodes: list[Episode]) -> tuple[pa.Table, pa.Table]:
    ep_rows, turn_rows = [], []
    for ep in episodes:
        fbs = [t for t in ep.turns if t.kind == "feedback"]
        p = ep.problem
        ep_rows.append(dict(
            episode_id=ep.episode_id, problem_id=p.id, task=p.task, split=p.split, sample=ep.sample,
            question=p.question, answer=p.answer, problem_meta=p.meta_json(), r1=ep.r1, r_final=ep.r_final,
            rewards=[t.reward for t in ep.solver_turns], strategies=[t.strategy for t in fbs],
            strategy_names=[t.strategy_name for t in fbs], n_turns=len(ep.turns)))
        for t in ep.turns:
            row = {k: getattr(t, k) for k in _TURN_FIELDS}
            span = t.feedback_span
            row.update(episode_id=ep.episode_id, problem_id=p.id, turn_index=t.index,
                       info=json.dumps(t.info, sort_keys=True, default=str),
                       feedback_span=None if span is None else [span.start, span.end])
            turn_rows.append(row)
    return (pa.Table.from_pylist(ep_rows, schema=EPISODE_SCHEMA),
            pa.Table.from_pylist(turn_rows, schema=TURN_SCHEMA))


def with_snapshot_id(table: pa.Table, sid: str) -> pa.Table:
    """``table`` with a constant ``snapshot_id`` (string) column appended."""
    return table.append_column(SNAPSHOT_ID, pa.array([sid] * table.num_rows, pa.string()))


def without_snapshot_id(table: pa.Table) -> pa.Table:
    return table.drop_columns([SNAPSHOT_ID]) if SNAPSHOT_ID in table.column_names else table


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as the parquet file ``pq.write_table`` writes (same bytes, in memory)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def canonical_bytes(stored: pa.Table) -> bytes:
    """The file the writer hashed for the id, re-derived from a stored table: without its
    ``snapshot_id`` column, and with list items named as Arrow names them before parquet renames
    them ``element``; the stored file's own columns, so files of older schemas re-derive alike."""
    t = without_snapshot_id(stored)
    schema = pa.schema([pa.field(f.name, pa.list_(f.type.value_type), f.nullable) if pa.types.is_list(f.type)
                        else f for f in t.schema])
    return parquet_bytes(t.cast(schema))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_string(t: pa.DataType) -> bool:
    view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(t) or pa.types.is_large_string(t) or view(t)


def _type_name(t: pa.DataType) -> str:
    """A logical type's name: one for every physical form a reader may pick (string, large_string,
    string_view; list, large_list), none for the list item's field name (Arrow "item", parquet "element")."""
    if _is_list(t):
        return f"list<{_type_name(t.value_type)}>"
    return "string" if _is_string(t) else str(t)


def _value_stream(arr: pa.Array):
    """The logical values of ``arr`` as byte chunks: validity, then the values in a fixed
    little-endian layout; a list's lengths, then its items; a string's lengths, then its UTF-8."""
    yield pc.is_valid(arr).to_numpy(zero_copy_only=False).astype("u1").tobytes()
    t = arr.type
    if _is_list(t):
        yield pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8").tobytes()
        yield from _value_stream(arr.flatten())
    elif _is_string(t):
        texts = [b"" if v is None else v.encode("utf-8") for v in arr.to_pylist()]
        yield np.array([len(b) for b in texts], dtype="<i8").tobytes()
        yield b"".join(texts)
    elif pa.types.is_boolean(t):
        yield arr.fill_null(False).to_numpy(zero_copy_only=False).astype("u1").tobytes()
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        dtype = np.dtype(t.to_pandas_dtype()).newbyteorder("<")
        yield arr.fill_null(0).to_numpy(zero_copy_only=False).astype(dtype).tobytes()
    else:
        raise TypeError(f"no canonical encoding for a {t} column")


def content_entry(table: pa.Table) -> dict:
    """What a format-3 id stands for in one data file: the sha256 of its columns' logical values
    (each column's name and type, then _value_stream) and that stream's length. It does not depend
    on how parquet encoded them (writer version, compression, page layout), so a pyarrow upgrade
    neither changes the id of the same episodes nor fails to verify a stored snapshot."""
    h, n = hashlib.sha256(), 0
    for field, col in zip(table.schema, table.columns):
        chunks = [f"{field.name}\0{_type_name(field.type)}\0".encode()]
        chunks += _value_stream(col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
        for c in chunks:
            h.update(len(c).to_bytes(8, "little"))  # framed: no two streams concatenate alike
            h.update(c)
            n += 8 + len(c)
    return {"sha256": h.hexdigest(), "bytes": n}


def tables_to_episodes(ep_table: pa.Table, turn_table: pa.Table) -> list[Episode]:
    turn_table = without_snapshot_id(turn_table)  # where the rows came from, not an Episode field
    by_ep: dict[str, list[Turn]] = {}
    for r in turn_table.to_pylist():
        info = json.loads(r.pop("info") or "{}")
        eid, _pid, idx = r.pop("episode_id"), r.pop("problem_id"), r.pop("turn_index")
        span = r.pop("feedback_span", None) or info.pop("feedback_span", None)
        r["truncated"] = bool(r.get("truncated"))
        by_ep.setdefault(eid, []).append(Turn(index=idx, info=info, feedback_span=None if span is None else
                                              FeedbackSpan(*map(int, span)), **r))
    out = []
    for r in ep_table.to_pylist():
        p = Problem(r["task"], r["problem_id"], r["question"], r["answer"], r["split"], json.loads(r["problem_meta"]))
        out.append(Episode(r["episode_id"], p, r["sample"], sorted(by_ep.get(r["episode_id"], []), key=lambda t: t.index)))
    return out


def _with_late_columns(turns: pa.Table) -> pa.Table:
    """A turns table written before LATE_TURN_COLUMNS existed, with them added (defaults)."""
    for name, default in LATE_TURN_COLUMNS.items():
        if name not in turns.column_names:
            typ = TURN_SCHEMA.field(name).type
            turns = turns.append_column(name, pa.array([default] * turns.num_rows, type=typ))
    return turns


def read_tables(folder: Path) -> tuple[pa.Table, pa.Table]:
    """(episodes, turns) of a snapshot folder, cast to the current schemas (no ``snapshot_id``
    column: ``Snapshot.tables`` adds the verified id); raises what
    pyarrow raises on unreadable files (the caller names the snapshot)."""
    return (without_snapshot_id(pq.read_table(folder / "episodes.parquet")).cast(EPISODE_SCHEMA),
            _with_late_columns(without_snapshot_id(pq.read_table(folder / "turns.parquet"))).cast(TURN_SCHEMA))
