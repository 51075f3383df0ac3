"""Reading LoRA on embed_tokens / lm_head and trainable tokens (`engine/lora/vocab_checkpoint.py`) from
real adapters saved by PEFT, and their refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter
from engine.model_config import ModelConfig

from .peft_factory import edit_config, make_adapter, mutate_tensors, read_tensors


def _refused(path: Path, model: ModelConfig, match: str, **kw: int) -> None:
    with pytest.raises(AdapterError, match=match):
        inspect_adapter(path, model, **kw)


VOCAB = ["q_proj", "embed_tokens", "lm_head"]


def test_embedding_and_lm_head_lora_read_as_peft_saves_them(tmp_path: Path, model: ModelConfig) -> None:
    """PEFT's `lora_embedding_A/B` of embed_tokens and lm_head's lora_A/B come out with their scaling and
    the projections' weights beside them; `target_modules` lists the two; the saved base-layer copies
    (PEFT's `save_embedding_layers`) are only shape-checked."""
    state = make_adapter(tmp_path, r=4, lora_alpha=8, target_modules=VOCAB, rank_pattern={"lm_head": 2})
    ck = inspect_adapter(tmp_path, model)
    assert ck.target_modules == ("q_proj", "embed_tokens", "lm_head") and len(ck.modules) == 2
    embed, head = ck.vocab
    assert (embed.module, embed.rank, embed.scaling, head.module, head.rank, head.scaling) == (
        "embed_tokens",
        4,
        2.0,
        "lm_head",
        2,
        4.0,
    )
    emb = "base_model.model.model.embed_tokens"
    assert torch.equal(embed.lora_a, state[f"{emb}.lora_embedding_A.default"])
    assert torch.equal(embed.lora_b, state[f"{emb}.lora_embedding_B.default"])
    assert torch.equal(head.lora_b, state["base_model.model.lm_head.lora_B.default.weight"])
    assert "base_model.model.lm_head.base_layer.weight" in read_tensors(tmp_path)
    assert inspect_adapter(tmp_path, model, load_weights=False).vocab[1].lora_a is None


def test_layers_to_transform_keeps_lm_head_as_peft_does(tmp_path: Path, model: ModelConfig) -> None:
    """PEFT keeps a target named by its full key (`lm_head`) whatever `layers_to_transform` says, and
    drops `embed_tokens` (its key is `model.embed_tokens`, which has no layer index)."""
    make_adapter(tmp_path, target_modules=VOCAB, layers_to_transform=[0])
    ck = inspect_adapter(tmp_path, model)
    assert ck.target_modules == ("q_proj", "lm_head") and {m.layer for m in ck.modules} == {0}


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda t: t.pop("base_model.model.model.embed_tokens.lora_embedding_B"),
            "its embed_tokens lora_B partner is missing",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.lora_B.weight", torch.zeros(127, 4)),
            r"lm_head.lora_B.weight': shape \[127, 4\] does not fit the base model's lm_head "
            r"\(expected \[128, 4\]\)",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.base_layer.weight", torch.zeros(130, 64)),
            r"lm_head.base_layer.weight': shape \[130, 64\] does not fit .* \(expected \[128, 64\]\)",
        ),
    ],
)
def test_vocab_lora_tensor_refusals(tmp_path: Path, model: ModelConfig, mutate, match: str) -> None:
    make_adapter(tmp_path, target_modules=VOCAB)
    mutate_tensors(tmp_path, mutate)
    _refused(tmp_path, model, match)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_dora": True}, "use_dora: DoRA on (lm_head|embed_tokens) is not supported"),
        ({"lora_bias": True}, "lora_bias: a bias on (lm_head|embed_tokens)'s LoRA is not supported"),
        ({"layers_to_transform": [0, 1]}, "embed_tokens.lora_embedding_A': module not selected"),
        ({"r": 64}, "r: rank 64 of lm_head exceeds max_lora_rank 32"),
    ],
)
def test_vocab_lora_config_refusals(tmp_path: Path, model: ModelConfig, changes: dict, match: str) -> None:
    if "r" in changes:
        make_adapter(tmp_path, r=64, target_modules=["lm_head"])
    else:
        make_adapter(tmp_path, target_modules=VOCAB)
    edit_config(tmp_path, **changes)
    _refused(tmp_path, model, match, max_lora_rank=32)


TOKENS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def test_trainable_tokens_read_as_peft_saves_them(tmp_path: Path, model: ModelConfig) -> None:
    """The dict form: new embedding rows and new LM-head rows of their own (the tiny Llama is untied)."""
    tti = {"embed_tokens": [5, 9], "lm_head": [9, 3, 100]}
    make_adapter(tmp_path, trainable_token_indices=tti)
    ck = inspect_adapter(tmp_path, model)
    embed, head = ck.tokens
    assert (embed.module, embed.indices, head.module, head.indices) == (
        "embed_tokens",
        (5, 9),
        "lm_head",
        (9, 3, 100),
    )
    assert ck.target_modules == ("q_proj", "v_proj") and not ck.vocab
    make_adapter(tmp_path / "b", seed=1, trainable_token_indices=[4, 8, 15])
    ck = inspect_adapter(tmp_path / "b", model)
    assert [(t.module, t.indices) for t in ck.tokens] == [("embed_tokens", (4, 8, 15))]  # untied: no head
    assert torch.equal(ck.tokens[0].values, read_tensors(tmp_path / "b")[TOKENS])


@pytest.mark.parametrize(
    ("changes", "mutate", "match"),
    [
        ({"trainable_token_indices": [5, 128]}, None, r"token id 128 out of range \(vocabulary of 128\)"),
        ({"trainable_token_indices": [5, 5]}, None, "duplicate token ids"),
        ({"trainable_token_indices": {"norm": [5]}}, None, "only embed_tokens and lm_head"),
        ({"trainable_token_indices": [5, 6, 7]}, None, r"shape \[2, 64\] does not fit 3 tokens"),
        ({"trainable_token_indices": None}, None, "not in trainable_token_indices"),
        ({}, lambda t: t.__setitem__(TOKENS, torch.full((2, 64), float("nan"))), "contains NaN or Inf"),
        (
            {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
            lambda t: t.update(
                {
                    "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128),
                    "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 4),
                }
            ),
            "trainable_token_indices: not supported together with LoRA on embed_tokens",
        ),
    ],
)
def test_trainable_tokens_refusals(tmp_path: Path, model: ModelConfig, changes, mutate, match: str) -> None:
    make_adapter(tmp_path, trainable_token_indices=[5, 9])
    edit_config(tmp_path, **changes)
    if mutate is not None:
        mutate_tensors(tmp_path, mutate)
    _refused(tmp_path, model, match)
