"""The router's rate limits: which budgets apply to a caller, and what one request is charged.

Built once by the entry point (:meth:`RouterRateLimits.from_config`; None when no limit is set, and then the
router makes no rate-limit call to Redis). The servicer calls :meth:`RouterRateLimits.admit` once per valid
request, before any worker is touched (:class:`RateLimited` when over a budget), and
:meth:`RouterRateLimits.release` exactly once when an admitted request ends. The budgets live in Redis
(:mod:`common.state.rate_limit`, GCRA on Redis's clock), so every router of a cluster enforces one limit.

Who is a caller: the principal the front authenticated (``key:<12 hex>`` for an API key, a JWT's ``sub``).
With auth off there is no principal: every caller is :data:`ANONYMOUS` and shares one budget.

What a request costs: 1 request, and ``prompt tokens + min(max_tokens, context left)`` tokens reserved at
admission; when it ends the tokens it did not generate are given back.

Budgets: ``--rate-limit-requests-per-min`` and ``--rate-limit-tokens-per-min`` (0 = off) for every caller, and
``--rate-limit-file`` (YAML, principal → budgets) for some callers; a budget an entry does not give is the
flag's, 0 lifts it::

    "key:0123456789ab": {requests_per_min: 600, tokens_per_min: 200000}
    svc-batch: {tokens_per_min: 0}
    anonymous: {requests_per_min: 10}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis
import yaml

from common.state.rate_limit import Limits, RateLimiter

ANONYMOUS = "anonymous"  # the caller when auth is off: one budget shared by all
RATE_LIMIT_KEY = "rate-limit"  # trailing metadata of a RESOURCE_EXHAUSTED from a rate limit: requests|tokens
_FILE_FIELDS = ("requests_per_min", "tokens_per_min")


class RateLimited(Exception):
    """A request over a budget; ``str()`` is the client's message, naming the limit and the caller."""

    def __init__(self, message: str, limit: str, retry_after_ms: int | None) -> None:
        super().__init__(message)
        self.limit = limit  # "requests" or "tokens"
        self.retry_after_ms = retry_after_ms  # None: no wait helps (the request is over the whole budget)


@dataclass(frozen=True)
class Charge:
    """What an admitted request was charged; :meth:`RouterRateLimits.release` gives back the unused part."""

    principal: str
    limits: Limits
    reserved_completion_tokens: int
    charged: bool  # False: nothing to give back (no budget, or admitted while Redis was down)


class RouterRateLimits:
    def __init__(self, limiter: RateLimiter, default: Limits, per_principal: Mapping[str, Limits] | None = None):
        self.limiter = limiter
        self.default = default
        self.per_principal = dict(per_principal or {})

    @classmethod
    def from_config(cls, config: Any, client: redis.Redis) -> RouterRateLimits | None:
        """From ``rate_limit_requests_per_min``, ``rate_limit_tokens_per_min``, ``rate_limit_file`` and
        ``redis_prefix`` (RouterConfig); None when no budget is set anywhere. ValueError names a bad value."""
        default = Limits(config.rate_limit_requests_per_min, config.rate_limit_tokens_per_min)
        per_principal = load_limits_file(config.rate_limit_file, default) if config.rate_limit_file else {}
        if not default.enabled and not any(lim.enabled for lim in per_principal.values()):
            return None
        return cls(RateLimiter(client, prefix=config.redis_prefix), default, per_principal)

    def limits_of(self, principal: str) -> Limits:
        return self.per_principal.get(principal, self.default)

    def admit(self, principal: str | None, num_prompt_tokens: int, max_completion_tokens: int) -> Charge:
        """Charge one request of ``principal`` (None: auth off, :data:`ANONYMOUS`); RateLimited if over a budget
        (then nothing is charged)."""
        who = principal or ANONYMOUS
        limits = self.limits_of(who)
        decision = self.limiter.admit(who, limits, num_prompt_tokens + max_completion_tokens)
        if decision.admitted:
            return Charge(who, limits, max_completion_tokens, decision.charged)
        budget = limits.of(decision.limit)
        need = f"{num_prompt_tokens} prompt + {max_completion_tokens} completion tokens"
        if decision.retry_after_ms is None:
            message = (f"rate limit: this request needs {need} = {num_prompt_tokens + max_completion_tokens}, "
                       f"more than the {budget} tokens per minute of {who}; lower max_tokens or shorten the prompt")
        else:
            why = f" (this request reserves {need})" if decision.limit == "tokens" else ""
            message = (f"rate limit: {budget} {decision.limit} per minute for {who} exceeded{why}, "
                       f"retry after {decision.retry_after_ms} ms")
        raise RateLimited(message, decision.limit, decision.retry_after_ms)

    def release(self, charge: Charge, num_completion_tokens: int) -> None:
        """The request of ``charge`` ended having generated ``num_completion_tokens``: give back the rest."""
        if charge.charged:
            unused = charge.reserved_completion_tokens - num_completion_tokens
            self.limiter.refund(charge.principal, charge.limits, max(0, unused))


def load_limits_file(path: str, default: Limits) -> dict[str, Limits]:
    """The ``--rate-limit-file`` at ``path``: principal → :class:`Limits`, a budget not given taken from
    ``default``. ValueError names the file and the bad entry; FileNotFoundError the missing file."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--rate-limit-file not found: {path}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read --rate-limit-file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--rate-limit-file {path} must map principals to budgets, got a {type(data).__name__}")
    limits = {}
    for principal, entry in data.items():
        where = f"--rate-limit-file {path}: entry {principal!r}"
        if not isinstance(principal, str) or not principal:
            raise ValueError(f"{where}: a principal must be a non-empty string")
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with {' and/or '.join(_FILE_FIELDS)}, got {entry!r}")
        unknown = sorted(set(map(str, entry)) - set(_FILE_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; the keys are {list(_FILE_FIELDS)}")
        try:
            limits[principal] = replace(default, **entry)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return limits
