"""The wheels the GPU machine lacks: download them here, install them there (docs/gpu.md).

The GPU machine reaches no package registry, so what it lacks travels as wheels in ``.gpu-wheels/``
(ignored by git, named in the device call's ``carry``). ``scripts/gpu_wheels.txt`` pins them.

    python3 scripts/gpu_wheels.py download          # here (make gpu-wheels): fetch the pinned wheels
    python3 scripts/gpu_wheels.py check             # the folder holds exactly the pinned wheels
    python3 scripts/gpu_wheels.py install --target /tmp/lowmem-site   # there (gpu_check.py does this)

``install`` runs ``pip install --no-index --no-deps --target``: nothing is resolved, nothing already
installed (torch above all) is replaced; the target folder goes on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "scripts" / "gpu_wheels.txt"
WHEELS = ROOT / ".gpu-wheels"
MAX_TOTAL_BYTES = 32 * 2**20  # the device call carries at most 64 MiB, the repository included
# CPython 3.12 on x86-64 Linux: every manylinux tag a wheel for the GPU machine may carry (pip matches exactly)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
PYTHON_VERSION = "3.12"


@dataclass(frozen=True)
class Pin:
    name: str  # as written in the list
    version: str

    @property
    def key(self) -> str:
        """The name as wheel files spell it (PEP 427: runs of -_. become _, lower case)."""
        return normalize(self.name)

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(path: Path = LIST) -> list[Pin]:
    """``name==version`` lines of ``path`` (comments and blank lines skipped).

    Raises:
        ValueError: a line is not ``name==version``, or a package is pinned twice.
    """
    pins: list[Pin] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", line)
        if match is None:
            raise ValueError(f"{path}:{number}: expected `name==version`, got {raw!r} (one exact pin per line)")
        pins.append(Pin(*match.groups()))
    keys = [pin.key for pin in pins]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"{path}: {twice} pinned more than once; keep one version of each (two stop the install)")
    return pins


def wheel_key_version(path: Path) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name ``name-version-...whl``."""
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def check(directory: Path = WHEELS, pins: list[Pin] | None = None) -> list[Path]:
    """The wheels of ``directory`` that match ``pins``, one per pin.

    Raises:
        FileNotFoundError: ``directory`` is missing or a pinned wheel is not in it.
        ValueError: a wheel in it is not pinned (another version, or an unlisted package).
    """
    pins = read_pins() if pins is None else pins
    if not directory.is_dir():
        raise FileNotFoundError(f"no wheel folder {directory}: run `make gpu-wheels` (scripts/gpu_wheels.py download)")
    wheels = sorted(directory.glob("*.whl"))
    wanted = {pin.key: pin.version for pin in pins}
    found: dict[str, Path] = {}
    for wheel in wheels:
        key, version = wheel_key_version(wheel)
        if wanted.get(key) != version:
            raise ValueError(
                f"{wheel.name} is not pinned in {LIST.name} ({key}=={wanted.get(key, 'unlisted')}): remove it"
            )
        found[key] = wheel
    missing = [str(pin) for pin in pins if pin.key not in found]
    if missing:
        raise FileNotFoundError(f"{directory} lacks {missing}: run `make gpu-wheels`")
    return [found[pin.key] for pin in pins]


def download(directory: Path = WHEELS, pins: list[Pin] | None = None, python: str = sys.executable) -> list[Path]:
    """Fetch the pinned wheels (no dependencies: each one is pinned itself) for CPython 3.12 manylinux x86-64."""
    pins = read_pins() if pins is None else pins
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.whl"):  # another version of a pin, or an unlisted package
        key, version = wheel_key_version(stale)
        if {pin.key: pin.version for pin in pins}.get(key) != version:
            stale.unlink()
    command = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--dest",
        str(directory),
    ]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + [str(pin) for pin in pins], check=True)
    wheels = check(directory, pins)
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.2f} MiB  in all ({directory})")
    if total > MAX_TOTAL_BYTES:
        raise SystemExit(
            f"the wheels take {total / 2**20:.1f} MiB, over {MAX_TOTAL_BYTES / 2**20:.0f} MiB: the device call carries 64 MiB"
        )
    return wheels


def install(
    target: Path,
    directory: Path = WHEELS,
    python: str = sys.executable,
    cross: bool = False,
    pins: list[Pin] | None = None,
) -> list[Path]:
    """``pip install --no-index --no-deps --target target`` of the checked wheels; returns them.

    Nothing is resolved or fetched and nothing installed is replaced: the target folder is separate
    (put it on ``PYTHONPATH``). ``cross=True`` installs for CPython 3.12 manylinux x86-64 whatever runs
    pip (the dry run does that here: the files land, nothing is imported from them).
    """
    wheels = check(directory, pins)
    target.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--upgrade",
        "--target",
        str(target),
    ]
    if cross:
        command += ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
    subprocess.run(command + [str(wheel) for wheel in wheels], check=True)
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_wheels.py", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["download", "check", "install"])
    parser.add_argument("--dir", type=Path, default=WHEELS, help=f"wheel folder (default {WHEELS.relative_to(ROOT)})")
    parser.add_argument("--target", type=Path, default=Path("/tmp/lowmem-site"), help="install: target folder")
    parser.add_argument("--cross", action="store_true", help="install: for CPython 3.12 manylinux x86-64 (dry run)")
    args = parser.parse_args(argv)
    if args.action == "download":
        download(args.dir)
    elif args.action == "check":
        for wheel in check(args.dir):
            print(wheel.name)
    else:
        install(args.target, args.dir, cross=args.cross)
        print(f"installed into {args.target}; export PYTHONPATH={args.target}:$PYTHONPATH")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
