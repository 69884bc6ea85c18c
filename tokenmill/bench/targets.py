"""What the benchmark measures. Each target sends one request and returns a RequestRecord.

    TokenmillTarget("127.0.0.1:50051")           the public GenerateStream gRPC API (native client)
    OpenAITarget("http://127.0.0.1:8000/v1")      any OpenAI-compatible /v1/completions, streamed (SSE)
    TransformersTarget(model)                     in-process transformers generate, static batches
    LoadPoller("127.0.0.1:50052")                 the scheduler's GetLoad, sampled during a run
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request's timings, in seconds from when it was sent (perf_counter clock)."""

    sent: float
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # gap between successive tokens, per token
    output_tokens: int = 0
    error: str = ""  # "" on success; otherwise the failure (e.g. "RESOURCE_EXHAUSTED: ...")


def _arrived(record: RequestRecord, now: float, last: float | None, num_tokens: int) -> float:
    """Books num_tokens arriving at now; a delta carrying several tokens splits its gap evenly."""
    if record.ttft is None:
        record.ttft = now - record.sent
        num_tokens -= 1  # the first token has a TTFT, not an inter-token gap
    elif num_tokens:
        record.itls += [(now - last) / num_tokens] * num_tokens
        num_tokens = 0
    if num_tokens > 0:  # the rest of a first delta came with it: zero gaps
        record.itls += [0.0] * num_tokens
    return now


class TokenmillTarget:
    name = "tokenmill"

    def __init__(self, address: str, temperature: float = 0.0) -> None:
        from tokenmill.client import AsyncClient

        self.address, self.temperature = address, temperature
        self.client = AsyncClient(address)

    async def send(self, prompt: str, max_tokens: int) -> RequestRecord:
        record = RequestRecord(time.perf_counter())
        last = None
        try:
            async for delta in self.client.stream(prompt, max_tokens=max_tokens, temperature=self.temperature,
                                                ignore_eos=True):
                if delta.token_ids:
                    last = _arrived(record, time.perf_counter(), last, len(delta.token_ids))
                    record.output_tokens += len(delta.token_ids)
                if delta.finish_reason in ("abort", "error"):
                    record.error = f"finish_reason={delta.finish_reason}"
        except Exception as error:  # noqa: BLE001 - a failed request is a measurement, not a crash
            record.error = f"{type(error).__name__}: {error}"[:200]
        record.e2e = time.perf_counter() - record.sent
        return record

    async def close(self) -> None:
        await self.client.close()


class OpenAITarget:
    """Streams /v1/completions; each SSE chunk with text counts as one token (servers send one per
    token), and the usage chunk (stream_options.include_usage) gives the exact count when present."""

    name = "openai-http"

    def __init__(self, base_url: str, model: str = "", temperature: float = 0.0) -> None:
        import aiohttp

        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.temperature = model, temperature
        # One fresh connection per request, closed after its response (force_close), and no cap on how
        # many are open (limit=0; aiohttp's default of 100 would queue requests inside the client at high
        # concurrency). Why not a keep-alive pool: llama.cpp's llama-server closes a connection right after
        # each streamed response without saying so, and a pooled connection whose close the client has not
        # yet read fails the next request ("Can not write request body" / ServerDisconnectedError: half the
        # requests in sync mode). Retrying such a request instead would re-send a non-idempotent POST
        # whenever the server dropped a connection for another reason, adding load the benchmark did not
        # ask for. A loopback connect costs well under a millisecond inside TTFT, the same for every
        # server, and is what vLLM's benchmark_serving does (a session per request).
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def send(self, prompt: str, max_tokens: int) -> RequestRecord:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": self.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        record = RequestRecord(time.perf_counter())
        last, usage, finish = None, None, None
        try:
            async with self.session.post(self.url, json=body) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:150]}"
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("error"):
                        record.error = f"error event: {json.dumps(chunk['error'])}"[:200]
                    if chunk.get("usage"):
                        usage = chunk["usage"].get("completion_tokens")
                    for choice in chunk.get("choices", []):
                        finish = choice.get("finish_reason") or finish
                    if any(choice.get("text") for choice in chunk.get("choices", [])):
                        last = _arrived(record, time.perf_counter(), last, 1)
                        record.output_tokens += 1
        except Exception as error:  # noqa: BLE001
            record.error = f"{type(error).__name__}: {error}"[:200]
        # A stream the server ended without saying why did not complete: a server whose engine died (vLLM CPU's
        # engine core past its step timeout) closes its streams cleanly, and they must not count as served.
        if not record.error and finish in (None, "abort", "error"):
            record.error = (f"finish_reason={finish}" if finish else "the stream ended without a finish_reason") + \
                f" after {record.output_tokens} of {max_tokens} tokens"
        record.output_tokens = usage if usage is not None else record.output_tokens
        record.e2e = time.perf_counter() - record.sent
        return record

    async def close(self) -> None:
        await self.session.close()


class TransformersTarget:
    """transformers `generate` in this process with static batches: a batch of up to `concurrency`
    requests starts together and returns when its longest request is done (how a server without
    continuous batching serves), so each request's end-to-end latency is its batch's."""

    name = "transformers"

    def __init__(self, model_path: str | None = None, temperature: float = 0.0) -> None:
        from tokenmill.bench.engine import load_transformers_model

        self.model, self.temperature = load_transformers_model(model_path), temperature
        self.model.generation_config.eos_token_id = None  # EOS ignored (see bench_engine.run_transformers)

    def run_batch(self, prompt_ids: list[list[int]], output_lens: list[int]) -> list[RequestRecord]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        step_times: list[float] = []

        class StepClock(LogitsProcessor):  # called once per generated token position, after its forward
            def __call__(self, input_ids, scores):
                step_times.append(time.perf_counter())
                return scores

        input_ids = torch.tensor(prompt_ids)  # equal prompt lengths: no padding
        sent = time.perf_counter()
        with torch.inference_mode():
            sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0} if self.temperature > 0 else {
                "do_sample": False}
            self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **sampling,
                                max_new_tokens=max(output_lens), pad_token_id=0,
                                logits_processor=LogitsProcessorList([StepClock()]))
        done = time.perf_counter()
        records = []
        for n in output_lens:
            times = step_times[:n]
            records.append(RequestRecord(sent, ttft=times[0] - sent, e2e=done - sent,
                                         itls=[b - a for a, b in zip(times, times[1:])], output_tokens=n))
        return records


class LoadPoller:
    """Samples the scheduler's GetLoad every interval_s while running: KV utilization and preemptions,
    and with a latency target what it chose (token budget, headroom) and how often it missed."""

    def __init__(self, scheduler_address: str, interval_s: float = 0.2) -> None:
        self.address, self.interval_s = scheduler_address, interval_s
        # (kv_utilization, preemptions_total, waiting, running, kv_pages_total, step token budget,
        #  ITL target headroom, ITL target misses total)
        self.samples: list[tuple[float, int, int, int, int, int, float, int]] = []
        self._task: asyncio.Task | None = None

    async def _poll(self) -> None:
        import grpc

        from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while True:
                reply = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5.0)
                self.samples.append((reply.kv_utilization, reply.num_preemptions_total,
                                     reply.num_waiting_requests, reply.num_running_requests, reply.num_kv_pages_total,
                                     reply.step_token_budget, reply.itl_target_headroom,
                                     reply.num_itl_target_misses_total))
                await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self.samples.clear()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> dict:
        """Mean KV utilization over samples with requests running, and the preemptions in the window."""
        await asyncio.sleep(self.interval_s * 1.5)  # one more sample after the last request ended
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a failed poll just ends the samples
            pass
        busy = [s for s in self.samples if s[3] > 0]
        return {"kv_utilization_mean": sum(s[0] for s in busy) / len(busy) if busy else None,
                "preemptions": self.samples[-1][1] - self.samples[0][1] if self.samples else None,
                "max_waiting": max((s[2] for s in self.samples), default=None),
                "kv_pages_total": self.samples[-1][4] if self.samples else None,
                # what a latency target chose while requests ran (why its throughput is what it is)
                "token_budget_p50": statistics.median(s[5] for s in busy) if busy else None,
                "itl_target_headroom_min": min((s[6] for s in busy), default=None),
                "itl_target_headroom_p50": statistics.median(s[6] for s in busy) if busy else None,
                "itl_target_misses": self.samples[-1][7] - self.samples[0][7] if self.samples else None}
