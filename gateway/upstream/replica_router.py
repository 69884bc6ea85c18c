"""The gateway's side of the gateway -> scheduler hop when there are several model replicas.

A SchedulerTarget (gateway.upstream.target) like one SchedulerClient, whose route() picks a replica per
request with gateway/upstream/replica_choice.py. Replicas come from a static list (--scheduler given more than
once) or from a DNS name resolved to all its addresses (a Kubernetes headless Service), re-resolved
every dns_refresh_s. Every refresh_s a background task reads each replica's load and cached prefix
keys from Redis (scheduler/process/load_report.py writes them) — or, without Redis, asks each replica's
GetLoad RPC (load only, no prefix affinity) — and checks its readiness over grpc.health.v1.
Nothing here is awaited on a request's path except the chosen replica's own call.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from core.errors import ServingError, Unavailable
from core.outputs import FinishReason, RequestOutput
from core.prefix_keys import extend_block_hashes  # the same keys the replicas publish
from core.requests import GenerationRequest
from gateway.upstream.replica_choice import DEFAULT_MAX_LOAD_IMBALANCE, ReplicaView, choose_replica
from gateway.upstream.circuit_breaker import CircuitBreaker
from gateway.upstream.scheduler_client import SchedulerClient
from kvstore.replica_keys import REPORT_INTERVAL_S, load_key, prefixes_key
from plumbing.process import cancel_and_wait
from plumbing.tls import ClientTLS
from protos.tokenmill.v1 import common_pb2

logger = logging.getLogger("tokenmill.gateway.replicas")

RECENT_PREFIX_TTL_S = 5.0  # prefixes routed here count as cached until the replica's report shows them


class _Prefixes:
    """What a replica last reported, plus the prompts this gateway sent it since (not reported yet)."""

    def __init__(self) -> None:
        self.reported: set[bytes] = set()
        self.recent: dict[bytes, float] = {}  # key -> loop time after which it no longer counts

    def __contains__(self, key: object) -> bool:
        return key in self.reported or key in self.recent


@dataclass(slots=True)
class Replica:
    address: str
    client: SchedulerClient
    ready: bool = False
    prefix_version: str | None = None
    prefixes: _Prefixes = field(default_factory=_Prefixes)
    view: ReplicaView = field(init=False)  # what replica_choice sees: load numbers and these prefixes

    def __post_init__(self) -> None:
        self.view = ReplicaView(self.address, prefixes=self.prefixes)


@dataclass(slots=True)
class ReplicaRoute:
    """One call's target: the chosen replica, guarded by its own breaker."""

    router: ReplicaRouter
    replica: Replica

    @property
    def address(self) -> str:
        return self.replica.address

    @property
    def breaker(self) -> CircuitBreaker:
        return self.replica.client.breaker

    def submit(self, request: GenerationRequest, **options) -> AsyncIterator[RequestOutput]:
        """SchedulerClient.submit on the chosen replica, counted in its in-flight load while it runs."""
        return self.router.submit_to(self.replica, request, **options)


async def resolve_all(name: str) -> list[str]:
    """HOST:PORT -> every address the host resolves to, as HOST:PORT (IPv6 bracketed), sorted."""
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--scheduler-dns={name!r} must be HOST:PORT")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class ReplicaRouter:
    """Several schedulers: a gateway.upstream.target.SchedulerTarget whose routes are its replicas."""

    def __init__(self, addresses: list[str], *, dns_name: str = "", redis_url: str = "",
                 refresh_s: float = REPORT_INTERVAL_S, dns_refresh_s: float = 10.0,
                 max_load_imbalance: float = DEFAULT_MAX_LOAD_IMBALANCE,
                 tls: ClientTLS | None = None, delta_stream: bool = True) -> None:
        if not addresses and not dns_name:
            raise ValueError("ReplicaRouter needs scheduler addresses or a DNS name; got neither")
        self.dns_name = dns_name
        self.refresh_s = refresh_s
        self.dns_refresh_s = dns_refresh_s
        self.max_load_imbalance = max_load_imbalance
        self.tls = tls  # every replica's link, like the single scheduler's
        self.delta_stream = delta_stream  # SchedulerClient's: tokens batched per step on one call per replica
        # each replica's SchedulerClient has its own circuit breaker: calls failing on one replica
        # open only its breaker, and route() sends requests to the others until it answers again
        self.replicas: dict[str, Replica] = {}
        self._retired: list[Replica] = []  # left DNS; closed once their calls are done
        self._routed: dict[str, Replica] = {}  # request id -> replica, while its call runs
        self._rotation = 0
        self.block_size = 0  # from the model info; 0: no prefix keys until known
        self._redis = None
        if redis_url:
            from kvstore.client import connect

            self._redis = connect(redis_url)
        self._set_addresses(addresses)
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:  # named in UNAVAILABLE messages, like SchedulerClient.address
        return "replicas " + ",".join(self.replicas) if self.replicas else f"replicas of {self.dns_name}"

    def _set_addresses(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.replicas:
                self.replicas[address] = Replica(address, SchedulerClient(address, tls=self.tls,
                                                                             delta_stream=self.delta_stream))
                logger.info("model replica %s added", address)
        for address in [a for a in self.replicas if a not in addresses]:
            self._retired.append(self.replicas.pop(address))
            logger.info("model replica %s removed", address)

    # --- the SchedulerClient interface ------------------------------------------------------------

    async def wait_ready(self, timeout_s: float) -> common_pb2.GetModelInfoResponse:
        """Waits until one replica is ready; returns its model info (every replica serves the same model)."""
        async with asyncio.timeout(timeout_s):
            while True:
                await self.refresh()
                ready = [replica for replica in self.replicas.values() if replica.ready]
                if ready:
                    model_info = await ready[0].client.wait_ready(timeout_s)
                    self.block_size = model_info.block_size
                    self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-refresh")
                    return model_info
                await asyncio.sleep(self.refresh_s)

    def route(self, prompt_token_ids: Sequence[int]) -> ReplicaRoute:
        return ReplicaRoute(self, self.choose(prompt_token_ids))

    async def submit_to(self, replica: Replica, request: GenerationRequest, **options) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        self._routed[request_id] = replica  # aborts by id go where the request runs
        replica.view.in_flight += 1
        outputs = replica.client.submit(request, **options)
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    yield output
        finally:
            replica.view.in_flight -= 1
            if self._routed.get(request_id) is replica:
                del self._routed[request_id]

    async def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> list[str]:
        targets: dict[str, tuple[Replica, list[str]]] = {}
        for request_id in request_ids:
            routed = self._routed.get(request_id)
            # unknown here (another gateway routed it): ask every replica; a routed one may have left
            # DNS (retired) with this call still running on it, so it is asked by object, not address
            for replica in [routed] if routed else list(self.replicas.values()):
                targets.setdefault(replica.address, (replica, []))[1].append(request_id)
        replies = await asyncio.gather(*(replica.client.abort(ids, reason) for replica, ids in targets.values()),
                                       return_exceptions=True)
        return sorted({rid for reply in replies if isinstance(reply, list) for rid in reply})

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for replica in [*self.replicas.values(), *self._retired]:
            await replica.client.close()
        if self._redis is not None:
            await self._redis.aclose()

    # --- routing ----------------------------------------------------------------------------------

    def choose(self, prompt_token_ids) -> Replica:
        ready = [replica for replica in self.replicas.values() if replica.ready]
        if not ready:
            raise Unavailable(f"no ready model replica among {self.address}")
        callable_ = [replica for replica in ready if replica.client.breaker.can_call()]
        if not callable_:
            raise Unavailable(f"no model replica among {self.address} can take a request: each ready one "
                              f"failed its last calls (circuit open; retried within {ready[0].client.breaker.open_s}s)")
        ready = callable_
        block_keys: list[bytes] = []
        if self.block_size:
            extend_block_hashes(block_keys, list(prompt_token_ids), self.block_size)
        self._rotation += 1
        chosen = ready[choose_replica([r.view for r in ready], block_keys, rotation=self._rotation,
                                      max_load_imbalance=self.max_load_imbalance)]
        expires = asyncio.get_running_loop().time() + RECENT_PREFIX_TTL_S
        for key in block_keys:
            chosen.prefixes.recent[key] = expires
        return chosen

    # --- background refresh -----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_dns = loop.time() + self.dns_refresh_s
        while True:
            await asyncio.sleep(self.refresh_s)
            resolve = bool(self.dns_name) and loop.time() >= next_dns
            if resolve:
                next_dns = loop.time() + self.dns_refresh_s
            try:
                await self.refresh(resolve_dns=resolve)
            except Exception:  # noqa: BLE001 - a refresh failure must not end routing
                logger.exception("refreshing model replicas failed; keeping the last known state")

    async def refresh(self, resolve_dns: bool = True) -> None:
        """Re-resolves the DNS name (if any and asked), then readiness, load and prefixes of every replica."""
        if self.dns_name and resolve_dns:
            try:
                self._set_addresses(await resolve_all(self.dns_name))
            except OSError as error:
                logger.warning("cannot resolve %s (%s); keeping %d replicas", self.dns_name, error, len(self.replicas))
        for replica in [r for r in self._retired if r.view.in_flight == 0]:
            self._retired.remove(replica)
            await replica.client.close()
        replicas = list(self.replicas.values())
        await asyncio.gather(*(self._check_ready(replica) for replica in replicas))
        if self._redis is not None:
            await self._read_reports(replicas)
        else:
            await asyncio.gather(*(self._poll_load(replica) for replica in replicas if replica.ready))
        now = asyncio.get_running_loop().time()
        for replica in replicas:
            recent = replica.prefixes.recent
            for key in [k for k, expires in recent.items() if expires < now]:
                del recent[key]

    async def _check_ready(self, replica: Replica) -> None:
        ready = await replica.client.is_ready()
        if ready != replica.ready:
            logger.info("model replica %s is %s", replica.address, "ready" if ready else "not ready")
        replica.ready = ready

    async def _poll_load(self, replica: Replica) -> None:
        try:
            load = await replica.client.get_load(timeout_s=2.0)
        except ServingError:
            return
        replica.view.reported_requests, replica.view.kv_usage = load.num_requests, load.kv_usage

    async def _read_reports(self, replicas: list[Replica]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for replica in replicas:
                pipe.hgetall(load_key(replica.address))
            reports = await pipe.execute()
            changed = []
            for replica, report in zip(replicas, reports):
                if not report:  # not reporting (yet): its load is what this gateway sends it
                    replica.view.reported_requests, replica.view.kv_usage = 0, 0.0
                    replica.prefixes.reported, replica.prefix_version = set(), None
                    continue
                replica.view.reported_requests = (int(report["num_waiting_requests"])
                                                  + int(report["num_running_requests"]))
                total = int(report["num_kv_pages_total"])
                replica.view.kv_usage = int(report["num_kv_pages_used"]) / total if total else 0.0
                if report["prefix_version"] != replica.prefix_version:
                    changed.append((replica, report["prefix_version"]))
            if changed:
                pipe = self._redis.pipeline(transaction=False)
                for replica, _ in changed:
                    pipe.smembers(prefixes_key(replica.address))
                for (replica, version), members in zip(changed, await pipe.execute()):
                    replica.prefixes.reported = {bytes.fromhex(member) for member in members}
                    replica.prefix_version = version
        except (RedisError, OSError) as error:
            logger.debug("reading replica reports from Redis failed: %s", error)
