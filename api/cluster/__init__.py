"""Scale-out on Ray Serve (`loraplex serve --replicas N`): design doc decision 9.

    HTTP ─► Ingress deployment (the same FastAPI app as `loraplex serve`, with a `RemoteEngineClient`)
              │  DeploymentHandle, streaming; AffinityRouter (default) or multiplexing picks the replica
              ▼
            EngineReplica deployment × N (each owns one engine process through `EngineClient`;
            its `@multiplexed` loader makes the adapter resident in *its* pool)

`--router affinity` (default): `AffinityRouter` scores each replica by predicted prefix hit (the engine's
block hash keyed by the adapter digest), adapter residency and load; `--router multiplex`: Ray's router
sends a request to a replica that already holds its multiplexed id (the adapter's digest). Every replica opens
the registry itself (shared PostgreSQL, blobs in the database or on a shared disk, Redis events) and
follows it, so a deactivated adapter is refused everywhere. `ray_api.py` is the only module that imports
Ray, besides `affinity_router.py`, Ray's extension point (imported by Serve only); everything else here,
the router's score included (`router_score.py`), is plain Python.
"""
