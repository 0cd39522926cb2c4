"""An import-linter contract type: no private names imported across modules.

PEP 8: a name with a leading underscore is private to its module. ``from pkg.mod import _name``
in another module (pylint's ``import-private-name``, C2701) reaches into that module's
internals; the fix is to make the name public or move it to the module that owns it. Ruff's
PLC2701 implements the rule but exempts imports from the same top-level package, i.e. every
import inside ``specdial``, so this contract checks them (``pyproject.toml`` registers it as
``private_names``; ``lint-imports`` runs it).

What counts: an ``ImportFrom`` (absolute or relative, module-level, function-local or under
``if TYPE_CHECKING:``) in a module of the graph that names a private name (``_x``, not a
dunder) of another module of the root package. Importing a private *module* (``from specdial
import _core``, the Rust extension) is not a private name: import-linter's ``private_modules``
rules govern modules. ``ignore_imports`` (``importer -> imported``) exempts a pair, as in the
other contracts.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils

__all__ = ["PrivateNamesContract", "private_name_imports"]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_file(root_dir: Path, root: str, module: str) -> Path | None:
    """The source file of ``module`` (a package's ``__init__.py``), None when it has none."""
    rel = Path(*module.split(".")[1:]) if module != root else Path()
    for candidate in (root_dir / rel / "__init__.py", (root_dir / rel).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _is_module(root_dir: Path, root: str, module: str) -> bool:
    """True when ``module`` is a module or package of the root package, source or extension."""
    rel = root_dir.joinpath(*module.split(".")[1:])
    return rel.is_dir() or rel.with_suffix(".py").is_file() or any(
        rel.parent.glob(rel.name + ".*.so")) or rel.with_suffix(".pyi").is_file()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_name_imports(root: str, root_dir: Path,
                         modules: set[str]) -> list[tuple[str, str, str, int]]:
    """``(importer, imported module, name, line)`` for every private name that a module of
    ``modules`` imports from another module of the package ``root`` (whose directory is
    ``root_dir``), in file order. Raises ``SyntaxError`` for a module that does not parse."""
    found = []
    for importer in sorted(modules):
        path = _module_file(root_dir, root, importer)
        if path is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _resolve(importer, is_package, node)
            if source != root and not source.startswith(root + "."):
                continue
            for alias in node.names:
                if (_is_private(alias.name) and source != importer
                        and not _is_module(root_dir, root, f"{source}.{alias.name}")):
                    found.append((importer, source, alias.name, node.lineno))
    return found


class PrivateNamesContract(Contract):
    """No module imports a private name from another module of the root package.

    Configuration options:

        - ignore_imports: ``importer -> imported`` pairs whose private-name imports are allowed
          (temporarily, with a comment naming who removes them). (Optional.)
        - unmatched_ignore_imports_alerting: ``none``, ``warn`` or ``error`` (default) when an
          ``ignore_imports`` pair is not an import of the graph, as in the built-in contracts.
    """

    type_name = "private_names"

    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(
        contract_utils.AlertLevel, default=contract_utils.AlertLevel.ERROR)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph, ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=self.unmatched_ignore_imports_alerting)  # type: ignore[arg-type]
        roots = {m.split(".")[0] for m in graph.modules}
        violations = []
        for root in sorted(roots):
            spec = importlib.util.find_spec(root)
            if spec is None or not spec.submodule_search_locations:
                continue
            root_dir = Path(list(spec.submodule_search_locations)[0])
            modules = {m for m in graph.modules if m == root or m.startswith(root + ".")}
            for importer, source, name, line in private_name_imports(root, root_dir, modules):
                # an ignored pair's edge was removed from the graph above
                if source in graph.modules and not graph.direct_import_exists(
                        importer=importer, imported=source):
                    continue
                violations.append({"importer": importer, "imported": source, "name": name,
                                   "line": line})
        return ContractCheck(kept=not violations, warnings=list(removal.warnings),
                             ignored_import_count=removal.ignored_import_count,
                             metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("Private names imported from another module (make the name "
                           "public, or move it to the module that uses it):", bold=False)
        output.new_line()
        for v in check.metadata["violations"]:
            output.print_error(f"- {v['importer']} -> {v['imported']}.{v['name']} "
                               f"(l.{v['line']})", bold=False)
            output.new_line()
