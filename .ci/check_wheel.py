"""Check a built specdial wheel (CI): a manylinux platform tag a package index accepts, the
package data a non-editable install needs (built-in models, benchmark prompt sets, stubs), and
an extension module that loads. Usage: python .ci/check_wheel.py WHEEL. Exits non-zero with a
message on the first failure."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRED = ["specdial/py.typed", "specdial/_core.pyi", "specdial/bench/prompts/code.jsonl",
            "specdial/bench/prompts/prose.jsonl", "specdial/bench/prompts/hard.jsonl",
            "specdial/builtin/target/model.safetensors", "specdial/builtin/eagle/config.json"]


def main(path: str) -> int:
    wheel = Path(path)
    tag = re.fullmatch(r"specdial-[^-]+-cp311-abi3-(?P<plat>[^-]+)\.whl", wheel.name)
    if tag is None or not re.fullmatch(r"manylinux_2_\d+_(x86_64|aarch64)"
                                       r"(\.manylinux\w+)*", tag["plat"]):
        print(f"{wheel.name}: not a cp311-abi3 manylinux wheel", file=sys.stderr)
        return 1
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [n for n in REQUIRED if n not in names]
        wheel_meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        tags = [line.split(": ", 1)[1] for line in z.read(wheel_meta).decode().splitlines()
                if line.startswith("Tag: ")]
        if missing:
            print(f"{wheel.name}: missing {missing}", file=sys.stderr)
            return 1
        if not tags or not all("manylinux" in t for t in tags):
            print(f"{wheel.name}: WHEEL tags {tags} are not manylinux", file=sys.stderr)
            return 1
        with tempfile.TemporaryDirectory() as d:
            z.extractall(d)
            code = ("import specdial, specdial._core as c; from specdial.bench.datasets import "
                    "build_requests; assert len(build_requests('mixed', 4)) == 4; "
                    "c.AdaptiveConfig.default(); print(specdial.__version__, c.__file__)")
            proc = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True,
                                  text=True, env={"PYTHONPATH": d, "PATH": "/usr/bin:/bin"})
            if proc.returncode == 0 and not proc.stdout.split()[-1].startswith(d):
                print(f"{wheel.name}: imported another specdial: {proc.stdout}", file=sys.stderr)
                return 1
            if proc.returncode:
                print(f"{wheel.name}: the extracted wheel does not import:\n{proc.stderr}",
                      file=sys.stderr)
                return 1
    print(f"{wheel.name}: ok ({', '.join(tags)}; version {proc.stdout.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
