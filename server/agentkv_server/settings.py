"""One typed settings object for the router, ``agentkv serve`` and the benchmark.

Everything a deployment can tune lives here, grouped in small frozen value objects (timeouts,
retention, cost model) so that call sites read ``settings.timeouts.first_token_s`` rather than a
long flat list. Build it in code, from a dict with ``Settings.model_validate``, or in layers with
:func:`load_settings`: a ``--config`` file (JSON or YAML), then ``AGENTKV_*`` environment
variables (``AGENTKV_POLICY=never``, ``AGENTKV_TIMEOUTS__FIRST_TOKEN_S=300``), then command-line
options (``agentkv router``).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from agentkv_server.errors import ConfigError
from agentkv_server.wire import ENV_PREFIX

__all__ = [
    "AdmissionSettings",
    "CapacitySettings",
    "CostModelSettings",
    "FaultSettings",
    "LocalPathSettings",
    "PairSettings",
    "PolicyName",
    "RetentionSettings",
    "Settings",
    "Timeouts",
    "environment_settings",
    "load_settings",
    "read_config_file",
]

logger = logging.getLogger(__name__)

PolicyName = Literal["agentkv", "upstream", "upstream-best", "never", "always"]
"""``agentkv``: cost model + client hints; ``upstream``: imitates vLLM's example proxy;
``upstream-best``: that proxy once streamed turns report their holdings; ``never``: always
recompute (the benchmark's baseline)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Timeouts(_Frozen):
    """Seconds allowed for a turn and for each call to an engine.

    Only what an engine does blames it (a connect refused or not answered in ``connect_s``, a
    dropped connection, no progress: ``faults``). A turn that runs out of ``first_token_s``
    while its engines are busy ends with 504 ``turn_timeout``; no engine is marked down and
    the turn is not repeated elsewhere (docs/faults.md, "Busy is not dead")."""

    connect_s: float = Field(2.0, gt=0, description="TCP connect to an engine")
    pool_s: float = Field(
        10.0,
        gt=0,
        description="a step's wait for a free connection to its engine (max_connections, "
        "max_connections_per_engine), within the step's own timeout; past it the step fails "
        "as the router's own failure, never the engine's",
    )
    first_token_s: float = Field(
        600.0,
        gt=0,
        description="a turn's deadline from its arrival to its first token (its wait in the "
        "router's queue and its prefill step included; a non-streamed turn: until its decode "
        "step starts); past it the turn ends with 504 turn_timeout, no engine blamed",
    )
    pull_s: float = Field(
        30.0,
        gt=0,
        description="a prefill step that pulls held KV while its engine makes no progress this "
        "long counts as stalled, and P recomputes (a holder dying mid-transfer can leave the "
        "step waiting); a P busy with other prompts is waited for",
    )
    decode_s: float = Field(600.0, gt=0, description="whole decode step, streaming included")
    health_s: float = Field(2.0, gt=0, description="one GET /health probe")
    release_s: float = Field(5.0, gt=0, description="a release request to a decode engine")
    store_s: float = Field(
        0.5, gt=0, description="one session-store (Redis) call; past it the turn recomputes"
    )
    tokenize_s: float = Field(
        1.0,
        gt=0,
        description="the holder's POST /tokenize that counts a turn's new tokens; past it "
        "the turn is planned without the local path",
    )
    report_s: float = Field(
        0.5,
        ge=0,
        description="how long a streamed turn's end ([DONE]) waits for the decode engine's "
        "holding report, so that the client's next turn finds the holding",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """``prefill_s`` (a prefill step's own deadline, which marked a busy P down) is read
        as ``first_token_s``: the bound its users meant, now on the whole turn."""
        if isinstance(data, Mapping) and "prefill_s" in data:
            data = dict(data)
            prefill_s = data.pop("prefill_s")
            data.setdefault("first_token_s", prefill_s)
            logger.warning(
                "timeouts.prefill_s is deprecated: read as timeouts.first_token_s, which bounds "
                "the whole turn (docs/faults.md, 'Busy is not dead')"
            )
        return data


class FaultSettings(_Frozen):
    """How fast the router notices a dead or hung engine (docs/faults.md).

    Before a pull is planned, the holder must have answered within ``liveness_cache_s`` or
    answer ``GET /health`` within ``liveness_timeout_s``: a holder that cannot answer means a
    recompute, never a pull P would wait on. While an engine step runs, the router reads the
    engine's progress (``GET /metrics``: its token counters and the gauges vLLM updates at every
    engine step) every ``progress_every_s``; the step is hung when ``unanswered_probes`` reads in
    a row get no answer (a frozen or dead engine) or none of them moves for ``stall_s`` (a
    blocked engine core). A queue is not a stall: an engine busy with other steps moves them. A stream already passed on that
    is silent for ``progress_every_s`` asks ``GET /health`` (``liveness_timeout_s`` each), and
    ``unanswered_probes`` unanswered in a row end it (it is then continued elsewhere). A hung
    step is aborted (its connection closed, which aborts the request in vLLM), the engine is
    suspect (no new work until a health probe passes) and the turn is served elsewhere.
    """

    liveness_timeout_s: float = Field(0.5, gt=0, description="a holder's GET /health before a pull")
    liveness_cache_s: float = Field(
        0.2, ge=0, description="an engine that answered this recently is not probed"
    )
    progress_every_s: float = Field(2.0, gt=0, description="progress reads while a step runs")
    unanswered_probes: int = Field(
        2,
        ge=1,
        description="progress reads (or a silent stream's health probes) in a row without "
        "answer that make a step hung",
    )
    stall_s: float = Field(
        60.0,
        gt=0,
        description="no engine step seen this long (its progress series all flat) makes a "
        "step stalled; longer than any one engine step (vLLM computes a long prompt in chunks, "
        "each a step that moves its KV cache usage)",
    )
    stream_resumes: int = Field(
        2,
        ge=0,
        description="times one streamed answer whose decode engine broke after its first chunk "
        "is continued on another decode engine (0: such a stream just ends)",
    )


class RetentionSettings(_Frozen):
    """How long decode engines keep a finished turn's KV for the session's next turn.

    Asked retention = clamp(next_turn_seconds * factor + slack_s, min_s, max_s); ``default_s``
    when the client gave no prediction (and as the holding's expiry when the engine does not
    report ``agentkv_expires_in_seconds``).
    """

    factor: float = Field(2.0, ge=1.0)
    slack_s: float = Field(
        60.0,
        ge=0,
        description="added to every hinted retention: a pull queued behind other prompts on a "
        "busy prefill engine must still find its blocks (memory is the capacity budget's job)",
    )
    min_s: float = Field(5.0, ge=0)
    max_s: float = Field(600.0, gt=0)
    default_s: float = Field(120.0, ge=0)
    safety_margin_s: float = Field(
        2.0, ge=0, description="subtracted from the engine's expiry: never pull what is leaving"
    )

    @model_validator(mode="after")
    def _ordered(self) -> RetentionSettings:
        if self.min_s > self.max_s:
            raise ValueError("retention min_s must not exceed max_s")
        return self


class CapacitySettings(_Frozen):
    """How much of each decode engine's KV retained holdings may occupy (docs/router.md,
    "Capacity").

    Each decode engine's capacity is learned from its connector's holding params
    (``agentkv_kv_cache_tokens``), or ``engine_tokens`` for engines that do not report it.
    Holdings may fill ``retained_fraction`` of it; the rest is for the turns running there, and a
    decode step that would not fit beside the holdings makes the least valuable ones go first. A
    holding with no turn for ``abandon_factor`` times its client-hinted gap plus ``abandon_slack_s``
    is abandoned: the first to go when room is needed.
    """

    enabled: bool = Field(True, description="False: holdings are bounded by their expiry only")
    retained_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="share of a decode engine's KV that holdings may occupy; the rest is kept "
        "for live turns (each needs room for its whole context)",
    )
    engine_tokens: int | None = Field(
        None, gt=0, description="KV capacity of engines that do not report theirs, in tokens"
    )
    abandon_factor: float = Field(
        10.0, ge=1, description="times the client-hinted gap (tool gaps are heavy-tailed)"
    )
    abandon_slack_s: float = Field(30.0, ge=0, description="added to the abandon threshold")
    sweep_s: float = Field(
        1.0, gt=0, description="how often holdings whose retention ran out are forgotten"
    )


class CostModelSettings(_Frozen):
    """Starting rates of the reuse-vs-recompute model; the router refines them as it measures."""

    prefill_tokens_per_s: float = Field(2000.0, gt=0, description="initial recompute rate")
    pull_tokens_per_s: float = Field(50000.0, gt=0, description="initial KV pull rate")
    pull_overhead_s: float = Field(
        0.05, ge=0, description="fixed cost of a pull (handshake, notification)"
    )
    ewma_alpha: float = Field(0.2, gt=0, le=1, description="weight of each new measurement")
    min_sample_tokens: int = Field(32, ge=1, description="smaller steps are too noisy to learn")
    expiry_guard_s: float = Field(
        1.0, ge=0, description="reuse only if the holding outlives the predicted pull by this"
    )


class LocalPathSettings(_Frozen):
    """When a turn may continue on its decode holder (docs/router.md, "Three paths").

    While the holder decodes other sequences, a local prefill enters its batch ``slice_tokens``
    at a time (the bundle starts decode engines with vLLM's ``--long-prefill-token-threshold``
    set to it), so each of their steps is slowed by one slice, not by the whole prefill. The
    local path is taken only when it is predicted fastest, the new part is at most
    ``max_new_tokens`` (longer parts go to a prefill engine whatever the load), and, while the
    holder decodes others, one slice adds at most ``max_stall_s`` to their inter-token delay
    and at most ``max_slowed_share`` of the holder's recent gaps run beside a local prefill.
    """

    enabled: bool = Field(
        True, description="False: never prefill on decode engines (pull or recompute only)"
    )
    max_new_tokens: int = Field(512, ge=0, description="longest new part computed on the holder")
    max_stall_s: float = Field(
        0.2,
        ge=0,
        description="the TPOT budget: largest inter-token delay a local prefill may add to each "
        "decode step of the holder's running sequences",
    )
    max_slowed_share: float = Field(
        0.005,
        ge=0,
        le=1,
        description="the TPOT tail budget: largest share of a holder's recent decode gaps "
        "(all seen, up to its last 2000) that may run beside a local prefill; a p99 moves only "
        "past 1 %",
    )
    slice_tokens: int = Field(
        64,
        ge=0,
        description="tokens of a local prefill per decode step while the holder decodes others "
        "(decode engines' --long-prefill-token-threshold); 0: the whole new part in one step",
    )

    def decode_engine_args(self) -> tuple[str, ...]:
        """vLLM options that make decode engines slice prefills as the router prices them."""
        if self.slice_tokens == 0:
            return ()
        return ("--long-prefill-token-threshold", str(self.slice_tokens))


class PairSettings(_Frozen):
    """How long a prefill/decode pair whose KV transfer failed is avoided (docs/router.md,
    "Pair health").

    A pair whose last transfer failed (the engine's ``agentkv_kv_load: failed``) is bad: a P/D
    turn goes over it only when no healthy engine forms a good pair with the turn's other
    engine. ``retry_s`` after the failure one turn tests it again; each failure in a row doubles
    that wait, up to ``max_retry_s``. One good transfer makes the pair good at once.
    """

    retry_s: float = Field(
        10.0, gt=0, description="wait after a pair's first failure before a turn tests it again"
    )
    max_retry_s: float = Field(
        160.0, gt=0, description="longest wait, however many failures in a row"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PairSettings:
        if self.retry_s > self.max_retry_s:
            raise ValueError("pairs retry_s must not exceed max_retry_s")
        return self


class AdmissionSettings(_Frozen):
    """How turns wait for prefill engines, and when they are refused (docs/router.md,
    "Admission").

    Each prefill engine is sent work while what it already has is predicted to take at most
    ``prefill_queue_s`` more; the rest waits in the router, where follow-ups of running sessions
    go before new sessions' first turns and tenants take turns. A turn predicted to wait longer
    than ``max_wait_s`` is refused as it arrives: 503 with ``Retry-After``. Prefill engines
    that ``agentkv serve`` starts compute at most ``prefill_step_tokens`` a step, so that what
    the router sends ahead waits one step, not a whole long prompt.
    """

    enabled: bool = Field(
        True, description="False: every turn goes to its prefill engine at once, none refused"
    )
    max_wait_s: float = Field(
        300.0,
        gt=0,
        description="the longest predicted wait for a prefill engine a turn is accepted with "
        "(a TTFT objective); beyond it the turn is refused at once with 503 and Retry-After",
    )
    prefill_queue_s: float = Field(
        2.0,
        ge=0,
        description="predicted seconds of work a prefill engine may have beyond a new step "
        "before the router holds new steps back (its queue is first-come first-served; the "
        "router's is by priority)",
    )
    prefill_step_tokens: int = Field(
        512,
        ge=0,
        description="tokens of one prefill engine step (prefill engines' --max-num-batched-"
        "tokens; a long prompt shares each step with the others, half of it at most): a "
        "follow-up sent to a busy prefill engine waits for the step it is computing, no more; "
        "0: the engine's default",
    )

    def prefill_engine_args(self) -> tuple[str, ...]:
        """vLLM options that bound what a turn sent to a prefill engine waits for there."""
        if self.prefill_step_tokens == 0:
            return ()
        return (
            "--max-num-batched-tokens",
            str(self.prefill_step_tokens),
            "--long-prefill-token-threshold",
            str(max(self.prefill_step_tokens // 2, 1)),
        )


class Settings(_Frozen):
    """Configuration of one router (and of the engines ``agentkv serve`` starts for it)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = Field(..., min_length=1)
    redis_url: str | None = Field(None, description="shared session store; memory when unset")
    redis_prefix: str = "agentkv:"
    policy: PolicyName = "agentkv"
    secret: SecretStr = Field(
        default_factory=lambda: SecretStr(secrets.token_urlsafe(24)),
        description="shared with decode engines' connectors for the holdings report endpoint",
    )
    api_keys: tuple[SecretStr, ...] = Field(
        (), description="clients' keys (Authorization: Bearer); none: no authentication"
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    max_json_depth: int = Field(
        128,
        ge=2,
        # orjson writes at most 254 levels, and the router adds a few to what it forwards
        # (kv_transfer_params): every body it accepts it can write again, on the fast path.
        le=200,
        description="nesting of a request body's JSON (objects and arrays): 400 beyond",
    )
    max_header_count: int = Field(100, gt=0, description="request headers per request")
    max_header_bytes: int = Field(
        16 * 1024, gt=0, description="request line target plus all header names and values"
    )
    max_sessions: int = Field(100_000, gt=0, description="bound of the session index (LRU)")
    max_connections: int = Field(
        1000, gt=0, description="connections to engines in use at once, all engines together"
    )
    max_connections_per_engine: int = Field(
        500,
        gt=0,
        description="connections in use to any one engine: a slow engine's streams leave the "
        "rest of the pool to the others",
    )
    decode_attempts: int = Field(2, ge=1, description="decode engines tried before giving up")
    health_interval_s: float = Field(5.0, gt=0)
    store_retry_s: float = Field(
        5.0, gt=0, description="after a session-store failure, recompute without it this long"
    )
    timeouts: Timeouts = Timeouts()
    faults: FaultSettings = FaultSettings()
    retention: RetentionSettings = RetentionSettings()
    cost: CostModelSettings = CostModelSettings()
    local: LocalPathSettings = LocalPathSettings()
    pairs: PairSettings = PairSettings()
    capacity: CapacitySettings = CapacitySettings()
    admission: AdmissionSettings = AdmissionSettings()

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        if any(len(key.get_secret_value()) < 16 for key in keys):
            raise ValueError("API keys must be at least 16 characters long")
        return keys

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _check_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://: {url!r}")
        return tuple(url.rstrip("/") for url in urls)


_LIST_FIELDS = frozenset({"prefill_urls", "decode_urls", "api_keys"})


class _Environment(EnvSettingsSource):
    """``AGENTKV_*`` variables; list fields also as comma-separated text (``a,b``)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if field_name in _LIST_FIELDS and not str(value).lstrip().startswith("["):
            return [part.strip() for part in str(value).split(",") if part.strip()]
        return super().decode_complex_value(field_name, field, value)


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings that ``AGENTKV_*`` variables of ``environ`` (default: this process's) set."""
    source = _Environment(
        Settings, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False
    )
    if environ is not None:
        source.env_vars = {key.lower(): value for key, value in environ.items()}
    try:
        return source()
    except SettingsError as exc:
        raise ConfigError(f"environment: {exc}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """A ``--config`` file: a JSON or YAML mapping of Settings fields."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid JSON: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        reason = getattr(exc, "problem", None) or "cannot parse"
        raise ConfigError(f"config file {path}: not valid YAML: {reason}{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {data!r:.40}")
    return data


def load_settings(*layers: Mapping[str, Any], source: str = "settings") -> Settings:
    """Settings from ``layers``, each overriding the ones before it (groups merge by field);
    ConfigError naming every bad field, on one line."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = _merge(merged, layer)
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'settings'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None


def _merge(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged
