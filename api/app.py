"""`create_app(settings)`: the FastAPI application, with the engine process and registry in its lifespan.

Start-up: open the registry (upgrading the default SQLite schema), start the engine process and wait for
it, follow the registry's events (an activated adapter is preloaded into the engine, a deactivated or
deleted one dropped) and re-read it every few seconds, then serve. Shutdown (SIGTERM via uvicorn): stop
accepting, let in-flight requests finish within uvicorn's grace period, then stop the engine and close
the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from api.admission import ClientAdmission
from api.auth import ensure_admin_token
from api.engine_client import EngineClient
from api.errors import install_error_handlers
from api.guard import RequestGuard
from api.limits.headers import RateLimitHeaders
from api.metrics import Metrics
from api.registry_lane import RegistryLane
from api.settings import ServerSettings
from api.state import AppState
from api.usage.service import UsageLimits
from engine.tokenizer import load_tokenizer
from lora_registry import open_registry
from lora_registry.follower import RegistryFollower
from lora_registry.key_cache import KeyCache
from lora_registry.schemas import ActiveAdapter

log = logging.getLogger("loraplex.server")


def create_app(settings: ServerSettings, client_factory: Callable[[Any], Any] | None = None) -> FastAPI:
    """The server's ASGI app; nothing starts until the lifespan runs. `client_factory(engine_config)`
    replaces the local engine process (`EngineClient`), e.g. by Ray Serve replicas (`api.cluster`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await _start(settings, client_factory or EngineClient)
        app.state.loraplex = state
        resync = asyncio.create_task(
            _resync_forever((state.follower, state.key_cache), settings.registry_resync_seconds)
        )
        try:
            yield
        finally:
            resync.cancel()
            state.follower.close()
            state.key_cache.close()
            await state.client.shutdown()
            if state.usage is not None:  # after the in-flight requests: writes their usage records
                await state.usage.close()
            state.registry.close()
            state.lookups.close()
            state.admin_calls.close()
            if state.schemas is not None:
                state.schemas.close()

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(RequestGuard)
    from api.routes import admin_api, chat, completions, models, responses, system, tokenize, usage_api

    for r in (
        usage_api.router,
        completions.router,
        chat.router,
        responses.router,
        tokenize.router,
        models.router,
        admin_api.router,
        admin_api.compat,
        system.router,
    ):
        app.include_router(r)
    _mount_admin_ui(app)
    return app


def _mount_admin_ui(app: FastAPI) -> None:
    try:
        from admin_ui import mount
    except ImportError:
        return
    mount(app)


async def _start(settings: ServerSettings, client_factory: Callable[[Any], Any]) -> AppState:
    reg_settings = settings.registry
    assert reg_settings is not None
    registry = await asyncio.to_thread(open_registry, reg_settings)
    admin_auth, _ = ensure_admin_token(reg_settings.data_dir, settings.admin_token)
    tokenizer = await asyncio.to_thread(load_tokenizer, settings.engine.tokenizer or settings.model)
    if settings.chat_template is not None:  # `serve --chat-template`: in place of the tokenizer's own
        if tokenizer is None:
            raise RuntimeError("--chat-template needs a tokenizer; this model has none (pass --tokenizer)")
        tokenizer.chat_template = settings.chat_template
    client = client_factory(settings.engine)
    try:
        await client.start()
    except BaseException:
        registry.close()
        raise
    info = client.info
    if info is not None:  # on uvicorn's logger, so it shows in the startup log
        logging.getLogger("uvicorn.error").info(
            "engine ready: %s, %s (%s); LoRA %s, %s pages",
            info.device, info.dtype, info.dtype_reason, info.lora_backend or "off", info.lora_dtype or "-",
        )  # fmt: skip
    loop = asyncio.get_running_loop()
    sync_locks: dict[str, asyncio.Lock] = {}

    def on_change(name: str, adapter: ActiveAdapter | None) -> None:
        # Called from the registry's thread (or a request's worker thread): hop onto the loop.
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_sync_engine(state, name, sync_locks)))

    follower = RegistryFollower(registry.adapters, registry.bus, on_change)
    admission = ClientAdmission(
        settings.client_seq_limit(),
        # behind `--replicas N` the ingress admits for every engine replica, not for one
        # (as many as the engine replicas take: `engine_capacity`, else `max_num_seqs` each)
        capacity=getattr(client, "engine_capacity", None)
        or settings.engine.max_num_seqs * getattr(client, "engine_replicas", 1),
        wait_seconds=settings.client_wait_seconds,
    )
    lookups = RegistryLane("lookup", threads=8, timeout=reg_settings.db_connect_timeout + 1.0)
    key_cache = KeyCache(registry.keys, registry.bus)
    state = AppState(
        settings, client, tokenizer, registry, follower, admin_auth, admission, key_cache, lookups,
        metrics=Metrics(per_replica=bool(getattr(client, "per_replica_metrics", False))),
    )  # fmt: skip
    for collector in getattr(client, "metric_collectors", ()):  # e.g. the cluster router's counters
        state.metrics.registry.register(collector)
    await asyncio.to_thread(follower.start)
    await asyncio.to_thread(key_cache.start)
    registry.start_outbox_relay()  # events written while the bus was down are delivered when it is back
    if follower.resyncs == 0:
        await asyncio.to_thread(follower.resync)
    if key_cache.resyncs == 0:
        await asyncio.to_thread(key_cache.resync)
    try:
        state.usage = await UsageLimits.start(
            registry, settings.usage, state.metrics.registry, reg_settings.redis_url
        )
    except BaseException:
        follower.close()
        key_cache.close()
        await client.shutdown()
        registry.close()
        raise
    return state


async def _resync_forever(followers: tuple[RegistryFollower | KeyCache, ...], every: float) -> None:
    """Re-read the active adapters and the API keys now and then, so changes made by another process on
    the same database without a shared event bus (e.g. the local CLI next to a server on SQLite) are
    picked up too."""
    while True:
        await asyncio.sleep(every)
        for follower in followers:
            try:
                await asyncio.to_thread(follower.resync)
            except Exception as exc:  # the database may be briefly unavailable; try again next time
                log.warning("registry resync failed: %s", exc)


async def _sync_engine(state: AppState, name: str, locks: dict[str, asyncio.Lock]) -> None:
    """Bring the engine in line with what the follower now says of `name`: start loading an active
    adapter into the engine's host cache in the background (the running batch never waits for it), or
    forget one that stopped being served (requests already admitted for it finish on it first).

    Syncs of one name run one at a time and read the follower's latest state, so a quick
    deactivate/activate/deactivate ends with the engine matching the last change, whatever the order in
    which the events' tasks got to run."""
    lock = locks.setdefault(name, asyncio.Lock())
    async with lock:
        await _sync_one(state, name, state.follower.snapshot().get(name))


async def _sync_one(state: AppState, name: str, adapter: ActiveAdapter | None) -> None:
    try:
        if adapter is not None:
            path = await asyncio.to_thread(state.registry.adapters.adapter_path, adapter.digest)
            await state.client.adapter_call("prefetch", name, str(path), adapter.digest)
        else:
            # Residency is per digest: content another active name serves stays in the pool.
            keep = {a.digest for a in state.follower.snapshot().values()}
            await state.client.adapter_call("remove", name, keep=keep)
    except Exception as exc:  # best effort: requests load adapters on demand anyway
        log.warning("engine adapter sync for %r failed: %s", name, exc)
