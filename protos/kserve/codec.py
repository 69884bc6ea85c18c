"""KServe v2 inference requests -> plain Python values, the way Triton's LLM backends read them.

The conventions are the vLLM backend's (the TensorRT-LLM backend's names agree where they overlap):

    text_input            BYTES [1]  the prompt, raw text (no chat template)
    stream                BOOL  [1]  optional; true: one response per text delta (ModelStreamInfer)
    sampling_parameters   BYTES [1]  optional; a JSON object {"max_tokens": 32, "temperature": "0.7", ...}
    exclude_input_in_output BOOL [1] optional; false puts the prompt before the completion
    text_output           BYTES [1]  the completion (or, streaming, one delta of it)

Sampling values may also come as request parameters (`parameters={"max_tokens": 32}` in tritonclient),
and then override the same key in sampling_parameters. Numbers may be strings, as the vLLM backend
accepts ({"temperature": "0.1"}). Range checks are not made here: gateway.prepare.request_builder makes them,
with the same verdict for every API.

No generated message type is imported: fields are read by name, so the same code reads tritonclient's
own messages (tests) and the gateway's (protos/kserve/grpc_service.proto), which share the wire format.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

from core.errors import InvalidArgument
from core.json_limits import load_json

TEXT_INPUT = "text_input"
STREAM_INPUT = "stream"
SAMPLING_PARAMETERS_INPUT = "sampling_parameters"
EXCLUDE_INPUT_INPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
# Triton's response parameter that marks a request's last response on a decoupled stream, and the
# request parameter with which a client asks for that flag in an extra response without outputs.
FINAL_RESPONSE_PARAMETER = "triton_final_response"
EMPTY_FINAL_RESPONSE_PARAMETER = "triton_enable_empty_final_response"

INPUT_DATATYPES = {TEXT_INPUT: "BYTES", STREAM_INPUT: "BOOL", SAMPLING_PARAMETERS_INPUT: "BYTES",
                   EXCLUDE_INPUT_INPUT: "BOOL"}
_INT_KEYS = ("max_tokens", "top_k", "seed")
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SAMPLING_KEYS = _INT_KEYS + _FLOAT_KEYS  # validate_sampling's keywords
_OTHER_KEYS = ("stop", "stop_token_ids", "ignore_eos", "stream", "priority")
# constrained decoding, by vLLM's names (a schema / choice may be JSON, or JSON text); the gateway checks them
CONSTRAINT_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format")
# Parameters tritonclient sets on its own: accepted and ignored (timeout only applies to Triton's dynamic
# batcher; the gRPC deadline bounds a tokenmill request), or checked (sequence_id: no sequence batching).
_IGNORED_PARAMETERS = ("timeout", "sequence_start", "sequence_end", EMPTY_FINAL_RESPONSE_PARAMETER,
                       "binary_data_output", "headers")
ACCEPTED_KEYS = SAMPLING_KEYS + _OTHER_KEYS + CONSTRAINT_KEYS


@dataclass(slots=True)
class LlmInferRequest:
    """One KServe request in request_builder.prepare_request's terms."""

    prompt: str
    stream: bool = False
    exclude_input_in_output: bool = True
    empty_final_response: bool = False  # the client asked for the final flag in a response of its own
    sampling: dict = field(default_factory=dict)  # validate_sampling keywords
    stop: object = None
    stop_token_ids: object = None
    ignore_eos: object = False
    priority: object = 0
    constraint_fields: dict = field(default_factory=dict)  # CONSTRAINT_KEYS given, their values as sent


def llm_request_from_proto(request) -> LlmInferRequest:
    """request: an inference.ModelInferRequest. Raises InvalidArgument naming the tensor or parameter."""
    tensors = decode_inputs(request)
    for index, output in enumerate(request.outputs):
        if output.name != TEXT_OUTPUT:
            raise InvalidArgument(f"outputs[{index}].name", output.name,
                                  f"unknown output; this model has {TEXT_OUTPUT!r}")
    if TEXT_INPUT not in tensors:
        raise InvalidArgument("inputs", [t.name for t in request.inputs],
                              f"must include {TEXT_INPUT!r} (BYTES, shape [1]) holding the prompt")
    try:
        prompt = tensors[TEXT_INPUT].decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(TEXT_INPUT, tensors[TEXT_INPUT], f"must be UTF-8 text ({error.reason})") from None
    if not prompt:
        raise InvalidArgument(TEXT_INPUT, prompt, "must not be empty")
    values = {}
    if SAMPLING_PARAMETERS_INPUT in tensors:
        values.update(_json_object(tensors[SAMPLING_PARAMETERS_INPUT]))
    parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
    if parameters.get("sequence_id") not in (None, 0, ""):
        raise InvalidArgument("sequence_id", parameters["sequence_id"], "sequence batching is not supported")
    parameters.pop("sequence_id", None)
    empty_final = parameters.get(EMPTY_FINAL_RESPONSE_PARAMETER) is True
    values.update((key, value) for key, value in parameters.items() if key not in _IGNORED_PARAMETERS)
    unknown = sorted(set(values) - set(ACCEPTED_KEYS))
    if unknown:
        raise InvalidArgument(unknown[0], values[unknown[0]],
                              f"unknown parameter; accepted: {', '.join(ACCEPTED_KEYS)}")
    stream = tensors.get(STREAM_INPUT, _bool("stream", values.get("stream", False)))
    return LlmInferRequest(
        prompt=prompt, stream=stream, exclude_input_in_output=tensors.get(EXCLUDE_INPUT_INPUT, True),
        empty_final_response=empty_final,
        sampling={key: _number(key, values[key]) for key in SAMPLING_KEYS if key in values},
        stop=_json_list_or_value(values.get("stop")), stop_token_ids=_json_list_or_value(values.get("stop_token_ids")),
        ignore_eos=_bool("ignore_eos", values.get("ignore_eos", False)), priority=values.get("priority", 0),
        constraint_fields={key: _constraint_value(key, values[key]) for key in CONSTRAINT_KEYS if key in values})


def _constraint_value(key: str, value: object) -> object:
    """A request parameter can only be a string: guided_choice, guided_json and response_format may come
    as JSON text there (a JSON-schema string stays text: guided_json accepts either)."""
    if key in ("guided_choice", "response_format") and isinstance(value, str):
        return load_json(value, key)
    return value


def decode_inputs(request) -> dict[str, bytes | bool]:
    """name -> the one element of each input tensor (bytes for BYTES, bool for BOOL)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument("raw_input_contents", f"{len(raw)} entries",
                              f"must hold one entry per input tensor ({len(request.inputs)})")
    tensors: dict[str, bytes | bool] = {}
    for index, tensor in enumerate(request.inputs):
        datatype = INPUT_DATATYPES.get(tensor.name)
        if datatype is None:
            raise InvalidArgument(f"inputs[{index}].name", tensor.name,
                                  f"unknown input; this model takes {', '.join(INPUT_DATATYPES)}")
        if tensor.name in tensors:
            raise InvalidArgument(f"inputs[{index}].name", tensor.name, "given twice")
        if tensor.datatype != datatype:
            raise InvalidArgument(f"{tensor.name}.datatype", tensor.datatype, f"must be {datatype}")
        if math.prod(tensor.shape) != 1 or any(dim < 0 for dim in tensor.shape):
            raise InvalidArgument(f"{tensor.name}.shape", list(tensor.shape),
                                  "must hold exactly one element, e.g. [1] or [1, 1] (one prompt per request)")
        elements = (_decode_raw(tensor.name, datatype, raw[index]) if raw
                    else list(tensor.contents.bytes_contents if datatype == "BYTES" else tensor.contents.bool_contents))
        if len(elements) != 1:
            raise InvalidArgument(tensor.name, f"{len(elements)} elements", "its shape says 1")
        tensors[tensor.name] = elements[0]
    return tensors


def parameter_value(parameter) -> object:
    """An inference.InferParameter's value as a Python value (None when unset)."""
    which = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, which) if which else None


def encode_bytes(elements: list[bytes]) -> bytes:
    """BYTES elements in the raw layout: each a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def _decode_raw(name: str, datatype: str, raw: bytes) -> list:
    if datatype == "BOOL":
        return [byte != 0 for byte in raw]
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            break
        (length,) = struct.unpack_from("<I", raw, offset)
        if offset + 4 + length > len(raw):
            break
        elements.append(bytes(raw[offset + 4:offset + 4 + length]))
        offset += 4 + length
    if offset != len(raw):
        raise InvalidArgument(name, f"{len(raw)} raw bytes",
                              "BYTES elements must each be a 4-byte little-endian length and that many bytes")
    return elements


def _json_object(raw: bytes) -> dict:
    value = load_json(raw, SAMPLING_PARAMETERS_INPUT)  # nesting and lone surrogates refused by path
    if not isinstance(value, dict):
        raise InvalidArgument(SAMPLING_PARAMETERS_INPUT, raw, "must be a JSON object of sampling parameters")
    return value


def _number(key: str, value: object) -> object:
    """Numeric strings become numbers (the vLLM backend's habit); anything else is left for validation."""
    if isinstance(value, str):
        try:
            return int(value) if key in _INT_KEYS else float(value)
        except ValueError:
            pass
    return value


def _bool(key: str, value: object) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise InvalidArgument(key, value, "must be true or false")
    return value


def _json_list_or_value(value: object) -> object:
    """A request parameter can only be a scalar: a JSON array in a string stands for a list."""
    if isinstance(value, str) and value.startswith("["):
        try:
            return load_json(value, "sampling_parameters")
        except InvalidArgument:
            pass  # not a JSON array after all: validation names the field with the value as sent
    return value
