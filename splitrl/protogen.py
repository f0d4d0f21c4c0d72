"""Generate the protobuf/gRPC Python modules from ``protos/`` (``make protos``).

The modules are committed so that an installed SplitRL needs no code generator. They are
written into ``splitrl/v1/`` because the proto package is ``splitrl.v1``: the generated imports
(``from splitrl.v1 import common_pb2``) then resolve inside this package. The output depends only
on the .proto files and the pinned grpcio-tools version, so ``tests/splitrl/test_protos.py`` can
regenerate into a temporary directory and require byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATED_DIR = ROOT / "splitrl" / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "splitrl" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every .proto into ``out_root`` (which gets ``splitrl/v1/...``)."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    rel = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *rel,
    ]
    # protoc resolves relative paths against the include dir; run from it for stable output.
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_root / "splitrl" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    written = generate(ROOT)
    init = GENERATED_DIR / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf/gRPC modules (``make protos``); do not edit."""\n')
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
