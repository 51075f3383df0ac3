"""The `--server URL --token T` backend: the registry commands over a running server's HTTP admin API.

Every method maps to one `/admin/api/...` call and returns the same schema types as `LocalBackend`
(read back with their `from_dict`), so each command prints exactly what it prints in local mode.
Every failure (no connection, a refused token, an OpenAI-style error body) becomes a one-line
`CliError`.
"""

from __future__ import annotations

import builtins  # `list` is also a method name in this module's classes
import contextlib
import os
import zipfile
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

import httpx

from api.cli.output import CliError
from lora_registry.limits import LimitInfo
from lora_registry.names import validate_name
from lora_registry.progress import ProgressReporter
from lora_registry.schemas import AdapterDetail, AdapterInfo, ApiKeyInfo, CreatedKey, RegisterResult
from lora_registry.usage import UsageReport

T = TypeVar("T")

# The PEFT file names (as in engine.lora.adapter_checkpoint, which imports torch: not needed here).
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")

TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# A registration uploads, then the server copies, hashes and validates the adapter before it answers.
UPLOAD_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def normalize_url(server: str) -> str:
    """`host:port` → `http://host:port`; no trailing slash. Refuses anything but http(s)."""
    url = server.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise CliError(f"--server {server!r} is not a valid URL ({exc})") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise CliError(f"--server {server!r} is not an http:// or https:// URL")
    return url


class _ProgressFile:
    """A binary file that reports each `read` to a progress callback (for httpx's multipart encoder).

    `fileno` lets httpx size the upload without reading it, so the request has a Content-Length.
    """

    def __init__(self, f: IO[bytes], advance: Callable[[int], None]) -> None:
        self._f = f
        self._advance = advance

    def read(self, n: int = -1) -> bytes:
        chunk = self._f.read(n)
        self._advance(len(chunk))
        return chunk

    def fileno(self) -> int:
        return self._f.fileno()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def upload_files(path: Path) -> list[Path]:
    """What to upload for PATH: a zip as it is, or a PEFT directory's two files.

    Refuses what the server would refuse without sending anything, with the local mode's messages.
    """
    if path.is_dir():
        cfg, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not cfg.is_file():
            raise CliError(f"{CONFIG_FILE}: missing in {path}")
        if not weights.is_file():
            pickled = [p for p in PICKLE_FILES if (path / p).exists()]
            if pickled:
                raise CliError(
                    f"{pickled[0]}: pickle weights are refused (unsafe to load); save as {WEIGHTS_FILE}"
                )
            raise CliError(f"{WEIGHTS_FILE}: missing in {path}")
        return [cfg, weights]
    if path.is_file() and zipfile.is_zipfile(path):
        return [path]
    if path.exists():
        raise CliError(f"{path}: not a PEFT adapter directory or a zip file")
    raise CliError(f"{path}: no such file or directory")


class RemoteBackend:
    """Drives the server at `url` with the admin token `token` (one HTTP connection per invocation)."""

    def __init__(self, url: str, token: str, transport: httpx.BaseTransport | None = None) -> None:
        if not token.isascii() or not token.isprintable():
            raise CliError("the admin token has characters that cannot be sent in an HTTP header")
        self.url = url
        self._client = httpx.Client(
            base_url=f"{url}/admin/api",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=TIMEOUT,
            transport=transport,
            follow_redirects=False,
        )

    # -- HTTP plumbing -------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One admin API call; returns the decoded JSON body or raises a one-line `CliError`."""
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(
                f"cannot connect to the server at {self.url}: {_reason(exc)} "
                "(is `loraplex serve` running there? check --server / LORAPLEX_SERVER)"
            ) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"the server at {self.url} did not answer in time ({_reason(exc)})") from exc
        except httpx.HTTPError as exc:
            raise CliError(f"request to {self.url} failed: {_reason(exc)}") from exc
        if response.is_success:
            try:
                return response.json()
            except ValueError as exc:
                raise CliError(
                    f"{self.url} answered {method} {response.url.path} with something other than JSON; "
                    "is --server a loraplex server?"
                ) from exc
        raise CliError(self._error_message(response))

    def _error_message(self, response: httpx.Response) -> str:
        """The server's OpenAI-style error message, with advice for token and routing problems."""
        message = _server_message(response)
        status = response.status_code
        if status == 401:
            return (
                f"the server at {self.url} wants an admin token: pass --token or set LORAPLEX_TOKEN "
                "(or LORAPLEX_ADMIN_TOKEN)"
            )
        if status == 403:
            return (
                f"the server at {self.url} refused the admin token ({message or 'forbidden'}); "
                "check --token / LORAPLEX_TOKEN / LORAPLEX_ADMIN_TOKEN"
            )
        if message is None or (status in (404, 405) and message in ("Not Found", "Method Not Allowed")):
            what = message or response.reason_phrase or "no error message"
            return (
                f"{self.url} answered {response.request.method} {response.url.path} with HTTP {status} "
                f"({what}); is --server a loraplex server with the admin API?"
            )
        return message

    def _parse(self, parse: Callable[[Any], T], body: Any) -> T:
        try:
            return parse(body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CliError(f"unexpected response from {self.url}: {type(exc).__name__}: {exc}") from exc

    # -- Backend -------------------------------------------------------------------------------

    def register(
        self, name: str, path: Path, description: str | None, activate: bool, progress: ProgressReporter
    ) -> RegisterResult:
        validate_name(name)
        files = upload_files(Path(path))
        data = {"name": name, "activate": "true" if activate else "false"}
        if description is not None:
            data["description"] = description
        advance = progress.phase("uploading", sum(f.stat().st_size for f in files))
        with _open_all(files) as handles:
            parts = [
                ("file", (_upload_name(f), _ProgressFile(h, advance), "application/octet-stream"))
                for f, h in zip(files, handles, strict=True)
            ]
            body = self._request("POST", "/adapters", data=data, files=parts, timeout=UPLOAD_TIMEOUT)
        return self._parse(RegisterResult.from_dict, body)

    def list(self) -> list[AdapterInfo]:
        body = self._request("GET", "/adapters")
        return self._parse(lambda b: [AdapterInfo.from_dict(a) for a in b["data"]], body)

    def show(self, name: str) -> AdapterDetail:
        return self._parse(AdapterDetail.from_dict, self._request("GET", f"/adapters/{_seg(name)}"))

    def activate(self, name: str) -> AdapterInfo:
        return self._parse(AdapterInfo.from_dict, self._request("POST", f"/adapters/{_seg(name)}/activate"))

    def deactivate(self, name: str) -> AdapterInfo:
        body = self._request("POST", f"/adapters/{_seg(name)}/deactivate")
        return self._parse(AdapterInfo.from_dict, body)

    def delete(self, name: str) -> None:
        self._request("DELETE", f"/adapters/{_seg(name)}")

    def rollback(self, name: str, version: int) -> AdapterInfo:
        body = self._request("POST", f"/adapters/{_seg(name)}/rollback", json={"version": version})
        return self._parse(AdapterInfo.from_dict, body)

    def create_key(self, name: str, admin: bool, adapters: Sequence[str]) -> CreatedKey:
        body = self._request("POST", "/keys", json={"name": name, "admin": admin, "adapters": list(adapters)})
        return self._parse(CreatedKey.from_dict, body)

    def list_keys(self) -> builtins.list[ApiKeyInfo]:
        body = self._request("GET", "/keys")
        return self._parse(lambda b: [ApiKeyInfo.from_dict(k) for k in b["data"]], body)

    def revoke_key(self, name: str) -> ApiKeyInfo:
        return self._parse(ApiKeyInfo.from_dict, self._request("DELETE", f"/keys/{_seg(name, 'key name')}"))

    def usage(
        self,
        by: str,
        start: datetime,
        end: datetime,
        bucket: str | None,
        adapter: str | None,
        key: str | None,
    ) -> UsageReport:
        params = {"by": by, "from": start.isoformat(), "to": end.isoformat()}
        params |= {k: v for k, v in (("bucket", bucket), ("adapter", adapter), ("key", key)) if v}
        return self._parse(UsageReport.from_dict, self._request("GET", "/usage", params=params))

    def get_limits(self, kind: str, name: str) -> LimitInfo:
        return self._parse(LimitInfo.from_dict, self._request("GET", _limits_path(kind, name)))

    def set_limits(
        self, kind: str, name: str, rpm: int | None, tpm: int | None, conc: int | None
    ) -> LimitInfo:
        body = {
            f: v
            for f, v in (("requests_per_minute", rpm), ("tokens_per_minute", tpm), ("max_concurrent", conc))
            if v is not None
        }
        return self._parse(LimitInfo.from_dict, self._request("PATCH", _limits_path(kind, name), json=body))

    def close(self) -> None:
        self._client.close()


def _limits_path(kind: str, name: str) -> str:
    what = "key name" if kind == "key" else "adapter name"
    return f"/{'keys' if kind == 'key' else 'adapters'}/{_seg(name, what)}/limits"


def _seg(name: str, what: str = "adapter name") -> str:
    """`name` as one URL path segment; a name with a `/` (never valid) is refused before it can reroute."""
    if "/" in name:
        validate_name(name, what)
    return quote(name, safe="")


def _upload_name(path: Path) -> str:
    """The multipart filename: the server tells a zip from the PEFT pair by the `.zip` suffix."""
    if path.name in (CONFIG_FILE, WEIGHTS_FILE) or path.suffix.lower() == ".zip":
        return path.name
    return f"{path.name}.zip"


@contextlib.contextmanager
def _open_all(paths: Sequence[Path]) -> Iterator[list[IO[bytes]]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(p.open("rb")) for p in paths]


def _server_message(response: httpx.Response) -> str | None:
    """`error.message` of an OpenAI-style error body (or FastAPI's `detail`), else None."""
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return None


def _reason(exc: BaseException) -> str:
    """A short reason: `[Errno 111] Connection refused` → `connection refused`."""
    text = str(exc).strip() or type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    text = text.splitlines()[0]
    return text[:1].lower() + text[1:]
