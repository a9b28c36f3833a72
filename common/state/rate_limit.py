"""Per-caller rate limits in Redis, shared exactly by every router: a requests budget and a tokens budget per
minute, charged atomically by one Lua script on Redis's clock.

Algorithm: GCRA (the generic cell rate algorithm, a token bucket kept as one timestamp). A budget of ``L`` per
minute is a bucket of ``L`` that refills continuously at ``L`` per 60 s: a caller may spend the whole ``L`` at
once, then one unit every ``60 000 / L`` ms. Per budget Redis keeps the theoretical arrival time ``tat`` (unix
ms on Redis's clock, ``redis.call('TIME')``, so routers' host clocks are never compared). A charge of ``c``
at ``now`` is admitted when ``max(tat, now) + c * 60 000 / L - now <= 60 000`` (within 0.01 ms, the float
granularity), and then moves ``tat`` there; refused, it waits the excess, which is the retry hint (rounded up
to the ms: exact unless other charges or refunds happen meanwhile). A request must pass both budgets; one that
fails either is charged nothing, and the hint is the longer of the two waits.

Tokens policy (reserve, then give back): admission charges ``prompt tokens + the most the request may
generate`` (its ``max_tokens``, capped by the context left); when it ends, :meth:`RateLimiter.refund` gives back
what it did not generate. So admission never lets a caller overrun its budget however long its requests run,
and what is finally spent is what was used. A request that needs more tokens than the whole budget can never
be admitted: it is refused at once (no Redis call) with ``retry_after_ms=None``.

Key: :func:`common.state.keys.rate_limit_key` (``{prefix}ratelimit:{principal}``), a hash with one field per
budget, expiring when both budgets are full again, so an idle caller leaves nothing behind.

Redis unreachable: the limiter fails OPEN (admits, ``charged=False``) and logs one warning when the outage
starts and one line when Redis answers again; during ``outage_retry_s`` after a failure it does not ask Redis
at all, so an outage costs requests no time. Thread-safe; one instance per router (built by its entry point).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from common.state.keys import DEFAULT_PREFIX, check_prefix, rate_limit_key

log = logging.getLogger(__name__)

WINDOW_MS = 60_000  # a budget's period: limits are per minute
LIMIT_NAMES = ("requests", "tokens")

# KEYS[1]: the caller's hash. ARGV[1]: 'admit' or 'refund'; ARGV[2]: the window, ms; ARGV[3], ARGV[4]: the
# requests budget's limit and cost; ARGV[5], ARGV[6]: the tokens budget's (a limit of 0: that budget is off).
# admit → {1, 0, ''} charged, or {0, wait_ms, 'requests'|'tokens'} charged nothing; refund → {1, 0, ''}.
_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local window = tonumber(ARGV[2])
local fields = {'requests_tat_ms', 'tokens_tat_ms'}
local names = {'requests', 'tokens'}
local limits = {tonumber(ARGV[3]), tonumber(ARGV[5])}
local costs = {tonumber(ARGV[4]), tonumber(ARGV[6])}
local state = redis.call('HMGET', KEYS[1], fields[1], fields[2])
local tats = {}
for i = 1, 2 do
  local tat = tonumber(state[i]) or now
  if tat < now then tat = now end
  tats[i] = tat
end
if ARGV[1] == 'refund' then
  if limits[2] <= 0 or not state[2] then return {1, 0, ''} end
  tats[2] = math.max(now, tats[2] - costs[2] * window / limits[2])
else
  local wait, refused = 0, ''
  for i = 1, 2 do
    if limits[i] > 0 and costs[i] > 0 then
      local new = tats[i] + costs[i] * window / limits[i]
      local over = new - now - window
      if over > 0.01 then
        if over > wait then wait, refused = over, names[i] end
      else
        tats[i] = new
      end
    end
  end
  if refused ~= '' then return {0, math.ceil(wait), refused} end
end
redis.call('DEL', KEYS[1])
local ttl = 0
for i = 1, 2 do
  if tats[i] > now then
    redis.call('HSET', KEYS[1], fields[i], string.format('%.17g', tats[i]))
    ttl = math.max(ttl, tats[i] - now)
  end
end
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(ttl)) end
return {1, 0, ''}
"""


@dataclass(frozen=True)
class Limits:
    """One caller's budgets per minute; 0 = that budget is off."""

    requests_per_min: int = 0
    tokens_per_min: int = 0

    def __post_init__(self) -> None:
        for name in ("requests_per_min", "tokens_per_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: no limit), got {value!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_min or self.tokens_per_min)

    def of(self, limit: str) -> int:
        """The budget named ``limit`` (``requests`` or ``tokens``), per minute."""
        return self.requests_per_min if limit == "requests" else self.tokens_per_min


@dataclass(frozen=True)
class Decision:
    """The answer of :meth:`RateLimiter.admit`."""

    admitted: bool
    limit: str = ""  # refused: the budget that refused ("requests" or "tokens"); "" when admitted
    retry_after_ms: int | None = None  # refused: ms until the same request would be admitted; None = never
    charged: bool = False  # admitted and charged in Redis (False: no limit, or admitted while Redis was down)


ADMITTED_UNCHARGED = Decision(True)


class RateLimiter:
    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, outage_retry_s: float = 1.0) -> None:
        """``outage_retry_s``: after a Redis error, admit without asking Redis this long (>= 0)."""
        if not outage_retry_s >= 0:
            raise ValueError(f"outage_retry_s must be >= 0, got {outage_retry_s!r}")
        self._prefix = check_prefix(prefix)
        self._script = client.register_script(_GCRA_LUA)
        self.outage_retry_s = outage_retry_s
        self._lock = threading.Lock()
        self._down_until: float | None = None  # monotonic s; None = Redis answered last time

    def admit(self, principal: str, limits: Limits, num_tokens: int) -> Decision:
        """Charge one request of ``num_tokens`` tokens (prompt + reserved completion) to ``principal``'s
        budgets, or refuse it and charge nothing. Never raises for Redis trouble (fails open)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if not limits.enabled:
            return ADMITTED_UNCHARGED
        if limits.tokens_per_min and num_tokens > limits.tokens_per_min:
            return Decision(False, "tokens", None)
        reply = self._call(principal, "admit", limits, 1, num_tokens)
        if reply is None:
            return ADMITTED_UNCHARGED
        admitted, wait_ms, limit = reply
        if admitted:
            return Decision(True, charged=True)
        return Decision(False, limit.decode() if isinstance(limit, bytes) else limit, max(1, int(wait_ms)))

    def refund(self, principal: str, limits: Limits, num_tokens: int) -> None:
        """Give back ``num_tokens`` unused tokens of an admitted, charged request (a budget is never filled past
        full). Never raises for Redis trouble."""
        if num_tokens > 0 and limits.tokens_per_min:
            self._call(principal, "refund", limits, 0, num_tokens)

    def _call(self, principal: str, mode: str, limits: Limits, num_requests: int, num_tokens: int) -> list | None:
        """The script's reply, or None when Redis is (or was just now) unreachable."""
        if self._down_until is not None and time.monotonic() < self._down_until:
            return None
        key = rate_limit_key(principal, prefix=self._prefix)
        args = [mode, WINDOW_MS, limits.requests_per_min, num_requests, limits.tokens_per_min, num_tokens]
        try:
            reply = self._script(keys=[key], args=args)
        except redis.RedisError as exc:
            with self._lock:
                first = self._down_until is None
                self._down_until = time.monotonic() + self.outage_retry_s
            if first:
                log.warning("rate limits not enforced: Redis failed (%s); admitting every request until it "
                            "answers again", exc)
            return None
        if self._down_until is not None:
            with self._lock:
                recovered, self._down_until = self._down_until is not None, None
            if recovered:
                log.warning("rate limits enforced again: Redis answers")
        return reply
