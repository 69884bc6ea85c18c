"""Everything this scheduler keeps in Redis, opened, started and closed as one object: the request
records (kvstore.state_writer), resumable requests' token streams and their submissions
(kvstore.token_streams, kvstore.live_requests: what a restart re-admits), the Redis health watch, the
load report gateways route by, and the orphan reaper. Without a Redis URL, NO_REDIS: the same calls, none
doing anything, and the loop gets no sinks.

    redis = await RedisSide.open(options, scheduler_id)  # credentials checked; writers built, not started
    loop = EngineLoop(..., redis.state, tokens=redis.tokens, live=redis.tokens)
    loop.start()
    await redis.start(loop, health)  # writers and health watch; re-admission; load report; orphan reaper
    ...
    await redis.withdraw()           # draining: gateways stop routing here
    await redis.aclose()             # after the loop stopped
"""
from __future__ import annotations

import asyncio

from grpc_health.v1.health_pb2 import HealthCheckResponse

from kvstore.credentials import check_redis_credentials
from kvstore.live_requests import LiveRequestReader, LiveRequestWriter
from kvstore.redis_health import REDIS_HEALTH_SERVICE, watch_redis
from kvstore.state_writer import RequestStateWriter
from kvstore.token_streams import TokenStreamWriter
from plumbing.rpc import ReadinessHealthServicer
from plumbing.telemetry.metrics import watch_redis_round_trips, watch_redis_writers
from scheduler.options import SchedulerOptions
from scheduler.process.load_report import LoadReporter
from scheduler.process.loop import EngineLoop
from scheduler.process.orphans import OrphanReaper, start_orphan_reaper
from scheduler.process.readmission import ReadmittableTokens, readmit

SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING


class NoRedis:
    """No Redis URL: no records, no resumable requests, nothing to start or close."""

    state: RequestStateWriter | None = None
    tokens: ReadmittableTokens | None = None

    async def start(self, loop: EngineLoop, health: ReadinessHealthServicer) -> None:
        pass

    async def withdraw(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


NO_REDIS = NoRedis()


class RedisSide(NoRedis):
    def __init__(self, options: SchedulerOptions, scheduler_id: str) -> None:
        """scheduler_id: the address gateways dial, the same after a restart: it names what to re-admit."""
        self.url, self.scheduler_id, self.orphan_timeout_s = options.redis_url, scheduler_id, options.orphan_timeout_s
        self.state = RequestStateWriter(self.url, ttl_s=options.state_ttl_s)
        self._token_streams = TokenStreamWriter(self.url, ttl_s=options.state_ttl_s)  # for resumable requests
        self._live = LiveRequestWriter(self.url, scheduler_id, ttl_s=options.state_ttl_s)
        self.tokens = ReadmittableTokens(self._token_streams, self._live)  # re-admitted after a crash
        self._health_watch: asyncio.Task | None = None
        self._reporter: LoadReporter | None = None
        self._orphans: OrphanReaper | None = None

    @classmethod
    async def open(cls, options: SchedulerOptions, scheduler_id: str) -> RedisSide | NoRedis:
        """NO_REDIS without a URL; exits (SystemExit) when Redis refuses the URL's credentials."""
        if not options.redis_url:
            return NO_REDIS
        await check_redis_credentials(options.redis_url, "scheduler")
        return cls(options, scheduler_id)

    async def start(self, loop: EngineLoop, health: ReadinessHealthServicer) -> None:
        """Call right after loop.start(), before readiness: the writers start before the loop's first
        step runs (nothing awaits in between), then what this scheduler ran when it died runs on."""
        self.state.start()
        self._token_streams.start()
        self._live.start()
        # what a Redis outage longer than the writers' buffers cost: counted, never silent
        watch_redis_writers(lambda: {"record": self.state.stats.dropped, "token_stream": self._token_streams.dropped})
        watch_redis_round_trips(self.round_trips, lambda: loop.num_steps)
        self._health_watch = asyncio.get_running_loop().create_task(watch_redis(
            self.url, lambda: self.state.healthy and self._token_streams.healthy,
            lambda ok: health.set(REDIS_HEALTH_SERVICE, SERVING if ok else NOT_SERVING)))
        reader = LiveRequestReader(self.url, self.scheduler_id)
        await readmit(loop, reader)
        await reader.aclose()
        self._reporter = LoadReporter(self.url, self.scheduler_id, loop)
        self._reporter.start()
        self._orphans = start_orphan_reaper(loop, self.url, self.orphan_timeout_s)  # None when off

    def round_trips(self) -> dict[str, int]:
        """Calls each writer sent to Redis so far, one round trip each (record: batches written)."""
        return {"record": self.state.stats.batches, "token_stream": self._token_streams.round_trips,
                "live": self._live.round_trips}

    async def withdraw(self) -> None:
        """Draining: the load report's keys go, so gateways stop routing here."""
        if self._reporter is not None:
            await self._reporter.aclose()

    async def aclose(self) -> None:
        if self._orphans is not None:
            await self._orphans.aclose()
        if self._health_watch is not None:
            self._health_watch.cancel()
        await self.state.aclose()
        await self._token_streams.aclose()
        await self._live.aclose()
