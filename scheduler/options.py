"""The scheduler process's options, declared once (STYLE.md habit 16): each field of SchedulerOptions
carries its flag (plumbing.options). Torch-free, like all of scheduler/.

    parser = argparse.ArgumentParser()
    SchedulerOptions.add_arguments(parser)       # the flags this service owns
    add_shared_arguments(parser)                 # TLS, peer roles, secret, message size, metrics (plumbing's)
    options = SchedulerOptions.from_args(args, **shared_values(parser, args))

The flags the plumbing helpers declare for every service (TLS files, --tls-allowed-roles, --insecure-internal,
--no-reflection, --internal-secret-file, --max-message-bytes, --metrics-port) are not repeated here:
their values land in plain fields through `from_args` overrides (shared_values), the composites among
them (tls, worker_tls, allowed_roles, internal_secret) already built and checked. A cluster sets each of
them per child. The scheduling rule's own config (scheduler.config.SchedulerConfig) is built from these
options and what the worker reports (SchedulerOptions.scheduler_config).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from plumbing import internal_secret, peer_roles, telemetry, tls
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, add_message_size_argument
from plumbing.options import NON_NEGATIVE_INT, POSITIVE, Options, option, ranged
from plumbing.tls import ClientTLS, ServerTLS
from scheduler.config import (KV_POLICIES, MAX_SPECULATIVE_TOKENS, QUEUE_POLICIES, SPECULATIVE_METHODS,
                              SchedulerConfig)

# The default --orphan-timeout-s (scheduler.process.orphans): long enough for a client whose gateway died to
# reconnect through another (and for a gateway to follow a request again after its scheduler restarted)
ORPHAN_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class SchedulerOptions(Options):
    GROUP = "scheduler"

    # where it listens and whom it serves (a cluster sets these per child)
    host: str = option("127.0.0.1", "interface the gRPC server listens on", cluster=False)
    port: int = option(50052, "gRPC port", type=int, cluster=False)
    worker: str = option("127.0.0.1:50053", "worker address HOST:PORT", cluster=False)
    redis_url: str = option("", "request state store, redis://[USER:PASSWORD@]HOST:PORT/DB (default: "
                                "$TOKENMILL_REDIS_URL, which keeps a password out of the process list); "
                                "empty: no request records", env="TOKENMILL_REDIS_URL", cluster=False)
    advertise_address: str = option("", "HOST:PORT gateways dial to reach this scheduler; names its load and "
                                        "prefix keys in Redis (default: --host:--port)", cluster=False)
    state_ttl_s: int = option(3600, "how long request records live in Redis", type=int)
    # the scheduling rule (scheduler.config.SchedulerConfig)
    kv_policy: str = option("paged", "paged: pages on demand; static: prompt + max_tokens reserved up front",
                            choices=KV_POLICIES)
    queue_policy: str = option("fcfs", "the waiting queue's order (priority: lower value runs first)",
                               choices=QUEUE_POLICIES)
    max_num_seqs: int = option(64, "most requests running at once", type=POSITIVE)
    max_num_batched_tokens: int = option(512, "token budget of one step (prefill chunks + decode tokens)", type=POSITIVE,
                                         cluster=False)
    target_itl_ms: float | None = option(
        None, "inter-token latency target: each step's token budget and the running-set size follow a learnt "
              "step-time model (the two flags above become upper bounds)", type=float)
    target_ttft_ms: float | None = option(
        None, "time-to-first-token target: a request about to miss it gets the full budget", type=float)
    max_model_len: int | None = option(None, "prompt + output of one request (default: the model's own limit)",
                                       type=POSITIVE)
    enable_prefix_caching: bool = option(True, "do not share full prompt pages through the prefix cache",
                                         flag="--no-prefix-caching")
    # on by default on CPU and GPU (issue 33): the worker goes from one step to the next without waiting for
    # the scheduler's bookkeeping; the flag is the way back to the synchronous loop
    async_scheduling: bool = option(True, "plan each step only after the previous step's result (the synchronous "
                                          "loop; by default step N+1 is planned and sent while the worker runs "
                                          "step N, and N's results are applied while N+1 runs)")
    # speculative decoding (scheduler.speculation; issue 35)
    speculative: str | None = option(
        None, "speculative decoding: ngram proposes each request's next tokens by prompt lookup (its last 4..2 "
              "tokens matched earlier in its prompt and output); draft: the worker's draft model (--draft-model) "
              "guesses them; the worker verifies them in the same step, "
              "so greedy output stays token for token the same and sampled output keeps its distribution; "
              "seeded requests decode as before; with async scheduling a request sits out the step planned while "
              "its drafts are verified (a batch where all speculate runs the synchronous loop); draft implies "
              "the synchronous loop", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(
        8, f"with --speculative: the most draft tokens a request verifies a step (1..{MAX_SPECULATIVE_TOKENS}); "
           "each request's own count follows its acceptance below it",
        type=ranged(int, 1, MAX_SPECULATIVE_TOKENS, what=f"in 1..{MAX_SPECULATIVE_TOKENS}"))
    # a model whose every layer slides: give back each request's pages before its window
    # (scheduler.pages.kv_manager). No flag: the process always does; tokenmill.llm's engine may not
    free_window_pages: bool = True
    # admission (scheduler.admission)
    max_waiting_requests: int = option(4096, "requests queued beyond the running batch; more are refused with "
                                             "RESOURCE_EXHAUSTED", type=POSITIVE)
    max_waiting_tokens: int = option(0, "prompt tokens queued beyond the running batch; 0: no bound",
                                      type=NON_NEGATIVE_INT)
    # the worker link and its failures (scheduler.process.worker_recovery)
    worker_timeout_s: float = option(600.0, "how long to wait for the worker", type=float)
    retry_on_worker_failure: bool = option(
        True, "requests on a worker that crashed fail (UNAVAILABLE) instead of being recomputed",
        flag="--no-retry-on-worker-failure")
    worker_reconnect_timeout_s: float = option(
        60.0, "how long requests wait for a crashed worker to come back before failing", type=float)
    # shutdown and abandoned requests
    drain_timeout_s: float = option(
        30.0, "on SIGTERM: readiness off, new requests UNAVAILABLE, in-flight ones get this long",
        flag=("--drain-timeout-s", "--drain-timeout"), type=float, cluster=False)
    orphan_timeout_s: float = option(
        ORPHAN_TIMEOUT_S, "with Redis, a resumable request whose client went away (its gateway died, or it was "
                          "re-admitted after a restart) and that no gateway follows from Redis for this long is "
                          "aborted, rather than decoding to max_tokens for nobody; 0: never", type=float)
    # what plumbing's shared flags set (add_shared_arguments / shared_values)
    max_message_bytes: int = field(default=INTERNAL_MAX_MESSAGE_BYTES)
    metrics_port: int | None = field(default=None)
    insecure_internal: bool = field(default=False)
    reflection: bool = field(default=True)
    tls: ServerTLS | None = field(default=None)
    allowed_roles: frozenset[str] = field(default=frozenset({"gateway"}))  # with mutual TLS: who may call
    worker_tls: ClientTLS | None = field(default=None)
    internal_secret: str | None = field(default=None)

    def scheduler_config(self, *, num_blocks: int, block_size: int, model_max_len: int, num_host_blocks: int = 0,
                         bytes_per_block: int = 0, sliding_window: int | None = None) -> SchedulerConfig:
        """The scheduling rule's config: these options over the pages and model the worker reports.
        sliding_window: the model's every-layer window (None: some layer attends the whole context)."""
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=min(self.max_model_len or model_max_len, model_max_len), kv_policy=self.kv_policy,
            queue_policy=self.queue_policy, enable_prefix_caching=self.enable_prefix_caching,
            num_host_blocks=num_host_blocks, bytes_per_block=bytes_per_block, target_itl_ms=self.target_itl_ms,
            target_ttft_ms=self.target_ttft_ms, sliding_window=sliding_window if self.free_window_pages else None,
            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens)


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags plumbing declares for every internal service, as this scheduler takes them."""
    add_message_size_argument(parser, INTERNAL_MAX_MESSAGE_BYTES)
    tls.add_server_arguments(parser)
    peer_roles.add_arguments(parser, ["gateway"])
    tls.add_client_arguments(parser, "worker")
    internal_secret.add_arguments(parser, "callers other than health checks must send it, and this scheduler sends "
                                          "it to its worker")
    telemetry.add_metrics_argument(parser)


def shared_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The SchedulerOptions fields add_shared_arguments' flags fill (files checked now; parser.error on a
    mistake), for SchedulerOptions.from_args(args, **shared_values(parser, args))."""
    return {"max_message_bytes": args.max_message_bytes, "metrics_port": args.metrics_port,
            "insecure_internal": args.insecure_internal, "reflection": not args.no_reflection,
            "tls": tls.server_tls_from_args(parser, args),
            "allowed_roles": peer_roles.allowed_roles_from_args(parser, args),
            "worker_tls": tls.client_tls_from_args(parser, args, "worker"),
            "internal_secret": internal_secret.secret_from_args(parser, args)}
