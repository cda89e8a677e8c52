"""Quota counts shared by every router of the mesh, in Redis (``--quota-redis-url``).

Each reservation and each settlement is one Lua script, so Redis runs it
whole, between any two other routers' scripts: check and take cannot be
split by a concurrent request. The rules are :func:`tokenmesh.router.
_quota_window.judge`'s, on Redis's clock (``TIME``), so routers' clocks do not
matter. Per tenant (keys share the ``{tenant}`` hash tag):

- ``tm:quota:{tenant}:tokens`` and ``:requests``: hash slot -> amount reserved
  in that slot; slots that left the window are deleted as they are met, the
  keys expire a window after their last use.
- ``tm:quota:{tenant}:running``: hash router id -> generations it runs. A
  router that stops renewing its entry in ``tm:quota:routers`` (a sorted set
  router id -> expiry, renewed every second) is taken to be gone: its running
  generations stop counting within ``ROUTER_TTL_S``.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from tokenmesh.router._quota_file import Limits
from tokenmesh.router._quota_window import SLOTS, Verdict

TIMEOUT_S = 0.5
"""Longest a call to Redis may take before the router counts Redis as down and grants from its own budget."""
ROUTER_TTL_S = 5.0
"""A router that has not renewed its entry for this long is gone: its running generations stop counting."""
ROUTERS = "tm:quota:routers"

_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_RESERVE = (
    _PRELUDE
    + """
local need, lt, lr, lc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local slot_ms, slots, router, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local cur = math.floor(now / slot_ms)
local function load(key)
  local flat = redis.call('HGETALL', key)
  local used, by = 0, {}
  for i = 1, #flat, 2 do
    local slot, amount = tonumber(flat[i]), tonumber(flat[i + 1])
    if slot < cur - slots then redis.call('HDEL', key, flat[i])
    else used = used + amount; by[#by + 1] = {slot, amount} end
  end
  table.sort(by, function(a, b) return a[1] < b[1] end)
  return used, by
end
local function wait(by, used, n, limit)
  local excess = used + n - limit
  for _, e in ipairs(by) do
    excess = excess - e[2]
    if excess <= 0 then return math.max(0, (e[1] + slots + 1) * slot_ms - now) end
  end
  return -1
end
local function reset(by)
  local newest = nil
  for _, e in ipairs(by) do if e[2] > 0 then newest = e[1] end end
  if newest == nil then return 0 end
  return math.max(0, (newest + slots + 1) * slot_ms - now)
end
redis.call('ZADD', KEYS[4], now + ttl, router)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local flat = redis.call('HGETALL', KEYS[3])
local running = 0
for i = 1, #flat, 2 do
  if redis.call('ZSCORE', KEYS[4], flat[i]) then running = running + tonumber(flat[i + 1])
  else redis.call('HDEL', KEYS[3], flat[i]) end
end
local ut, bt = load(KEYS[1])
local ur, br = load(KEYS[2])
local refused, retry = 0, -1
if lc >= 0 and running + 1 > lc then refused, retry = 1, math.min(1000, slot_ms)
elseif lr >= 0 and ur + 1 > lr then refused, retry = 2, wait(br, ur, 1, lr)
elseif lt >= 0 and need > lt then refused = 3
elseif lt >= 0 and ut + need > lt then refused, retry = 4, wait(bt, ut, need, lt) end
if refused > 0 then return {refused, retry, ut, ur, reset(bt), reset(br), cur} end
redis.call('HINCRBY', KEYS[1], cur, need)
redis.call('HINCRBY', KEYS[2], cur, 1)
redis.call('HINCRBY', KEYS[3], router, 1)
local keep = (slots + 2) * slot_ms
redis.call('PEXPIRE', KEYS[1], keep)
redis.call('PEXPIRE', KEYS[2], keep)
redis.call('PEXPIRE', KEYS[3], math.max(keep, 3600000))
local full = (cur + slots + 1) * slot_ms - now
return {0, -1, ut + need, ur + 1, full, full, cur}
"""
)

_RELEASE = (
    _PRELUDE
    + """
local slot, refund, router = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local slot_ms, slots = tonumber(ARGV[4]), tonumber(ARGV[5])
local in_window = tonumber(slot) >= math.floor(now / slot_ms) - slots
if refund ~= 0 and in_window and redis.call('HEXISTS', KEYS[1], slot) == 1 then
  if redis.call('HINCRBY', KEYS[1], slot, -refund) <= 0 then redis.call('HDEL', KEYS[1], slot) end
end
if redis.call('HINCRBY', KEYS[2], router, -1) <= 0 then redis.call('HDEL', KEYS[2], router) end
return 1
"""
)

_ALIVE = (
    _PRELUDE
    + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)

_REFUSED = {1: "concurrent", 2: "requests", 3: "too_large", 4: "tokens"}


def _key(tenant: str, what: str) -> str:
    return f"tm:quota:{{{tenant}}}:{what}"


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisStore:
    """The counts of every router, in Redis.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` with TLS), as redis-py reads it.
        router: this router's id (its entries in the running counts).
        window_s: the quota's window (every router of the mesh must use the same).

    """

    client: redis.Redis
    router: str
    slot_ms: int
    _reserve: AsyncScript
    _release: AsyncScript
    _alive: AsyncScript

    def __init__(self, url: str, router: str, window_s: float) -> None:
        # No retries inside redis-py: a Redis that does not answer at once is down, and the router's own budget
        # takes over (a retry would hold every admission up for it).
        self.client = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0)
        )
        self.router = router
        self.slot_ms = max(1, round(window_s * 1000 / SLOTS))
        self._reserve = self.client.register_script(_RESERVE)
        self._release = self.client.register_script(_RELEASE)
        self._alive = self.client.register_script(_ALIVE)

    async def reserve(self, tenant: str, limits: Limits, need: int) -> Verdict:
        """Check and take a reservation (one script); raises redis's errors and OSError when Redis is down."""
        keys = [_key(tenant, "tokens"), _key(tenant, "requests"), _key(tenant, "running"), ROUTERS]
        args: list[int | str] = [need, _limit(limits.tokens), _limit(limits.requests), _limit(limits.concurrent)]
        args += [self.slot_ms, SLOTS, self.router, round(ROUTER_TTL_S * 1000)]
        refused, retry, used_t, used_r, reset_t, reset_r, slot = await self._reserve(keys=keys, args=args)
        return Verdict(
            _REFUSED.get(int(refused), ""),
            None if int(retry) < 0 else int(retry) / 1000,
            int(used_t),
            int(used_r),
            int(reset_t) / 1000,
            int(reset_r) / 1000,
            int(slot),
        )

    async def release(self, tenant: str, slot: int, refund: int) -> None:
        """The generation ended: one running less, refund tokens back into its slot (negative: more used)."""
        keys = [_key(tenant, "tokens"), _key(tenant, "running")]
        await self._release(keys=keys, args=[slot, refund, self.router, self.slot_ms, SLOTS])

    async def alive(self) -> int:
        """Renew this router's entry; the number of routers alive."""
        return int(await self._alive(keys=[ROUTERS], args=[self.router, round(ROUTER_TTL_S * 1000)]))

    async def set_running(self, running: Mapping[str, int]) -> None:
        """Write this router's running generations per tenant as it counts them (after releases Redis missed)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for tenant, count in running.items():
                if count > 0:
                    pipe.hset(_key(tenant, "running"), self.router, count)
                else:
                    pipe.hdel(_key(tenant, "running"), self.router)
            await pipe.execute()

    async def reconnect(self) -> None:
        """Drop every pooled connection (after an outage they may be to a Redis that restarted)."""
        await self.client.connection_pool.disconnect()

    async def close(self) -> None:
        """Close the connections."""
        await self.client.aclose()
