"""The service layer on SQLite and PostgreSQL: versions, activation, rollback, delete, events, audit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from engine.lora.adapter_checkpoint import adapter_digest
from lora_registry.errors import BlobCorrupt, InvalidAdapter, NotFound, RegistryError
from lora_registry.events import RegistryEvent
from lora_registry.models import AdapterVersion
from lora_registry.registry import Registry, open_registry
from lora_registry.settings import RegistrySettings
from tests.engine.lora.peft_factory import make_adapter


def _types(events: list[RegistryEvent]) -> list[str]:
    return [e.type for e in events]


def test_register_stores_version_blobs_and_audit(registry: Registry, adapter_dirs, events) -> None:
    svc = registry.adapters
    res = svc.register("support-bot", adapter_dirs["a"], description="customer service")
    assert res.created and res.version.version == 1
    assert res.version.digest == adapter_digest(adapter_dirs["a"])
    assert res.version.rank == 4 and res.version.target_modules == ("q_proj", "v_proj")
    assert res.version.source == "dir:a" and len(res.version.base_model_fingerprint) == 64
    info = svc.show("support-bot").adapter
    assert info.status == "inactive" and info.description == "customer service" and info.current.version == 1
    assert len(svc.blobs.digests()) == 2  # config + weights
    assert _types(events) == ["adapter.registered"]
    assert events[0].digest == res.version.digest and events[0].version == 1
    assert [(a.action, a.target) for a in svc.audit_log()] == [("adapter.registered", "support-bot")]
    assert svc.active_adapters() == []


def test_register_accepts_a_dora_adapter(registry: Registry, tmp_path: Path) -> None:
    """A PEFT DoRA adapter (`use_dora`, magnitude vectors) registers like any LoRA adapter."""
    make_adapter(tmp_path / "dora", seed=4, use_dora=True, target_modules="all-linear")
    res = registry.adapters.register("dora-bot", tmp_path / "dora")
    assert res.created and res.version.digest == adapter_digest(tmp_path / "dora")
    assert res.version.rank == 4 and len(res.version.target_modules) == 7


def test_register_accepts_embedding_and_lm_head_lora(registry: Registry, tmp_path: Path) -> None:
    """A PEFT adapter with LoRA on embed_tokens and lm_head (and a projection) registers; its version
    lists the two among its target modules."""
    targets = ["q_proj", "embed_tokens", "lm_head"]
    make_adapter(tmp_path / "vocab", seed=5, target_modules=targets)
    res = registry.adapters.register("vocab-bot", tmp_path / "vocab")
    assert res.created and res.version.digest == adapter_digest(tmp_path / "vocab")
    assert res.version.rank == 4 and list(res.version.target_modules) == targets


def test_register_accepts_trainable_tokens(registry: Registry, tmp_path: Path) -> None:
    """A PEFT adapter with `trainable_token_indices` (new rows for some token ids) registers."""
    make_adapter(tmp_path / "tok", seed=6, trainable_token_indices=[5, 9, 17])
    res = registry.adapters.register("tokens-bot", tmp_path / "tok")
    assert res.created and res.version.digest == adapter_digest(tmp_path / "tok")


def test_register_accepts_modules_to_save_of_embeddings(registry: Registry, tmp_path: Path) -> None:
    """A PEFT adapter saving whole copies of embed_tokens and lm_head (`modules_to_save`) registers; one
    saving another module (the final norm) is refused naming it."""
    make_adapter(tmp_path / "saved", seed=7, modules_to_save=["embed_tokens", "lm_head"])
    res = registry.adapters.register("saved-bot", tmp_path / "saved")
    assert res.created and res.version.digest == adapter_digest(tmp_path / "saved")
    make_adapter(tmp_path / "norm", seed=8, modules_to_save=["norm"])
    with pytest.raises(InvalidAdapter, match=r"modules_to_save\[0\]: 'norm' is not supported"):
        registry.adapters.register("norm-bot", tmp_path / "norm")


def test_same_content_is_a_noop_and_new_content_a_new_version(
    registry: Registry, adapter_dirs, adapter_copy, events
) -> None:
    svc = registry.adapters
    first = svc.register("bot", adapter_dirs["a"])
    again = svc.register("bot", adapter_dirs["a"])
    assert not again.created and again.version == first.version
    reformatted = adapter_copy("a")
    cfg = json.loads((reformatted / "adapter_config.json").read_text())
    (reformatted / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    assert not svc.register("bot", reformatted).created
    assert svc.show("bot").adapter.num_versions == 1 and len(svc.blobs.digests()) == 2
    second = svc.register("bot", adapter_dirs["b"], activate=True)
    assert second.created and second.version.version == 2
    assert second.adapter.current.digest == adapter_digest(adapter_dirs["b"]) and second.adapter.is_active
    assert len(svc.blobs.digests()) == 3  # the config blob is shared
    assert _types(events) == ["adapter.registered", "adapter.registered", "adapter.activated"]


def test_activate_deactivate_rollback(registry: Registry, adapter_dirs, events) -> None:
    svc = registry.adapters
    v1 = svc.register("bot", adapter_dirs["a"]).version
    v2 = svc.register("bot", adapter_dirs["b"]).version
    assert svc.activate("bot").is_active
    assert [(a.name, a.version, a.digest) for a in svc.active_adapters()] == [("bot", 2, v2.digest)]
    svc.activate("bot")  # already active: no event
    info = svc.rollback("bot", 1)
    assert info.current.version == 1 and info.is_active
    assert svc.active_adapter("bot").digest == v1.digest
    with pytest.raises(NotFound, match="has no version 7"):
        svc.rollback("bot", 7)
    assert not svc.deactivate("bot").is_active and svc.active_adapters() == []
    assert _types(events)[2:] == ["adapter.activated", "adapter.rolled_back", "adapter.deactivated"]
    assert events[-2].digest == v1.digest and events[-2].status == "active"
    actions = [a.action for a in svc.audit_log()]
    assert actions[:3] == ["adapter.deactivated", "adapter.rolled_back", "adapter.activated"]


def test_versions_are_immutable(registry: Registry, adapter_dirs) -> None:
    registry.adapters.register("bot", adapter_dirs["a"])
    with registry.adapters.sessions.begin() as s:
        v = s.scalars(select(AdapterVersion)).one()
        v.rank = 99
        with pytest.raises(ValueError, match="immutable"):
            s.flush()


def test_delete_removes_rows_and_unshared_blobs(registry: Registry, adapter_dirs, events) -> None:
    svc = registry.adapters
    svc.register("one", adapter_dirs["a"])
    svc.register("one", adapter_dirs["big"])
    svc.register("two", adapter_dirs["a"])  # shares both blobs of one's version 1
    path = svc.adapter_path(svc.show("one").adapter.current.digest)
    assert path.is_dir()
    svc.delete("one")
    assert [a.name for a in svc.list()] == ["two"]
    assert not path.exists()
    assert len(svc.blobs.digests()) == 2  # a's config and weights stay for "two"
    svc.delete("two")
    assert svc.list() == [] and svc.blobs.digests() == []
    assert events[-1].type == "adapter.deleted" and events[-1].name == "two"
    with pytest.raises(NotFound, match="no adapter named 'two'"):
        svc.delete("two")


def test_adapter_path_materializes_verified_weights(registry: Registry, adapter_dirs) -> None:
    svc = registry.adapters
    digest = svc.register("bot", adapter_dirs["big"]).version.digest
    path = svc.adapter_path(digest)
    assert adapter_digest(path) == digest
    assert (path / "adapter_model.safetensors").read_bytes() == (
        adapter_dirs["big"] / "adapter_model.safetensors"
    ).read_bytes()
    # a corrupted blob is detected when it is read again
    shutil.rmtree(path)
    weights_blob = next(d for d in svc.blobs.digests() if svc.blobs.path(d).stat().st_size > 1000)
    p = svc.blobs.path(weights_blob)
    p.chmod(0o644)
    p.write_bytes(p.read_bytes()[:-1] + b"\x00")
    with pytest.raises(BlobCorrupt, match="does not match its digest"):
        svc.adapter_path(digest)
    assert not path.exists()


def test_base_model_comes_from_settings_or_the_recorded_one(
    registry: Registry, adapter_dirs, settings
) -> None:
    registry.adapters.register("bot", adapter_dirs["a"])  # records LORAPLEX_MODEL
    bare = RegistrySettings(data_dir=settings.data_dir, database_url=settings.database_url, model_path=None)
    other = open_registry(bare, auto_upgrade=False)
    try:
        assert other.adapters.register("bot2", adapter_dirs["b"]).created
    finally:
        other.close()


def test_no_base_model_is_a_clear_error(registry: Registry, adapter_dirs, settings) -> None:
    bare = RegistrySettings(data_dir=settings.data_dir, database_url=settings.database_url, model_path=None)
    reg = open_registry(bare, auto_upgrade=False)
    try:
        with pytest.raises(RegistryError, match="set LORAPLEX_MODEL"):
            reg.adapters.register("bot", adapter_dirs["a"])
    finally:
        reg.close()


def test_missing_base_model_dir(registry: Registry, adapter_dirs, settings, tmp_path: Path) -> None:
    broken = RegistrySettings(
        data_dir=settings.data_dir, database_url=settings.database_url, model_path=tmp_path / "nothing"
    )
    reg = open_registry(broken, auto_upgrade=False)
    try:
        with pytest.raises(RegistryError, match=r"no config\.json"):
            reg.adapters.register("bot", adapter_dirs["a"])
        assert reg.adapters.list() == []
    finally:
        reg.close()
