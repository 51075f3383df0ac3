"""The bundled demo (demo/base + four LoRA adapters) meets issue 7's quality bar, measured by our engine.

Every run draws fresh inputs: the seed comes from `LORAPLEX_DEMO_SEED` when set (to replay a failure),
otherwise from the OS, and is printed in every assertion message.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tools.train_demo import DEMO_OUTPUTS

pytestmark = pytest.mark.slow  # the demo model end to end

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo"
BASE = DEMO / "base"
SAMPLES_PER_MODEL = 200
BAR = 0.95
MAX_DEMO_BYTES = 10_000_000
LETTERS = "abcdefghijklmnopqrstuvwxyz"

EXPECTED = DEMO_OUTPUTS


def random_text(rng: random.Random) -> str:
    """1-3 words of 1-8 random lowercase letters joined by single spaces, at most 24 characters."""
    while True:
        n_words = rng.randint(1, 3)
        text = " ".join("".join(rng.choices(LETTERS, k=rng.randint(1, 8))) for _ in range(n_words))
        if len(text) <= 24:
            return text


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(model=str(BASE), device="cpu", dtype="float32", max_lora_rank=64)


def test_all_five_models_mixed_in_one_batch_meet_the_bar(llm) -> None:
    from engine import LoRARequest, SamplingParams

    seed = int(os.environ.get("LORAPLEX_DEMO_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    adapters = [name for name in EXPECTED if name is not None]
    requests = {name: LoRARequest(name, str(DEMO / "adapters" / name)) for name in adapters}
    # round-robin over the five models, so every engine step mixes base and adapter tokens
    jobs = [(name, random_text(rng)) for _ in range(SAMPLES_PER_MODEL) for name in EXPECTED]
    outs = llm.generate(
        [f"{text}=" for _, text in jobs],
        SamplingParams(max_tokens=32, temperature=0, stop=["\n"]),
        lora_request=[requests[name] if name else None for name, _ in jobs],
    )
    correct = dict.fromkeys(EXPECTED, 0)
    misses: dict[str | None, list[str]] = {name: [] for name in EXPECTED}
    for (name, text), out in zip(jobs, outs, strict=True):
        got = out.outputs[0].text
        if got == EXPECTED[name](text):
            correct[name] += 1
        else:
            misses[name].append(f"{text!r} -> {got!r}")
    accuracy = {name or "base": n / SAMPLES_PER_MODEL for name, n in correct.items()}
    below = {k: v for k, v in accuracy.items() if v < BAR}
    examples = {name or "base": m[:3] for name, m in misses.items() if m}
    assert not below, (
        f"LORAPLEX_DEMO_SEED={seed}: accuracy {accuracy} below {BAR:.0%} for {sorted(below)}; e.g. {examples}"
    )


def test_demo_directory_stays_under_10_mb() -> None:
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert 0 < size < MAX_DEMO_BYTES, f"demo/ holds {size} bytes"


def test_adapters_are_peft_checkpoints() -> None:
    for name in ("upper", "reverse", "rot13", "novowels"):
        folder = DEMO / "adapters" / name
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"], folder


def test_tokenizer_is_character_level_and_round_trips() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE))
    for text in ["abc xyz=", "hello world=hello world\n", "Mixed CASE, digits 0-9 & ~!", " a  b \n\n"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(text) + 1  # one token per character, after <s>
        assert tok.decode(ids, skip_special_tokens=True) == text
    vocab = tok.get_vocab()
    assert "\n" in vocab and "=" in vocab
    assert None not in (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]


def test_train_script_help() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_demo.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--seed" in proc.stdout and "--only" in proc.stdout
