"""The .proto files follow the API rules: versioned package, everything commented, enum zero values
*_UNSPECIFIED, and `optional` on the sampling fields whose unset value differs from zero."""
from __future__ import annotations

from importlib import resources

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from protos.generate import REPO_ROOT, proto_sources

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto field numbers,
# which is how source_code_info paths name elements.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2

OPTIONAL_SAMPLING_FIELDS = {
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "logprobs",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[descriptor_pb2.FileDescriptorProto]:
    out = tmp_path_factory.mktemp("descriptors") / "set.pb"
    well_known = resources.files("grpc_tools") / "_proto"
    args = ["protoc", f"-I{REPO_ROOT}", f"-I{well_known}", "--include_source_info",
            f"--descriptor_set_out={out}", *map(str, proto_sources())]
    assert protoc.main(args) == 0
    # Our own API only: protos/kserve is KServe's published wire protocol, kept as the spec has it.
    ours = [f for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
            if f.package.startswith("tokenmill.")]
    assert len(ours) >= 5, [f.name for f in ours]
    return ours


def elements(file: descriptor_pb2.FileDescriptorProto):
    """(path, full name) of every message, field, oneof, enum, enum value, service and method."""
    def enum(path, prefix, enum_type):
        yield path, f"{prefix}.{enum_type.name}"
        for i, value in enumerate(enum_type.value):
            yield (*path, ENUM_VALUE, i), f"{prefix}.{enum_type.name}.{value.name}"

    def message(path, prefix, msg):
        name = f"{prefix}.{msg.name}"
        yield path, name
        for i, field in enumerate(msg.field):
            yield (*path, MESSAGE_FIELD, i), f"{name}.{field.name}"
        for i, oneof in enumerate(msg.oneof_decl):
            if not oneof.name.startswith("_"):  # synthetic oneofs of `optional` fields
                yield (*path, MESSAGE_ONEOF, i), f"{name}.{oneof.name}"
        for i, nested in enumerate(msg.nested_type):
            yield from message((*path, MESSAGE_NESTED, i), name, nested)
        for i, nested_enum in enumerate(msg.enum_type):
            yield from enum((*path, MESSAGE_ENUM, i), name, nested_enum)

    for i, msg in enumerate(file.message_type):
        yield from message((FILE_MESSAGE, i), file.package, msg)
    for i, enum_type in enumerate(file.enum_type):
        yield from enum((FILE_ENUM, i), file.package, enum_type)
    for i, service in enumerate(file.service):
        yield (FILE_SERVICE, i), f"{file.package}.{service.name}"
        for j, method in enumerate(service.method):
            yield (FILE_SERVICE, i, SERVICE_METHOD, j), f"{file.package}.{service.name}.{method.name}"


def test_package_is_versioned(files):
    assert {file.package for file in files} == {"tokenmill.v1"}
    assert all(file.syntax == "proto3" for file in files)


def test_every_element_is_commented(files):
    uncommented = []
    for file in files:
        comments = {
            tuple(location.path): (location.leading_comments + location.trailing_comments).strip()
            for location in file.source_code_info.location
        }
        uncommented += [f"{file.name}: {name}" for path, name in elements(file) if not comments.get(path)]
    assert not uncommented, "elements without a comment:\n" + "\n".join(uncommented)


def test_enum_values_are_prefixed_and_zero_is_unspecified(files):
    enums = [enum_type for file in files for enum_type in file.enum_type]
    enums += [e for file in files for msg in file.message_type for e in msg.enum_type]
    for enum_type in enums:
        prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum_type.name).lstrip("_") + "_"
        zero = enum_type.value[0]
        assert zero.number == 0 and zero.name == f"{prefix}UNSPECIFIED", f"{enum_type.name}: {zero.name}"
        assert all(value.name.startswith(prefix) for value in enum_type.value), enum_type.name


@pytest.mark.parametrize("message_name", ["GenerateParameters", "SamplingParams"])
def test_sampling_fields_distinguish_unset_from_zero(files, message_name):
    (message,) = [msg for file in files for msg in file.message_type if msg.name == message_name]
    fields = {field.name: field for field in message.field}
    assert OPTIONAL_SAMPLING_FIELDS <= fields.keys()
    not_optional = sorted(name for name in OPTIONAL_SAMPLING_FIELDS if not fields[name].proto3_optional)
    assert not not_optional, f"{message_name}: fields that must be `optional`: {not_optional}"
