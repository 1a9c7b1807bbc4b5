"""SGLang's HTTP protocol, read from SGLang's own source, for conformance tests.

The pinned release's wheel is fetched without its dependencies (`pip download --no-deps`) into a
cache, and its `http_server.py` (routes, their methods, the request type each takes, the status
codes each can answer) and `io_struct.py` (each request type's fields and annotations) are parsed
with `ast`. Nothing of SGLang is imported or copied: what miles sends and what the built-in engine
answers are checked against this reading.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
_SERVER = "sglang/srt/entrypoints/http_server.py"
_STRUCTS = "sglang/srt/managers/io_struct.py"
_SAMPLING = "sglang/srt/sampling/sampling_params.py"
_OPENAI = "sglang/srt/entrypoints/openai/protocol.py"
_HTTP_STATUS = {"OK": 200, "BAD_REQUEST": 400, "NOT_FOUND": 404, "SERVICE_UNAVAILABLE": 503,
                "INTERNAL_SERVER_ERROR": 500, "UNAUTHORIZED": 401}


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / f"sglang-{SGLANG_VERSION}"


def fetch_wheel() -> Path:
    """The sglang wheel, downloaded once into the cache. Without the registry the test is skipped
    with the reason, except under CI (CI=true), where that is a failure: CI can reach the registry."""
    where = cache_dir()
    wheels = sorted(where.glob("sglang-*.whl"))
    if not wheels:
        where.mkdir(parents=True, exist_ok=True)
        # Downloaded aside and renamed in: a test worker beside this one never sees half a wheel.
        with tempfile.TemporaryDirectory(dir=where) as partial:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                   f"sglang=={SGLANG_VERSION}", "-d", partial], capture_output=True, text=True,
                                  timeout=600)
            for wheel in Path(partial).glob("sglang-*.whl"):
                os.replace(wheel, where / wheel.name)
        wheels = sorted(where.glob("sglang-*.whl"))
        if proc.returncode != 0 or not wheels:
            why = f"pip download sglang=={SGLANG_VERSION} failed: {(proc.stderr or proc.stdout).strip()[-400:]}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(why)
            pytest.skip(why + " (no package registry here; CI runs this test)")
    return wheels[-1]


@dataclass
class Route:
    path: str
    methods: set[str]
    body_type: str | None  # the request struct the handler takes as its JSON body, if any
    status_codes: set[int] = field(default_factory=set)  # the codes its handler names explicitly


@dataclass
class Protocol:
    routes: dict[str, Route]
    structs: dict[str, dict[str, ast.expr]]  # struct -> field -> annotation (inherited fields included)
    sampling: dict[str, ast.expr]  # /generate's sampling_params: field -> annotation
    # Names a field's annotation may use: type aliases (MultimodalDataInputFormat = Union[...]) and the
    # OpenAI-compatible request models (ChatCompletionMessageContentImagePart, ...), for `matches`.
    names: dict[str, ast.expr | dict[str, ast.expr]] = field(default_factory=dict)

    def fields(self, path: str) -> dict[str, ast.expr]:
        route = self.routes[path]
        return self.structs.get(route.body_type, {}) if route.body_type else {}


def read_protocol(wheel: Path) -> Protocol:
    with zipfile.ZipFile(wheel) as z:
        server = ast.parse(z.read(_SERVER).decode())
        structs = ast.parse(z.read(_STRUCTS).decode())
        sampling = ast.parse(z.read(_SAMPLING).decode())
        openai = ast.parse(z.read(_OPENAI).decode())
    names: dict = {**_aliases(structs), **_aliases(openai), **_structs(openai)}
    return Protocol(_routes(server), _structs(structs), _structs(sampling)["SamplingParams"], names)


def _aliases(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level type aliases: `Name = Union[...]` / `List[...]`."""
    return {node.targets[0].id: node.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)}


def _literal_path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    # os.environ.get("NAME", "/default") routes: their default path
    if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
        return node.args[1].value
    return None


def _body_type(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    for arg in fn.args.args:
        ann = arg.annotation
        if ann is None:
            continue
        # Annotated[X, Body()] and Annotated[Optional[X], Body()]
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            ann = ann.slice.elts[0]
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Optional":
            ann = ann.slice
        name = ast.unparse(ann)
        if name.endswith(("ReqInput", "Req")) or name in ("AbortReq",):
            return name
    return None


def _status_codes(fn) -> set[int]:
    codes = set()
    for node in ast.walk(fn):
        # `status_code=...` in a response, or `status_code = ...` assigned first (the LoRA handlers' form).
        named = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "status_code"
                                                     for t in node.targets)
        if named or isinstance(node, ast.keyword) and node.arg == "status_code":
            for value in ast.walk(node.value):
                if isinstance(value, ast.Constant) and isinstance(value.value, int):
                    codes.add(value.value)
                if isinstance(value, ast.Attribute) and value.attr in _HTTP_STATUS:
                    codes.add(_HTTP_STATUS[value.attr])
    return codes


def _routes(tree: ast.Module) -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args):
                continue
            path = _literal_path(dec.args[0])
            if path is None:
                continue
            kind = dec.func.attr
            if kind == "api_route":
                methods = {"GET"}
                for kw in dec.keywords:
                    if kw.arg == "methods":
                        methods = {e.value for e in kw.value.elts}
            else:
                methods = {kind.upper()}
            route = routes.setdefault(path, Route(path, set(), _body_type(fn), _status_codes(fn)))
            route.methods |= methods
    return routes


def _structs(tree: ast.Module) -> dict[str, dict[str, ast.expr]]:
    own: dict[str, tuple[list[str], dict[str, ast.expr]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields = {s.target.id: s.annotation for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            own[node.name] = ([ast.unparse(b) for b in node.bases], fields)

    def resolved(name: str) -> dict[str, ast.expr]:
        bases, fields = own[name]
        out: dict[str, ast.expr] = {}
        for b in bases:
            if b in own:
                out.update(resolved(b))
        out.update(fields)
        return out

    return {name: resolved(name) for name in own}


# ---- JSON type matching ---------------------------------------------------------------------------

def matches(value, ann: ast.expr, names: dict | None = None) -> bool:
    """Whether a JSON value has the type SGLang's annotation declares (unknown names match anything).
    With `names` (Protocol.names), aliases are followed and a model's JSON object must hold only its
    declared fields, each of its declared type."""
    names = names or {}
    if isinstance(ann, ast.Constant) and ann.value is None:
        return value is None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        return matches(value, ast.parse(ann.value, mode="eval").body, names)
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return matches(value, ann.left, names) or matches(value, ann.right, names)
    if isinstance(ann, ast.Name):
        known = names.get(ann.id)
        if isinstance(known, dict):  # a request model: a JSON object of its fields
            return isinstance(value, dict) and all(k in known and matches(v, known[k], names) for k, v in value.items())
        if known is not None:
            return matches(value, known, names)
        return _scalar(value, ann.id)
    if isinstance(ann, ast.Subscript):
        head = ast.unparse(ann.value).split(".")[-1]
        args = list(ann.slice.elts) if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            return value is None or matches(value, args[0], names)
        if head == "Union":
            return any(matches(value, a, names) for a in args)
        if head == "Annotated":
            return matches(value, args[0], names)
        if head in ("List", "list", "Sequence", "Set", "set"):
            return isinstance(value, list) and all(matches(v, args[0], names) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(matches(v, args[-1], names) for v in value.values())
        if head == "Literal":
            return value in [a.value for a in args if isinstance(a, ast.Constant)]
    return True


def _scalar(value, name: str) -> bool:
    if name == "str":
        return isinstance(value, str)
    if name == "bool":
        return isinstance(value, bool)
    if name == "int":
        return type(value) is int
    if name == "float":
        return type(value) in (int, float)
    if name in ("dict", "Dict"):
        return isinstance(value, dict)
    if name in ("list", "List"):
        return isinstance(value, list)
    return True  # Any, or a type alias this reading does not follow
