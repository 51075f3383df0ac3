"""`python -m engine.distributed`: one tensor-parallel worker process (`engine/distributed/worker.py`); its
`WorkerSpec` is the first line of stdin. Started by `WorkerGroup.start`, not by hand."""

import sys

from engine.distributed.worker import WorkerSpec, worker_main

if __name__ == "__main__":
    worker_main(WorkerSpec.from_json(sys.stdin.readline()))
