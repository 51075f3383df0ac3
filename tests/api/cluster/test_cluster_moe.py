"""Ray replicas serve a mixture-of-experts base model: `loraplex serve --replicas 2` on a tiny random
Qwen3-MoE with an expert adapter (PEFT's `target_parameters` on the fused experts) and an attention adapter
registered; concurrent greedy requests for both adapters and the base model, spread over both replicas by
the router, answer PEFT's tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.cluster.conftest import Cluster, running_cluster
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

pytestmark = pytest.mark.slow  # a local Ray cluster and the PEFT oracle

PROMPTS = ([5, 17, 33, 8], [9, 9, 40, 2, 61], [70, 3, 11])
NEW = 8


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):
    """(tiny Qwen3-MoE base, {adapter name: PEFT dir}, PEFT oracle)."""
    root = tmp_path_factory.mktemp("cluster-moe")
    base = build_checkpoint(root / "base", "qwen3_moe")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {
        "experts": build_adapter(base, root / "experts", r=4, lora_alpha=8, target_parameters=experts),
        "attention": build_adapter(
            base, root / "attention", seed=1, r=8, target_modules=["q_proj", "v_proj"]
        ),
    }
    return base, adapters, PeftGreedyOracle(base)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, moe):
    base, adapters, _ = moe
    with running_cluster(tmp_path_factory, model=base, adapters=adapters, replicas=2) as c:
        yield c


def test_replicas_answer_peft_tokens_for_expert_and_attention_adapters(cluster: Cluster, moe) -> None:
    _, adapters, oracle = moe
    base_name = cluster.settings.served_model_name
    jobs = [(name, p) for name in (*adapters, None) for p in PROMPTS] * 2

    def complete(job: tuple[str | None, list[int]]) -> list[int]:
        name, prompt = job
        body = {"model": name or base_name, "prompt": prompt, "max_tokens": NEW, "temperature": 0}
        r = httpx.post(f"{cluster.url}/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(complete, jobs))
    for (name, prompt), tokens in zip(jobs, got, strict=True):
        assert tokens == oracle.greedy(prompt, NEW, adapters[name] if name else None), (name, prompt)
    replicas = cluster.replicas()
    assert len(replicas) == 2, replicas
    held = [a for r in replicas for a in r["adapters"] if "experts" in a["names"] and a["tier"] == "device"]
    assert held and all(a["memory_bytes"] > 0 for a in held), replicas
