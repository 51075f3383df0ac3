"""Prefill/decode disaggregation inside the engine: a prefill-only request exports its prompt's KV blocks
and the state needed to continue it; another engine imports both and decodes (design doc decision 9).

- `connector.py`: the `KVConnector` interface (send these blocks / receive into fresh blocks / release)
  and the plain-data `KVBlocks` it hands between the two sides;
- `host_copy.py`: `HostCopyConnector`, which copies blocks to host bytes (one piece or per layer) for
  a transport that moves bytes (Ray's object store in `api/cluster/disaggregated/`);
- `shm_stage.py`: `ShmStageConnector` ("shm"), blocks staged in a /dev/shm file that the receiving engine
  on the same host reads straight into its blocks (the decode replica's hop to its engine);
- `state.py`: `TransferState`, the request's continuation (tokens, sampler seed state, logprobs);
- `export_import.py`: what `LLMEngine` does at each end.
"""

from engine.kv_transfer.connector import KVBlocks, KVConnector, KVLayout, make_connector
from engine.kv_transfer.state import KV_TRANSFER_FINISH, KVExport, TransferState

__all__ = [
    "KV_TRANSFER_FINISH",
    "KVBlocks",
    "KVConnector",
    "KVExport",
    "KVLayout",
    "TransferState",
    "make_connector",
]
