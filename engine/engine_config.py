"""All of the engine's settings in one validated object (the keyword arguments of `LLM`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.intmath import cdiv


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # budget for the KV cache when num_kv_blocks is None
    # CUDA: the fraction of the device's memory this engine may use in all (vLLM's meaning); the KV
    # cache gets what the model and everything else on the device leave of it. None: 90% of free memory.
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # cap on prompt + output tokens (None: the model's positions)
    tokenizer: str | None = None  # tokenizer directory (None: the model's own)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    enable_lora: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    lora_pool_pages: int | None = (
        None  # pages per projection; default: room for 2*max_loras max-rank adapters
    )
    lora_page_rank: int = 16
    # device bytes for what resident adapters keep beside their pages (modules_to_save copies, token rows,
    # embedding/LM-head LoRA, DoRA vectors; engine/lora/side_memory.py); None: as much as the pages take
    lora_side_memory_bytes: int | None = None
    # Adapter-aware admission (engine/scheduler/admission.py): requests whose adapter is in the device pool
    # are admitted ahead of those whose adapter is not, each of which is passed over in at most
    # `lora_max_bypass_steps` steps; False: plain policy order.
    lora_resident_first: bool = True
    lora_max_bypass_steps: int = 32
    lora_backend: str = "auto"  # CPU: "native" (default when a C compiler works) or "torch"; CUDA: "triton"
    lora_dtype: str = "auto"  # dtype of the adapter pool: auto (= dtype), float32, bfloat16, float16
    attention_backend: str = "auto"  # likewise
    detokenize: bool = True  # False: outputs carry token ids only (a server detokenizes elsewhere)
    num_threads: int | None = (
        None  # torch intra-op threads (None: torch's default, at most the CPUs we may use)
    )
    adaptive_threads: bool = True  # CPU: one thread while other processes take our cores (cpu_threads.py)
    seed: int = 0
    speculative: str | None = None  # None (off), "ngram" (prompt lookup) or "draft:PATH" (engine/spec/)
    num_speculative_tokens: int = 4  # k: the most tokens proposed per sequence and step (adapts down)
    packed_cpu_gemms: bool = True  # CPU float32, native bfloat16: oneDNN-prepacked weights (cpu_gemm.py)
    kv_connector: str = "host-layers"  # disaggregation: KV blocks per layer ("host": one piece); kv_transfer/
    cuda_graphs: bool = True  # CUDA: plain decode steps replay captured graphs (engine/decode_graphs.py)
    # record the block hashes the prefix cache stores and evicts, for `LLMEngine.take_kv_events` (a
    # cluster replica reports them to the router); off, nothing is recorded
    kv_events: bool = False
    # Tensor parallel (engine/distributed/): the model sharded over this many ranks (this process is
    # rank 0); on CPU each rank gets num_threads / N threads. `distributed_timeout`: seconds a step's
    # collective may wait for a rank before the group is declared failed (and restarted).
    tensor_parallel_size: int = 1
    fully_sharded_loras: bool = False
    distributed_timeout: float = 30.0
    # MoE models under tensor parallel: each rank holds only its experts, whole (vLLM's name), placed
    # `linear` (contiguous ranges) or `round_robin` (expert e on rank e % N); engine/distributed/moe_shard.py
    enable_expert_parallel: bool = False
    expert_placement: str = "linear"

    def adapter_pool_pages(self) -> int:
        """Pages per projection in the adapter pool: `lora_pool_pages`, or room for `2 * max_loras`
        adapters of `max_lora_rank`."""
        return self.lora_pool_pages or 2 * self.max_loras * cdiv(self.max_lora_rank, self.lora_page_rank)

    def check_choices(self) -> None:
        """Raise ValueError for a named choice that does not exist (dtypes, backends, device, policy),
        before anything is loaded: a server refuses bad options up front, not in its engine process."""
        from engine.attention.backend import validate_attention_backend
        from engine.lora.backend import validate_lora_backend
        from engine.model_config import check_dtype_name
        from engine.scheduler.policy import validate_policy

        check_dtype_name("dtype", self.dtype)
        check_dtype_name("lora_dtype", self.lora_dtype)
        validate_lora_backend(self.lora_backend)
        validate_attention_backend(self.attention_backend)
        self._check_device_name()
        validate_policy(self.scheduling_policy)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        self.speculative_config()
        self.check_parallel()

    def check_parallel(self) -> None:
        """ValueError for parallel settings that cannot work on this machine (before loading)."""
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        if self.expert_placement not in ("linear", "round_robin"):
            raise ValueError(f"expert_placement must be linear or round_robin, got {self.expert_placement!r}")
        if tp == 1:
            return
        device = self.resolve_device()
        if self.fully_sharded_loras and self.lora_page_rank % tp:
            raise ValueError(
                f"fully_sharded_loras splits each LoRA page's rank-rows over the ranks: lora_page_rank "
                f"{self.lora_page_rank} must be divisible by tensor_parallel_size={tp}"
            )
        if self.fully_sharded_loras and device.type == "cuda":
            raise ValueError(
                "fully_sharded_loras runs on the CPU LoRA path only (the Triton LoRA kernels read whole A "
                "pages); use the default LoRA sharding on CUDA"
            )
        if device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} CUDA devices; "
                f"this machine has {torch.cuda.device_count()}"
            )
        if device.type == "cpu":
            from engine.cpu_threads import available_cpus

            cpus = self.num_threads or available_cpus()
            if tp > cpus:
                raise ValueError(f"tensor_parallel_size={tp} is more ranks than the {cpus} CPUs to run them")

    def speculative_config(self):
        """The parsed speculative decoding settings (None: off); ValueError for bad values."""
        from engine.spec.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)

    def _check_device_name(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")

    def resolve_device(self) -> torch.device:
        """`auto` picks CUDA when available, else CPU."""
        self._check_device_name()
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available")
        return torch.device(self.device)

    def kv_budget_bytes(self, device: torch.device) -> int:
        """Memory for the KV cache: the explicit budget; on CUDA what `gpu_memory_utilization` of the
        device leaves once the model is loaded (`cuda_kv_budget`), else 90% of free device memory; on
        CPU 1 GiB (`gpu_memory_utilization` does not apply)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if self.gpu_memory_utilization is None:
                return int(free * 0.9)
            return cuda_kv_budget(free, total, self.gpu_memory_utilization)
        return 1 << 30


def cuda_kv_budget(free: int, total: int, utilization: float) -> int:
    """Bytes for the KV cache when this engine may use `utilization` of a device of `total` bytes with
    `free` still free (the model loaded): that share minus all that is in use; ValueError when nothing
    is left (the share is already taken)."""
    used = total - free
    budget = int(total * utilization) - used
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization {utilization:g} allows {total * utilization / gib:.2f} GiB of this "
            f"device's {total / gib:.2f} GiB, but {used / gib:.2f} GiB is already in use (the model and "
            "anything else on the device): raise it, or free the device"
        )
    return budget
