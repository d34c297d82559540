"""The session index in Redis, shared by router replicas: turn 1 through one replica and turn 2
through another still reuse.

Keys (all under the configured prefix):
  ``h:<session>``  holding JSON, expiring with the holding (PX)
  ``t:<ticket>``   ticket JSON, expiring after the longest a turn may run
  ``e:<session>``  wall time the session was ended (tombstone for turns still in flight)
  ``index``        sorted set session -> expiry, bounding the index: past ``max_sessions`` the
                   holdings closest to expiry are evicted first
  ``recorded``     pub/sub channel: the ticket of each holding a router recorded from a decode
                   engine's report, for the router whose stream waits on it

``take`` is one Lua script around GETDEL (atomic: two concurrent turns never both get a
holding); ``offer`` is another (compare issue times, honour the tombstone, bound the index).
Tickets of non-streamed turns never come here (their holding returns to the router that issued
them). Needs Redis >= 6.2 and a single-node deployment or one hash slot (the scripts build
eviction keys themselves).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis

from agentkv_server.router.sessions import Clock, Holding, Ticket

__all__ = ["RedisStore"]

# GETDEL the holding and drop it from the index: one round trip (a MULTI pipeline took half as
# much CPU again in redis-py).
_TAKE = """
local holding = redis.call('GETDEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return holding
"""

_OFFER = """
local holding_key, ended_key, index_key = KEYS[1], KEYS[2], KEYS[3]
local value, issued_at, ttl_ms = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local session, expires_at, max_sessions, holding_prefix = ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local ended = redis.call('GET', ended_key)
if ended and tonumber(ended) >= issued_at then return {value} end
local current = redis.call('GET', holding_key)
if current and tonumber(cjson.decode(current)['issued_at']) > issued_at then return {value} end
redis.call('SET', holding_key, value, 'PX', ttl_ms)
redis.call('ZADD', index_key, expires_at, session)
local losers = {}
if current then table.insert(losers, current) end
local excess = redis.call('ZCARD', index_key) - max_sessions
if excess > 0 then
  local victims = redis.call('ZPOPMIN', index_key, excess)
  for i = 1, #victims, 2 do
    local evicted = redis.call('GETDEL', holding_prefix .. victims[i])
    if evicted then table.insert(losers, evicted) end
  end
end
return losers
"""


class RedisStore:
    """A :class:`~agentkv_server.router.sessions.SessionStore` in Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str,
        max_sessions: int,
        ticket_ttl_s: float,
        clock: Clock = time.time,
    ) -> None:
        self._redis = redis
        self._prefix = prefix
        self._max_sessions = max_sessions
        self._ticket_ttl_ms = max(1, int(ticket_ttl_s * 1000))
        self._clock = clock
        self._take = redis.register_script(_TAKE)
        self._offer = redis.register_script(_OFFER)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float | None = None, **kwargs) -> RedisStore:
        """A store on a new client; ``timeout_s`` bounds each connect and each reply."""
        client = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, **kwargs)

    def _holding_key(self, session_key: str) -> str:
        return f"{self._prefix}h:{session_key}"

    @property
    def _index_key(self) -> str:
        return f"{self._prefix}index"

    async def take(self, session_key: str) -> Holding | None:
        raw = await self._take(
            keys=[self._holding_key(session_key), self._index_key], args=[session_key]
        )
        return self._live(raw)

    async def offer(self, holding: Holding) -> list[Holding]:
        ttl_ms = int((holding.expires_at - self._clock()) * 1000)
        if ttl_ms <= 0:
            return []
        raw_losers = await self._offer(
            keys=[
                self._holding_key(holding.session_key),
                f"{self._prefix}e:{holding.session_key}",
                self._index_key,
            ],
            args=[
                holding.to_json(),
                repr(holding.issued_at),
                ttl_ms,
                holding.session_key,
                repr(holding.expires_at),
                self._max_sessions,
                f"{self._prefix}h:",
            ],
        )
        return [loser for raw in raw_losers if (loser := self._live(raw)) is not None]

    async def end(self, session_key: str, at: float) -> Holding | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{self._prefix}e:{session_key}", repr(at), px=self._ticket_ttl_ms)
            pipe.getdel(self._holding_key(session_key))
            pipe.zrem(self._index_key, session_key)
            _, raw, _ = await pipe.execute()
        return self._live(raw)

    async def add_ticket(self, ticket: Ticket) -> None:
        await self._redis.set(
            f"{self._prefix}t:{ticket.ticket}", ticket.to_json(), px=self._ticket_ttl_ms
        )

    async def pop_ticket(self, ticket_id: str) -> Ticket | None:
        raw = await self._redis.getdel(f"{self._prefix}t:{ticket_id}")
        return None if raw is None else Ticket.from_json(raw)

    async def announce_recorded(self, ticket_id: str) -> None:
        await self._redis.publish(self._recorded_channel, ticket_id)

    async def watch_recorded(self, on_recorded: Callable[[str], None]) -> None:
        # Its own connection, read without the client's reply timeout: it waits for messages.
        async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(self._recorded_channel)
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is not None and message["type"] == "message":
                    data = message["data"]
                    on_recorded(data.decode() if isinstance(data, bytes) else str(data))

    @property
    def _recorded_channel(self) -> str:
        return f"{self._prefix}recorded"

    async def count(self) -> int:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(self._index_key, "-inf", self._clock())
            pipe.zcard(self._index_key)
            _, count = await pipe.execute()
        return int(count)

    async def close(self) -> None:
        await self._redis.aclose()

    def _live(self, raw: bytes | str | None) -> Holding | None:
        if raw is None:
            return None
        holding = Holding.from_json(raw)
        return holding if holding.expires_at > self._clock() else None
