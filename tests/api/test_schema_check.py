"""`SchemaChecker` on its own: cached by hash (one compile for many requests), bounded by a per-request
budget (400) and by the number of specs compiling at once (503), refusals named by field."""

from __future__ import annotations

import asyncio

import pytest

from api.errors import APIError
from api.schema_check import SchemaChecker
from api.structured import SchemaJob
from engine.structured import StructuredSpec
from engine.tokenizer import load_tokenizer
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema_check")
    build_checkpoint(d, "llama", vocab_size=100)
    save_char_tokenizer(d)
    return load_tokenizer(str(d))


def _job(schema: dict, param: str = "response_format.json_schema.schema") -> SchemaJob:
    return SchemaJob(StructuredSpec.json_schema(schema), param, True)


def _heavy(tag: str) -> dict:
    names = [f"{tag}{i}" for i in range(2400)]
    return {"type": "object", "properties": {k: {} for k in names}, "required": names}


def test_concurrent_requests_for_one_schema_compile_it_once(tokenizer):
    checker = SchemaChecker(tokenizer, 100)

    async def run() -> None:
        await asyncio.gather(*(checker.check([_job(_heavy("a"))]) for _ in range(6)))
        await checker.check([_job(_heavy("a"))])

    asyncio.run(run())
    assert checker.compiles == 1
    checker.close()


def test_refusals_are_cached_and_name_the_field(tokenizer):
    checker = SchemaChecker(tokenizer, 100)
    job = _job({"type": "string", "pattern": "^x{60000}$"}, "tools")
    for _ in range(2):
        with pytest.raises(APIError) as err:
            asyncio.run(checker.check([job]))
        assert err.value.status == 400 and err.value.param == "tools"
    assert checker.compiles == 1
    checker.close()


def test_budget_and_queue_bounds(tokenizer):
    slow = SchemaChecker(tokenizer, 100, budget_seconds=0.001)
    with pytest.raises(APIError) as err:
        asyncio.run(slow.check([_job(_heavy("b"))]))
    assert err.value.status == 400 and "took over" in str(err.value)
    slow.close()
    busy = SchemaChecker(tokenizer, 100, workers=1, max_pending=1)

    async def two() -> list:
        return await asyncio.gather(
            busy.check([_job(_heavy("c"))]), busy.check([_job(_heavy("d"))]), return_exceptions=True
        )

    first, second = asyncio.run(two())
    assert first is None
    assert isinstance(second, APIError) and second.status == 503
    busy.close()
