"""Tensor parallel pieces without processes: the step frames round-trip, and the sharding rules cut
heads, KV heads (replicated below the rank count), fused projections and adapters consistently."""

from __future__ import annotations

import numpy as np
import torch

from engine.distributed import step_plan as sp
from engine.distributed.shard import TensorShard
from engine.lora.adapter_checkpoint import AdapterCheckpoint, LoRAModuleWeights
from engine.model_config import ModelConfig
from engine.step_inputs import StepInputs


def config(heads: int = 8, kv_heads: int = 2) -> ModelConfig:
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=heads)
    raw |= dict(num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=32, intermediate_size=96)
    return ModelConfig.from_dict(raw)


def test_step_frame_round_trips():
    inp = StepInputs(
        input_ids=[5, 6, 7],
        positions=np.array([4, 0, 1]),
        slot_mapping=np.array([9, 12, 13]),
        block_tables=np.array([[2, 0], [3, 4]], dtype=np.int32),
        seq_lens=[5, 2],
        query_starts=[0, 1, 3],
        logits_rows=[0, 2],
        num_decodes=1,
    )
    kind, arrays = sp.decode(sp.encode_step(inp, [(1, 3, 4)]))
    got = sp.decode_step(arrays)
    assert kind == sp.STEP
    assert got.inputs.input_ids == inp.input_ids and got.inputs.seq_lens == inp.seq_lens
    assert got.inputs.query_starts == inp.query_starts and got.inputs.num_decodes == 1
    assert np.array_equal(got.inputs.block_tables, inp.block_tables)
    assert np.array_equal(got.inputs.slot_mapping, inp.slot_mapping)
    assert got.inputs.logits_rows == []  # workers compute no logits
    assert got.lora_runs.tolist() == [[1, 3, 4]]


def test_upload_frame_round_trips():
    a, b = torch.randn(4, 64), torch.randn(16, 4)
    w = LoRAModuleWeights(1, "k_proj", 4, 8.0, 2.0, a, b)
    ckpt = AdapterCheckpoint("ab" * 32, 4, 8.0, ("k_proj",), False, 0, None, (w,))
    kind, arrays = sp.decode(sp.encode_upload(ckpt, 3, [[], [5], [], [], [], [], []]))
    got, slot, pages = sp.decode_upload(arrays)
    assert kind == sp.UPLOAD and slot == 3 and pages == [[], [5], [], [], [], [], []]
    assert got.digest == ckpt.digest
    (m,) = got.modules
    assert (m.layer, m.module, m.rank, m.scaling) == (1, "k_proj", 4, 2.0)
    assert torch.equal(m.lora_a, a) and torch.equal(m.lora_b, b)
    assert sp.decode_evict(sp.decode(sp.encode_evict(ckpt.digest))[1]) == ckpt.digest


def test_kv_heads_split_or_replicated():
    cfg = config(heads=8, kv_heads=2)
    assert [list(TensorShard(r, 2, cfg).kv_heads) for r in range(2)] == [[0], [1]]
    # 4 ranks over 2 KV heads: ranks 0-1 read KV head 0, ranks 2-3 KV head 1 (their q heads' group)
    assert [list(TensorShard(r, 4, cfg).kv_heads) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(TensorShard(r, 4, cfg).heads) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    local = TensorShard(3, 4, cfg).local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 24)


def test_fused_projection_cut_equals_slice_by_slice():
    """A fused q|k|v tensor (Phi-3's checkpoint) is cut to the same rows as q, k and v cut one by one."""
    cfg = config(heads=8, kv_heads=2)
    d = cfg.head_dim
    q, k, v = torch.randn(8 * d, 64), torch.randn(2 * d, 64), torch.randn(2 * d, 64)
    shard = TensorShard(1, 2, cfg)
    fused = shard.projection(("q_proj", "k_proj", "v_proj"), "weight", torch.cat([q, k, v]))
    apart = [shard.projection((n,), "weight", t) for n, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
    assert torch.equal(fused, torch.cat(apart))
    assert torch.equal(apart[0], q[4 * d : 8 * d]) and torch.equal(apart[1], k[d : 2 * d])


def test_row_parallel_lora_partials_sum_to_the_whole():
    """o_proj: each rank's scale * (x_r @ A_r.T) @ B.T sums to scale * (x @ A.T) @ B.T; and q_proj's B
    rows of both ranks stack to B."""
    cfg = config(heads=8, kv_heads=2)
    a, b = torch.randn(4, cfg.q_size, dtype=torch.float64), torch.randn(64, 4, dtype=torch.float64)
    x = torch.randn(3, cfg.q_size, dtype=torch.float64)
    parts = []
    for r in range(2):
        shard = TensorShard(r, 2, cfg)
        ar, br = shard.lora("o_proj", a, b)
        cols = shard.projection(("o_proj",), "weight", torch.eye(cfg.q_size, dtype=torch.float64))
        parts.append((x @ cols) @ ar.T @ br.T)
    assert torch.allclose(parts[0] + parts[1], x @ a.T @ b.T)
    bq = torch.randn(cfg.q_size, 4)
    rows = [TensorShard(r, 2, cfg).lora("q_proj", torch.randn(4, 64), bq)[1] for r in range(2)]
    assert torch.equal(torch.cat(rows), bq)
