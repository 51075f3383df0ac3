"""GGUF checkpoints: the weights we load equal what transformers loads from the same file
(`from_pretrained(dir, gguf_file=...)`, the oracle), the header becomes the right config and tokenizer,
and bad files are clear errors (CLI: one line and exit 1, never a traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.model.gguf_file import GGUFError, find_gguf
from engine.model.loader import _target, load_model
from engine.model_config import ModelConfig, ModelConfigError, dtype_reason
from engine.tokenizer import load_tokenizer
from tests.helpers.gguf_files import CHAT_TEMPLATE, build_gguf_pair, char_vocab, hf_gguf_model, write_gguf

pytestmark = pytest.mark.slow  # transformers' GGUF loader as the oracle

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # the ones llama.cpp users meet most


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """gguf_file(arch, qtype, **write_kwargs) -> (HF dir, GGUF file), cached per arguments."""
    cache: dict = {}

    def make(arch: str = "llama", qtype: str = "F32", **kw) -> tuple[Path, Path]:
        key = (arch, qtype, tuple(sorted(kw.items(), key=str)))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}")
            cache[key] = build_gguf_pair(root, arch, qtype, **kw)
        return cache[key]

    return make


def _ours(model) -> dict[str, torch.Tensor]:
    """Our parameters under HF keys (packed projections split back into q/k/v and gate/up)."""
    params = dict(model.named_parameters())

    def get(hf_key: str) -> torch.Tensor:
        target = _target(hf_key)
        assert target is not None, hf_key
        name, idx = target
        p = params[name]
        if idx is None:
            return p
        module = model.get_submodule(name.rsplit(".", 1)[0])
        start = module.slice_offsets()[idx]
        return p[start : start + module.slice_sizes[idx]]

    return get  # type: ignore[return-value]


def _hf_state(gguf: Path) -> dict[str, torch.Tensor]:
    ref = hf_gguf_model(gguf)
    tied = ref.config.tie_word_embeddings
    return {k: v for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", q) for q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", *K_QUANTS)]
    + [("qwen2", "Q8_0"), ("qwen2", "Q4_K")],
)
def test_weights_equal_transformers_gguf_load(gguf_file, arch, qtype):
    _, gguf = gguf_file(arch, qtype)
    cfg = ModelConfig.from_dir(gguf)
    get = _ours(load_model(cfg, torch.float32, torch.device("cpu")))
    ref = _hf_state(gguf)
    assert (
        len(ref)
        == 2 + 9 * cfg.num_layers + (0 if cfg.tie_word_embeddings else 1) + 3 * cfg.qkv_bias * cfg.num_layers
    )
    for key, value in ref.items():
        assert torch.equal(get(key), value), key


def test_f32_file_loads_the_source_checkpoint_exactly(gguf_file):
    """Names, q/k un-permutation and layout: an F32 GGUF gives back the HF checkpoint bit for bit."""
    hf, gguf = gguf_file("llama", "F32")
    ours = load_model(ModelConfig.from_dir(gguf), torch.float32, torch.device("cpu"))
    source = load_model(ModelConfig.from_dir(hf), torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(ours.named_parameters(), source.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_from_metadata(gguf_file, arch):
    hf, gguf = gguf_file(arch, "F16")
    from_gguf, from_hf = ModelConfig.from_dir(gguf), ModelConfig.from_dir(hf)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "qkv_bias", "rope_theta"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)
    assert from_gguf.checkpoint_dtype == torch.float16  # every matmul weight is F16
    assert (from_gguf.bos_token_id, from_gguf.eos_token_ids) == (1, (2,))
    assert from_gguf.path == gguf
    reason = dtype_reason("auto", from_gguf, torch.device("cpu"))
    assert reason.startswith("auto: float16 checkpoint") and reason.endswith(
        "GGUF file, F16, F32 dequantized at load"
    )


def test_directory_with_one_gguf_file(gguf_file, tmp_path):
    _, gguf = gguf_file("llama", "Q8_0")
    assert find_gguf(gguf.parent) == gguf
    assert ModelConfig.from_dir(gguf.parent).path == gguf
    assert find_gguf(tmp_path) is None  # an empty directory is not a GGUF checkpoint
    hf, _ = gguf_file("llama", "F32")
    assert find_gguf(hf) is None


def test_tokenizer_from_metadata(gguf_file):
    from transformers import AutoTokenizer

    _, gguf = gguf_file("llama", "Q8_0")
    tok = load_tokenizer(gguf)
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = "Hello world, 42 times!"
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    vocab = char_vocab(96)
    assert ids[0] == 1 and [vocab[i] for i in ids[1:6]] == ["▁", "H", "e", "l", "l"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.chat_template == CHAT_TEMPLATE
    assert load_tokenizer(gguf.parent) is not None


def test_file_without_tokenizer(gguf_file):
    _, gguf = gguf_file("llama", "Q8_0", tokenizer=False)
    assert load_tokenizer(gguf) is None


# ---- bad files ---------------------------------------------------------------------------------------
def _unsupported_arch(root: Path, _hf: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(root / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return root / "gpt2.gguf"


def _unsupported_type(root: Path, hf: Path) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    out = write_gguf(hf, root / "iq.gguf", "Q8_0")
    w = GGUFWriter(str(root / "iq4.gguf"), "llama")  # same model, one tensor as IQ4_NL
    from gguf import GGUFReader

    r = GGUFReader(str(out))
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name == "blk.0.ffn_down.weight":
            w.add_tensor(t.name, np.zeros((64, 4 * 18), np.uint8), raw_dtype=GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return root / "iq4.gguf"


def _truncated(root: Path, hf: Path) -> Path:
    out = write_gguf(hf, root / "cut.gguf", "Q8_0")
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 3000])
    return out


def _corrupt(root: Path, _hf: Path) -> Path:
    (root / "junk.gguf").write_bytes(b"GGML" + bytes(range(256)) * 8)
    return root / "junk.gguf"


def _two_files(root: Path, hf: Path) -> Path:
    (root / "two").mkdir()
    write_gguf(hf, root / "two" / "a.gguf", "Q8_0")
    shutil.copy(root / "two" / "a.gguf", root / "two" / "b.gguf")
    return root / "two"


def _unsupported_tokenizer(root: Path, hf: Path) -> Path:
    return write_gguf(hf, root / "rwkv-tok.gguf", "Q8_0", tokenizer_model="rwkv")


BAD = {
    "tokenizer": (_unsupported_tokenizer, "tokenizer type 'rwkv' is not supported"),
    "arch": (_unsupported_arch, "GGUF architecture 'gpt2' is not supported"),
    "type": (_unsupported_type, "tensor type IQ4_NL is not supported"),
    "truncated": (_truncated, "not a readable GGUF file"),
    "corrupt": (_corrupt, "not a readable GGUF file"),
    "two files": (_two_files, "holds 2 .gguf files"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_are_clear_errors(gguf_file, tmp_path, case):
    from api.cli import app

    hf, _ = gguf_file("llama", "F32")
    make, message = BAD[case]
    path = make(tmp_path, hf)
    with pytest.raises(ModelConfigError, match=message) as info:
        ModelConfig.from_dir(path)
    assert isinstance(info.value, GGUFError)
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--model", str(path)], env=env)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_serve_starts_on_a_gguf_file(gguf_file, tmp_path, monkeypatch):
    from api.cli import app

    _, gguf = gguf_file("llama", "Q8_0")
    started = []
    monkeypatch.setattr("api.server.serve", lambda settings, **_: started.append(settings))
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(gguf)}
    result = CliRunner().invoke(app, ["serve", "--port", "0"], env=env)
    assert result.exit_code == 0, result.output
    assert [s.engine.model for s in started] == [str(gguf)]


def test_adapters_register_against_a_gguf_base(gguf_file, tmp_path):
    """`LORAPLEX_MODEL=file.gguf`: adapters trained on the HF checkpoint validate against its GGUF."""
    from api.cli import app
    from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter

    hf, gguf = gguf_file("llama", "Q8_0")
    adapter = build_adapter(hf, tmp_path / "ad", **ADAPTER_SPECS["all7-r4"])
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(gguf)}
    result = CliRunner().invoke(app, ["adapters", "register", "support", str(adapter)], env=env)
    assert result.exit_code == 0, result.output
    bad = build_adapter(build_gguf_pair(tmp_path / "k", "llama", "Q4_K")[0], tmp_path / "wide", r=2,
                        lora_alpha=4, target_modules=["q_proj"])  # fmt: skip
    result = CliRunner().invoke(app, ["adapters", "register", "wide", str(bad)], env=env)
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_missing_tensor_is_a_checkpoint_error(gguf_file):
    from engine.model.loader import CheckpointError

    _, gguf = gguf_file("llama", "Q8_0", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(
        CheckpointError, match=r"lacks weights for: layers\.1\.mlp\.gate_up_proj\.weight\[slice 1\]"
    ):
        load_model(ModelConfig.from_dir(gguf), torch.float32, torch.device("cpu"))
