"""The committed protobuf modules are exactly what grpcio-tools generates from proto/."""

from __future__ import annotations

from pathlib import Path

from pagedserve.protogen import REPO_ROOT, generate, proto_files


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated, "protoc produced nothing"
    assert len(proto_files()) * 3 == len(generated)
    for rel in generated:
        committed = REPO_ROOT / "pagedserve" / rel.relative_to("pagedserve")
        assert committed.is_file(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{committed} is stale: run `make proto`")
