"""Regenerates the Python stubs from the .proto sources: `python -m protos.generate`.

protoc runs with the repository root as its only include path for our files, so a proto imports
"protos/tokenmill/v1/common.proto" and the generated code imports `from protos.tokenmill.v1 import
common_pb2`: our Python package is `protos`, and a top-level `tokenmill.v1` would collide with the
`tokenmill` package. The KServe v2 protocol (package `inference`) lives the same way in protos/kserve.
"""
from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIRS = (REPO_ROOT / "protos" / "tokenmill" / "v1", REPO_ROOT / "protos" / "kserve")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[Path]:
    return sorted(path for proto_dir in PROTO_DIRS for path in proto_dir.glob("*.proto"))


def generated_files(directory: Path) -> list[Path]:
    """The generated stubs under directory/<each of PROTO_DIRS>, sorted."""
    stub_dirs = [directory / proto_dir.relative_to(REPO_ROOT) for proto_dir in PROTO_DIRS]
    return sorted(path for stub_dir in stub_dirs if stub_dir.is_dir() for path in stub_dir.iterdir()
                  if path.name.endswith(GENERATED_SUFFIXES))


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Writes the stubs next to each proto source, under out_root, and returns their paths."""
    # google/protobuf/*.proto (Timestamp) ship inside grpc_tools.
    well_known_protos = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known_protos}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(path) for path in proto_sources()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(p.name for p in proto_sources())}")
    return generated_files(out_root)


def main() -> None:
    for path in generate():
        print(path.relative_to(REPO_ROOT))


if __name__ == "__main__":
    sys.exit(main())
