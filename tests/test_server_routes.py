"""The server's structure (issue 27): the app mounts exactly the routes it always had, with the
same methods, from three ``APIRouter`` s (OpenAI, SGLang-native, operational) whose handlers
are module-level functions taking the shared state as a dependency; and the server package
stays small: files <= 500 lines, functions <= 80 lines, no private name imported from another
server module."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import httpx
from fastapi.routing import APIRoute

from specdial.server import app as app_module
from specdial.server import openai_api, ops_api, sglang_api
from specdial.server.state import ServerState, get_state
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled

SERVER = Path(app_module.__file__).parent

# Every route of the app before the routers (main at cf1e326), with its methods, and the ones
# added since.
ROUTES = {
    ("/health", ("GET",)), ("/metrics", ("GET",)),
    ("/v1/models", ("GET",)), ("/v1/models/{model_id:path}", ("GET",)),
    ("/v1/completions", ("POST",)), ("/v1/chat/completions", ("POST",)),
    ("/generate", ("POST", "PUT")),
    ("/server_info", ("GET",)), ("/get_server_info", ("GET",)),
    ("/get_model_info", ("GET",)), ("/version", ("GET",)),
    ("/tokenize", ("POST",)), ("/v1/tokenize", ("POST",)),
    ("/detokenize", ("POST",)), ("/v1/detokenize", ("POST",)),
    ("/tokenizer_info", ("GET",)),
    ("/flush_cache", ("GET", "POST")),  # issue 30: SGLang's
    ("/health_generate", ("GET",)), ("/abort_request", ("POST",)),  # SGLang's
    ("/ping", ("GET", "POST")),  # vLLM's
}
ROUTERS = {"openai": openai_api.router, "sglang": sglang_api.router, "ops": ops_api.router}


def _flat(routes: list) -> list:
    """The routes, an included router's expanded (FastAPI >= 0.16x keeps an included router as
    one entry holding ``original_router``; older versions copy its routes)."""
    out = []
    for r in routes:
        sub = getattr(r, "original_router", None)
        out += _flat(sub.routes) if sub is not None else [r]
    return out


def _routes(routes: list) -> set[tuple[str, tuple[str, ...]]]:
    flat = _flat(routes)
    assert all(isinstance(r, APIRoute) for r in flat), flat  # no docs / openapi routes
    return {(r.path, tuple(sorted(r.methods))) for r in flat}


def test_the_app_mounts_the_same_routes_with_the_same_methods():
    app = app_module.create_app(FakeEngine(), shutdown_engine_on_exit=False)
    assert _routes(app.routes) == ROUTES


def _example(path: str) -> str:
    return path.replace("{model_id:path}", "specdial-default")


def test_every_route_answers_its_methods_and_only_those():
    """Over HTTP: each route's methods reach a handler (no routing 404 / 405; an empty body
    is a 400 of the handler), any other method is a 405; an unknown path a 404."""
    with LiveServer(FakeEngine(), shutdown_timeout=scaled(2)) as live, \
            httpx.Client(base_url=live.url, timeout=scaled(10)) as c:
        for path, methods in sorted(ROUTES):
            for method in ("GET", "POST", "PUT", "DELETE"):
                kwargs = {"json": {}} if method in ("POST", "PUT") else {}
                r = c.request(method, _example(path), **kwargs)
                if method in methods:
                    assert r.status_code in (200, 400), (method, path, r.status_code, r.text)
                else:
                    assert r.status_code == 405, (method, path, r.status_code, r.text)
                    assert r.json()["error"]["code"] == "405"
        r = c.get("/v1/no_such_route")
        assert r.status_code == 404 and r.json()["error"]["code"] == "404"


def test_every_route_comes_from_one_router_with_a_module_level_handler():
    mounted: dict[str, set] = {name: _routes(r.routes) for name, r in ROUTERS.items()}
    assert set().union(*mounted.values()) == ROUTES
    names = list(mounted)
    for i, a in enumerate(names):  # each route in one router only
        for b in names[i + 1:]:
            assert not mounted[a] & mounted[b], (a, b)
    assert all(p.startswith("/v1/") for p, _ in mounted["openai"])
    assert {p for p, _ in mounted["ops"]} == {"/health", "/metrics", "/flush_cache", "/ping",
                                              "/health_generate", "/abort_request"}
    for router in ROUTERS.values():
        for route in _flat(router.routes):
            fn = route.endpoint
            assert "<locals>" not in fn.__qualname__, fn.__qualname__
            assert getattr(inspect.getmodule(fn), fn.__name__) is fn


def test_the_shared_state_is_a_dependency_reading_app_state():
    engine = FakeEngine()
    app = app_module.create_app(engine, served_model_name="m", shutdown_engine_on_exit=False)
    state = app.state.specdial
    assert isinstance(state, ServerState) and state.engine is engine

    class _Req:  # what get_state reads of a request
        pass

    req = _Req()
    req.app = app  # type: ignore[attr-defined]
    # async: FastAPI runs it on the event loop, not through the thread pool
    assert inspect.iscoroutinefunction(get_state)
    assert asyncio.run(get_state(req)) is state  # type: ignore[arg-type]
    uses_state = [r for router in ROUTERS.values() for r in _flat(router.routes)
                  if any(d.call is get_state for d in r.dependant.dependencies)]
    # every handler but /version (which reads nothing) asks for the state
    assert {r.path for r in uses_state} == {p for p, _ in ROUTES} - {"/version"}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_server_files_and_functions_stay_small():
    for path in sorted(SERVER.glob("*.py")):
        lines = path.read_text().splitlines()
        assert len(lines) <= 500, f"{path.name}: {len(lines)} lines"
        for fn in _functions(ast.parse("\n".join(lines))):
            n = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
            assert n <= 80, f"{path.name}:{fn.lineno} {fn.name}: {n} lines"


def test_no_private_name_is_imported_from_another_server_module():
    for path in sorted(SERVER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "specdial.server"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_the_state_checks_shared_by_the_routers_without_a_tokenizer():
    """ServerState's tokenizer checks as each router uses them (formerly closures of
    create_app): SGLang's and the tokenizer endpoints answer ``no_tokenizer``; an OpenAI
    field that needs token texts is ``unsupported_parameter`` naming it."""
    engine = FakeEngine()
    engine.tokenizer = None
    with LiveServer(engine, shutdown_timeout=scaled(2)) as live, \
            httpx.Client(base_url=live.url, timeout=scaled(10)) as c:
        r = c.post("/generate", json={"input_ids": [97, 98], "return_logprob": True,
                                      "return_text_in_logprobs": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", r.text
        for method, path in (("POST", "/tokenize"), ("POST", "/v1/detokenize"),
                             ("GET", "/tokenizer_info")):
            body = {"prompt": "a"} if path == "/tokenize" else {"tokens": [97]}
            r = c.request(method, path, json=body if method == "POST" else None)
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", path
        r = c.post("/v1/completions", json={"prompt": [97], "logprobs": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_parameter", r.text
        assert err["param"] == "logprobs"
        r = c.get("/v1/models/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_modules_import_one_way():
    """No import cycle among the server's modules, function-local imports included (app <->
    sglang_api and config <-> limits / connections were ones)."""
    graph: dict[str, set[str]] = {}
    for path in SERVER.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "specdial.server":
                deps |= {a.name for a in node.names if (SERVER / f"{a.name}.py").exists()}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "specdial.server."):
                deps.add(node.module.split(".")[2])  # type: ignore[union-attr]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, " -> ".join(path + [module])
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
