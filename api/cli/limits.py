"""`loraplex adapters limit NAME …` and `loraplex keys limit KEY …`: show or change rate limits.

Options given change that limit (0 removes it); options left out stay as they are; with no option the
current limits are shown. (No `from __future__ import annotations` here: the option help texts are
built per command, and Typer must see them evaluated.)
"""

from typing import Annotated

import typer

from api.cli.output import handle_errors, print_json, stdout
from api.cli.state import state_of
from lora_registry.limits import MAX_LIMIT, LimitInfo


def describe(info: LimitInfo) -> str:
    """One line: "support (adapter): 60 requests/min, 1000 tokens/min, no concurrency limit"."""
    parts = [
        f"{info.requests_per_minute} requests/min" if info.requests_per_minute else "no request limit",
        f"{info.tokens_per_minute} tokens/min" if info.tokens_per_minute else "no token limit",
        f"at most {info.max_concurrent} concurrent" if info.max_concurrent else "no concurrency limit",
    ]
    return f"[bold]{info.name}[/] ({info.kind}): " + ", ".join(parts)


def _command(kind: str, what: str):
    @handle_errors
    def limit(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help=f"The {what}'s name.")],
        requests_per_minute: Annotated[
            int | None, typer.Option("--requests-per-minute", min=0, max=MAX_LIMIT, help="0 removes it.")
        ] = None,
        tokens_per_minute: Annotated[
            int | None,
            typer.Option(
                "--tokens-per-minute", min=0, max=MAX_LIMIT, help="Prompt + max_tokens charged; 0 removes it."
            ),
        ] = None,
        max_concurrent: Annotated[
            int | None, typer.Option("--max-concurrent", min=0, max=MAX_LIMIT, help="0 removes it.")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        backend = state_of(ctx).backend()
        if requests_per_minute is None and tokens_per_minute is None and max_concurrent is None:
            info = backend.get_limits(kind, name)
        else:
            info = backend.set_limits(kind, name, requests_per_minute, tokens_per_minute, max_concurrent)
        if as_json:
            print_json(info.to_dict())
        else:
            stdout().print(describe(info))

    limit.__doc__ = (
        f"Show or set the rate limits of {what} NAME: requests and tokens per minute, concurrent requests."
    )
    return limit


adapter_limit = _command("adapter", "adapter")
key_limit = _command("key", "API key")
