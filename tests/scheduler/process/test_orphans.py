"""scheduler.process.orphans: a resumable request without its Submit call is aborted once it has been unfollowed
for the timeout; a followed one starts a new timeout; with Redis away nothing is aborted."""
from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from core.outputs import FinishReason
from scheduler.process.orphans import OrphanReaper


class FakeStreams:
    def __init__(self) -> None:
        self.since: dict[str, float] = {}

    def detached(self) -> dict[str, float]:
        return dict(self.since)

    def detach(self, request_id: str, since: float | None = None) -> None:
        self.since[request_id] = since


class FakeLoop:
    def __init__(self) -> None:
        self.streams = FakeStreams()
        self.aborted: list[tuple[str, FinishReason]] = []

    def abort(self, request_id: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        self.aborted.append((request_id, finish_reason))
        del self.streams.since[request_id]  # the loop ends it
        return True


class FakeFollowers:
    def __init__(self, followed: set[str]) -> None:
        self.followed_ids = followed
        self.asked: list[list[str]] = []
        self.down = False

    async def followed(self, request_ids: list[str]) -> set[str]:
        if self.down:
            raise RedisConnectionError("Redis is away")
        self.asked.append(request_ids)
        return self.followed_ids & set(request_ids)


async def test_only_an_unfollowed_request_past_the_timeout_is_aborted_and_a_followed_one_waits_anew():
    now = [100.0]
    loop, followers = FakeLoop(), FakeFollowers({"followed"})
    reaper = OrphanReaper(loop, followers, timeout_s=5.0, clock=lambda: now[0])
    loop.streams.since = {"orphan": 94.0, "followed": 94.0, "recent": 97.0}
    assert await reaper.check() == ["orphan"]
    assert loop.aborted == [("orphan", FinishReason.ABORT)]
    assert sorted(followers.asked[0]) == ["followed", "orphan"], "only those past the timeout are looked up"
    assert loop.streams.since == {"followed": 100.0, "recent": 97.0}, "followed: a new timeout from now"
    now[0] = 103.0  # "recent" is due now, "followed" not yet
    followers.followed_ids = set()
    assert await reaper.check() == ["recent"]


async def test_with_redis_away_no_request_is_taken_for_an_orphan():
    loop, followers = FakeLoop(), FakeFollowers(set())
    followers.down = True
    reaper = OrphanReaper(loop, followers, timeout_s=1.0, clock=lambda: 100.0)
    loop.streams.since = {"unknown": 0.0}
    assert await reaper.check() == [] and loop.aborted == []
