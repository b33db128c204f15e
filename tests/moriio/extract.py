# Checks a downloaded vLLM wheel against its pinned sha256 and extracts, with Python's zipfile,
# only the files `cargo xtask moriio-conformance` imports (xtask/src/moriio/wheel.rs lists them).
# argv: WHEEL DEST [--sha256 HEX]... [--member PATH]... ; a member ending in "/" takes every file
# under that folder. Exit 3: the wheel matches no pinned hash; 4: a member is missing; 5: the
# wheel is not a readable zip. DEST is replaced only once every file is out.

import argparse
import hashlib
import os
import shutil
import sys
import zipfile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("wheel")
    parser.add_argument("dest")
    parser.add_argument("--sha256", action="append", default=[])
    parser.add_argument("--member", action="append", default=[])
    args = parser.parse_args()

    name = os.path.basename(args.wheel)
    size = os.path.getsize(args.wheel)
    print(f"  checking the sha256 of {name} ({size / 1e6:.0f} MB) ...", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    with open(args.wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    got = digest.hexdigest()
    if got not in args.sha256:
        print(f"{name}: sha256 {got} is not a pinned hash ({', '.join(args.sha256)})", file=sys.stderr)
        sys.exit(3)

    partial = args.dest + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with zipfile.ZipFile(args.wheel) as wheel:
            names = wheel.namelist()
            chosen = []
            for member in args.member:
                found = [n for n in names if n.startswith(member)] if member.endswith("/") else [member]
                if not found or (not member.endswith("/") and member not in names):
                    print(f"{name} has no {member}", file=sys.stderr)
                    sys.exit(4)
                chosen.extend(n for n in found if not n.endswith("/"))
            for n in chosen:
                wheel.extract(n, partial)
    except zipfile.BadZipFile as e:
        print(f"{name} is not a readable wheel: {e}", file=sys.stderr)
        sys.exit(5)
    shutil.rmtree(args.dest, ignore_errors=True)
    os.replace(partial, args.dest)
    print(f"  extracted {len(chosen)} files of {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
