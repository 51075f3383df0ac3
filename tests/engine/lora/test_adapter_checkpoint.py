"""PEFT adapter reading and validation against real adapters saved by PEFT."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.lora.adapter_checkpoint import AdapterError, adapter_digest, inspect_adapter
from engine.model_config import ModelConfig

from .peft_factory import TINY_LLAMA, edit_config, make_adapter, mutate_tensors, read_tensors, write_tensors

PREFIX = "base_model.model.model.layers"


def _other_model(**changes: int) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY_LLAMA, **changes}
    return ModelConfig.from_dict(raw, Path("."))


def test_reads_weights_identical_to_peft_state_dict(tmp_path: Path, model: ModelConfig) -> None:
    state = make_adapter(tmp_path, seed=1)
    ck = inspect_adapter(tmp_path, model)
    assert ck.rank == 4 and ck.alpha == 8.0 and not ck.use_rslora
    assert ck.target_modules == ("q_proj", "v_proj")
    assert [(m.layer, m.module) for m in ck.modules] == [
        (0, "q_proj"),
        (0, "v_proj"),
        (1, "q_proj"),
        (1, "v_proj"),
    ]
    for m in ck.modules:
        parent = "self_attn"
        a = state[f"{PREFIX}.{m.layer}.{parent}.{m.module}.lora_A.default.weight"]
        b = state[f"{PREFIX}.{m.layer}.{parent}.{m.module}.lora_B.default.weight"]
        assert torch.equal(m.lora_a, a) and torch.equal(m.lora_b, b)
        assert m.scaling == 2.0
    assert ck.modules[0].lora_b.abs().sum() > 0  # B was randomized, so the test can see a mix-up
    assert ck.size_bytes == sum(
        f.stat().st_size for f in tmp_path.iterdir() if f.suffix in (".json", ".safetensors")
    )


def test_all_linear_with_rank_and_alpha_patterns(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(
        tmp_path,
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        rank_pattern={"down_proj": 2, "layers.1.self_attn.q_proj": 8},
        alpha_pattern={"v_proj": 3},
    )
    ck = inspect_adapter(tmp_path, model)
    by = {(m.layer, m.module): m for m in ck.modules}
    assert len(by) == 14 and ck.rank == 8
    assert ck.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert by[0, "down_proj"].rank == 2 and by[0, "down_proj"].scaling == 4.0
    assert by[1, "q_proj"].rank == 8 and by[0, "q_proj"].rank == 4
    assert by[0, "v_proj"].alpha == 3.0 and by[0, "v_proj"].scaling == 0.75
    assert tuple(by[0, "down_proj"].lora_a.shape) == (2, 96) and tuple(by[0, "k_proj"].lora_b.shape) == (
        32,
        4,
    )


def test_dora_magnitudes_read_per_module(tmp_path: Path, model: ModelConfig) -> None:
    """A DoRA adapter's magnitude vectors come with their module's weights; a wrong length is refused."""
    state = make_adapter(tmp_path, seed=2, use_dora=True)
    ck = inspect_adapter(tmp_path, model)
    assert ck.use_dora and not ck.lora_bias
    for m in ck.modules:
        mag = state[f"{PREFIX}.{m.layer}.self_attn.{m.module}.lora_magnitude_vector.default.weight"]
        assert m.magnitude is not None and torch.equal(m.magnitude, mag) and m.bias_b is None
    assert inspect_adapter(tmp_path, model, load_weights=False).modules[0].magnitude is None
    tensors = read_tensors(tmp_path)
    key = f"{PREFIX}.1.self_attn.v_proj.lora_magnitude_vector"
    tensors[key] = tensors[key][:-1]
    write_tensors(tmp_path, tensors)
    _refused(
        tmp_path, model, r"v_proj.lora_magnitude_vector': shape \[31\] does not fit .* \(expected \[32\]\)"
    )


def test_rslora_scaling(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path, r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "up_proj"])
    ck = inspect_adapter(tmp_path, model)
    assert ck.use_rslora and ck.target_modules == ("o_proj", "up_proj")
    assert all(math.isclose(m.scaling, 8 / 4) for m in ck.modules)


def test_regex_targets_and_layers_to_transform(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path / "rx", target_modules=r".*\.layers\.1\.self_attn\.(k|o)_proj")
    ck = inspect_adapter(tmp_path / "rx", model)
    assert [(m.layer, m.module) for m in ck.modules] == [(1, "k_proj"), (1, "o_proj")]
    make_adapter(tmp_path / "lt", target_modules=["gate_proj", "down_proj"], layers_to_transform=[0])
    ck = inspect_adapter(tmp_path / "lt", model)
    assert [(m.layer, m.module) for m in ck.modules] == [(0, "gate_proj"), (0, "down_proj")]


def test_default_adapter_name_infix_is_tolerated(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path)
    before = inspect_adapter(tmp_path, model)
    tensors = read_tensors(tmp_path)
    write_tensors(tmp_path, {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()})
    after = inspect_adapter(tmp_path, model)
    assert all(torch.equal(x.lora_a, y.lora_a) for x, y in zip(before.modules, after.modules, strict=True))


def test_digest_tracks_content_not_json_formatting(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path, seed=3)
    d0 = inspect_adapter(tmp_path, model).digest
    assert adapter_digest(tmp_path) == d0 and len(d0) == 64
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg, indent=7, sort_keys=False) + "\n\n")
    assert adapter_digest(tmp_path) == d0
    edit_config(tmp_path, lora_alpha=9)
    assert adapter_digest(tmp_path) != d0
    edit_config(tmp_path, lora_alpha=8)
    assert adapter_digest(tmp_path) == d0
    tensors = read_tensors(tmp_path)
    key = next(iter(tensors))
    tensors[key][0, 0] += 1e-3
    write_tensors(tmp_path, tensors)
    assert adapter_digest(tmp_path) != d0


def test_metadata_only_inspection(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path)
    ck = inspect_adapter(tmp_path, model, load_weights=False)
    assert ck.digest == adapter_digest(tmp_path) and all(m.lora_a is None for m in ck.modules)


# ---- refusals -------------------------------------------------------------------------------------


def _refused(path: Path, model: ModelConfig, match: str, **kw: int) -> None:
    with pytest.raises(AdapterError, match=match):
        inspect_adapter(path, model, **kw)


def test_pickle_weights_refused(tmp_path: Path, model: ModelConfig) -> None:
    state = make_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save(state, tmp_path / "adapter_model.bin")
    _refused(tmp_path, model, r"adapter_model\.bin: pickle weights are refused")


def test_missing_files(tmp_path: Path, model: ModelConfig) -> None:
    _refused(tmp_path / "nope", model, "not a directory")
    make_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    _refused(tmp_path, model, r"adapter_model\.safetensors: missing")
    (tmp_path / "adapter_config.json").unlink()
    _refused(tmp_path, model, r"adapter_config\.json: missing")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_dora": True}, "use_dora: DoRA's lora_magnitude_vector partner is missing"),
        ({"use_dora": "yes"}, "use_dora: expected true or false"),
        ({"lora_bias": True}, "lora_bias: its lora_B bias partner is missing"),
        ({"use_dora": True, "lora_bias": True}, "lora_bias: not supported together with use_dora"),
        ({"bias": "all"}, "bias: 'all' is not supported"),
        ({"modules_to_save": ["norm"]}, r"modules_to_save\[0\]: 'norm' has no saved weight"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save\[0\]: 'lm_head' has no saved weight"),
        ({"modules_to_save": "lm_head"}, "modules_to_save: expected a list of module names"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type: 'PREFIX_TUNING' is not supported"),
        (
            {"target_modules": ["q_proj", "v_proj", "wte"]},
            r"'wte' is an embedding.*only embed_tokens and lm_head",
        ),
        ({"ensure_weight_tying": True}, "ensure_weight_tying .* is not supported"),
        (
            {"trainable_token_indices": [5, 6]},
            r"indices\['embed_tokens'\]: its trainable_tokens_delta is missing",
        ),
        ({"target_modules": ["q_proj", "v_proj", "c_attn"]}, "target_modules: unknown module name 'c_attn'"),
        ({"target_modules": "model.embed_tokens"}, r"q_proj.*not selected by target_modules"),
        ({"target_modules": ["q_proj"]}, r"v_proj.*not selected by target_modules"),
        ({"layers_to_transform": [7]}, "layers_to_transform: layer 7 out of range"),
        ({"r": 0}, "r: expected a positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha: expected a number"),
        ({"r": 2}, r"shape \[4, 64\] does not fit .* \(expected \[2, 64\]\)"),
    ],
)
def test_config_refusals(tmp_path: Path, model: ModelConfig, changes: dict, match: str) -> None:
    make_adapter(tmp_path)
    edit_config(tmp_path, **changes)
    _refused(tmp_path, model, match)


def test_bad_json_refused(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 4,')
    _refused(tmp_path, model, r"adapter_config\.json: not valid JSON")


def test_rank_above_max_refused(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path / "a", r=8)
    _refused(tmp_path / "a", model, "r: rank 8 of layer 0 q_proj exceeds max_lora_rank 4", max_lora_rank=4)
    make_adapter(tmp_path / "b", r=2, target_modules=["v_proj", "down_proj"], rank_pattern={"down_proj": 16})
    _refused(
        tmp_path / "b",
        model,
        r"rank_pattern\['down_proj'\]: rank 16 .* exceeds max_lora_rank 8",
        max_lora_rank=8,
    )


@pytest.mark.parametrize(
    ("targets", "other", "module"),
    [
        (["q_proj"], {"num_attention_heads": 8, "head_dim": 16}, "q_proj"),  # q out = heads*head_dim
        (["k_proj"], {"num_key_value_heads": 4}, "k_proj"),
        (["o_proj"], {"hidden_size": 128, "num_attention_heads": 8}, "o_proj"),
        (["up_proj"], {"intermediate_size": 128}, "up_proj"),
        (["down_proj"], {"intermediate_size": 128}, "down_proj"),
        (["v_proj"], {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}, "v_proj"),
    ],
)
def test_shapes_that_do_not_fit_the_base_model(
    tmp_path: Path, targets: list, other: dict, module: str
) -> None:
    make_adapter(tmp_path, target_modules=targets)
    _refused(
        tmp_path, _other_model(**other), rf"tensor '.*{module}\.lora_[AB]\.weight': shape .* does not fit"
    )


def test_tensor_level_refusals(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path)
    clean = read_tensors(tmp_path)
    a0 = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    b0 = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"

    cases = [
        (lambda t: t[a0].__setitem__((0, 0), float("nan")), "q_proj.lora_A.weight': contains NaN or Inf"),
        (lambda t: t[b0].__setitem__((1, 1), float("inf")), "q_proj.lora_B.weight': contains NaN or Inf"),
        (lambda t: t.pop(b0), r"lora_A.weight': its lora_B partner is missing"),
        (lambda t: t.__setitem__(b0.replace("0.self", "5.self"), t.pop(b0)), "layer 5 out of range"),
        (
            lambda t: t.__setitem__(f"{PREFIX}.0.self_attn.rotary.lora_A.weight", t[a0].clone()),
            "unknown module",
        ),
        (lambda t: t.__setitem__(f"{PREFIX}.0.mlp.q_proj.lora_A.weight", t[a0].clone()), "unknown module"),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", t[a0].clone()),
            "lm_head.lora_A.weight': module not selected by target_modules",
        ),
        (
            lambda t: t.__setitem__("base_model.model.transformer.wte.lora_A.weight", t[a0].clone()),
            "embedding/lm_head adapters are not supported",
        ),
        (lambda t: t.__setitem__(a0 + "_x", t[a0].clone()), "not a LoRA A/B weight"),
        (lambda t: t.__setitem__(a0, t[a0].to(torch.int32)), "dtype I32 is not a floating-point type"),
        (
            lambda t: t.__setitem__(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", t[a0].clone()),
            "a DoRA magnitude vector, but use_dora is not set",
        ),
        (
            lambda t: t.__setitem__(b0.replace(".weight", ".bias"), t[a0][0].clone()),
            "a lora_B bias, but lora_bias is not set",
        ),
    ]
    for fn, match in cases:
        mutate_tensors(tmp_path, fn)
        _refused(tmp_path, model, match)
        write_tensors(tmp_path, clean)
    inspect_adapter(tmp_path, model)  # the restored adapter is fine again


def test_truncated_and_corrupt_files(tmp_path: Path, model: ModelConfig) -> None:
    make_adapter(tmp_path)
    f = tmp_path / "adapter_model.safetensors"
    data = f.read_bytes()
    for broken, match in [
        (data[:-10], "truncated"),
        (data[:5], "truncated"),
        (data[:40], "truncated or corrupt header"),
        (data[:8] + b"x" * (len(data) - 8), "corrupt header"),
        (data + b"junk", "unexpected bytes after the tensors"),
    ]:
        f.write_bytes(broken)
        _refused(tmp_path, model, match)
