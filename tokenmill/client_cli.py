"""`tokenmill generate`: send one prompt (or a one-turn chat) to a running gateway and print the text.

Text goes to stdout as it streams in; a one-line summary (tokens, finish reason, timings) goes to
stderr, so `tokenmill generate "..." > out.txt` keeps only the text.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from plumbing import tls as tls_config


@dataclass(slots=True)
class GenerateOptions:
    prompt: str
    address: str = "127.0.0.1:50051"
    chat: bool = False
    system: str | None = None
    stream: bool = True
    max_tokens: int | None = None  # None: the server default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    connect_timeout_s: float = 5.0
    tls: tls_config.ClientTLS | None = None  # None: plaintext


def build_request(options: GenerateOptions) -> generation_pb2.GenerateRequest:
    parameters = generation_pb2.GenerateParameters(stop=options.stop)
    # only the flags given are set: an unset field means the server default, not zero
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(options, name)
        if value is not None:
            setattr(parameters, name, value)
    request = generation_pb2.GenerateRequest(parameters=parameters)
    if options.chat or options.system is not None:
        turns = [generation_pb2.ChatMessage(role="system", content=options.system)] if options.system else []
        turns.append(generation_pb2.ChatMessage(role="user", content=options.prompt))
        request.messages.CopyFrom(generation_pb2.ChatMessages(messages=turns))
    else:
        request.prompt = options.prompt
    return request


def generate(options: GenerateOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Runs one request; returns the exit status (0 ok, 1 gRPC error, 130 interrupted).
    out/err default to sys.stdout/sys.stderr as they are at call time."""
    out, err = out or sys.stdout, err or sys.stderr
    request = build_request(options)
    try:
        channel = tls_config.channel(options.address, options.tls)
    except tls_config.TLSConfigError as error:
        print(f"error: {error}", file=err)
        return 2
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=options.connect_timeout_s)
        except grpc.FutureTimeoutError:
            print(f"UNAVAILABLE: no tokenmill gateway at {options.address} (nothing answered within "
                  f"{options.connect_timeout_s:g}s); start one with `tokenmill serve`", file=err)
            return 1
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        call = None
        try:
            if options.stream:
                call = stub.GenerateStream(request)
                summary = _print_stream(call, out, started)
            else:
                response = stub.Generate(request)
                out.write(response.text)
                summary = _Summary(response.request_id, len(response.token_ids), response.finish_reason,
                                   response.usage if response.HasField("usage") else None, None)
        except grpc.RpcError as error:
            out.write("\n")
            out.flush()
            print(f"{error.code().name}: {error.details()}", file=err)
            return 1
        except KeyboardInterrupt:
            if call is not None:
                call.cancel()
            out.write("\n")
            print("interrupted: request cancelled", file=err)
            return 130
    out.write("\n")
    out.flush()
    print(summary.line(time.perf_counter() - started), file=err)
    return 0


@dataclass(slots=True)
class _Summary:
    request_id: str
    num_tokens: int
    finish_reason: int
    usage: common_pb2.Usage | None
    time_to_first_token_s: float | None  # measured here, so it includes the network

    def line(self, elapsed_s: float) -> str:
        tokens = self.usage.completion_tokens if self.usage is not None else self.num_tokens
        reason = common_pb2.FinishReason.Name(self.finish_reason).removeprefix("FINISH_REASON_").lower()
        parts = [f"{tokens} tokens", f"finish: {reason}", f"{elapsed_s:.2f}s"]
        if self.usage is not None:
            parts.insert(1, f"{self.usage.prompt_tokens} prompt tokens")
        if self.time_to_first_token_s is not None:
            parts.append(f"first token {self.time_to_first_token_s:.2f}s")
        if tokens and elapsed_s > 0:
            parts.append(f"{tokens / elapsed_s:.1f} tokens/s")
        return f"[{', '.join(parts)}; request {self.request_id}]"


def _print_stream(call, out: TextIO, started: float) -> _Summary:
    summary = _Summary("", 0, common_pb2.FINISH_REASON_UNSPECIFIED, None, None)
    for message in call:
        summary.request_id = message.request_id
        if message.token_ids and summary.time_to_first_token_s is None:
            summary.time_to_first_token_s = time.perf_counter() - started
        summary.num_tokens += len(message.token_ids)
        if message.text:
            out.write(message.text)
            out.flush()
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            summary.finish_reason = message.finish_reason
        if message.HasField("usage"):
            summary.usage = message.usage
    return summary
