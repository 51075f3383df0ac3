"""Copy-paste snippets for calling one adapter's endpoint: curl and the official `openai` client."""

from __future__ import annotations

import json


def endpoint_snippets(base_url: str, name: str) -> dict[str, str]:
    """{"curl": ..., "python": ...} calling `<base_url>/v1/adapters/<name>/completions`."""
    url = f"{base_url}/v1/adapters/{name}"
    body = json.dumps({"prompt": "Hello", "max_tokens": 32})
    curl = (
        f"curl {url}/completions \\\n"
        '  -H "Authorization: Bearer $LORAPLEX_API_KEY" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        f"  -d '{body}'"
    )
    python = (
        "import os\n"
        "from openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{url}", api_key=os.environ["LORAPLEX_API_KEY"])\n'
        f'reply = client.completions.create(model="{name}", prompt="Hello", max_tokens=32)\n'
        "print(reply.choices[0].text)"
    )
    return {"curl": curl, "python": python}
