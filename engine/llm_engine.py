"""`LLMEngine`: the step-wise engine a server drives (`add_request`, `step`, `abort_request`).

One step is `plan = scheduler.schedule(); out = runner.run(plan); scheduler.update(plan, out)`, then
detokenization and stop strings for the requests that got a token. A prompt with `n > 1` becomes `n`
sequences whose prompt blocks are shared through the prefix cache; they are reported together.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections import abc
from pathlib import Path
from typing import Any

import msgspec
import torch

from engine.cpu_threads import ThreadGovernor, available_cpus
from engine.decode_graphs import enable_decode_graphs
from engine.distributed.setup import tensor_parallel
from engine.distributed.shard_model import load_shard
from engine.distributed.worker_group import WorkerGroup, WorkerGroupError
from engine.engine_adapters import EngineAdapters, SequenceError
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.kv_cache.cache_events import CacheEvents
from engine.kv_transfer import KV_TRANSFER_FINISH, KVExport, make_connector
from engine.kv_transfer.export_import import (
    check_layout,
    export_sequence,
    imported_sequence,
    place_blocks,
)
from engine.lora.dora import ProjectionBaseWeights
from engine.lora.manager import LoRAInfo, LoRAManager, LoRAPoolStats
from engine.lora_request import LoRARequest
from engine.metrics import EngineStats
from engine.model.loader import load_model
from engine.model_config import ModelConfig, dtype_reason, resolve_dtype, resolve_lora_dtype
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.output_processor import SequenceText
from engine.outputs import RequestOutput
from engine.request_group import RequestGroup
from engine.request_tokens import resolve_request_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.output import RunnerOutput, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.spec import SpecDecoder, make_spec_decoder
from engine.structured.manager import StructuredOutput
from engine.structured.masking import MaskingSampler
from engine.tokenizer import load_tokenizer
from kernels.intmath import cdiv

log = logging.getLogger(__name__)
ADAPTER_WAIT_SECONDS = 0.01  # most an empty step waits for a background adapter load


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            if config.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {config.num_threads}")
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        self.thread_governor = None
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
        if self.device.type == "cpu":
            if self.tp is None and config.num_threads is None:  # torch's default can exceed the CPUs
                torch.set_num_threads(min(torch.get_num_threads(), available_cpus()))
            if config.adaptive_threads and torch.get_num_threads() > 1:
                cost = self.tp.group.collective_cost if self.tp is not None else None
                self.thread_governor = ThreadGovernor(torch.get_num_threads(), overhead=cost)
        self.model_config = checkpoint.capped(config.max_model_len)  # what requests may use
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.dtype_reason = dtype_reason(config.dtype, self.model_config, self.device)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        # this rank's shapes (the KV cache's heads): the whole model's at one rank, else rank 0's shard's
        self.rank_config = self.model_config
        if self.tp is None:
            self.model = load_model(checkpoint, self.dtype, self.device)
            if config.packed_cpu_gemms:
                self.model.pack_cpu_gemms()
        else:
            self.rank_config = self.tp.shard.local_config().capped(config.max_model_len)
            self.model = load_shard(
                checkpoint,
                self.tp.shard,
                self.dtype,
                self.device,
                self.tp.group.all_reduce,
                config.packed_cpu_gemms,
            )
        self.num_kv_blocks = self._num_blocks()
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.kv.long_prompt_from = self.model.rope.long_from
        if config.kv_events:
            self.kv.pool.enable_events()
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager.create(
                self.model_config,
                resolve_lora_dtype(config.lora_dtype, self.dtype),
                self.device,
                compute_dtype=self.dtype,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras,
                num_pages=config.adapter_pool_pages(),
                page_rank=config.lora_page_rank,
                max_loras=config.max_loras,
                backend=config.lora_backend,
                side_budget=config.lora_side_memory_bytes,
                base=ProjectionBaseWeights(self.model),  # this rank's shard under tensor parallel
                shard=self.tp.shard if self.tp is not None else None,
            )
            if self.tp is not None:
                self.lora.pool.all_reduce = self.tp.group.all_reduce  # row-parallel DoRA norms
                if self.tp.shard.fully_sharded:
                    self.lora.pool.all_gather = self.tp.group.all_gather
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config),
            self.kv,
            self._eos_token_ids(),
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
            self._start_group(self.tp.group)
        elif config.cuda_graphs and self.device.type == "cuda":
            enable_decode_graphs(self.runner, self.lora, config.max_num_seqs)
        self.structured = StructuredOutput(
            self.tokenizer, self.model_config.vocab_size, self._eos_token_ids()
        )
        self.runner.sampler.eos_token_ids = self._eos_token_ids()
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
        self._groups: dict[str, RequestGroup] = {}
        self.kv_connector = make_connector(config.kv_connector)  # prefill/decode disaggregation
        self._prefill_only: set[str] = set()  # requests whose KV is exported after their first token
        self._seq_to_group: dict[str, str] = {}
        self._steps = 0
        self._last_step_tokens = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **kwargs))

    # ---- set-up helpers ---------------------------------------------------------------------------
    def _start_group(self, group: WorkerGroup) -> None:
        """Start the tensor-parallel workers with this rank's KV cache size and adapter pool."""
        group.num_kv_blocks = self.num_kv_blocks
        if self.lora is not None:
            group.lora_backend = self.lora.backend
            group.pool = self.lora.pool
            self.lora.pool.journal = []
        group.start()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at one rank); the engine is unusable after."""
        if self.tp is not None:
            self.tp.group.close()

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {cfg.num_kv_blocks}")
            return cfg.num_kv_blocks
        per_block = kv_block_bytes(self.rank_config, cfg.block_size, self.dtype)
        by_budget = cfg.kv_budget_bytes(self.device) // per_block
        enough = cfg.max_num_seqs * cdiv(self.model_config.max_model_len, cfg.block_size)
        return max(1, int(min(by_budget, enough)))

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen = Path(self.config.model) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | abc.Sequence[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), validating both forms."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files; pass prompts as lists of token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

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
        params = resolve_request_tokens(
            params or SamplingParams(), self.tokenizer, self.model_config.vocab_size
        )
        self.structured.check(params)  # compiles the grammar (cached); refuses a spec that does not compile
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        max_total = self._max_total(len(ids), params)
        if prefill_only and len(params.choices()) != 1:
            raise ValueError("a prefill-only request has one sequence (n = 1, no best_of)")
        if prefill_only and self.tp is not None:
            raise ValueError("KV transfer needs an engine of one rank (tensor_parallel_size 1)")
        lora_key, lora_keys = self.adapters.key_for(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i, choice in enumerate(params.choices()):
            gen = None
            if choice.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(choice.seed)
            seq_id = request_id if (params.best_of or params.n) == 1 else f"{request_id}#{i}"
            seqs.append(
                Sequence(seq_id, ids, choice, arrival, priority, lora_request, lora_key, gen, max_total)
            )
            seqs[-1].lora_keys = lora_keys
            self.structured.attach(seqs[-1])
        texts = [self._sequence_text(params) for _ in seqs]
        self._groups[request_id] = RequestGroup(request_id, text, ids, seqs, texts, params.n)
        for s in seqs:
            self._seq_to_group[s.seq_id] = request_id
            self.scheduler.add_request(s)
        self._prompt_tokens += len(ids)
        if prefill_only:
            self._prefill_only.add(request_id)

    def _max_total(self, prompt_len: int, params: SamplingParams) -> int:
        """The most tokens (prompt + output) a request may reach: `prompt_len + max_tokens`, capped by the
        model's context; ValueError when the prompt fills the context or the KV cache could never hold it."""
        max_len = self.model_config.max_model_len
        if prompt_len >= max_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the model's context is {max_len} tokens")
        max_total = min(prompt_len + params.max_tokens, max_len)
        if not self.kv.can_fit(self.kv.blocks_needed(max_total)):
            raise ValueError(
                f"request needs {self.kv.blocks_needed(max_total)} KV blocks for {max_total} tokens but the "
                f"cache has {self.num_kv_blocks}; lower max_tokens or raise num_kv_blocks"
            )
        return max_total

    def import_request(self, export: KVExport) -> bool:
        """Continue another engine's prefill-only request (`add_request(..., prefill_only=True)`): its
        state and prompt K/V (engine/kv_transfer/export_import.py). Its outputs then come from `step` as
        for any request, the transferred tokens first. Returns False when the KV pool had no room and the
        prompt is recomputed instead; raises `ValueError` for an export this engine cannot continue."""
        st = export.state
        if self.tp is not None:
            raise ValueError("KV transfer needs an engine of one rank (tensor_parallel_size 1)")
        check_layout(export.blocks, self.runner.kv_cache)
        params = resolve_request_tokens(st.params, self.tokenizer, self.model_config.vocab_size)
        self.structured.check(params)
        if st.request_id in self._groups:
            raise ValueError(f"request id {st.request_id!r} is already in use")
        if len(params.choices()) != 1 or not st.output_token_ids:
            raise ValueError("a KV import continues one sequence that has sampled its first token")
        _, ids = self.tokenize(st.prompt_token_ids)
        self.tokenize(st.output_token_ids)  # token ids in the vocabulary
        max_total = self._max_total(len(ids), params)
        seq = imported_sequence(self, msgspec.structs.replace(st, params=params), max_total)
        placed = place_blocks(self, seq, export, self.kv_connector)
        text = self._sequence_text(params)
        if text is not None:
            for tok in seq.output_token_ids:
                text.accept(tok, None)
            seq.text = text.text
        self._groups[st.request_id] = RequestGroup(st.request_id, None, ids, [seq], [text], 1)
        self._seq_to_group[seq.seq_id] = st.request_id
        self.scheduler.add_request(seq)
        self._prompt_tokens += len(ids)
        return placed

    def release_kv_transfer(self, request_id: str) -> None:
        """The receiver has the request's blocks: end its transfer on this (sending) side."""
        self.kv_connector.release(request_id)

    def _export(self, group: RequestGroup, out: RequestOutput) -> RequestOutput:
        """End prefill-only `group` after its first token: `out` with its KV export, finish "kv_transfer"."""
        seq = group.seqs[0]
        out.kv_export = export_sequence(self, seq, self.kv_connector)
        self.scheduler.finish_request(seq, SequenceStatus.FINISHED_ABORTED)  # its blocks stay cached here
        out.finished = True
        out.outputs[0].finish_reason = KV_TRANSFER_FINISH
        return out

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

    def _end_all(self, errors: list[SequenceError], refused: bool = False) -> list[RequestOutput]:
        """End the request of each sequence named, once, with its error (`refused`: the request's own
        fault, `RequestOutput.refused`)."""
        ended: dict[str, RequestOutput] = {}
        for seq, error in errors:
            gid = self._seq_to_group.get(seq.seq_id)
            if gid is not None and gid in self._groups and gid not in ended:
                ended[gid] = self._end_with_error(gid, error)
                ended[gid].refused = refused
        return list(ended.values())

    def _sequence_text(self, params: SamplingParams) -> SequenceText | None:
        if self.tokenizer is None or not self.config.detokenize:
            return None
        return SequenceText(self.tokenizer, params.stop, params.min_tokens)

    def abort_request(self, request_id: str | abc.Sequence[str]) -> None:
        """Stop the request(s) now, freeing their KV blocks and adapter holds; unknown or finished ids are
        ignored."""
        self._abort(request_id)
        self.adapters.retain()

    def _abort(self, request_id: str | abc.Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            self._prefill_only.discard(rid)
            if group is None:
                continue
            for seq in group.seqs:
                self._seq_to_group.pop(seq.seq_id, None)
                self.scheduler.finish_request(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return the state of every request that produced a token.

        An exception raised for one request (its sampling, its adapter, its detokenization) ends only
        that request, reported with `error` set; its KV blocks and adapter pin are released and every
        other request carries on.
        """
        t_start = time.perf_counter()
        outputs = self._end_all(self.adapters.failed_loads())
        outputs += self._end_all(self.adapters.prepare())
        outputs += self._end_all(self.adapters.refused_mixes(), refused=True)
        plan = self.scheduler.schedule()
        self._steps += 1
        self._last_step_tokens = plan.num_batched_tokens
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
                plan, out, failed = self._run_isolated(plan)
                outputs += failed
        except WorkerGroupError as exc:
            return outputs + self._group_failed(exc)
        if self.thread_governor is not None:
            self.thread_governor.end()
        if self.spec is not None:
            self.spec.observe(plan, out)
        progressed = self.scheduler.update(plan, out)
        self._generation_tokens += sum(max(1, s.num_new_tokens) for s in progressed)
        for seq, error in self.structured.advance(progressed, self.scheduler.finish_request):
            gid = self._seq_to_group.get(seq.seq_id)
            if gid is not None and gid in self._groups:
                outputs.append(self._end_with_error(gid, error))
        touched: dict[str, RequestGroup] = {}
        for seq in progressed:
            gid = self._seq_to_group.get(seq.seq_id)
            if gid is None:
                continue
            group = self._groups[gid]
            try:
                group.detokenize(seq, self.scheduler.finish_request)
            except Exception as exc:
                outputs.append(self._end_with_error(gid, f"detokenization failed: {exc!r}"))
                touched.pop(gid, None)
                continue
            touched[gid] = group
        for gid, group in touched.items():
            if gid not in self._groups:
                continue
            ro = group.output()
            if gid in self._prefill_only:
                self._prefill_only.discard(gid)
                if not ro.finished:
                    ro = self._export(group, ro)
            outputs.append(ro)
            if ro.finished:
                self._forget(gid)
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
        outputs = [self._end_with_error(gid, error) for gid in list(self._groups)]
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

    def _run_isolated(
        self, plan: SchedulerOutput
    ) -> tuple[SchedulerOutput, RunnerOutput, list[RequestOutput]]:
        """The batch raised: run each scheduled sequence alone, end those that raise again with an error,
        and return the plan and output of the ones that ran."""
        kept, sampled, spec_tokens, failed = [], [], [], []
        for item in plan.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            try:
                one = self.runner.run(SchedulerOutput([item], item.num_tokens))
            except Exception as exc:
                gid = self._seq_to_group.get(seq.seq_id)
                if gid is not None:
                    failed.append(self._end_with_error(gid, f"request failed in the engine: {exc!r}"))
                else:
                    self.scheduler.finish_request(seq, SequenceStatus.FINISHED_ABORTED)
                continue
            kept.append(item)
            sampled.append(one.sampled[0])
            spec_tokens.append(one.spec_tokens[0] if one.spec_tokens is not None else None)
        # a sequence that ran may belong to a request (n > 1) that a later failure of its sibling ended
        alive = [i for i, it in enumerate(kept) if not it.seq.is_finished]
        kept, sampled = [kept[i] for i in alive], [sampled[i] for i in alive]
        spec_tokens = [spec_tokens[i] for i in alive]
        tokens = sum(it.num_tokens for it in kept)
        return SchedulerOutput(kept, tokens, plan.preempted), RunnerOutput(sampled, spec_tokens), failed

    def _end_with_error(self, gid: str, error: str) -> RequestOutput:
        """End every sequence of group `gid` (freeing its KV blocks and adapter pin) and report `error`."""
        group = self._groups[gid]
        self._abort(gid)
        out = group.output()
        out.error = error
        return out

    def _forget(self, gid: str) -> None:
        self._prefill_only.discard(gid)
        group = self._groups.pop(gid, None)
        if group is not None:
            for s in group.seqs:
                self._seq_to_group.pop(s.seq_id, None)

    def take_kv_events(self) -> CacheEvents | None:
        """The block hashes the prefix cache stored and evicted since the last call (a snapshot the first
        time, or after many changes), or None unless the engine was made with `kv_events=True`."""
        return self.kv.pool.take_events()

    def get_stats(self) -> EngineStats:
        kv = self.kv.stats()
        stats = self._base_stats(kv)
        if self.spec is not None:
            total = self.spec.stats.total()
            stats.spec_proposed_tokens = total.proposed
            stats.spec_accepted_tokens = total.accepted
            stats.spec_verifications = total.verifications
            stats.spec_by_adapter = {
                name: [s.proposed, s.accepted, s.verifications]
                for name, s in self.spec.stats.by_adapter.items()
            }
        return stats

    def _base_stats(self, kv) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used,
            kv_blocks_cached_free=kv.num_cached_free,
            kv_blocks_free=kv.num_free,
            kv_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.stats.num_preemptions,
            last_step_tokens=self._last_step_tokens,
            num_steps=self._steps,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            running_loras=_adapter_names(self.scheduler.running),
            waiting_loras=_adapter_names(self.scheduler.waiting),
        )


def _adapter_names(requests) -> list[str]:
    """Distinct adapter names of `requests` (a weighted mix's members), sorted (the base model is left
    out)."""
    return sorted(
        {lr.name for r in requests if r.lora_request is not None for lr, _ in r.lora_request.members()}
    )
