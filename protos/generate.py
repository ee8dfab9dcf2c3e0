"""Regenerate the protobuf and gRPC modules from ``millpond.proto``.

Run ``python -m millpond.protos.generate`` (or ``python protos/generate.py``) after editing
the proto; ``--check`` fails if the committed modules differ from what would be generated.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "millpond.proto"
OUTPUTS = ("millpond_pb2.py", "millpond_pb2.pyi", "millpond_pb2_grpc.py")


def _generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    grpc_file = out_dir / "millpond_pb2_grpc.py"
    # protoc writes a top-level import; the module lives in the millpond.protos package.
    text = re.sub(
        r"^import millpond_pb2 as",
        "from millpond.protos import millpond_pb2 as",
        grpc_file.read_text(),
        flags=re.M,
    )
    grpc_file.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on drift, write nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _generate(Path(tmp))
        drift = []
        for name in OUTPUTS:
            new = (Path(tmp) / name).read_text()
            old_path = HERE / name
            old = old_path.read_text() if old_path.exists() else ""
            if new != old:
                drift.append(name)
                if args.check:
                    sys.stdout.writelines(
                        difflib.unified_diff(
                            old.splitlines(True), new.splitlines(True), name, name + " (generated)"
                        )
                    )
                else:
                    old_path.write_text(new)
    if args.check and drift:
        print(f"generated modules out of date: {', '.join(drift)}; run python protos/generate.py")
        return 1
    print("up to date" if not drift else f"regenerated {', '.join(drift)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
