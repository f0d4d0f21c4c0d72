"""Hypothesis strategies for any protobuf message, built from its descriptor.

    messages(sampler_pb2.GenerateRequest.DESCRIPTOR)   -> GenerateRequest instances
    field_mutated(valid_request)                       -> it, with a few fields anything
    stream_mutated([msg, ...])                         -> a request stream, a few messages off
    mutated_bytes(descriptor, seed)                    -> a serialized message, then damaged

The maintained strategy generators for protobuf on PyPI are gone (hypothesis-protobuf: 2015,
hypothesis-pb: 2019), and walking the descriptor is short: every scalar type gets its full
range (with Hypothesis' preference for boundaries and small values), strings any Unicode,
repeated fields and maps a few entries, oneofs one member or none, nested messages recursively.
"""

from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_REPEATED = 4
MAX_DEPTH = 4


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in _INTS:
        lo, hi = _INTS[t]
        return st.one_of(st.integers(-3, 40).filter(lambda v: lo <= v <= hi),
                         st.integers(lo, hi))
    if t == F.TYPE_FLOAT:
        return st.floats(width=32)
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.text(max_size=24)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return _scalar(field)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@st.composite
def messages(draw, descriptor: Descriptor, depth: int = 0):
    """An instance of the message ``descriptor`` describes, with any subset of fields set."""
    message = message_factory.GetMessageClass(descriptor)()
    if depth >= MAX_DEPTH:
        return message
    chosen = {oneof.name: draw(st.sampled_from([None, *(f.name for f in oneof.fields)]))
              for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] != field.name:
            continue
        if oneof is None and not draw(st.booleans()):
            continue
        if _is_map(field):
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_scalar(key_field), _value(value_field, depth),
                                           max_size=MAX_REPEATED))
            target = getattr(message, field.name)
            for key, value in entries.items():
                if value_field.type == F.TYPE_MESSAGE:
                    target[key].CopyFrom(value)
                else:
                    target[key] = value
        elif field.is_repeated:
            getattr(message, field.name).extend(
                draw(st.lists(_value(field, depth), max_size=MAX_REPEATED)))
        elif field.type == F.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(draw(_value(field, depth)))
        else:
            setattr(message, field.name, draw(_value(field, depth)))
    return message


@st.composite
def mutated_bytes(draw, descriptor: Descriptor, seed: bytes | None = None):
    """A serialized message (``seed``, or one generated for ``descriptor``) damaged by a few
    byte flips, insertions, deletions or a cut; or bytes with no message behind them at all."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=96))
    if seed is not None and draw(st.booleans()):
        data = bytearray(seed)
    else:
        data = bytearray(draw(messages(descriptor)).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        at = draw(st.integers(0, len(data)))
        if op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif not data:
            continue
        elif op == "flip":
            at = min(at, len(data) - 1)
            data[at] ^= draw(st.integers(1, 255))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        else:
            del data[at:]
    return bytes(data)


@st.composite
def field_mutated(draw, seed):
    """A copy of the valid message ``seed`` with 1-3 fields anywhere in its tree replaced by
    anything their type allows, cleared, or (repeated fields) grown: requests that pass the
    first checks and reach the deeper ones."""
    message = type(seed)()
    message.CopyFrom(seed)
    for _ in range(draw(st.integers(1, 3))):
        _mutate_one_field(draw, message, depth=0)
    return message


def _mutate_one_field(draw, message, depth: int) -> None:
    if not message.DESCRIPTOR.fields:  # an empty request: nothing to change
        return
    field = draw(st.sampled_from(list(message.DESCRIPTOR.fields)))
    op = draw(st.sampled_from(["replace", "clear", "descend"]))
    if op == "clear":
        message.ClearField(field.name)
        return
    nested = field.type == F.TYPE_MESSAGE and not _is_map(field) and depth < MAX_DEPTH
    if _is_map(field):
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        key, value = draw(_scalar(key_field)), draw(_value(value_field, depth))
        target = getattr(message, field.name)
        if value_field.type == F.TYPE_MESSAGE:
            target[key].CopyFrom(value)
        else:
            target[key] = value
    elif field.is_repeated:
        container = getattr(message, field.name)
        if op == "descend" and nested and len(container):
            _mutate_one_field(draw, container[draw(st.integers(0, len(container) - 1))],
                              depth + 1)
        elif op == "descend":
            container.append(draw(_value(field, depth)))
        else:
            del container[:]
            container.extend(draw(st.lists(_value(field, depth), max_size=MAX_REPEATED)))
    elif nested and op == "descend":
        _mutate_one_field(draw, getattr(message, field.name), depth + 1)
    elif field.type == F.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(draw(_value(field, depth)))
    else:
        setattr(message, field.name, draw(_value(field, depth)))


@st.composite
def stream_mutated(draw, seeds: list):
    """A request stream made from the valid stream ``seeds``: some messages field-mutated,
    and possibly one dropped, duplicated or moved."""
    stream = list(seeds)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(stream) - 1)) if stream else 0
        op = draw(st.sampled_from(["mutate", "mutate", "drop", "duplicate", "move"]))
        if not stream:
            break
        if op == "mutate":
            stream[i] = draw(field_mutated(stream[i]))
        elif op == "drop":
            del stream[i]
        elif op == "duplicate":
            stream.insert(i, stream[i])
        else:
            stream.insert(draw(st.integers(0, len(stream) - 1)), stream.pop(i))
    return stream
