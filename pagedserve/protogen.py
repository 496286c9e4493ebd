"""Generates the protobuf and gRPC Python modules from proto/ (python -m pagedserve.protogen)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    for path in proto_files():
        rel = path.relative_to(PROTO_ROOT)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        # protoc resolves the relative proto path against the include directory.
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed on {rel} (exit {code})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
