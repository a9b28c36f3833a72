"""Generate the Python stubs of protos/pdserve/v1/*.proto into pdserve/v1/ (messages, gRPC, type stubs).

    python scripts/gen_protos.py           # regenerate
    python scripts/gen_protos.py --check   # exit 1 if the committed stubs are not what the protos generate

Every generated file starts with a do-not-edit header naming this command.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
OUT_PACKAGE = Path("pdserve") / "v1"
HEADER = "# DO NOT EDIT: generated from protos/pdserve/v1 by `python scripts/gen_protos.py`.\n"
INIT = '"""Generated protobuf and gRPC stubs of the pdserve.v1 API (see protos/pdserve/v1)."""\n'


def generate(out_root: Path) -> dict[str, str]:
    """Run protoc into ``out_root``; returns {relative path: text} of every generated file, headers added."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pdserve" / "v1").glob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    files = {}
    for path in sorted((out_root / OUT_PACKAGE).iterdir()):
        text = path.read_text()
        files[str(OUT_PACKAGE / path.name)] = HEADER + text
    files[str(OUT_PACKAGE / "__init__.py")] = INIT
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed stubs instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
    existing = {str(p.relative_to(REPO)) for p in (REPO / OUT_PACKAGE).glob("*") if p.is_file()}
    if args.check:
        stale = sorted(p for p, text in files.items() if not (REPO / p).is_file() or (REPO / p).read_text() != text)
        extra = sorted(existing - set(files))
        for p in stale:
            old = (REPO / p).read_text().splitlines() if (REPO / p).is_file() else []
            sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(old, files[p].splitlines(), p, p, n=1))
        if stale or extra:
            print(f"stale generated stubs: {stale}; files without a proto: {extra}. Run: python scripts/gen_protos.py")
            return 1
        return 0
    for p in existing - set(files):
        (REPO / p).unlink()
    for p, text in files.items():
        (REPO / p).parent.mkdir(parents=True, exist_ok=True)
        (REPO / p).write_text(text)
    print(f"wrote {len(files)} files under {OUT_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
