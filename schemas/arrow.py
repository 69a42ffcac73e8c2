"""Arrow schemas derived from the event models, and the conversions both ways.

The mapping is by Python type: str -> string, `Int64` -> int64, float -> float64, bool -> bool,
datetime -> timestamp[us, UTC], Literal[...] -> string, list[T] -> list<T>, dict[str, T] -> map<string, T>,
nested model -> struct; `X | None` makes the field nullable. A field of a type outside this list is a
programming error and fails at import of the first schema, not at write time. So is a plain `int`:
pydantic accepts any size of int, and a valid event the ledger cannot write would stop it for good.
"""

from __future__ import annotations

import types
import typing
from datetime import datetime
from functools import cache
from typing import Annotated, Any, Literal, Union

import pyarrow as pa
from pydantic import BaseModel, Field

_INT64_RANGE = Field(ge=-(2**63), le=2**63 - 1)
Int64 = Annotated[int, _INT64_RANGE]
"""The int of every event field: an int beyond Arrow's int64 makes the event invalid (dead-lettered
with its reason), not a row the ledger cannot write. Further bounds go in the field's `Field(...)`."""

_SCALARS: dict[type, pa.DataType] = {
    str: pa.string(),
    float: pa.float64(),
    bool: pa.bool_(),
    datetime: pa.timestamp("us", tz="UTC"),
}


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """Strip Annotated and Optional; return (inner type, nullable). `Int64` stays itself."""
    while typing.get_origin(tp) is typing.Annotated and not _is_int64(tp):
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unions other than Optional have no Arrow mapping: {tp}")
        return _unwrap(args[0])[0], True
    return tp, False


def _is_int64(tp: Any) -> bool:
    return typing.get_args(tp)[0] is int and any(m is _INT64_RANGE for m in tp.__metadata__)


def _arrow_type(tp: Any) -> pa.DataType:
    tp, _ = _unwrap(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # `Int64`
        return pa.int64()
    if tp is int:
        raise TypeError("declare int fields as `schemas.arrow.Int64`: pydantic's int has no size, Arrow's has")
    if tp in _SCALARS:
        return _SCALARS[tp]
    if origin is Literal:
        return pa.string()
    if origin is list:
        return pa.list_(_arrow_type(typing.get_args(tp)[0]))
    if origin is dict:
        key, value = typing.get_args(tp)
        return pa.map_(_arrow_type(key), _arrow_type(value))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return pa.struct(_fields(tp))
    raise TypeError(f"no Arrow mapping for {tp!r}")


def _fields(model: type[BaseModel]) -> list[pa.Field]:
    hints = typing.get_type_hints(model, include_extras=True)
    out = []
    for name in model.model_fields:
        _, nullable = _unwrap(hints[name])
        out.append(pa.field(name, _arrow_type(hints[name]), nullable=nullable))
    return out


@cache
def arrow_schema(model: type[BaseModel]) -> pa.Schema:
    """The Arrow schema of an event class; field order follows the model."""
    return pa.schema(_fields(model), metadata={b"awrl.event_type": model.__name__.encode()})


def events_to_table(events: list[BaseModel], model: type[BaseModel] | None = None) -> pa.Table:
    """All `events` must be of one class (a Parquet file holds one event type)."""
    if model is None:
        if not events:
            raise ValueError("cannot infer the event class of an empty list; pass model=")
        model = type(events[0])
    if any(type(e) is not model for e in events):
        raise TypeError(f"events_to_table got events other than {model.__name__}")
    rows = [e.model_dump() for e in events]
    return pa.Table.from_pylist(rows, schema=arrow_schema(model))


def table_to_events(table: pa.Table, model: type[BaseModel]) -> list[BaseModel]:
    """Inverse of `events_to_table`: Arrow maps come back as lists of pairs, so fold them to dicts."""
    hints = typing.get_type_hints(model, include_extras=True)
    return [model.model_validate(_from_arrow(row, model, hints)) for row in table.to_pylist()]


def _from_arrow(row: dict, model: type[BaseModel], hints: dict) -> dict:
    return {name: _value(row[name], hints[name]) for name in model.model_fields if name in row}


def _value(value: Any, tp: Any) -> Any:
    tp, _ = _unwrap(tp)
    if value is None or typing.get_origin(tp) is typing.Annotated:  # None, or an `Int64`
        return value
    origin = typing.get_origin(tp)
    if origin is dict:
        vt = typing.get_args(tp)[1]
        return {k: _value(v, vt) for k, v in value}
    if origin is list:
        (it,) = typing.get_args(tp)
        return [_value(v, it) for v in value]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _from_arrow(value, tp, typing.get_type_hints(tp, include_extras=True))
    return value
