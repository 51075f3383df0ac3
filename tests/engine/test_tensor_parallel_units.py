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
    kind, arrays = sp.decode(sp.encode_step(inp, [(1, 3, 4, 0, 1.0), (1, 2, 6, 1, -0.25)]))
    got = sp.decode_step(arrays)
    assert kind == sp.STEP
    assert got.inputs.input_ids == inp.input_ids and got.inputs.seq_lens == inp.seq_lens
    assert got.inputs.query_starts == inp.query_starts and got.inputs.num_decodes == 1
    assert np.array_equal(got.inputs.block_tables, inp.block_tables)
    assert np.array_equal(got.inputs.slot_mapping, inp.slot_mapping)
    assert got.inputs.logits_rows == []  # workers compute no logits
    assert got.lora_runs.tolist() == [[1, 3, 4, 0], [1, 2, 6, 1]]
    assert got.lora_weights.tolist() == [1.0, -0.25]
    assert got.num_threads == 0 and not got.graph  # rank 0's threads unchanged, eager
    _, arrays = sp.decode(sp.encode_step(inp, [], num_threads=3, graph=True))
    got = sp.decode_step(arrays)
    assert got.num_threads == 3 and got.graph and got.lora_runs.shape == (0, 4)


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


def test_upload_frame_carries_side_tensors():
    """DoRA magnitudes, lora_B biases and the embedding side reach the workers; the LM-head side (rank 0
    only computes logits) is not sent."""
    from engine.lora.vocab_checkpoint import SavedModule, TrainableTokens, VocabLoRAWeights

    q = LoRAModuleWeights(0, "q_proj", 2, 4.0, 2.0, torch.randn(2, 64), torch.randn(64, 2), torch.rand(64))
    o = LoRAModuleWeights(
        1, "o_proj", 2, 4.0, 2.0, torch.randn(2, 64), torch.randn(64, 2), None, torch.randn(64)
    )
    vocab = (
        VocabLoRAWeights("embed_tokens", 3, 6.0, 2.0, torch.randn(3, 32), torch.randn(64, 3)),
        VocabLoRAWeights("lm_head", 3, 6.0, 2.0, torch.randn(3, 64), torch.randn(32, 3)),
    )
    tokens = (TrainableTokens("embed_tokens", (4, 7), torch.randn(2, 64)),)
    saved = (SavedModule("embed_tokens", torch.randn(32, 64)), SavedModule("lm_head", torch.randn(32, 64)))
    ckpt = AdapterCheckpoint("cd" * 32, 2, 4.0, (), False, 0, None, (q, o), True, False, vocab, tokens, saved)
    got, _, _ = sp.decode_upload(sp.decode(sp.encode_upload(ckpt, 0, [[0], [], [], [1], [], [], []]))[1])
    assert got.use_dora and not got.lora_bias
    gq, go = got.modules
    assert torch.equal(gq.magnitude, q.magnitude) and gq.bias_b is None
    assert go.magnitude is None and torch.equal(go.bias_b, o.bias_b)
    (v,) = got.vocab
    assert v.module == "embed_tokens" and (v.rank, v.scaling) == (3, 2.0)
    assert torch.equal(v.lora_a, vocab[0].lora_a) and torch.equal(v.lora_b, vocab[0].lora_b)
    assert got.tokens[0].indices == (4, 7) and torch.equal(got.tokens[0].values, tokens[0].values)
    assert [s.module for s in got.saved] == ["embed_tokens"] and torch.equal(
        got.saved[0].weight, saved[0].weight
    )


class _Weights:
    """`BaseWeights` over plain per-slice weights (one layer), the shard's or the whole model's."""

    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        self.w = w

    def row_sq_norms(self, layer, module):
        return self.w[module].pow(2).sum(1)

    def times_weight_t(self, layer, module, a):
        return a @ self.w[module].T

    def bias(self, layer, module):
        return None


def test_row_parallel_dora_norm_partials_sum_to_the_whole():
    """o_proj's DoRA norm from the two ranks' columns: the partial squared norms sum to the whole
    model's; q_proj's rows of f are the rows of the whole f (no communication); a row-parallel lora_B
    bias is kept by rank 0 only."""
    from engine.distributed.shard_adapters import local_slice
    from engine.lora.dora import dora_sq_norm, row_epilogue

    cfg = config(heads=8, kv_heads=2)
    wo, wq = (
        torch.randn(64, cfg.q_size),
        torch.randn(cfg.q_size, 64),
    )
    o = LoRAModuleWeights(
        0,
        "o_proj",
        4,
        8.0,
        0.5,
        torch.randn(4, cfg.q_size),
        torch.randn(64, 4),
        torch.rand(64) + 1,
        torch.randn(64),
    )
    q = LoRAModuleWeights(
        0,
        "q_proj",
        4,
        8.0,
        0.5,
        torch.randn(4, 64),
        torch.randn(cfg.q_size, 4),
        torch.rand(cfg.q_size) + 1,
    )
    whole = _Weights({"o_proj": wo, "q_proj": wq})
    parts, f_rows, biases = [], [], []
    for r in range(2):
        shard = TensorShard(r, 2, cfg)
        local = _Weights(
            {
                "o_proj": shard.projection(("o_proj",), "weight", wo),
                "q_proj": shard.projection(("q_proj",), "weight", wq),
            }
        )
        lo = local_slice(shard, o)
        parts.append(dora_sq_norm(lo, local))
        biases.append(lo.bias_b)
        f_rows.append(row_epilogue(local_slice(shard, q), local)[0])
    assert torch.allclose(parts[0] + parts[1], dora_sq_norm(o, whole), rtol=1e-4)
    assert torch.allclose(torch.cat(f_rows), row_epilogue(q, whole)[0], rtol=1e-4)
    assert torch.equal(biases[0], o.bias_b) and not biases[1].any()
