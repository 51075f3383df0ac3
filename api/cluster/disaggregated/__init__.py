"""Prefill/decode disaggregation on Ray Serve (`loraplex serve --prefill-replicas P --decode-replicas D`).

    HTTP ─► Ingress (the same FastAPI app, with a `DisaggregatedClient`)
              │ 1. prefill: AffinityRouter (prefix + adapter + load) picks a PrefillReplica
              │    ──► its engine runs the prompt with the adapter (chunked, prefix-cached), samples the
              │        first token (streamed to the client at once) and exports the prompt's KV blocks;
              │        the replica puts them in Ray's object store (`handoff.py`)
              │ 2. meanwhile: DecodeRouter (adapter residency, free KV blocks, load) picks a DecodeReplica
              │    and `prepare` makes the adapter resident there while the prefill runs
              │ 3. decode(that replica, handoff): it fetches the blocks, its engine imports them (into its
              │    own prefix cache) and decodes; tokens stream back through the ingress
              ▼
            PrefillReplica × P, DecodeReplica × D (each an `EngineReplica`: one engine process)

Faults: a prefill replica that fails before the first token is retried once elsewhere; after it, or
when the decode replica fails or the transfer stalls past `kv_transfer_timeout_s`, the request ends
with the retryable 503 / SSE error. The prefill side frees its blocks when it exports them (they stay
in its prefix cache); the decode side's are freed when its request ends or is aborted.
`decode_router.py` is Ray's extension point like `api/cluster/affinity_router.py`; the rest goes through
`api/cluster/ray_api.py`.
"""
