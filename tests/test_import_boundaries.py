"""Each process imports only its own folder and the shared package, never another process's code.

```
 folder       package                may import besides itself and pagedserve/ (shared)
 frontend/    pagedserve.frontend    -                      and never torch
 scheduler/   pagedserve.scheduler   -                      and never torch
 worker/      pagedserve.worker      kernels/, through pagedserve.kernels.ops only
 kernels/     pagedserve.kernels     -
 pagedserve/  pagedserve             -  (cli.py and launch/ start the processes: left out)
```

The worker enters the kernels through one door, `pagedserve.kernels.ops` (the module or names
imported from it): ops picks each kernel path, so no worker module repeats a choice or reaches
into a kernel's module. Tests and benchmarks may import any kernel module.

The worker never imports a grammar library (llguidance, xgrammar): the scheduler computes the
token bitmasks of structured output and the worker only applies them.

`pagedserve/testing/` holds test doubles and research tools (a torch-free worker stand-in, a GGUF
writer, fp8 KV calibration): it may import any process, and nothing outside tests/ and bench/
imports it.

Every .py file is parsed with `ast`, so imports inside functions and under TYPE_CHECKING count
too. A second check imports the frontend's and the scheduler's modules in a fresh interpreter and
requires that torch was not loaded on the way (through a shared module, say).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_OF_FOLDER = {"frontend": "pagedserve.frontend", "scheduler": "pagedserve.scheduler",
                     "worker": "pagedserve.worker", "kernels": "pagedserve.kernels", "pagedserve": "pagedserve"}
PROCESS_FOLDERS = ("frontend", "scheduler", "worker", "kernels")
MAY_IMPORT = {"frontend": set(), "scheduler": set(), "worker": {"kernels"}, "kernels": set(), "pagedserve": set()}
TORCH_FREE = ("frontend", "scheduler")
KERNELS_DOOR = "pagedserve.kernels.ops"
# The launcher: `pagedserve` and `serve` build every process's config and start the processes.
LAUNCH_MODULES = {"pagedserve/cli.py", "pagedserve/launch/supervisor.py", "pagedserve/launch/serve_config.py"}
TESTING_FOLDER = "pagedserve/testing/"
TESTING_PACKAGE = "pagedserve.testing"


def _source_files() -> list[Path]:
    files = []
    for folder in PACKAGE_OF_FOLDER:
        files += sorted((REPO_ROOT / folder).rglob("*.py"))
    return [path for path in files if path.relative_to(REPO_ROOT).as_posix() not in LAUNCH_MODULES
            and not path.relative_to(REPO_ROOT).as_posix().startswith(TESTING_FOLDER)]


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT)
    parts = [PACKAGE_OF_FOLDER[rel.parts[0]], *rel.parts[1:-1]]
    if rel.stem != "__init__":
        parts.append(rel.stem)
    return ".".join(parts)


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the source of a module of `package`;
    `from X import y` yields X.y."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _imports_of(path: Path) -> list[tuple[int, str]]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imported_modules(path.read_text(), package)


def _process_folder_of(module: str) -> str | None:
    """The process folder a module belongs to, or None (shared package, third party)."""
    parts = module.split(".")
    if parts[0] == "pagedserve" and len(parts) > 1 and parts[1] in PROCESS_FOLDERS:
        return parts[1]
    return None


def _folder_of(path: Path) -> str:
    return path.relative_to(REPO_ROOT).parts[0]


def test_the_walk_sees_every_folder() -> None:
    folders = {_folder_of(path) for path in _source_files()}
    assert folders == set(PACKAGE_OF_FOLDER)


def test_module_names_follow_the_package_dir_mapping() -> None:
    assert _module_name(REPO_ROOT / "scheduler" / "engine.py") == "pagedserve.scheduler.engine"
    assert _module_name(REPO_ROOT / "worker" / "models" / "__init__.py") == "pagedserve.worker.models"
    assert _module_name(REPO_ROOT / "pagedserve" / "contracts" / "plan_codec.py") == "pagedserve.contracts.plan_codec"


def test_every_import_form_is_seen() -> None:
    source = ("import pagedserve.worker.sampler\n"
              "from pagedserve import scheduler\n"
              "from ..kernels import ops\n"
              "from . import readiness\n"
              "def lazy():\n"
              "    from .models.llama import LlamaForCausalLM\n")
    modules = [module for _, module in imported_modules(source, "pagedserve.frontend")]
    assert modules == ["pagedserve.worker.sampler", "pagedserve.scheduler", "pagedserve.kernels.ops",
                       "pagedserve.frontend.readiness", "pagedserve.frontend.models.llama.LlamaForCausalLM"]
    assert [_process_folder_of(module) for module in modules] == ["worker", "scheduler", "kernels",
                                                                   "frontend", "frontend"]


def test_no_process_imports_another_process() -> None:
    violations = []
    for path in _source_files():
        folder = _folder_of(path)
        rel = path.relative_to(REPO_ROOT).as_posix()
        for line, module in _imports_of(path):
            target = _process_folder_of(module)
            if target is None or target == folder or target in MAY_IMPORT[folder]:
                continue
            violations.append(f"{rel}:{line} imports {module}")
    assert not violations, "imports across process folders:\n" + "\n".join(violations)


def test_frontend_and_scheduler_code_never_imports_torch() -> None:
    violations = []
    for path in _source_files():
        if _folder_of(path) not in TORCH_FREE:
            continue
        for line, module in _imports_of(path):
            if module.split(".")[0] in ("torch", "triton"):
                violations.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {module}")
    assert not violations, "\n".join(violations)


def test_grammars_stay_out_of_the_worker() -> None:
    """Structured output: the scheduler compiles grammars and computes the token bitmasks; the
    worker only applies the rows it is sent, so it never imports a grammar library."""
    violations = [f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
                  for path in _source_files() if _folder_of(path) in ("worker", "kernels")
                  for line, module in _imports_of(path) if module.split(".")[0] in ("llguidance", "xgrammar")]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("folder", TORCH_FREE)
def test_loading_frontend_or_scheduler_leaves_torch_out(folder: str) -> None:
    modules = sorted(_module_name(path) for path in (REPO_ROOT / folder).rglob("*.py"))
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'triton'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {folder}/ loaded {result.stdout.strip()}"


def test_nothing_in_the_product_imports_the_testing_package() -> None:
    violations = []
    for folder in PACKAGE_OF_FOLDER:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel.startswith(TESTING_FOLDER):
                continue
            violations += [f"{rel}:{line} imports {module}" for line, module in _imports_of(path)
                           if module == TESTING_PACKAGE or module.startswith(TESTING_PACKAGE + ".")]
    assert not violations, "\n".join(violations)


def enters_kernels_by_the_door(module: str) -> bool:
    """A worker import of `module` is allowed: not the kernels, or ops itself or a name from it."""
    if _process_folder_of(module) != "kernels":
        return True
    return module == KERNELS_DOOR or module.startswith(KERNELS_DOOR + ".")


def test_the_door_rule_tells_ops_from_the_kernel_modules() -> None:
    source = ("from pagedserve.kernels import ops\n"
              "from pagedserve.kernels.ops import PackedWeight\n"
              "import pagedserve.kernels.ops\n"
              "from ..kernels.linear import native_rows\n"
              "from pagedserve.kernels.layer.reference import rotate\n"
              "import pagedserve.kernels\n"
              "from pagedserve.kernels import opsx\n"
              "from pagedserve import kernels\n")
    modules = [module for _, module in imported_modules(source, "pagedserve.worker")]
    assert [enters_kernels_by_the_door(module) for module in modules] == [True, True, True, False, False, False,
                                                                          False, False]


def test_the_worker_enters_the_kernels_only_through_ops() -> None:
    violations = []
    for path in _source_files():
        if _folder_of(path) != "worker":
            continue
        rel = path.relative_to(REPO_ROOT).as_posix()
        violations += [f"{rel}:{line} imports {module}" for line, module in _imports_of(path)
                       if not enters_kernels_by_the_door(module)]
    assert not violations, "the worker imports kernel modules other than ops:\n" + "\n".join(violations)
