"""The adapter page and the admin API's adapter JSON show what the serving version contains: DoRA,
LoRA bias, the modules with LoRA, trainable tokens, saved modules and its device memory in this pool."""

from __future__ import annotations

import pytest

from engine.lora.adapter_checkpoint import inspect_adapter
from engine.lora.side_memory import side_bytes
from engine.model_config import ModelConfig
from tests.admin_ui.conftest import logged_in_client, register
from tests.helpers.live_server import start_server
from tests.helpers.tiny_adapters import build_adapter

pytestmark = pytest.mark.slow  # a live server

KINDS = {
    "dora-tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    "saved-head": dict(
        r=2,
        lora_alpha=4,
        target_modules=["o_proj"],
        modules_to_save=["lm_head"],
        trainable_token_indices=[5, 9],
    ),
    "embed-lora": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "down_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def served(ui_model, tmp_path_factory):
    base, _ = ui_model
    root = tmp_path_factory.mktemp("contents")
    dirs = {n: build_adapter(base, root / n, seed=40 + i, **s) for i, (n, s) in enumerate(KINDS.items())}
    for name, path in dirs.items():
        register(root / "data", base, name, path)
    server = start_server(base, root / "data", max_lora_rank=16)
    client, _ = logged_in_client(server)
    yield server, client, dirs
    client.close()
    server.stop()


def test_the_admin_api_reports_the_contents(served):
    server, _, dirs = served
    cfg = ModelConfig.from_dir(server.state.settings.model)
    with server.admin() as admin:
        dora = admin.get("/admin/api/adapters/dora-tokens").json()["contents"]
        saved = admin.get("/admin/api/adapters/saved-head").json()["contents"]
        embed = admin.get("/admin/api/adapters/embed-lora").json()["contents"]
    assert dora["use_dora"] and not dora["lora_bias"] and dora["lora_modules"] == ["q_proj", "v_proj"]
    assert dora["trainable_tokens"] == {} and dora["modules_to_save"] == []
    assert saved["modules_to_save"] == ["lm_head"] and saved["trainable_tokens"] == {"embed_tokens": 2}
    assert embed["use_rslora"] and embed["lora_modules"] == ["down_proj", "embed_tokens"]
    for c, name in ((dora, "dora-tokens"), (saved, "saved-head"), (embed, "embed-lora")):
        ckpt = inspect_adapter(dirs[name], cfg, max_lora_rank=16, load_weights=False)
        assert c["side_bytes"] == side_bytes(ckpt, cfg, 4) > 0  # float32 pool
        assert c["page_bytes"] > 0 and c["device_bytes"] == c["page_bytes"] + c["side_bytes"]
    assert saved["side_bytes"] >= cfg.vocab_size * cfg.hidden_size * 4  # a whole LM head


def test_the_adapter_page_shows_the_contents(served):
    _, client, _ = served
    page = client.get("/admin/adapters/saved-head").text
    assert 'id="h-contents"' in page
    assert "2 in <code>embed_tokens</code>" in page
    assert '<dd class="modules" id="contents-saved"><code>lm_head</code>' in page
    dora = client.get("/admin/adapters/dora-tokens").text
    assert '<span class="badge badge-info">DoRA</span>' in dora and "none" in dora
    assert 'id="contents-memory" title="' in dora and " bytes" in dora
