"""The gateway's services seen through gRPC server reflection, and called through it without generated stubs:
request and response classes are built from the reflected descriptors, calls go by full method name."""
from __future__ import annotations

import base64
import struct

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def reflected_call(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, service: str, method: str,
                   fields: dict):
    """Calls a unary method knowing only its name: everything else comes from reflection."""
    descriptor = pool.FindServiceByName(service).methods_by_name[method]
    request_class = message_factory.GetMessageClass(descriptor.input_type)
    response_class = message_factory.GetMessageClass(descriptor.output_type)
    call = channel.unary_unary(f"/{service}/{method}", request_serializer=request_class.SerializeToString,
                               response_deserializer=response_class.FromString)
    return call(json_format.ParseDict(fields, request_class()), timeout=120)


def test_reflection_lists_the_services_and_generates_without_stubs(gateway_cluster):
    with grpc.insecure_channel(gateway_cluster.gateway_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"tokenmill.v1.Generation", "inference.GRPCInferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= set(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)  # our own pool: nothing from generated modules

        generate = pool.FindServiceByName("tokenmill.v1.Generation").methods_by_name["Generate"]
        assert generate.input_type.full_name == "tokenmill.v1.GenerateRequest"
        reply = reflected_call(channel, pool, "tokenmill.v1.Generation", "Generate",
                               {"prompt": PROMPT, "parameters": {"maxTokens": 8, "temperature": 0}})
        assert reply.text.strip() and 1 <= reply.usage.completion_tokens <= 8

        # The KServe protocol is described in full too (its model_config.proto dependency included),
        # so a reflection client such as grpcurl can call it: same greedy text as Generate.
        stream_infer = pool.FindServiceByName("inference.GRPCInferenceService").methods_by_name["ModelStreamInfer"]
        assert stream_infer.client_streaming and stream_infer.server_streaming
        config = pool.FindMessageTypeByName("inference.ModelConfig")
        assert config.fields_by_name["model_transaction_policy"].number == 19
        prompt_bytes = PROMPT.encode()
        infer = reflected_call(channel, pool, "inference.GRPCInferenceService", "ModelInfer", {
            "modelName": "smollm2",
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
            # bytes are base64 in protobuf's JSON mapping; a BYTES element is a 4-byte length, then the bytes
            "rawInputContents": [base64.b64encode(struct.pack("<I", len(prompt_bytes)) + prompt_bytes).decode()],
            "parameters": {"max_tokens": {"int64Param": 8}, "temperature": {"doubleParam": 0.0}}})
        (raw_text,) = infer.raw_output_contents
        assert raw_text[4:].decode() == reply.text and [o.name for o in infer.outputs] == ["text_output"]

