"""`LLMEngine`: the step-wise engine a server drives (`add_request`, `step`, `abort_request`).

One step is `plan = scheduler.schedule(); out = runner.run(plan); scheduler.update(plan, out)`, then
detokenization and stop strings for the requests that got a token. A prompt with `n > 1` becomes `n`
sequences whose prompt blocks are shared through the prefix cache; they are reported together.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import abc
from concurrent.futures import Executor
from typing import Any

import torch

from engine import engine_kv_transfer, request_admission
from engine.decode_graphs import enable_decode_graphs
from engine.distributed.setup import tensor_parallel
from engine.distributed.worker_group import WorkerGroupError
from engine.engine_adapters import EngineAdapters
from engine.engine_config import EngineConfig
from engine.engine_kv_transfer import PendingImport
from engine.engine_setup import (
    cpu_thread_governor,
    eos_token_ids,
    load_rank_model,
    make_lora_manager,
    num_kv_blocks,
    start_worker_group,
)
from engine.engine_stats import StepCounters, engine_stats
from engine.kv_cache import KVCacheManager
from engine.kv_cache.cache_events import CacheEvents
from engine.kv_transfer import KVExport, make_connector
from engine.lora.manager import LoRAInfo, LoRAManager, LoRAPoolStats
from engine.lora_request import LoRARequest
from engine.metrics import EngineStats
from engine.model_config import ModelConfig, dtype_reason, resolve_dtype
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request_group import RequestGroup
from engine.request_table import RequestTable
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.spec import SpecDecoder, make_spec_decoder
from engine.step_isolation import run_isolated
from engine.structured.manager import StructuredOutput
from engine.structured.masking import MaskingSampler
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
ADAPTER_WAIT_SECONDS = 0.01  # most an empty step waits for a background adapter load


class LLMEngine:
    """The step loop over its parts: set-up (engine_setup.py), admission (request_admission.py), the
    unfinished requests and their outputs (request_table.py), batch-failure isolation (step_isolation.py),
    KV transfer (engine_kv_transfer.py), adapters (engine_adapters.py) and counters (engine_stats.py)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            if config.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {config.num_threads}")
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        checkpoint = ModelConfig.from_dir(config.model)
        self.tp = tensor_parallel(config, checkpoint, self.device)  # None: one rank
        if self.tp is not None:
            # the workers stop when this engine is collected or the interpreter exits, even one whose
            # start failed past this point
            weakref.finalize(self, self.tp.group.close)
            self.tp.group.launch()  # the workers load their shards while this process loads its own
        # False (a server's engine process): a failed worker group is raised out of `step`, not restarted
        self.recover_worker_group = True
        # under tensor parallel the threads are split over the ranks, and rank 0's governor sets every
        # rank's (the workers take its count from each step's plan: engine/cpu_threads.py)
        self.thread_governor = cpu_thread_governor(config, self.device, self.tp)
        self.model_config = checkpoint.capped(config.max_model_len)  # what requests may use
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.dtype_reason = dtype_reason(config.dtype, self.model_config, self.device)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        # this rank's shapes (the KV cache's heads): the whole model's at one rank, else rank 0's shard's
        self.model, self.rank_config = load_rank_model(config, checkpoint, self.tp, self.dtype, self.device)
        self.num_kv_blocks = num_kv_blocks(
            config, self.rank_config, self.model_config, self.dtype, self.device
        )
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.kv.long_prompt_from = self.model.rope.long_from
        if config.kv_events:
            self.kv.pool.enable_events()
        self.lora: LoRAManager | None = make_lora_manager(
            config, self.model_config, self.dtype, self.device, self.model, self.tp
        )
        eos = eos_token_ids(config.model, self.model_config, self.tokenizer)
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config),
            self.kv,
            eos,
            is_resident=self.lora.is_resident if self.lora is not None else None,
        )
        self.adapters = EngineAdapters(self.lora, self.scheduler)
        self.runner = ModelRunner(
            self.model,
            self.rank_config,
            self.num_kv_blocks,
            config.block_size,
            self.dtype,
            self.device,
            config.seed,
            config.attention_backend,
            lora_context=self.lora.step_context if self.lora is not None else None,
            group=self.tp.group if self.tp is not None else None,
        )
        if self.tp is not None:
            start_worker_group(self.tp.group, self.num_kv_blocks, self.lora)
        elif config.cuda_graphs and self.device.type == "cuda":
            enable_decode_graphs(self.runner, self.lora, config.max_num_seqs)
        self.structured = StructuredOutput(self.tokenizer, self.model_config.vocab_size, eos)
        self.runner.sampler.eos_token_ids = eos
        self.runner.sampler = MaskingSampler(self.runner.sampler, self.structured.masks)  # type: ignore[assignment]
        self.spec: SpecDecoder | None = make_spec_decoder(
            config.speculative_config(),
            target=self.model_config,
            device=self.device,
            dtype=self.dtype,
            num_blocks=self.num_kv_blocks,
            block_size=config.block_size,
            attention_backend=config.attention_backend,
        )
        self.requests = RequestTable(self.scheduler.finish_request)  # the unfinished requests
        self.kv_connector = make_connector(config.kv_connector)  # prefill/decode disaggregation
        self.counters = StepCounters()

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **kwargs))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at one rank); the engine is unusable after."""
        if self.tp is not None:
            self.tp.group.close()

    @property
    def _groups(self) -> dict[str, RequestGroup]:
        """The unfinished requests by id (`self.requests.groups`; tests read it)."""
        return self.requests.groups

    # ---- requests (engine/request_admission.py, engine/engine_kv_transfer.py) ---------------------
    def tokenize(self, prompt: str | abc.Sequence[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), validating both forms."""
        return request_admission.tokenize(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | abc.Sequence[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request; raises `ValueError` if it is malformed or could never fit in the KV cache.

        `prefill_only`: once its first token is sampled, the request ends with finish reason
        "kv_transfer" and its output's `kv_export` (engine/kv_transfer) for another engine's
        `import_request`, unless that token already finished it (stop, length)."""
        request_admission.admit_request(
            self, request_id, prompt, params, lora_request, priority, arrival_time, prefill_only
        )

    def import_request(self, export: KVExport) -> bool:
        """Continue another engine's prefill-only request (`add_request(..., prefill_only=True)`): its
        state and prompt K/V (engine/kv_transfer/export_import.py). Its outputs then come from `step` as
        for any request, the transferred tokens first. Returns False when the KV pool had no room and the
        prompt is recomputed instead; raises `ValueError` for an export this engine cannot continue."""
        return engine_kv_transfer.import_request(self, export)

    def begin_import(self, export: KVExport, copier: Executor | None = None) -> PendingImport:
        """`import_request` in two halves, so the K/V copy can run in `copier` (a worker thread) while
        steps go on: reserve the blocks and start receiving; `finish_import` once `.done()`."""
        return engine_kv_transfer.begin_import(self, export, copier)

    def finish_import(self, pending: PendingImport) -> bool:
        """Queue a begun import whose blocks are filled; as `import_request` returns (or raises)."""
        return engine_kv_transfer.finish_import(self, pending)

    def _export(self, group: RequestGroup, out: RequestOutput) -> RequestOutput:
        """End prefill-only `group` after its first token: `out` with its KV export, finish "kv_transfer"."""
        return engine_kv_transfer.export_request(self, group, out)

    def release_kv_transfer(self, request_id: str) -> None:
        """The receiver has the request's blocks: end its transfer on this (sending) side."""
        self.kv_connector.release(request_id)

    def abort_request(self, request_id: str | abc.Sequence[str]) -> None:
        """Stop the request(s) now, freeing their KV blocks and adapter holds; unknown or finished ids are
        ignored."""
        self.requests.abort(request_id)
        self.adapters.retain()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- adapters (engine/engine_adapters.py) ----------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> str:
        """Validate and load an adapter into host memory now; returns its content digest."""
        return self.adapters.add(lora_request)

    def prefetch_lora(self, lora_request: LoRARequest) -> None:
        """Begin loading an adapter into host memory in the background (e.g. when it is activated)."""
        self.adapters.prefetch(lora_request)

    def remove_lora(self, name_or_digest: str, keep: abc.Set[str] = frozenset()) -> bool:
        """Forget an adapter. Requests already admitted for it finish on it first (it is dropped after the
        last one); returns whether it was known. Removing a name whose content another name (or a digest
        in `keep`) still serves only forgets the name: the shared pool entry stays resident."""
        return self.adapters.remove(name_or_digest, keep)

    def pin_lora(self, name_or_digest: str, pinned: bool = True) -> bool:
        return self.adapters.pin(name_or_digest, pinned)

    def list_loras(self) -> list[LoRAInfo]:
        return self.adapters.infos()

    def get_lora_stats(self) -> LoRAPoolStats:
        return self.adapters.stats()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return the state of every request that produced a token.

        An exception raised for one request (its sampling, its adapter, its detokenization) ends only
        that request, reported with `error` set; its KV blocks and adapter pin are released and every
        other request carries on.
        """
        t_start = time.perf_counter()
        requests = self.requests
        outputs = requests.end_all(self.adapters.failed_loads())
        outputs += requests.end_all(self.adapters.prepare())
        outputs += requests.end_all(self.adapters.refused_mixes(), refused=True)
        plan = self.scheduler.schedule()
        self.counters.steps += 1
        self.counters.last_step_tokens = plan.num_batched_tokens
        if plan.empty:
            if self.spec is not None:  # e.g. everything was aborted: the proposer's state goes too
                self.spec.proposer.retain({s.seq_id for s in self.scheduler.running})
            self.adapters.retain()
            if not outputs:
                # Nothing can run until an adapter load ends: wait for it here rather than have the
                # caller spin on empty steps, which starves the loading thread of the GIL.
                self.adapters.wait_for_loads(ADAPTER_WAIT_SECONDS)
            return outputs
        if self.thread_governor is not None:
            self.thread_governor.begin()
        self.structured.begin_step(plan)  # grammar masks are computed while the model runs
        try:
            try:
                out = self.runner.run(plan)
            except WorkerGroupError:
                raise
            except Exception:
                plan, out, failed = run_isolated(self.runner, plan, requests)
                outputs += failed
        except WorkerGroupError as exc:
            return outputs + self._group_failed(exc)
        if self.thread_governor is not None:
            self.thread_governor.end()
        if self.spec is not None:
            self.spec.observe(plan, out)
        progressed = self.scheduler.update(plan, out)
        self.counters.generation_tokens += sum(max(1, s.num_new_tokens) for s in progressed)
        for seq, error in self.structured.advance(progressed, self.scheduler.finish_request):
            gid = requests.group_id(seq)
            if gid is not None:
                outputs.append(requests.end_with_error(gid, error))
        outputs += requests.collect(progressed, self._export)
        if self.spec is not None:
            self._propose()  # its time counts toward the step's (a draft model's forwards)
            new_tokens = sum(max(1, s.num_new_tokens) for s in progressed)
            self.spec.end_step(plan.num_batched_tokens, time.perf_counter() - t_start, new_tokens)
        self.adapters.retain()
        return outputs

    def _group_failed(self, exc: WorkerGroupError) -> list[RequestOutput]:
        """A rank died or hung: end every unfinished request with a retryable error, drop the prefix cache
        (the workers' KV is gone) and restart the group; with `recover_worker_group` False, re-raise."""
        assert self.tp is not None, "only a tensor-parallel engine has a worker group"
        log.error("tensor-parallel worker group failed: %s", exc)
        if not self.recover_worker_group:
            self.tp.group.close()
            raise exc
        error = f"the engine's worker group failed ({exc}) and was restarted; retry the request"
        outputs = [self.requests.end_with_error(gid, error) for gid in list(self.requests.groups)]
        self.kv.pool.reset_prefix_cache()
        self.tp.group.restart()
        return outputs

    def _propose(self) -> None:
        """Speculative proposals for the next step; a proposer that fails only turns speculation off for
        this step (the target still decodes every sequence)."""
        assert self.spec is not None
        try:
            self.spec.propose(self.scheduler.running)
        except Exception:
            log.exception("speculative proposer failed; this step decodes without proposals")
            for seq in self.scheduler.running:
                seq.spec_token_ids = []

    # ---- observability (engine/engine_stats.py) ---------------------------------------------------
    def take_kv_events(self) -> CacheEvents | None:
        """The block hashes the prefix cache stored and evicted since the last call (a snapshot the first
        time, or after many changes), or None unless the engine was made with `kv_events=True`."""
        return self.kv.pool.take_events()

    def get_stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.kv.stats(), self.counters, self.spec)
