"""docs/configuration.md against the code, both ways, and every relative link of the docs.

Every environment variable the code reads must have a row in docs/configuration.md, and
every row must name a variable something reads. The code's names come from the ASTs of
every .py file under CODE_DIRS (tests/ excluded: what only tests read may be documented,
in its own group, but need not be):

1. direct reads: the string key of `os.environ.get(..)`, `os.getenv(..)`, `os.environ[..]`,
   `os.environ.pop / setdefault(..)`, and of `.get(..)` / `[..]` on any name that is an
   environment mapping (`environ`, `env`, or a parameter or variable assigned from
   `os.environ`); a key that is a module-level string constant (`ENV = "KV_..."`) is
   resolved, in its own module or any other;
2. `from_env` functions and every function whose environment read takes a computed key
   (`environ.get(name)`, a helper `raw(name)`): every string literal in them that looks
   like a variable name (NAME), e.g. EngineConfig.from_env's `("KV_CACHE_MB", None)`
   tuples and MediaSettings.from_env's `raw("VIDEO_FPS")`;
3. settings dataclasses that read a variable per field (`for f in fields(cls)` and
   `f.name.upper()`, with a constant prefix such as f"HTTP_{f.name.upper()}"): prefix +
   each field's name uppercased (LimitSettings, HttpSettings, and any new one).

Writes to the environment (`os.environ["PATH"] = ..`) are not reads and are skipped.
The documented names are the backquoted names in the first cell of each table row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("backend", "openai_frontend", "launcher", "model_repository", "bench", "loadtest")
DOC = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")  # a prefix such as "HTTP_" is not a name

# Read by the code but not settings of this project: documented nowhere, on purpose.
NOT_SETTINGS = {
    "PATH": "the system's search path (the kernels' build and the launcher put the venv's bin/ first)",
    "LD_LIBRARY_PATH": "the system's library path (the launcher prepends libpython's and Triton's folders)",
    "HOME": "the user's home folder",
    "CUDA_VISIBLE_DEVICES": "the CUDA runtime's own",
}

# Documented but read by other programs, not by this repository's Python: Dynamo's runtime
# (launcher/dynamo_worker.py passes these through to it) and the Makefile's own variables.
READ_ELSEWHERE = {
    "NATS_SERVER": "Dynamo's runtime (launcher/dynamo_worker.py's dynamo_env sets it for REPLICAS)",
    "DYN_FILE_KV": "Dynamo's runtime: file discovery's folder (dynamo_env sets it)",
    "DYN_TCP_RPC_HOST": "Dynamo's runtime: the request plane's address (dynamo_env sets it)",
    "DYN_EVENT_PLANE": "Dynamo's runtime (dynamo_env sets it)",
    "ETCD_ENDPOINTS": "Dynamo's runtime, with DYN_DISCOVERY_BACKEND=etcd (deploy/)",
    "PYTHON": "the Makefile's interpreter for the venv (`PYTHON ?= python3`)",
}

ENV_NAMES = {"environ", "env"}  # names that are an environment mapping wherever they appear


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _module_constants(tree: ast.Module) -> dict[str, str]:
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return constants


class _Reads(ast.NodeVisitor):
    """One module's environment reads: literal keys, and the names `from_env` functions hold."""

    def __init__(self, constants: dict[str, str]):
        self.constants = constants  # module-level string constants, this module's then all
        self.names: set[str] = set()
        self.unresolved: set[str] = set()  # UPPERCASE name keys no module's constant resolves
        self.env_vars: set[str] = set(ENV_NAMES)
        self.writes: set[int] = set()  # id() of subscripts that are assignment targets

    # -- what is an environment mapping --
    def _is_env(self, node: ast.AST) -> bool:
        if _is_os_environ(node):
            return True
        return isinstance(node, ast.Name) and node.id in self.env_vars

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Subscript):
                self.writes.add(id(target))
        value = node.value
        # env = os.environ / env = dict(os.environ) / env = os.environ if x else y
        if _is_os_environ(value) or (
            isinstance(value, ast.IfExp) and (_is_os_environ(value.body) or _is_os_environ(value.orelse))
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.env_vars.add(target.id)
        self.generic_visit(node)

    def visit_arguments(self, node: ast.arguments) -> None:
        # a parameter defaulting to os.environ is an environment mapping
        params = node.posonlyargs + node.args
        for arg, default in zip(params[len(params) - len(node.defaults) :], node.defaults, strict=True):
            if _is_os_environ(default):
                self.env_vars.add(arg.arg)
        for arg, default in zip(node.kwonlyargs, node.kw_defaults, strict=True):
            if default is not None and _is_os_environ(default):
                self.env_vars.add(arg.arg)
        self.generic_visit(node)

    # -- the reads --
    def _key(self, node: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.names.add(node.value)
        elif isinstance(node, ast.Name) and node.id in self.constants:
            self.names.add(self.constants[node.id])
        elif isinstance(node, ast.Name) and node.id.isupper():
            self.unresolved.add(node.id)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if node.args and isinstance(func, ast.Attribute):
            if func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os":
                self._key(node.args[0])
            elif func.attr in ("get", "pop", "setdefault", "__getitem__") and self._is_env(func.value):
                self._key(node.args[0])
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if id(node) not in self.writes and self._is_env(node.value):
            self._key(node.slice)
        self.generic_visit(node)


def _has_computed_read(func: ast.AST, env_vars: set[str]) -> bool:
    """Does this function read the environment with a key that is not a literal?"""
    for node in ast.walk(func):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            receiver = node.func.value
            if node.func.attr in ("get", "pop") and (
                _is_os_environ(receiver) or (isinstance(receiver, ast.Name) and receiver.id in env_vars)
            ):
                key = node.args[0]
            elif node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and (
            _is_os_environ(node.value) or (isinstance(node.value, ast.Name) and node.value.id in env_vars)
        ):
            key = node.slice
        if (
            key is not None
            and not isinstance(key, ast.Constant)
            and not (isinstance(key, ast.Name) and key.id.isupper())
        ):
            return True
    return False


def _literal_names(func: ast.AST) -> set[str]:
    """The whole string literals in `func` that look like variable names (an f-string's
    constant parts, such as "HTTP_" in f"HTTP_{f.name.upper()}", are pieces, not names)."""
    pieces = {id(part) for node in ast.walk(func) if isinstance(node, ast.JoinedStr) for part in node.values}
    return {
        node.value
        for node in ast.walk(func)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in pieces
        and NAME.match(node.value)
    }


def _field_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" not in ast.unparse(node.annotation):
                names.append(node.target.id)
    return names


def _per_field_prefixes(func: ast.AST) -> set[str]:
    """The prefixes of `<x>.name.upper()` in a function that walks `fields(..)`: '' for a bare
    f.name.upper(), 'HTTP_' for f"HTTP_{f.name.upper()}" or "HTTP_" + f.name.upper()."""
    walks_fields = any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "fields")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "fields")
        )
        for node in ast.walk(func)
    )
    if not walks_fields:
        return set()

    def is_upper_name(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "upper"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "name"
        )

    prefixes: set[str] = set()
    inside: set[int] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.JoinedStr):
            for i, part in enumerate(node.values):
                if isinstance(part, ast.FormattedValue) and is_upper_name(part.value):
                    before = node.values[:i]
                    if all(isinstance(p, ast.Constant) for p in before):
                        prefixes.add("".join(p.value for p in before))
                        inside.add(id(part.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and is_upper_name(node.right):
            if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                prefixes.add(node.left.value)
                inside.add(id(node.right))
    for node in ast.walk(func):
        if is_upper_name(node) and id(node) not in inside:
            prefixes.add("")
    return prefixes


def code_env_names(dirs=CODE_DIRS, root: Path = ROOT) -> set[str]:
    """Every environment variable name the .py files under `dirs` (in `root`) read."""
    trees = {}
    for folder in dirs:
        for path in sorted((root / folder).rglob("*.py")):
            trees[path] = ast.parse(path.read_text(), filename=str(path))
    all_constants: dict[str, str] = {}
    for tree in trees.values():
        for key, value in _module_constants(tree).items():
            all_constants.setdefault(key, value)
    names: set[str] = set()
    for tree in trees.values():
        reads = _Reads({**all_constants, **_module_constants(tree)})
        reads.visit(tree)
        names |= reads.names
        assert not reads.unresolved, f"environment keys no string constant resolves: {reads.unresolved}"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == "from_env" or _has_computed_read(node, reads.env_vars):
                    names |= _literal_names(node)
            elif isinstance(node, ast.ClassDef):
                fields = _field_names(node)
                for method in node.body:
                    if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                        for prefix in _per_field_prefixes(method):
                            names |= {prefix + field.upper() for field in fields}
    return {name for name in names if NAME.match(name)}


def documented_names(text: str | None = None) -> set[str]:
    """The backquoted names in the first cell of every table row of docs/configuration.md."""
    text = DOC.read_text() if text is None else text
    names = set()
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*:?-", line):
            first = line.split("|")[1]
            names |= {n for n in re.findall(r"`([^`]+)`", first) if NAME.match(n)}
    return names


def check(code: set[str], documented: set[str], tests_read: set[str]) -> list[str]:
    problems = []
    undocumented = sorted(code - documented - set(NOT_SETTINGS))
    if undocumented:
        problems.append(f"read by the code but not in docs/configuration.md: {', '.join(undocumented)}")
    unknown = sorted(documented - code - tests_read - set(READ_ELSEWHERE))
    if unknown:
        problems.append(f"in docs/configuration.md but read nowhere: {', '.join(unknown)}")
    return problems


def test_every_variable_the_code_reads_is_documented_and_back():
    code = code_env_names()
    tests_read = code_env_names(("tests",))
    problems = check(code, documented_names(), tests_read)
    assert not problems, "\n".join(problems)


def test_the_extraction_finds_each_kind_of_read():
    """The three rules each find their names (so a broken rule cannot pass silently)."""
    code = code_env_names()
    assert {"MODEL", "API_KEYS", "QUANT_GEMM", "LLM_CACHE_DIR"} <= code  # direct reads
    assert {"KV_CACHE_MB", "MAX_LORA_RANK", "VIDEO_FPS", "TRITON_GRPC_PORT"} <= code  # from_env literals
    assert {"MAX_INFLIGHT_REQUESTS", "HTTP_MAX_HEADER_BYTES"} <= code  # dataclass fields
    assert "KV_EVENTS_ENDPOINT" in code  # a module constant as the key


SAMPLE = """
import os
from dataclasses import dataclass, fields
from typing import ClassVar

ENV = "SAMPLE_CONSTANT_KEY"


@dataclass
class QuantSettings:
    kinds: ClassVar[tuple] = ("int4",)
    gemm: str = "float32"
    gemv_max_rows: int = 0

    @classmethod
    def load(cls, environ):
        names = {f.name: "QUANT_" + f.name.upper() for f in fields(cls)}
        return cls(**{field: environ[name] for field, name in names.items() if name in environ})


def settings(environ):
    def raw(name):
        return environ.get(name, "").strip()

    return {"a": raw("SAMPLE_HELPER_A"), "b": raw("SAMPLE_HELPER_B")}


def more(mapping=os.environ):
    os.environ["PATH"] = "/bin"  # a write, not a read
    return os.getenv("SAMPLE_GETENV"), mapping.get("SAMPLE_DEFAULT_PARAM"), os.environ.get(ENV), f"HTTP_{1}"
"""


def test_the_extraction_follows_reads_wherever_they_move(tmp_path):
    """Reads moved into new modules, a new settings dataclass with a prefix, a helper
    inside a function not named from_env: all found, and nothing that is not a name."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "anywhere.py").write_text(SAMPLE)
    names = code_env_names(("pkg",), root=tmp_path)
    assert names == {
        "QUANT_GEMM",
        "QUANT_GEMV_MAX_ROWS",
        "SAMPLE_HELPER_A",
        "SAMPLE_HELPER_B",
        "SAMPLE_GETENV",
        "SAMPLE_DEFAULT_PARAM",
        "SAMPLE_CONSTANT_KEY",
    }


def test_a_missing_or_unknown_row_fails():
    code, documented = code_env_names(), documented_names()
    assert not check(code, documented - {"KV_CACHE_MB"}, set()) == []
    assert "KV_CACHE_MB" in check(code, documented - {"KV_CACHE_MB"}, set())[0]
    assert "NOT_A_SETTING" in check(code, documented | {"NOT_A_SETTING"}, set())[-1]


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z]+:|^#", t)]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but - and _ dropped, spaces to -."""
    anchors = set()
    for line in re.sub(r"```.*?```", "", path.read_text(), flags=re.S).splitlines():
        match = re.match(r"^#+\s+(.*)", line)
        if match:
            anchors.add(re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in _relative_links(page):
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if file.startswith("build/") or "/build/" in file:  # written by the tests' runs
                continue
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
