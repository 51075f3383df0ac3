"""`loraplex serve MODEL` (or `--model MODEL`): the OpenAI-compatible server, admin API and admin UI.

`vllm serve`'s flags mean here what they mean there (README, "Coming from vLLM"); those that are not
engine settings are read by `api.cli.vllm_flags`. The options are declared in `api.cli.serve_flags`
(server and engine) and `api.cli.serve_cluster_flags` (Ray Serve).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from api.cli import serve_cluster_flags as cluster_flags
from api.cli import serve_flags as flags
from api.cli.output import fail, stderr
from api.cluster.options import (
    CONTRACT_AFTER_S,
    HOLD_MARGIN,
    KV_TRANSFER_TIMEOUT_S,
    MAX_SPREAD,
    SPREAD_LOAD,
    W_ADAPTER,
    W_LOAD,
    W_PREFIX,
    RouterQueue,
    RouterWeights,
    SpreadPolicy,
)
from lora_registry.errors import RegistryError

MIN_ADMIN_TOKEN_CHARS = 16


def serve(
    model_arg: Annotated[
        Path | None,
        typer.Argument(
            metavar="MODEL", help="The base model, as --model (vLLM's positional form).", show_default=False
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            envvar="LORAPLEX_MODEL",
            help="Base model: a local HF directory, or a llama.cpp .gguf file (dequantized at load).",
        ),
    ] = None,
    host: flags.Host = "127.0.0.1",
    port: flags.Port = 8000,
    device: flags.Device = None,
    dtype: flags.Dtype = None,
    served_model_name: flags.ServedModelName = None,
    require_api_key: flags.RequireApiKey = False,
    api_key: flags.ApiKey = None,
    lora_modules: flags.LoraModules = None,
    enable_lora: flags.EnableLora = False,
    max_cpu_loras: flags.MaxCpuLoras = None,
    max_model_len: flags.MaxModelLen = None,
    gpu_memory_utilization: flags.GpuMemoryUtilization = None,
    enable_prefix_caching: flags.EnablePrefixCaching = None,
    chat_template: flags.ChatTemplate = None,
    tokenizer: flags.Tokenizer = None,
    seed: flags.Seed = None,
    max_num_batched_tokens: flags.MaxNumBatchedTokens = None,
    enable_auto_tool_choice: flags.EnableAutoToolChoice = False,
    tool_call_parser: flags.ToolCallParser = None,
    max_seqs_per_client: flags.MaxSeqsPerClient = None,
    max_loras: flags.MaxLoras = None,
    max_lora_rank: flags.MaxLoraRank = None,
    max_num_seqs: flags.MaxNumSeqs = None,
    num_kv_blocks: flags.NumKvBlocks = None,
    threads: flags.Threads = None,
    lora_backend: flags.LoraBackend = None,
    lora_dtype: flags.LoraDtype = None,
    speculative: flags.Speculative = None,
    num_speculative_tokens: flags.NumSpeculativeTokens = None,
    cuda_graphs: flags.CudaGraphs = None,
    tensor_parallel_size: flags.TensorParallelSize = None,
    fully_sharded_loras: flags.FullyShardedLoras = None,
    enable_expert_parallel: flags.EnableExpertParallel = None,
    expert_placement: flags.ExpertPlacement = None,
    log_level: flags.LogLevel = "info",
    shutdown_grace: flags.ShutdownGrace = None,
    replicas: cluster_flags.Replicas = None,
    min_replicas: cluster_flags.MinReplicas = None,
    max_replicas: cluster_flags.MaxReplicas = None,
    target_ongoing_requests: cluster_flags.TargetOngoingRequests = None,
    prefill_replicas: cluster_flags.PrefillReplicas = None,
    decode_replicas: cluster_flags.DecodeReplicas = None,
    kv_transfer_timeout: cluster_flags.KvTransferTimeout = None,
    local_prefill_tokens: cluster_flags.LocalPrefillTokens = 0,
    ray_address: cluster_flags.RayAddress = None,
    ray_num_cpus: cluster_flags.RayNumCpus = None,
    cpus_per_replica: cluster_flags.CpusPerReplica = 0.0,
    gpus_per_replica: cluster_flags.GpusPerReplica = 0.0,
    ingress_replicas: cluster_flags.IngressReplicas = 1,
    wait_for_nodes: cluster_flags.WaitForNodes = False,
    router: cluster_flags.Router = "affinity",
    router_w_prefix: cluster_flags.RouterWPrefix = W_PREFIX,
    router_w_adapter: cluster_flags.RouterWAdapter = W_ADAPTER,
    router_w_load: cluster_flags.RouterWLoad = W_LOAD,
    router_spread_load: cluster_flags.RouterSpreadLoad = SPREAD_LOAD,
    router_max_spread: cluster_flags.RouterMaxSpread = MAX_SPREAD,
    router_contract_after: cluster_flags.RouterContractAfter = CONTRACT_AFTER_S,
    router_max_ongoing: cluster_flags.RouterMaxOngoing = None,
    router_hold_margin: cluster_flags.RouterHoldMargin = HOLD_MARGIN,
) -> None:
    """Start the server: one resident base model, every active adapter of the registry.

    Engine options left out take `EngineConfig`'s defaults (the one place they are written)."""
    from api.auth import ensure_admin_token, store_admin_token
    from api.cli import vllm_flags
    from api.server import PortUnavailable, bind_socket
    from api.server import serve as run
    from api.settings import ServerSettings

    if model_arg is not None and model is not None and model_arg != model:
        fail(f"two base models: {model_arg} (positional) and --model {model}; give one")
    model = model_arg or model
    if model is None:
        fail("no base model: pass MODEL (or --model MODEL), or set LORAPLEX_MODEL")
    from engine.model_config import ModelConfig

    try:  # reads config.json (or a GGUF file's header) only: bad models fail here, not in the engine
        checkpoint = ModelConfig.from_dir(model).capped(max_model_len)
        if tensor_parallel_size is not None and tensor_parallel_size > 1:
            from engine.distributed.shard import check_tensor_parallel

            check_tensor_parallel(checkpoint, tensor_parallel_size, bool(enable_expert_parallel))
        if expert_placement is not None and expert_placement not in ("linear", "round_robin"):
            raise ValueError(f"--expert-placement must be linear or round_robin, got {expert_placement!r}")
        modules = vllm_flags.parse_lora_modules(lora_modules or [])
        template = None if chat_template is None else vllm_flags.read_chat_template(chat_template)
        if tool_call_parser is not None:
            vllm_flags.check_tool_call_parser(tool_call_parser)
        _check_tokenizer(model, tokenizer, template)
    except ValueError as exc:  # ModelConfigError is one
        fail(str(exc))
    try:
        settings = ServerSettings.build(
            str(model),
            host=host,
            port=port,
            served_model_name=served_model_name,
            require_api_key=require_api_key,
            api_key=api_key or None,
            chat_template=template,
            max_seqs_per_client=max_seqs_per_client,
            shutdown_grace_seconds=shutdown_grace,
            engine_kwargs=engine_options(
                device=device,
                dtype=dtype,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_num_seqs=max_num_seqs,
                num_kv_blocks=num_kv_blocks,
                num_threads=threads,
                lora_backend=lora_backend,
                lora_dtype=lora_dtype,
                speculative=speculative,
                num_speculative_tokens=num_speculative_tokens,
                cuda_graphs=cuda_graphs,
                max_cpu_loras=max_cpu_loras,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                tokenizer=None if tokenizer is None else str(tokenizer.expanduser().absolute()),
                seed=seed,
                max_num_batched_tokens=max_num_batched_tokens,
                tensor_parallel_size=tensor_parallel_size,
                fully_sharded_loras=fully_sharded_loras,
                enable_expert_parallel=enable_expert_parallel,
                expert_placement=expert_placement,
            ),
        )
    except ValueError as exc:
        fail(str(exc))
    assert settings.registry is not None
    if settings.admin_token is not None and len(settings.admin_token) < MIN_ADMIN_TOKEN_CHARS:
        fail(
            f"LORAPLEX_ADMIN_TOKEN has {len(settings.admin_token)} characters; an admin token needs at "
            f"least {MIN_ADMIN_TOKEN_CHARS} (make one: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'), or unset it to have one generated"
        )
    try:  # before anything loads: a port in use fails now, not after the model has loaded
        sock = bind_socket(host, port)
    except PortUnavailable as exc:
        fail(str(exc))
    scaling_flags = (max_replicas, min_replicas, target_ongoing_requests)
    disaggregated = prefill_replicas is not None or decode_replicas is not None
    problem = _cluster_flags_problem(
        replicas, scaling_flags, prefill_replicas, decode_replicas, local_prefill_tokens, kv_transfer_timeout
    )
    if problem is not None:
        sock.close()
        fail(problem)
    cluster = replicas is not None or disaggregated or any(v is not None for v in scaling_flags)
    if cluster:  # each scaling flag alone: refused later
        sock.close()  # Ray Serve's proxy listens itself: this was only the check
    if modules:  # before the server starts, so that it serves them from its first request
        try:
            for line in vllm_flags.register_lora_modules(settings.registry, modules):
                stderr().print(f"  LoRA module  {line}", highlight=False)
        except (vllm_flags.LoraModuleError, RegistryError) as exc:
            sock.close()
            fail(str(exc))
    data_dir = settings.registry.data_dir
    # A token generated now is served from memory and stored (and shown) only once the server is serving.
    _, generated = ensure_admin_token(data_dir, settings.admin_token, store=False)
    if generated:
        settings.admin_token = generated
    err = stderr()

    def on_serving() -> None:
        if generated:
            store_admin_token(data_dir, generated)
            err.print(f"  Admin token  [bold yellow]{generated}[/]  (shown once; stored hashed)")

    def on_stopped() -> None:
        err.print("loraplex stopped")

    base = f"http://{host}:{port}"
    err.print(f"[bold]loraplex[/] serving [cyan]{settings.served_model_name}[/] from {model}")
    err.print(f"  OpenAI API   {base}/v1   (per adapter: {base}/v1/adapters/<name>)")
    err.print(f"  Admin UI     {base}/admin")
    err.print(f"  Metrics      {base}/metrics")
    if generated:
        err.print("  Admin token  generated; shown here once the server is serving")
    elif settings.admin_token is None:
        err.print("  Admin token  set earlier (stored hashed); set LORAPLEX_ADMIN_TOKEN to choose one")
    if cluster:
        from api.cluster.options import ClusterOptions

        layout = ClusterOptions(
            replicas or min_replicas or (0 if disaggregated else 1),
            ray_address,
            ray_num_cpus,
            cpus_per_replica,
            gpus_per_replica,
            ingress_replicas,
            router,
            RouterWeights(router_w_prefix, router_w_adapter, router_w_load),
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            prefill_replicas=prefill_replicas or 0,
            decode_replicas=decode_replicas or 0,
            kv_transfer_timeout_s=(
                kv_transfer_timeout if kv_transfer_timeout is not None else KV_TRANSFER_TIMEOUT_S
            ),
            local_prefill_tokens=local_prefill_tokens,
            spread=SpreadPolicy(router_spread_load, router_max_spread, router_contract_after),
            queue=RouterQueue(router_max_ongoing, router_hold_margin),
            wait_for_nodes=wait_for_nodes,
        )
        _serve_replicas(settings, layout, on_serving)
    else:
        # A server that ran exits inside `run` (after `on_stopped`), without interpreter teardown.
        run(settings, log_level=log_level, on_stopped=on_stopped, sock=sock, on_serving=on_serving)
    err.print("loraplex stopped")


def _cluster_flags_problem(
    replicas: int | None,
    scaling_flags: tuple[object, ...],
    prefill_replicas: int | None,
    decode_replicas: int | None,
    local_prefill_tokens: int,
    kv_transfer_timeout: float | None,
) -> str | None:
    """Why the replica flags given do not go together (None: they do): disaggregation takes both
    `--prefill-replicas` and `--decode-replicas` and neither `--replicas` nor autoscaling
    (`scaling_flags`: the autoscaling flags, None where not given); its own flags need it."""
    disaggregated = prefill_replicas is not None or decode_replicas is not None
    scaling = any(v is not None for v in scaling_flags)
    whole = prefill_replicas is not None and decode_replicas is not None
    if disaggregated and (not whole or replicas is not None or scaling):
        return "--prefill-replicas and --decode-replicas go together, and replace --replicas and autoscaling"
    only = "applies to --prefill-replicas/--decode-replicas only"
    if local_prefill_tokens and not disaggregated:
        return f"--local-prefill-tokens {only}"
    if kv_transfer_timeout is not None and not disaggregated:
        return f"--kv-transfer-timeout {only}"
    return None


def _serve_replicas(settings, layout, on_serving: Callable[[], None]) -> None:
    """Serve on Ray Serve with the `ClusterOptions` `layout`, logging start-up phases to stderr."""
    import logging

    from api.cluster.ray_api import RayMissing, require_ray
    from api.cluster.replica_resources import replica_resources
    from api.cluster.run import ClusterRefused, serve_cluster

    try:
        require_ray()
        layout.validate()
        resources = replica_resources(settings.engine, layout.cpus_per_replica, layout.gpus_per_replica)
    except (RayMissing, ValueError) as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    where = layout.ray_address or "a new local Ray cluster"
    per = resources.describe()
    count = f"{layout.replicas} engine replicas"
    if layout.disaggregated:
        count = f"{layout.prefill_replicas} prefill + {layout.decode_replicas} decode replicas"
    scaling = layout.autoscaling_config(settings.engine.max_num_seqs)
    if scaling is not None:
        count = (
            f"{count} (autoscaling {scaling['min_replicas']}-{scaling['max_replicas']}, target "
            f"{scaling['target_ongoing_requests']:g} ongoing requests each)"
        )
    stderr().print(
        f"  Replicas     {count} ({per}) + {layout.ingress_replicas} ingress on "
        f"{where} (Ray Serve, {layout.router} router)"
    )
    try:
        serve_cluster(settings, layout, on_serving)
    except ClusterRefused as exc:
        fail(str(exc))


def _check_tokenizer(model: Path, tokenizer: Path | None, template: str | None) -> None:
    """ValueError for a `--tokenizer` that is no tokenizer directory, or a `--chat-template` with no
    tokenizer to apply it (a checkpoint directory without tokenizer files, and no `--tokenizer`)."""
    from engine.tokenizer import has_tokenizer_files

    if tokenizer is not None and not has_tokenizer_files(tokenizer.expanduser()):
        raise ValueError(f"--tokenizer {tokenizer}: no tokenizer files there (tokenizer.json, ...)")
    bare = model.is_dir() and not has_tokenizer_files(model) and not any(model.glob("*.gguf"))
    if template is not None and tokenizer is None and bare:
        raise ValueError(f"--chat-template needs a tokenizer; {model} has none (pass --tokenizer DIR)")


def engine_options(**given: object) -> dict[str, object]:
    """The `EngineConfig` fields set on the command line (an option left out is None: the default)."""
    return {k: v for k, v in given.items() if v is not None}
