"""Scale-out on Ray Serve (`loraplex serve --replicas N`): design doc decision 9.

    HTTP ─► Ingress deployment (the same FastAPI app as `loraplex serve`, with a `RemoteEngineClient`)
              │  DeploymentHandle, streaming, multiplexed_model_id = adapter content digest
              ▼
            EngineReplica deployment × N (each owns one engine process through `EngineClient`;
            its `@multiplexed` loader makes the adapter resident in *its* pool)

Ray's router sends a request to a replica that already holds its multiplexed id. Every replica opens
the registry itself (shared PostgreSQL, blobs in the database or on a shared disk, Redis events) and
follows it, so a deactivated adapter is refused everywhere. `ray_api.py` is the only module that imports
Ray; everything else here is plain Python.
"""
