"""Local `$ref`s of JSON schemas: hoisting a nested schema's definitions, and finding self-references.

- `hoist(schema, prefix)`: a schema nested inside another (a tool's `parameters` inside its call schema)
  keeps its own `$defs` / `definitions`, but its `$ref`s are resolved against the *outer* document's
  root. `hoist` moves the definitions to `prefix.NAME` (and, when something refers to the nested
  schema's root, the schema itself to `prefix`) and rewrites every local `$ref` to match.
- `self_reference(schema)`: the first `$ref` whose chain of references leads back to where it started
  without going through any property or item (`{"$ref": "#"}`, a definition whose `$ref` is itself):
  such a schema is infinitely recursive with no base case, so no output can ever match it.
"""

from __future__ import annotations

from typing import Any

DEF_KEYS = ("$defs", "definitions")
DATA_KEYS = ("const", "enum", "default", "examples")  # values there are JSON data, not schemas
MAX_CHAIN = 1000  # references followed from one `$ref`


def hoist(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the schema to nest, definitions for the outer document's `$defs`). `prefix` must not contain
    `/` or `~`. A schema with no local `$ref` and no definitions is returned as it is, with none."""
    if not any(k in schema for k in DEF_KEYS) and not _has_local_ref(schema):
        return schema, {}
    defs: dict[str, Any] = {}
    for key in DEF_KEYS:
        found = schema.get(key)
        if isinstance(found, dict):
            for name, sub in found.items():
                defs[f"{prefix}.{name}"] = _rewrite(sub, prefix)
    body = _rewrite({k: v for k, v in schema.items() if k not in DEF_KEYS}, prefix)
    defs[prefix] = body
    return {"$ref": f"#/$defs/{prefix}"}, defs


def _rewrite_ref(ref: str, prefix: str) -> str:
    pointer = ref[1:]
    for key in DEF_KEYS:
        head = f"/{key}/"
        if pointer.startswith(head):
            return f"#/$defs/{prefix}.{pointer[len(head) :]}"
    return f"#/$defs/{prefix}{pointer}"


def _rewrite(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_rewrite(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = _rewrite_ref(v, prefix)
        elif k in DATA_KEYS:
            out[k] = v
        else:
            out[k] = _rewrite(v, prefix)
    return out


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    if not isinstance(node, dict):
        return False
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            return True
        if k not in DATA_KEYS and _has_local_ref(v):
            return True
    return False


def self_reference(schema: dict[str, Any]) -> str | None:
    """The first local `$ref` that leads back to itself through `$ref`s alone, else None."""
    for node in _schemas(schema):
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            continue
        seen = {id(node)}
        target: Any = node
        for _ in range(MAX_CHAIN):
            nxt = target.get("$ref") if isinstance(target, dict) else None
            if not isinstance(nxt, str) or not nxt.startswith("#"):
                break
            target = resolve(schema, nxt)
            if target is None:
                break
            if id(target) in seen:
                return ref
            seen.add(id(target))
    return None


def resolve(root: dict[str, Any], ref: str) -> Any:
    """The node local reference `ref` (`#`, `#/a/b`) names in `root`, or None."""
    node: Any = root
    pointer = ref[1:]
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None  # an anchor name: left to the compiler
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _schemas(node: Any) -> list[dict[str, Any]]:
    """Every dict in `node` outside data keywords, iteratively (a deep schema is no recursion risk)."""
    out: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, list):
            stack.extend(cur)
        elif isinstance(cur, dict):
            out.append(cur)
            stack.extend(v for k, v in cur.items() if k not in DATA_KEYS)
    return out
