"""The gateway's Redis side, in one object: request records (GetRequestStatus, CancelRequest, and the
records of requests a scheduler loses) and what resume needs (gateway.generation.resume.ResumeStore).

    redis = RedisReaders(options.redis_url, scheduler_wait_s=options.scheduler_resume_wait_s)
    await redis.start()                   # credentials checked (SystemExit naming the URL), readers built
    Generations(tokenizer, scheduler, redis.state_reader, redis.resume)   # None without a Redis URL:
                                          # status unavailable, no resume, no records of lost requests
    await redis.aclose()

Without a Redis URL every call does nothing, so the process wiring it has no `if redis_url` branches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.generation.resume import ResumeStore
    from kvstore.state_reader import RequestStateReader


class RedisReaders:
    def __init__(self, redis_url: str, *, scheduler_wait_s: float) -> None:
        self.redis_url = redis_url
        self.scheduler_wait_s = scheduler_wait_s  # --scheduler-resume-wait-s
        self.state_reader: RequestStateReader | None = None
        self.resume: ResumeStore | None = None

    async def start(self) -> None:
        """Checks the credentials (a refused password stops the process at start, not on the first request)
        and builds the readers. Imports here: without Redis the gateway never loads the clients."""
        if not self.redis_url:
            return
        from gateway.generation.ownership import RequestOwners
        from gateway.generation.resume import ResumeStore
        from kvstore.credentials import check_redis_credentials
        from kvstore.followers import Followers
        from kvstore.request_claims import RequestClaims
        from kvstore.state_reader import RequestStateReader
        from kvstore.token_streams import TokenStreamReader

        await check_redis_credentials(self.redis_url, "gateway")
        self.state_reader = RequestStateReader(self.redis_url)
        self.resume = ResumeStore(TokenStreamReader(self.redis_url), self.state_reader,
                                  RequestOwners(self.state_reader),
                                  RequestClaims(self.redis_url),  # one request per client-chosen id, across replicas
                                  Followers(self.redis_url), scheduler_wait_s=self.scheduler_wait_s)

    async def aclose(self) -> None:
        if self.state_reader is not None:
            await self.state_reader.aclose()
        if self.resume is not None:
            await self.resume.aclose()
