"""Read a vLLM release's Python source with `ast`, without importing it.

Two places hold such source: the vLLM installed in the stage environment
(doctor must not import it: the import takes tens of seconds and wants a
GPU) and vLLM's source releases, which the tests read to check that the
compatibility layer's assumptions hold for each version. Both answer the
same questions here, so `compat.plan` decides from either.
"""

from __future__ import annotations

import ast
import re
import tarfile
from pathlib import Path


class VllmSource:
    """The `vllm/` package source of one version, read lazily."""

    def __init__(self, version: str, read):
        self.version = version
        self._read = read  # relative path under vllm/ -> text or None
        # Per instance, so that a source read for one doctor report (in the
        # long-lived panel) is freed with it.
        self._texts: dict[str, str | None] = {}
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_dir(cls, package_dir: Path, version: str) -> "VllmSource":
        def read(rel: str):
            p = Path(package_dir) / rel
            return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else None
        return cls(version, read)

    @classmethod
    def from_sdist(cls, tarball: Path) -> "VllmSource":
        tf = tarfile.open(tarball)
        m = re.match(r"vllm-(.+)\.tar\.gz$", Path(tarball).name)
        version = m.group(1) if m else "?"
        prefix = f"vllm-{version}/vllm/"

        def read(rel: str):
            try:
                f = tf.extractfile(prefix + rel)
            except KeyError:
                return None
            return f.read().decode("utf-8", errors="replace") if f else None
        return cls(version, read)

    # -- raw access -------------------------------------------------------
    def text(self, module: str) -> str | None:
        """Source of a dotted module under vllm (`v1.request`), file or package."""
        if module not in self._texts:
            rel = module.replace(".", "/")
            self._texts[module] = self._read(rel + ".py") or self._read(rel + "/__init__.py")
        return self._texts[module]

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            src = self.text(module)
            self._trees[module] = ast.parse(src) if src is not None else None
        return self._trees[module]

    def has_module(self, module: str) -> bool:
        return self.text(module) is not None

    def is_package(self, module: str) -> bool:
        """Whether a module is a package (its relative imports start one level lower)."""
        return self.text(module) is not None and \
            self._read(module.replace(".", "/") + ".py") is None

    def absolute(self, module: str, node: ast.ImportFrom) -> str | None:
        """The module (under vllm.) an import in `module` names; None outside vllm."""
        if node.level == 0:
            name = node.module or ""
            return name.removeprefix("vllm.") if name.startswith("vllm.") else None
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if self.is_package(module) else 0)
        base = parts[:max(keep, 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def _node(self, module: str, qualname: str):
        tree = self.tree(module)
        if tree is None:
            return None
        body, node = tree.body, None
        for part in qualname.split("."):
            node = next((n for n in body if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
            if node is None:
                return None
            body = node.body
        return node

    def function(self, module: str, qualname: str) -> ast.FunctionDef | None:
        """A function's or method's definition (`Class.method`), for the
        questions only its body answers; None where it is not defined there."""
        fn = self._node(module, qualname)
        return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None

    # -- questions the compatibility layer asks ------------------------------
    def signature(self, module: str, qualname: str) -> dict | None:
        """{"params": [(name, required)], "var_kw": bool} of a function or
        method, `self`/`cls` left out; None where it is not defined there."""
        fn = self.function(module, qualname)
        if fn is None:
            return None
        a = fn.args
        pos = a.posonlyargs + a.args
        first_default = len(pos) - len(a.defaults)
        params = [(x.arg, i < first_default) for i, x in enumerate(pos)]
        params += [(x.arg, d is None) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
        return {"params": [p for p in params if p[0] not in ("self", "cls")],
                "var_kw": a.kwarg is not None}

    def function_params(self, module: str, qualname: str) -> list[str] | None:
        """Parameter names of a function or method (`Class.__init__`), in order."""
        fn = self.function(module, qualname)
        if fn is None:
            return None
        a = fn.args
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        return [n for n in names if n not in ("self", "cls")]

    def returned_list(self, module: str, qualname: str) -> list | None:
        """The list literal a method returns (`return [576]`,
        `return [MultipleOf(32)]`): ints, and ("multiple", k) for MultipleOf(k)."""
        fn = self.function(module, qualname)
        if fn is None:
            return None
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.List):
                out = []
                for el in node.value.elts:
                    if isinstance(el, ast.Constant) and isinstance(el.value, int):
                        out.append(el.value)
                    elif isinstance(el, ast.Call) and ast.unparse(el.func).endswith("MultipleOf") \
                            and el.args and isinstance(el.args[0], ast.Constant):
                        out.append(("multiple", el.args[0].value))
                    else:
                        return None
                return out
        return None

    def dataclass_fields(self, module: str, cls: str) -> dict[str, bool] | None:
        """{field: is_required_initvar} of a (pydantic) dataclass."""
        node = self._node(module, cls)
        if not isinstance(node, ast.ClassDef):
            return None
        out = {}
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                ann = ast.unparse(st.annotation)
                out[st.target.id] = ann.startswith("InitVar") and st.value is None
        return out

    def field_default(self, module: str, cls: str, name: str) -> str | None:
        """The source of a dataclass field's default (`Field(default=X)` -> X)."""
        node = self._node(module, cls)
        if not isinstance(node, ast.ClassDef):
            return None
        for st in node.body:
            if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                    and st.target.id == name and st.value is not None):
                v = st.value
                if isinstance(v, ast.Call) and ast.unparse(v.func).endswith("Field"):
                    v = next((kw.value for kw in v.keywords if kw.arg == "default"), None)
                return ast.unparse(v) if v is not None else None
        return None

    def class_members(self, module: str, cls: str) -> set[str] | None:
        """Method names and `self.X` attributes a class assigns anywhere in
        its body (what a subclass may rely on)."""
        node = self._node(module, cls)
        if not isinstance(node, ast.ClassDef):
            return None
        out = set()
        for st in node.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(st.name)
        for n in ast.walk(node):
            target = n.target if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else None
            targets = n.targets if isinstance(n, ast.Assign) else [target] if target else []
            for t in targets:   # `self.a, self.b = ...` too
                for part in ast.walk(t):
                    if (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
                            and part.value.id == "self"):
                        out.add(part.attr)
        return out

    def has_function(self, module: str, name: str) -> bool:
        return self.function(module, name) is not None

    def class_bases(self, module: str, cls: str) -> list[str] | None:
        node = self._node(module, cls)
        if not isinstance(node, ast.ClassDef):
            return None
        return [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]

    def imported_names(self, module: str) -> dict[str, list[tuple[str, str]]]:
        """{name bound in `module`: [(module it comes from, its name there)]}
        for each `from X import Y [as Z]` at module level, inside if/else and
        try branches too (the packages that pick a platform's implementation
        in their __init__), in source order."""
        tree = self.tree(module)
        out: dict[str, list[tuple[str, str]]] = {}

        def walk(body):
            for st in body:
                if isinstance(st, ast.ImportFrom):
                    src = self.absolute(module, st)
                    for a in st.names if src is not None else []:
                        out.setdefault(a.asname or a.name, []).append((src, a.name))
                elif isinstance(st, (ast.If, ast.Try)):
                    walk(st.body)
                    walk(st.orelse)
                    for h in getattr(st, "handlers", []):
                        walk(h.body)
        walk(tree.body if tree is not None else [])
        return out

    def definitions(self, module: str, cls: str, _depth: int = 0) -> list[tuple[str, str]]:
        """Where the class (or function) `module` binds as `cls` is defined: there, or
        through its re-exports (each platform's branch, in source order)."""
        if isinstance(self._node(module, cls), (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return [(module, cls)]
        out: list[tuple[str, str]] = []
        for src, name in self.imported_names(module).get(cls, []) if _depth < 6 else []:
            out += [d for d in self.definitions(src, name, _depth + 1) if d not in out]
        return out

    def implements(self, module: str, cls: str, interface: str, _depth: int = 0) -> bool | None:
        """Whether `cls` lists `interface` among its bases, following the
        bases (and re-exports) into the modules they come from. None if the
        class is not there."""
        defs = self.definitions(module, cls)
        if not defs:
            return None
        return any(self.class_implements(m, c, interface, _depth) for m, c in defs)

    def class_implements(self, module: str, cls: str, interface: str, _depth: int = 0) -> bool:
        """One definition's answer (its bases followed across modules)."""
        bases = self.class_bases(module, cls) or []
        if interface in bases:
            return True
        if _depth > 8:
            return False
        return any(self.class_implements(m, c, interface, _depth + 1)
                   for b in bases
                   for m, c in self.definitions(module, b) if (m, c) != (module, cls))

    def model_class(self, arch: str) -> tuple[str, str] | None:
        """(module, class) the model registry maps an architecture name to:
        relative to model_executor.models, or absolute (`vllm.models.kimi_k3`,
        0.33's platform-split packages)."""
        tree = self.tree("model_executor.models.registry")
        if tree is None:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if (isinstance(k, ast.Constant) and k.value == arch and isinstance(v, ast.Tuple)
                            and len(v.elts) == 2 and all(isinstance(e, ast.Constant) for e in v.elts)):
                        path = v.elts[0].value
                        return (path.removeprefix("vllm.") if path.startswith("vllm.")
                                else f"model_executor.models.{path}", v.elts[1].value)
        return None

    def string_constants(self, module: str, needle: str) -> list[str]:
        """String literals (implicit concatenations joined) containing `needle`."""
        tree = self.tree(module)
        if tree is None:
            return []
        return [n.value for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and needle in n.value]
