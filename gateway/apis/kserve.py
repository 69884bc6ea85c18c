"""inference.GRPCInferenceService: the KServe v2 / Triton gRPC protocol on the gateway.

Thin like GenerationServicer: ModelInferRequest -> protos.kserve.codec.llm_request_from_proto ->
request_builder.prepare_request -> Generations.stream (the route every API shares) -> ModelInferResponse(s). The
served model is decoupled (Triton's vLLM backend conventions): ModelStreamInfer with stream=true sends
one response per text delta, the last flagged "triton_final_response"; ModelInfer returns the whole text.

The generated stubs define the protobuf package `inference`, as tritonclient's own stubs do, and one
process cannot load both (the default descriptor pool refuses duplicate symbols): gateway.main imports
this module inside serve(), and tests drive it with tritonclient from another process.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import re
import time
import uuid

import grpc

from gateway.access.control import AccessControl, caller_key
from gateway.apis import kserve_metrics
from gateway.apis.served_model import ServedModel
from gateway.apis.stream_idle import IdleWatchdog, StreamIdle, record_idle
from gateway.generation.context import CallContext
from gateway.generation.stream import Finish
from gateway.prepare.constraints import constraint_field, openai_constraint
from gateway.prepare.request_builder import check_constraints, prepare_request, sandbox_or_default, text_token_ids
from gateway.prepare.validation import ClientSampling
from gateway.telemetry import request_scope
from kvstore.request_claims import ClaimVerdict
from protos.kserve import codec, grpc_service_pb2 as pb, grpc_service_pb2_grpc, model_config_pb2
from protos.tokenmill.v1 import common_pb2
from core.errors import InvalidArgument, NotFound, UnknownModel
from plumbing.grammar_sandbox import GrammarSandbox
from plumbing.rpc import status_for

logger = logging.getLogger(__name__)
_CLAIM_TIMEOUT_S = 0.5  # a hung Redis delays a KServe request by at most this (then it runs suffixed)

KSERVE_SERVICE = "inference.GRPCInferenceService"
MODEL_VERSION = "1"  # one version per served model, as Triton numbers a repository's first
BACKEND = "tokenmill"
EXTENSIONS = ("model_configuration", "parameters")  # RepositoryIndex alone is not "model_repository"
_INPUTS = ((codec.TEXT_INPUT, model_config_pb2.TYPE_STRING, False),  # (name, type, optional)
           (codec.STREAM_INPUT, model_config_pb2.TYPE_BOOL, True),
           (codec.SAMPLING_PARAMETERS_INPUT, model_config_pb2.TYPE_STRING, True),
           (codec.EXCLUDE_INPUT_INPUT, model_config_pb2.TYPE_BOOL, True))
_DATATYPE_NAMES = {model_config_pb2.TYPE_STRING: "BYTES", model_config_pb2.TYPE_BOOL: "BOOL"}


def model_aliases(model_name: str) -> set[str]:
    """Names a client may use, lower-cased: the served name, without its quantization suffix, and the
    family ("SmolLM2-135M-Instruct.Q4_1" -> also "smollm2-135m-instruct" and "smollm2")."""
    family = re.match(r"[A-Za-z0-9]*", model_name).group()
    return {name.lower() for name in (model_name, model_name.split(".")[0], family) if name}


class KServeServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    # --stream-idle-timeout-s (gateway.main sets it): ModelStreamInfer's client must take each
    # response within it, or the stream ends CANCELLED and its requests are aborted; 0: no limit
    stream_idle_timeout_s: float = 0.0

    def __init__(self, model: ServedModel, access: AccessControl | None = None,
                 constraints: GrammarSandbox | None = None) -> None:
        # the route choice (gateway.generation.generations): with Redis, requests run resumable, with records,
        # and go on through a scheduler restart; the record id is the client's KServe id (_record_id)
        self.generations = model.generations
        self._live_ids: set[str] = set()  # the record ids of the KServe requests running here
        self.tokenizer = model.tokenizer
        self.constraints = sandbox_or_default(constraints)  # compiles client constraints off the event loop
        self.access = access  # the caller's key brings its latency targets
        self.limits = model.limits
        self.model_info = model.info
        self.state_reader = model.generations.records  # records an idle stream's reason; None without Redis
        self.model_name = model.name
        self.aliases = model_aliases(self.model_name)

    def _check_model(self, name: str, version: str = "") -> None:
        if name.lower() not in self.aliases:
            other_names = ", ".join(sorted(self.aliases - {self.model_name.lower()}))
            raise UnknownModel(name, self.model_name, f" (also as {other_names})")
        if version not in ("", MODEL_VERSION):
            raise NotFound("version", version, f"model {self.model_name!r} has version {MODEL_VERSION!r} only")

    # The servicer is registered only after the scheduler reported ready (gateway.main), so whoever
    # reaches it finds the server and the model ready; draining is told through grpc.health.v1.
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        self._check_model(request.name, request.version)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=BACKEND, version=_server_version(), extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        self._check_model(request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model_name, versions=[MODEL_VERSION], platform=BACKEND,
            inputs=[tensor(name=name, datatype=_DATATYPE_NAMES[kind], shape=[1]) for name, kind, _ in _INPUTS],
            outputs=[tensor(name=codec.TEXT_OUTPUT, datatype="BYTES", shape=[1])])

    async def ModelConfig(self, request, context):
        self._check_model(request.name, request.version)
        facts = self.model_info.model_config
        parameters = {"architecture": facts.architecture, "max_context_length": facts.max_context_length,
                      "vocab_size": facts.vocab_size, "dtype": facts.dtype, "quantization": facts.quantization,
                      "device": self.model_info.device, "block_size": self.model_info.block_size,
                      "num_blocks": self.model_info.num_blocks,
                      "kv_cache_policy": common_pb2.KvCachePolicy.Name(self.model_info.kv_cache_policy)}
        config = model_config_pb2.ModelConfig(
            name=self.model_name, backend=BACKEND, max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=name, data_type=kind, dims=[1], optional=optional)
                   for name, kind, optional in _INPUTS],
            output=[model_config_pb2.ModelOutput(name=codec.TEXT_OUTPUT, data_type=model_config_pb2.TYPE_STRING,
                                                 dims=[1])],
            parameters={key: model_config_pb2.ModelParameter(string_value=str(value))
                        for key, value in parameters.items() if value != ""},
            model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True))
        return pb.ModelConfigResponse(config=config)

    async def RepositoryIndex(self, request, context):
        index = pb.RepositoryIndexResponse.ModelIndex(name=self.model_name, version=MODEL_VERSION, state="READY")
        return pb.RepositoryIndexResponse(models=[index])

    async def ModelInfer(self, request, context):
        llm = codec.llm_request_from_proto(request)
        if llm.stream:
            raise InvalidArgument(codec.STREAM_INPUT, True, "ModelInfer returns the whole text; stream with "
                                                            "ModelStreamInfer (the model is decoupled)")
        async with self._record_id(request.id) as record_id:
            text, finish = await self._whole_text(request, llm, context, record_id)
        return self._response(request, text, finish)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; their responses interleave (match them by id).
        A failed request gets one response with error_message and the stream goes on."""
        responses: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()
        generating: set[str] = set()  # the scheduler ids of the requests still running

        async def run(request) -> None:
            try:
                async with self._record_id(request.id) as record_id:
                    generating.add(record_id)
                    try:
                        async for response in self._stream_responses(request, context, record_id):
                            responses.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
                    finally:
                        generating.discard(record_id)
            except Exception as exc:  # noqa: BLE001 - one request's failure is a message, not the stream's end
                responses.put_nowait(_error_response(request, exc))

        async def read_requests() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(run(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:  # the client closed its side: finish what it sent
                    await asyncio.wait(set(running))
            finally:
                responses.put_nowait(None)

        reader = asyncio.create_task(read_requests())
        try:
            with IdleWatchdog(self.stream_idle_timeout_s) as watchdog:
                while (response := await responses.get()) is not None:
                    # context.write, not yield, so a client that stopped reading can time out (gateway.apis.stream_idle)
                    try:
                        await watchdog.write(context.write(response))
                    except StreamIdle as error:
                        # before the finally below aborts them (their records would say only "cancelled")
                        await record_idle(self.state_reader, generating, error)
                        raise
            await reader  # a broken request stream ends the call with its error
        finally:  # the client went away: cancelling each request aborts it in the scheduler
            for task in (reader, *running):
                task.cancel()

    @contextlib.asynccontextmanager
    async def _record_id(self, client_id: str):
        """The request's record id (its id in spans, logs, Redis and the scheduler): the client's KServe id.
        KServe ids only correlate responses and clients reuse them, so a repeated id is never refused: one
        already running here, or already bound in Redis (kvstore.request_claims: a claim lives as long as
        the request's record), runs as `<id>~<8 hex>`; the responses still carry the client's id."""
        record_id = client_id
        if not client_id:
            record_id = uuid.uuid4().hex
        elif client_id in self._live_ids or not await self._claim(client_id):
            record_id = f"{client_id}~{uuid.uuid4().hex[:8]}"
        self._live_ids.add(record_id)
        try:
            yield record_id
        finally:
            self._live_ids.discard(record_id)

    async def _claim(self, client_id: str) -> bool:
        """Binds the id in Redis for this request (False: taken, or Redis does not answer in time)."""
        claims = self.generations.resume.claims if self.generations.resume is not None else None
        if claims is None:
            return True  # no Redis: no records to collide with; the id is free unless it runs here
        try:
            async with asyncio.timeout(_CLAIM_TIMEOUT_S):
                claim = await claims.claim(client_id, f"kserve:{uuid.uuid4().hex}")
        except Exception as error:  # noqa: BLE001 - Redis away: run under a suffixed id rather than wait
            logger.warning("cannot claim KServe id %r (Redis: %r); running it suffixed", client_id, error)
            return False
        return claim.verdict is ClaimVerdict.CLAIMED

    async def _stream_responses(self, request, context, scheduler_id: str):
        llm = codec.llm_request_from_proto(request)
        if not llm.stream:  # the vLLM backend's default: one response with the whole text
            text, finish = await self._whole_text(request, llm, context, scheduler_id)
            yield self._response(request, text, finish, final=True)
            return
        deltas = self._deltas(request, llm, context, scheduler_id)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                last = delta.finish is not None and not llm.empty_final_response
                if delta.text or last:
                    yield self._response(request, delta.text, delta.finish if last else None, final=last)
                if delta.finish is not None and llm.empty_final_response:
                    yield self._response(request, None, delta.finish, final=True)

    async def _whole_text(self, request, llm: codec.LlmInferRequest, context,
                          scheduler_id: str = "") -> tuple[str, Finish | None]:
        text, finish = (llm.prompt if not llm.exclude_input_in_output else ""), None
        deltas = self._deltas(request, llm, context, scheduler_id)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                text += delta.text
                finish = delta.finish
        return text, finish

    @kserve_metrics.counted  # Triton's nv_inference_* metrics
    async def _deltas(self, request, llm: codec.LlmInferRequest, context, scheduler_id: str = ""):
        """scheduler_id: the request's record id (_record_id: the client's KServe id, suffixed when repeated)."""
        arrival = time.monotonic()
        with request_scope(scheduler_id):  # a refusal here still names its request (attributes, log line)
            self._check_model(request.model_name, request.model_version)
            try:
                prompt_ids = text_token_ids(llm.prompt, self.tokenizer, self.limits)
            except InvalidArgument as error:  # name the tensor the client filled, not the internal field
                raise InvalidArgument(codec.TEXT_INPUT, error.value, error.limit_or_reason) from None
            sampling = ClientSampling(**llm.sampling, constraint=openai_constraint(llm.constraint_fields),
                                      stop_token_ids=llm.stop_token_ids, ignore_eos=llm.ignore_eos)
            prepared = prepare_request(prompt_ids, self.tokenizer, self.limits, sampling=sampling, stop=llm.stop,
                                       request_id=scheduler_id, priority=llm.priority)
            prepared.constraint_field = constraint_field(llm.constraint_fields)
            await check_constraints(prepared, self.constraints)
        key = caller_key(self.access, context)
        if key is not None:
            prepared.request = key.with_targets(prepared.request)
        # claimed already (_record_id) and never resumed by a client (KServe has no resume); with Redis still
        # resumable, so a scheduler restart does not cut it
        call = CallContext.at_edge(arrival, context.time_remaining(), owner=None if key is None else key.name)
        deltas = self.generations.stream(prepared, call)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    def _response(self, request, text: str | None, finish: Finish | None, final: bool | None = None):
        """text None: a response without outputs (the empty final response)."""
        response = pb.ModelInferResponse(model_name=self.model_name, model_version=MODEL_VERSION, id=request.id)
        if text is not None:
            response.outputs.add(name=codec.TEXT_OUTPUT, datatype="BYTES", shape=[1])
            response.raw_output_contents.append(codec.encode_bytes([text.encode("utf-8")]))
        if final is not None:
            response.parameters[codec.FINAL_RESPONSE_PARAMETER].bool_param = final
        if finish is not None:
            response.parameters["finish_reason"].string_param = finish.reason.value
            response.parameters["prompt_tokens"].int64_param = finish.prompt_tokens
            response.parameters["completion_tokens"].int64_param = finish.completion_tokens
        return response


def _server_version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _error_response(request, exc: Exception) -> pb.ModelStreamInferResponse:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in ModelStreamInfer", exc_info=exc)
    return pb.ModelStreamInferResponse(error_message=f"{code.name}: {message}",
                                       infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                                            id=request.id))


def add_kserve_servicer(server: grpc.aio.Server, model: ServedModel, access: AccessControl | None = None,
                        constraints: GrammarSandbox | None = None) -> KServeServicer:
    servicer = KServeServicer(model, access, constraints)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    return servicer
