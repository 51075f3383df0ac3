"""The routers the cluster benchmark compares, by name, each as loraplex deploys it.

* `pow2`: Ray Serve's default router (power of two choices on queue length); requests carry no
  multiplexed model id, so nothing but load decides.
* `multiplex`: `serve --router multiplex`, Serve's multiplexing: each adapter request carries its
  adapter's content digest as multiplexed model id, and Serve prefers replicas whose LRU holds it.
* `ray-prefix`: Ray's `PrefixCacheAffinityRouter` (the prefix tree of Ray Serve LLM) at its defaults,
  with the adapter's digest as multiplexed model id as Ray Serve LLM sends LoRA requests. Its public
  import (`ray.serve.llm.request_router`) pulls in `ray[llm]` (pyarrow and more); the class itself
  imports from `ray.llm._internal...` without vLLM. It reads the prompt text from a `prompt` or
  `messages` attribute of the call's argument, which loraplex's `generate(payload)` does not have, so
  `RayPrefixRouter` gives it the prompt's token ids as text (one character per token) and changes
  nothing else.
* `affinity`: `serve --router affinity` (the default): loraplex's `AffinityRouter`, deployed by
  `api.cluster.deployments.engine_deployment` exactly as `loraplex serve` does, so the benchmark measures
  whatever that router is at this commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RAY_PREFIX_CLASS = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
ROUTERS = ("pow2", "multiplex", "ray-prefix", "affinity")


@dataclass(frozen=True, slots=True)
class RouterPlan:
    """How to deploy and call the engine deployment for one router."""

    name: str
    cluster_router: str  # `ClusterOptions.router` the engine deployment is built with
    model_id: bool  # requests carry the adapter digest as Serve's multiplexed model id
    router_class: str | None = None  # a `RequestRouterConfig` class path in place of the built one


def plan(name: str) -> RouterPlan:
    """The plan for router `name` (one of `ROUTERS`)."""
    plans = {
        "pow2": RouterPlan("pow2", "multiplex", model_id=False),
        "multiplex": RouterPlan("multiplex", "multiplex", model_id=True),
        "ray-prefix": RouterPlan(
            "ray-prefix", "multiplex", model_id=True, router_class="bench.cluster.routers.RayPrefixRouter"
        ),
        "affinity": RouterPlan("affinity", "affinity", model_id=False),
    }
    if name not in plans:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    return plans[name]


def ray_prefix_router_status() -> str | None:
    """None when Ray's `PrefixCacheAffinityRouter` imports here; else why not (one line)."""
    try:
        import importlib

        importlib.import_module(RAY_PREFIX_CLASS)
    except Exception as exc:  # ImportError, or whatever its imports raise
        return f"Ray's PrefixCacheAffinityRouter does not import without ray[llm]/vLLM: {exc}"
    return None


def router_config(router_class: str) -> Any:
    """Serve's `RequestRouterConfig` for `router_class` (replica stats every second, as loraplex's)."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=router_class,
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )


def _ray_prefix_base() -> type:
    import importlib

    return importlib.import_module(RAY_PREFIX_CLASS).PrefixCacheAffinityRouter  # type: ignore[no-any-return]


def _prompt_text(pending_request: Any) -> str:
    """The prompt of a `generate(payload)` call as text: one character per token id."""
    from api.engine_protocol import AddRequest, decode_to_engine

    payload = pending_request.args[0] if pending_request.args else None
    try:
        req = decode_to_engine(payload) if isinstance(payload, bytes) else None
    except Exception:
        req = None
    if not isinstance(req, AddRequest) or not req.prompt_token_ids:
        return "?"  # another call: one character, so that the router's match rate stays defined
    return "".join(chr(0x100 + t) for t in req.prompt_token_ids)


def __getattr__(name: str) -> Any:
    """`RayPrefixRouter`, built on first use: importing this module must not import Ray."""
    if name != "RayPrefixRouter":
        raise AttributeError(name)

    class RayPrefixRouter(_ray_prefix_base()):  # type: ignore[misc]
        """Ray's `PrefixCacheAffinityRouter`, reading loraplex's engine requests (see the module doc)."""

        def _extract_text_from_request(self, pending_request: Any) -> str:
            return _prompt_text(pending_request)

    RayPrefixRouter.__module__ = __name__
    RayPrefixRouter.__qualname__ = "RayPrefixRouter"
    globals()["RayPrefixRouter"] = RayPrefixRouter
    return RayPrefixRouter
