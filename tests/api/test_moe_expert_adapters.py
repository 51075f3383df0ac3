"""Expert LoRA through the product on a mixture-of-experts base model: an adapter on the experts (PEFT's
`target_parameters`) uploads through the admin API, serves PEFT's tokens and is reported in the pool
with its device memory; adapters on the router or a dense layer's MLP are refused by the admin API (422)
and by the CLI (an error line, non-zero exit), naming the module, and nothing is registered."""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from api.cli import app
from tests.api.test_structured_output import PERSON
from tests.helpers.live_server import start_server, wait_until
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

pytestmark = pytest.mark.slow  # a live server and the PEFT oracle

PROMPT = [5, 17, 33, 8]
REFUSED = {
    "router-param": r"target_parameters: 'mlp.gate.weight': LoRA on the router is not supported",
    "dense-mlp": r"module 'model.layers.1.mlp.gate_proj' is part of the mixture-of-experts",
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):
    """(tiny Qwen3-MoE base, {name: adapter dir}, PEFT oracle)."""
    root = tmp_path_factory.mktemp("moe-served")
    base = build_checkpoint(root / "base", "qwen3_moe", vocab_size=100)
    save_char_tokenizer(base)  # for the structured-output requests
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    dirs = {
        "experts": build_adapter(
            base, root / "experts", r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=experts
        ),
        "router-param": build_adapter(
            base, root / "router-param", r=4, target_modules=["q_proj"], target_parameters=["mlp.gate.weight"]
        ),
    }
    dense = root / "dense-mlp"  # layer 1 is a dense layer (`mlp_only_layers`): its MLP takes no LoRA
    shutil.copytree(dirs["experts"], dense)
    cfg = json.loads((dense / "adapter_config.json").read_text())
    (dense / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": ["q_proj", "gate_proj"]}))
    pre = "base_model.model.model.layers.1.mlp.gate_proj"
    weights = load_file(dense / "adapter_model.safetensors")
    weights |= {f"{pre}.lora_A.weight": torch.ones(4, 64), f"{pre}.lora_B.weight": torch.ones(128, 4)}
    save_file(weights, str(dense / "adapter_model.safetensors"))
    dirs["dense-mlp"] = dense
    return base, dirs, PeftGreedyOracle(base)


@pytest.fixture(scope="module")
def server(moe, tmp_path_factory):
    srv = start_server(moe[0], tmp_path_factory.mktemp("moe-data"))
    yield srv
    srv.stop()


def _zip(adapter_dir: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            z.write(adapter_dir / f, f"peft/{f}")
    return buf.getvalue()


def test_expert_adapter_uploads_serves_and_reports_memory(server, moe):
    _, dirs, oracle = moe
    admin = server.admin()
    files = {"file": ("experts.zip", _zip(dirs["experts"]), "application/zip")}
    r = admin.post("/admin/api/adapters", data={"name": "moe-bot", "activate": "true"}, files=files)
    assert r.status_code == 201, r.text
    body = {"model": "moe-bot", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle.greedy(PROMPT, 6, dirs["experts"])

    def resident() -> dict | None:
        pool = admin.get("/admin/api/pool")
        if pool.status_code != 200:
            return None
        return next((a for a in pool.json()["adapters"] if a["active_name"] == "moe-bot"), None)

    assert wait_until(lambda: (a := resident()) is not None and a["memory_bytes"] > 0, timeout=30)
    entry = resident()
    assert entry is not None and entry["tier"] == "device" and entry["rank"] == 4


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_admin_api_refuses_router_and_dense_mlp_adapters(case, server, moe):
    admin = server.admin()
    files = {"file": (f"{case}.zip", _zip(moe[1][case]), "application/zip")}
    r = admin.post("/admin/api/adapters", data={"name": case}, files=files)
    assert r.status_code == 422, r.text
    assert re.search(REFUSED[case], r.json()["error"]["message"]), r.json()
    names = [a["name"] for a in admin.get("/admin/api/adapters").json()["data"]]
    assert case not in names


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_cli_refuses_router_and_dense_mlp_adapters(case, moe, tmp_path):
    base, dirs, _ = moe
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(base)}
    result = CliRunner().invoke(app, ["adapters", "register", case, str(dirs[case])], env=env)
    assert result.exit_code == 1 and "Traceback" not in result.output
    last = [ln for ln in result.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error:")
    assert re.search(REFUSED[case], " ".join(result.stderr.split())), result.stderr
    listed = CliRunner().invoke(app, ["adapters", "list", "--json"], env=env)
    assert listed.exit_code == 0 and json.loads(listed.stdout) == []


@pytest.fixture(scope="module")
def ep_server(moe, tmp_path_factory):
    """`serve -tp 2 --enable-expert-parallel --expert-placement round_robin` on the MoE base."""
    srv = start_server(
        moe[0],
        tmp_path_factory.mktemp("moe-ep-data"),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        expert_placement="round_robin",
    )
    yield srv
    srv.stop()


def test_expert_parallel_server_serves_expert_adapter(ep_server, moe):
    """Under expert parallel an uploaded expert adapter answers PEFT's tokens next to the base model's,
    and the pool reports its (rank 0's) device memory."""
    _, dirs, oracle = moe
    admin = ep_server.admin()
    files = {"file": ("experts.zip", _zip(dirs["experts"]), "application/zip")}
    r = admin.post("/admin/api/adapters", data={"name": "ep-bot", "activate": "true"}, files=files)
    assert r.status_code == 201, r.text
    base_name = ep_server.state.settings.served_model_name
    for model, adapter in (("ep-bot", dirs["experts"]), (base_name, None)):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{ep_server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == oracle.greedy(PROMPT, 6, adapter), model

    def reported() -> bool:
        pool = admin.get("/admin/api/pool")
        adapters = pool.json()["adapters"] if pool.status_code == 200 else []
        return any(a["active_name"] == "ep-bot" and a["memory_bytes"] > 0 for a in adapters)

    assert wait_until(reported, timeout=30)


@pytest.mark.parametrize("which", ["server", "ep_server"])
def test_structured_output_on_the_moe_model(which, request, moe):
    """`response_format` json_schema on the MoE base and on an expert adapter (one device, and expert
    parallel): every constrained output validates, while a free request in the same batch gives the
    tokens it gives alone. The model is random, so only the grammar can make the outputs valid."""
    srv = request.getfixturevalue(which)
    files = {"file": ("experts.zip", _zip(moe[1]["experts"]), "application/zip")}
    r = srv.admin().post("/admin/api/adapters", data={"name": "json-bot", "activate": "true"}, files=files)
    assert r.status_code == 201, r.text
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    free = dict(
        model="json-bot", prompt="who?", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    alone = client.completions.create(**free).choices[0].text
    jobs = [
        dict(
            model=m,
            prompt=f"person {i}:",
            max_tokens=200,
            temperature=t,
            seed=i,
            extra_body={"response_format": fmt},
        )
        for i, (m, t) in enumerate(
            [(srv.state.settings.served_model_name, 0), ("json-bot", 0), ("json-bot", 1.0)]
        )
    ]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        outs = list(pool.map(lambda kw: client.completions.create(**kw).choices[0], [*jobs, free]))
    assert outs[-1].text == alone
    for out in outs[:-1]:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
