"""The KServe v2 / Triton gRPC protocol on the gateway, driven by the unmodified tritonclient[grpc].

Unit tests read tritonclient's own request messages with protos.kserve.codec (same wire format); the
slow tests run a real cluster (tests/gateway/conftest.py) and compare against the native Generate API.
This process never imports the gateway's inference stubs: tritonclient's define the same protobuf
symbols (see gateway/apis/kserve.py).
"""
from __future__ import annotations

import json
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor

from protos.kserve import codec
from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from core.errors import InvalidArgument

PROMPT = "The capital of France is"
OTHER_PROMPT = "Three colours of the rainbow are"
GREEDY = {"max_tokens": 16, "temperature": 0.0}


def infer_request(prompt: bytes = b"Hello", raw: bool = True, **parameters) -> service_pb2.ModelInferRequest:
    """A request laid out as tritonclient lays it out (raw contents) or with typed contents."""
    request = service_pb2.ModelInferRequest(model_name="smollm2", id="r1")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    if raw:
        request.raw_input_contents.append(serialize_byte_tensor(np.array([prompt], dtype=object)).item())
    else:
        tensor.contents.bytes_contents.append(prompt)
    for key, value in parameters.items():
        field = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


@pytest.mark.parametrize("raw", [True, False])
def test_codec_reads_text_and_sampling_values(raw):
    request = infer_request("Héllo".encode(), raw=raw, max_tokens=8, temperature=0.5, stop='["\\n", "."]',
                            triton_enable_empty_final_response=True, timeout=5)
    llm = codec.llm_request_from_proto(request)
    assert llm.prompt == "Héllo" and not llm.stream and llm.empty_final_response
    assert llm.sampling == {"max_tokens": 8, "temperature": 0.5} and llm.stop == ["\n", "."]


def test_codec_sampling_parameters_json_as_the_vllm_backend_sends_it():
    request = infer_request()
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    json_text = json.dumps({"temperature": "0.1", "top_p": "0.95", "max_tokens": "20", "stop": ["x"]}).encode()
    request.raw_input_contents.append(serialize_byte_tensor(np.array([json_text], dtype=object)).item())
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    request.raw_input_contents.append(b"\x01")
    request.parameters["max_tokens"].int64_param = 5  # a request parameter wins over the JSON
    llm = codec.llm_request_from_proto(request)
    assert llm.sampling == {"temperature": 0.1, "top_p": 0.95, "max_tokens": 5} and llm.stop == ["x"] and llm.stream


def _drop_text(request):
    del request.inputs[0]
    del request.raw_input_contents[0]


def _add_image(request):
    request.inputs.add(name="image", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\0\0\0\0")


@pytest.mark.parametrize("change, field, words", [
    (_drop_text, "inputs", "text_input"),
    (lambda r: setattr(r.inputs[0], "datatype", "INT32"), "text_input.datatype", "must be BYTES"),
    (lambda r: r.inputs[0].shape.append(2), "text_input.shape", "exactly one element"),
    (_add_image, "inputs[1].name", "text_input"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\x09\x00\x00\x00ab"), "text_input", "4-byte"),
    (lambda r: setattr(r.parameters["best_of"], "int64_param", 2), "best_of", "accepted: max_tokens"),
    (lambda r: r.outputs.add(name="logits"), "outputs[0].name", "text_output"),
    (lambda r: setattr(r.parameters["sequence_id"], "int64_param", 7), "sequence_id", "not supported"),
    (lambda r: setattr(r.parameters["ignore_eos"], "string_param", "maybe"), "ignore_eos", "true or false"),
])
def test_codec_errors_name_the_tensor_or_parameter(change, field, words):
    request = infer_request()
    change(request)
    with pytest.raises(InvalidArgument) as error:
        codec.llm_request_from_proto(request)
    assert error.value.field == field and words in str(error.value)


def test_codec_encodes_bytes_as_tritonclient_decodes_them():
    raw = codec.encode_bytes(["Paris é".encode(), b""])
    assert list(deserialize_bytes_tensor(raw)) == ["Paris é".encode(), b""]


# ---- against a real cluster ------------------------------------------------------------------


def text_inputs(prompt: str, stream: bool | None = None, sampling: dict | None = None) -> list:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    inputs = [text]
    if stream is not None:
        inputs.append(grpcclient.InferInput("stream", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
    if sampling is not None:
        inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
    return inputs


def native(config, method: str, request):
    with grpc.insecure_channel(config.gateway_address) as channel:
        return getattr(generation_pb2_grpc.GenerationStub(channel), method)(request)


def native_text(config, prompt: str, **parameters) -> str:
    request = generation_pb2.GenerateRequest(prompt=prompt, parameters=generation_pb2.GenerateParameters(**parameters))
    return native(config, "Generate", request).text


def output_text(result) -> str | None:
    array = result.as_numpy("text_output")
    return None if array is None else array[0].decode()


def is_final(result) -> bool:
    return result.get_response().parameters[codec.FINAL_RESPONSE_PARAMETER].bool_param


def run_stream(client, requests: list[tuple[list, dict]]) -> list[tuple[object, object]]:
    """Sends every request on one stream; returns the (result, error) callbacks in arrival order."""
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)), stream_timeout=120)
    for inputs, options in requests:
        client.async_stream_infer("smollm2", inputs, **options)
    client.stop_stream()  # closes our side; returns once the server ended the stream
    return list(received.queue)


@pytest.mark.slow
def test_health_metadata_config_and_unknown_model(gateway_cluster):
    name = native(gateway_cluster, "GetModelInfo", common_pb2.GetModelInfoRequest()).model_config.name
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(name) and client.is_model_ready("smollm2")
    server = client.get_server_metadata()
    assert server.name == "tokenmill" and "model_configuration" in server.extensions

    metadata = client.get_model_metadata("smollm2")
    assert metadata.name == name and list(metadata.versions) == ["1"]
    inputs = {tensor.name: (tensor.datatype, list(tensor.shape)) for tensor in metadata.inputs}
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert [(t.name, t.datatype) for t in metadata.outputs] == [("text_output", "BYTES")]

    config = client.get_model_config(name).config
    assert config.name == name and config.model_transaction_policy.decoupled
    assert {i.name: i.optional for i in config.input}["text_input"] is False
    assert int(config.parameters["max_context_length"].string_value) > 0
    assert [model.name for model in client.get_model_repository_index().models] == [name]

    for call in (client.get_model_metadata, client.is_model_ready, client.get_model_config):
        with pytest.raises(InferenceServerException) as error:
            call("no-such-model")
        assert error.value.status() == "StatusCode.NOT_FOUND"
        assert "no-such-model" in error.value.message() and name in error.value.message()


@pytest.mark.slow
def test_model_infer_equals_native_generate(gateway_cluster):
    want = native_text(gateway_cluster, PROMPT, **GREEDY)
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)
    result = client.infer("smollm2", text_inputs(PROMPT), parameters=GREEDY, request_id="r-1")
    response = result.get_response()
    assert want and output_text(result) == want
    assert response.id == "r-1" and response.parameters["completion_tokens"].int64_param >= 1
    assert response.parameters["finish_reason"].string_param in ("stop", "length")

    # the vLLM backend's sampling_parameters JSON, numbers as strings, gives the same text
    sampling = {"max_tokens": "16", "temperature": "0"}
    assert output_text(client.infer("smollm2", text_inputs(PROMPT, sampling=sampling))) == want

    stop = want[len(want) // 2:len(want) // 2 + 3]
    stopped = client.infer("smollm2", text_inputs(PROMPT), parameters={**GREEDY, "stop": json.dumps([stop])})
    assert output_text(stopped) == native_text(gateway_cluster, PROMPT, stop=[stop], **GREEDY)
    assert stop not in output_text(stopped)


@pytest.mark.slow
def test_stream_infer_sends_deltas_then_a_final_flag(gateway_cluster):
    wants = {prompt: native_text(gateway_cluster, prompt, **GREEDY) for prompt in (PROMPT, OTHER_PROMPT)}
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)
    callbacks = run_stream(client, [
        (text_inputs(PROMPT, stream=True), {"parameters": GREEDY, "request_id": "deltas"}),
        (text_inputs(OTHER_PROMPT, stream=True), {"parameters": GREEDY, "request_id": "empty-final",
                                                  "enable_empty_final_response": True}),
        (text_inputs(PROMPT, stream=False), {"parameters": GREEDY, "request_id": "whole"}),
    ])
    assert [error for _, error in callbacks if error is not None] == []
    by_id: dict[str, list] = {}
    for result, _ in callbacks:
        by_id.setdefault(result.get_response().id, []).append(result)

    deltas = by_id["deltas"]  # one response per delta, the final flag on the last one only
    assert len(deltas) > 3 and [is_final(r) for r in deltas] == [False] * (len(deltas) - 1) + [True]
    assert "".join(output_text(r) for r in deltas) == wants[PROMPT]
    assert deltas[-1].get_response().parameters["finish_reason"].string_param in ("stop", "length")

    empty_final = by_id["empty-final"]  # asked for: the flag comes in a response without outputs
    assert output_text(empty_final[-1]) is None and is_final(empty_final[-1])
    assert not any(is_final(r) for r in empty_final[:-1])
    assert "".join(output_text(r) for r in empty_final[:-1]) == wants[OTHER_PROMPT]

    whole = by_id["whole"]  # stream=false on a stream: the vLLM backend's one response
    assert len(whole) == 1 and is_final(whole[0]) and output_text(whole[0]) == wants[PROMPT]


@pytest.mark.slow
def test_errors_name_the_field_value_and_limit(gateway_cluster):
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)
    bad_type = grpcclient.InferInput("text_input", [1], "INT32")
    bad_type.set_data_from_numpy(np.array([7], dtype=np.int32))
    cases = [
        ("smollm2", text_inputs(PROMPT), {"max_tokens": 0}, "INVALID_ARGUMENT", ["max_tokens=0", "[1, 4096]"]),
        ("smollm2", text_inputs(PROMPT), {"top_p": 1.5}, "INVALID_ARGUMENT", ["top_p=1.5", "(0, 1]"]),
        ("smollm2", [bad_type], {}, "INVALID_ARGUMENT", ["text_input.datatype", "INT32", "BYTES"]),
        ("smollm2", text_inputs(PROMPT), {"best_of": 2}, "INVALID_ARGUMENT", ["best_of", "accepted"]),
        ("smollm2", text_inputs(PROMPT, stream=True), {}, "INVALID_ARGUMENT", ["stream", "ModelStreamInfer"]),
        ("gpt-5", text_inputs(PROMPT), {}, "NOT_FOUND", ["'gpt-5'"]),
    ]
    for model, inputs, parameters, status, words in cases:
        with pytest.raises(InferenceServerException) as error:
            client.infer(model, inputs, parameters=parameters)
        assert error.value.status() == f"StatusCode.{status}", (parameters, str(error.value))
        assert all(word in error.value.message() for word in words), error.value.message()

    # on a stream, a failed request is one error callback and the stream goes on
    callbacks = run_stream(client, [(text_inputs(PROMPT, stream=True), {"parameters": {"max_tokens": 0}}),
                                    (text_inputs(PROMPT, stream=True), {"parameters": GREEDY, "request_id": "ok"})])
    errors = [error for _, error in callbacks if error is not None]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0].message() and "max_tokens=0" in errors[0].message()
    results = [result for result, error in callbacks if error is None]
    assert results and all(r.get_response().id == "ok" for r in results) and is_final(results[-1])


@pytest.mark.slow
def test_cancelling_the_stream_aborts_its_requests(gateway_cluster):
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    long_run = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    client.async_stream_infer("smollm2", text_inputs("Tell me a long story.", stream=True), parameters=long_run)
    for _ in range(3):
        result, error = received.get(timeout=60)
        assert error is None and not is_final(result)
    with grpc.insecure_channel(gateway_cluster.scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        assert scheduler.GetLoad(scheduler_pb2.GetLoadRequest()).num_kv_pages_used > 0
        client.stop_stream(cancel_requests=True)
        for _ in range(200):  # a few scheduler steps at most
            if scheduler.GetLoad(scheduler_pb2.GetLoadRequest()).num_kv_pages_used == 0:
                break
            time.sleep(0.05)
        assert scheduler.GetLoad(scheduler_pb2.GetLoadRequest()).num_kv_pages_used == 0
