"""Events decoded for the ledger: validated exactly as `decode_event`, then built into Arrow column-wise.

Through Python objects, each step's ~1.8k packed token values become Python ints twice (validation,
then `model_dump`) and go back into Arrow one by one: 80% of the ledger writer's time (measured in
bench/ledger.py). Here each message is validated by the same pydantic models, with the same rules and
the same error for a bad one (the dead-letter decision stays per message), except that a packed field
keeps its decoded little-endian bytes; a batch's packed column is then one concatenation.

A columnar event is an instance of a subclass of its event class (`columnar_class`), so the class's
own validators and `topic` apply; it is only for `columnar_table`. Elsewhere, use `decode_event`.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Union

import numpy as np
import pyarrow as pa
from pydantic import Field, TypeAdapter, WrapValidator, create_model

from schemas.arrow import arrow_schema, events_to_table
from schemas.events import EVENT_TYPES, Event, Packed, packed_bytes


class PackedValues:
    """A validated packed field: its little-endian bytes, or the validated list when the JSON carried
    a plain list. `len()` is the number of values, as for the list (the models' validators compare
    lengths)."""

    __slots__ = ("data", "values", "count")

    def __init__(self, data: bytes | None, values: list | None, count: int):
        self.data, self.values, self.count = data, values, count

    def __len__(self) -> int:
        return self.count


@cache
def packed_fields(model: type[Event]) -> dict[str, str]:
    """The model's packed fields and their wire dtypes."""
    return {name: m.dtype for name, f in model.model_fields.items() for m in f.metadata if isinstance(m, Packed)}


def _keep_bytes(dtype: str) -> WrapValidator:
    itemsize = np.dtype(dtype).itemsize

    def validate(value, handler) -> PackedValues:
        if isinstance(value, str):
            data = packed_bytes(value, itemsize)
            return PackedValues(data, None, len(data) // itemsize)
        values = handler(value)  # a plain list: the field's own list validation
        return PackedValues(None, values, len(values))

    return WrapValidator(validate)


@cache
def columnar_class(model: type[Event]) -> type[Event]:
    """`model` with its packed fields kept as bytes (`model` itself when it has none)."""
    packed = packed_fields(model)
    if not packed:
        return model
    fields = {}
    for name, dtype in packed.items():
        field = model.model_fields[name]
        assert field.is_required(), f"{model.__name__}.{name}: a packed field with a default is not supported"
        fields[name] = (Annotated[field.annotation, _keep_bytes(dtype)], Field(description=field.description))
    return create_model(f"{model.__name__}Columnar", __base__=model, __module__=__name__, **fields)


_ADAPTER: TypeAdapter[Event] = TypeAdapter(
    Annotated[Union[tuple(columnar_class(cls) for cls in EVENT_TYPES)], Field(discriminator="event_type")]  # noqa: UP007 - a Union over a computed tuple
)


def decode_columnar(raw: bytes | str) -> Event:
    """`decode_event` for `columnar_table`: same acceptance, same errors, packed fields left as bytes."""
    return _ADAPTER.validate_json(raw)


def columnar_table(events: list[Event], model: type[Event]) -> pa.Table:
    """The Arrow table of `events` of `model` (from `decode_columnar`, or plain events), equal to
    `events_to_table` of the same events decoded by `decode_event`."""
    classes = (model, columnar_class(model))
    if any(type(e) not in classes for e in events):
        raise TypeError(f"columnar_table got events other than {model.__name__}")
    packed = packed_fields(model)
    if not packed:  # then `columnar_class(model)` is `model`
        return events_to_table(events, model)
    schema = arrow_schema(model)
    rest = pa.schema([f for f in schema if f.name not in packed])
    exclude = set(packed)
    table = pa.Table.from_pylist([e.model_dump(exclude=exclude) for e in events], schema=rest)
    columns = {
        name: _list_column([getattr(e, name) for e in events], dtype, schema.field(name).type)
        for name, dtype in packed.items()
    }
    return pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else table.column(f.name) for f in schema], schema=schema
    )


def _list_column(values: list[PackedValues | list], dtype: str, list_type: pa.ListType) -> pa.Array:
    target = np.dtype(list_type.value_type.to_pandas_dtype())
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    if all(isinstance(v, PackedValues) and v.data is not None for v in values):  # the usual case: one copy
        flat = np.frombuffer(b"".join([v.data for v in values]), dtype=dtype).astype(target)
    else:
        flat = np.concatenate([_values(v, dtype, target) for v in values] or [np.empty(0, target)], dtype=target)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=list_type)


def _values(v: PackedValues | list, dtype: str, target: np.dtype) -> np.ndarray:
    if not isinstance(v, PackedValues):
        return np.asarray(v, dtype=target)
    return np.frombuffer(v.data, dtype=dtype) if v.data is not None else np.asarray(v.values, dtype=target)


__all__ = ["PackedValues", "columnar_class", "columnar_table", "decode_columnar", "packed_fields"]
