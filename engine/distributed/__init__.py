"""The engine on several devices: tensor (and expert) parallel over a worker group on torch.distributed.

- `group.py`: the one owner of the process group (gloo on CPU, NCCL on CUDA) and its collectives;
- `shard.py`: what each rank holds of the model and of every adapter (Megatron-style);
- `moe_shard.py`: of a mixture-of-experts model's blocks (experts split by rows, or whole per rank under
  expert parallel) and of each adapter's expert LoRA;
- `shard_adapters.py`: a rank's DoRA / lora_bias vectors (the row-parallel DoRA norm: one all-reduce per
  upload);
- `shard_model.py`: a rank's model shard, wired to the all-reduce;
- `step_plan.py`: the typed frames rank 0 sends each step (inputs, LoRA runs, pool changes), with
  `adapter_frames.py` (an upload's side tensors) and `lora_runs.py` (a step's LoRA rows, mixes included);
- `worker.py` / `worker_group.py`: ranks 1..N-1, and rank 0's handle on them (start, step, restart);
- `setup.py`: rank 0's set-up from the engine's config.
"""
