"""docs/architecture.md is the code map: it names every Python module of the product exactly once,
in a table row that starts with the module's path in backticks, and names no module that does not
exist. Generated protobuf code (pagedserve/v1, pagedserve/internal) and package __init__ files (whose
docstrings point to the map) are not modules of the map.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_MAP = ROOT / "docs" / "architecture.md"
PRODUCT_FOLDERS = ("frontend", "scheduler", "worker", "kernels", "pagedserve")
GENERATED = ("pagedserve/v1/", "pagedserve/internal/")
MODULE_ROW = re.compile(r"^\|\s*`([\w/]+\.py)`\s*\|")


def product_modules() -> set[str]:
    modules = set()
    for folder in PRODUCT_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            name = path.relative_to(ROOT).as_posix()
            if path.name != "__init__.py" and not name.startswith(GENERATED):
                modules.add(name)
    return modules


def mapped_modules() -> Counter:
    return Counter(match.group(1) for line in CODE_MAP.read_text().splitlines()
                   if (match := MODULE_ROW.match(line)))


def test_the_map_names_every_module():
    assert sorted(product_modules() - set(mapped_modules())) == []


def test_the_map_names_no_module_that_does_not_exist():
    assert sorted(set(mapped_modules()) - product_modules()) == []


def test_the_map_names_each_module_once():
    assert sorted(name for name, count in mapped_modules().items() if count > 1) == []


def test_every_package_docstring_points_to_the_map():
    packages = [path for folder in PRODUCT_FOLDERS for path in (ROOT / folder).rglob("__init__.py")
                if not path.relative_to(ROOT).as_posix().startswith(GENERATED)]
    assert packages
    assert [path.relative_to(ROOT).as_posix() for path in packages
            if "docs/architecture.md" not in path.read_text()] == []
