"""Offline-host bundles: the wheels a vLLM release needs beyond what a GPU host's image already has.

A GPU host without a package index gets vLLM as wheels copied in parts. Which wheels is computed, not kept by hand:
starting from the release's requirement (`vllm==0.33.0`), every requirement of every wheel is read from that wheel's
own METADATA and checked against the image's package list (`pip list --format=json` as read on a host, stored under
`bench/hosts/images/`). A requirement the image's version satisfies is taken from the image; any other is carried:
the newest release with a wheel for the host (its Python, glibc and machine) that satisfies every requirement seen
for it, whose own requirements are then followed the same way. An image package a carried wheel needs at another
version is carried at that version (the bundle is installed into its own prefix, ahead of the image on sys.path, so
the image's copy stays for everything else).

pip cannot do this: it resolves against the environment it runs in, not against another machine's package list.

A package can be left out on purpose (`--leave-out NAME="why"`): a requirement of the release that none of the paths
the bundle is for imports, too large to copy. What is left out, why, and who asked for it is written in the lock.

  python -m bench.hosts.bundle lock vllm==0.33.0 --image bench/hosts/images/cuda-2026-11.json \
      --leave-out 'pynvvideocodec=video decoding' --out bench/hosts/releases/vllm-0.33.0.json
  python -m bench.hosts.bundle check bench/hosts/releases/vllm-0.33.0.json   # offline: resolves from the lock
  python -m bench.hosts.bundle pack bench/hosts/releases/vllm-0.33.0.json .gpu/vllm-0.33.0 --part-mib 57

`lock` reads the index (PyPI's simple API) and downloads the wheels it follows into a cache, since a wheel's
METADATA is where its requirements are; `check` needs no network: it resolves again over the requirements recorded
in the lock and fails where the lock no longer follows from them and the image's list (CI runs it). `pack` puts the
carried wheels (checked against the lock's sha256) into one tar, xz-compressed, split into parts of at most
`--part-mib`, with an md5 of the whole; `bench/hosts/gpu_host.sh install-release` unpacks them on the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.parser
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections import deque
from pathlib import Path
from typing import Protocol

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

HOSTS = Path(__file__).resolve().parent
DEFAULT_IMAGE = HOSTS / "images" / "cuda-2026-11.json"
DEFAULT_INDEX = "https://pypi.org/simple"
DEFAULT_CACHE = Path.home() / ".cache" / "vllm-bdlora" / "wheels"
# Resolving starts again with a requirement made stricter each time a later requirement rules out an earlier pick;
# a release's tree settles in a few rounds, and one that does not is a conflict to report, not to search.
MAX_ROUNDS = 50


class ResolutionError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Target:
    """The host a bundle is for: what wheel tags it installs and how it evaluates requirement markers."""

    python: str  # full version, e.g. "3.12.3"
    glibc: str  # e.g. "2.39"
    machine: str = "x86_64"

    @property
    def python_tuple(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    def platforms(self) -> list[str]:
        glibc_major, glibc_minor = (int(part) for part in self.glibc.split("."))
        tags = [f"manylinux_{glibc_major}_{minor}_{self.machine}" for minor in range(glibc_minor, 16, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{self.machine}" for minor, name in legacy.items() if minor <= glibc_minor]

    def supported_tags(self) -> list[Tag]:
        """Best first, as pip orders them."""
        interpreter = f"cp{self.python_tuple[0]}{self.python_tuple[1]}"
        platforms = self.platforms()
        return [
            *cpython_tags(self.python_tuple, [interpreter, "abi3", "none"], platforms),
            *compatible_tags(self.python_tuple, interpreter, platforms),
        ]

    def marker_environment(self, extra: str = "") -> dict[str, str]:
        return {
            "python_version": ".".join(self.python.split(".")[:2]),
            "python_full_version": self.python,
            "implementation_name": "cpython",
            "implementation_version": self.python,
            "platform_python_implementation": "CPython",
            "platform_machine": self.machine,
            "platform_system": "Linux",
            "sys_platform": "linux",
            "os_name": "posix",
            "platform_release": "",
            "platform_version": "",
            "extra": extra,
        }


@dataclasses.dataclass(frozen=True)
class Image:
    """A host image: its target and the version of every package its Python already has."""

    name: str
    target: Target
    packages: dict[str, Version]

    @classmethod
    def read(cls, path: Path) -> Image:
        data = json.loads(Path(path).read_text())
        packages = {canonicalize_name(p["name"]): Version(p["version"]) for p in data["packages"]}
        return cls(Path(path).stem, Target(**data["target"]), packages)


@dataclasses.dataclass(frozen=True)
class Wheel:
    name: str
    version: Version
    filename: str
    url: str
    size: int
    sha256: str

    @classmethod
    def of_entry(cls, entry: dict) -> Wheel:
        """A wheel as a lock entry records it (an image package's entry has no file)."""
        return cls(entry["name"], Version(entry["version"]), entry.get("filename", ""), entry.get("url", ""),
                   entry.get("size", 0), entry.get("sha256", ""))  # fmt: skip


class Index(Protocol):
    def wheels(self, name: str) -> list[Wheel]:
        """One wheel per version the target can install, newest first."""

    def requirements(self, wheel: Wheel) -> list[str]:
        """The wheel's own Requires-Dist lines."""


def best_wheel_per_version(files: list[Wheel], target: Target) -> list[Wheel]:
    rank = {tag: position for position, tag in enumerate(target.supported_tags())}
    best: dict[Version, tuple[int, Wheel]] = {}
    for wheel in files:
        _, _, _, tags = parse_wheel_filename(wheel.filename)
        ranks = [rank[tag] for tag in tags if tag in rank]
        if ranks and (wheel.version not in best or min(ranks) < best[wheel.version][0]):
            best[wheel.version] = (min(ranks), wheel)
    return [best[version][1] for version in sorted(best, reverse=True)]


def requires_dist(wheel_path: Path) -> list[str]:
    with zipfile.ZipFile(wheel_path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        metadata = email.parser.BytesParser().parsebytes(archive.read(name), headersonly=True)
    return metadata.get_all("Requires-Dist") or []


class SimpleIndex:
    """A PEP 691 (JSON simple API) index; wheels are downloaded into a cache to read their METADATA."""

    def __init__(self, target: Target, url: str = DEFAULT_INDEX, cache: Path = DEFAULT_CACHE):
        self.target, self.url, self.cache = target, url.rstrip("/"), Path(cache)
        self._wheels: dict[str, list[Wheel]] = {}

    def files(self, name: str) -> list[dict]:
        """The index's entries for every file of a project: filename, url, size, hashes, yanked."""
        request = urllib.request.Request(
            f"{self.url}/{canonicalize_name(name)}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["files"]

    def wheels(self, name: str) -> list[Wheel]:
        if name not in self._wheels:
            files = []
            for entry in self.files(name):
                filename = entry["filename"]
                if not filename.endswith(".whl") or entry.get("yanked"):
                    continue
                try:
                    _, version, _, _ = parse_wheel_filename(filename)
                except (InvalidWheelFilename, InvalidVersion):  # old uploads that predate the wheel spec
                    continue
                sha256 = entry.get("hashes", {}).get("sha256", "")
                files.append(Wheel(name, version, filename, entry["url"], entry.get("size") or 0, sha256))
            self._wheels[name] = best_wheel_per_version(files, self.target)
        return self._wheels[name]

    def download(self, wheel: Wheel) -> Path:
        path = self.cache / wheel.filename
        if not path.exists() or (wheel.sha256 and sha256_of(path) != wheel.sha256):
            self.cache.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".part")
            with urllib.request.urlopen(wheel.url, timeout=600) as response, open(partial, "wb") as out:
                while chunk := response.read(1 << 22):
                    out.write(chunk)
            if wheel.sha256 and sha256_of(partial) != wheel.sha256:
                partial.unlink()
                raise ResolutionError(f"{wheel.filename}: sha256 differs from the index's")
            partial.rename(path)
        return path

    def requirements(self, wheel: Wheel) -> list[str]:
        return requires_dist(self.download(wheel))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass
class Pick:
    name: str
    version: Version
    source: str  # "image" or "carried"
    wheel: Wheel | None = None
    requires: list[str] = dataclasses.field(default_factory=list)
    required_by: list[str] = dataclasses.field(default_factory=list)
    extras: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Resolution:
    roots: list[str]
    image: Image
    picks: dict[str, Pick]
    left_out: dict[str, tuple[str, list[str]]]  # name -> (why, required by)
    image_instead: dict[str, tuple[str, list[str]]] = dataclasses.field(default_factory=dict)  # likewise

    @property
    def carried(self) -> list[Pick]:
        return [pick for pick in self.picks.values() if pick.source == "carried"]

    @property
    def from_image(self) -> list[Pick]:
        return [pick for pick in self.picks.values() if pick.source == "image"]

    def carried_bytes(self) -> int:
        return sum(pick.wheel.size for pick in self.carried if pick.wheel)


class _Stricter(Exception):
    def __init__(self, name: str, specifier: SpecifierSet):
        self.name, self.specifier = name, specifier


def _applies(requirement: Requirement, target: Target, extras: set[str]) -> bool:
    """Whether a Requires-Dist line applies on the target for a package asked for with `extras`."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(target.marker_environment(extra)) for extra in {"", *extras})


def _wanted_by_extras(requirement: Requirement, target: Target, extras: set[str]) -> bool:
    """Whether a line applies for one of `extras` but not for the package alone."""
    return (
        requirement.marker is not None
        and not requirement.marker.evaluate(target.marker_environment(""))
        and _applies(requirement, target, extras)
    )


def resolve(
    roots: list[str],
    image: Image,
    index: Index,
    leave_out: dict[str, str] | None = None,
    use_image: dict[str, str] | None = None,
    log=lambda message: None,
) -> Resolution:
    """The packages `roots` need on the image's host, each from the image or carried (see the module docstring).

    `leave_out` names packages not carried at all, `use_image` packages whose image version serves although a
    requirement asks for another (each with why).
    """
    leave_out = {canonicalize_name(name): why for name, why in (leave_out or {}).items()}
    use_image = {canonicalize_name(name): why for name, why in (use_image or {}).items()}
    for name in use_image:
        if name not in image.packages:
            raise ResolutionError(f"--use-image {name}: the image {image.name} has no {name}")
    stricter: dict[str, SpecifierSet] = {}
    for _ in range(MAX_ROUNDS):
        try:
            return _resolve_once(roots, image, index, leave_out, use_image, stricter)
        except _Stricter as retry:
            log(f"starting again with {retry.name}{retry.specifier}")
            stricter[retry.name] = retry.specifier
    raise ResolutionError(f"no stable resolution in {MAX_ROUNDS} rounds; last: {stricter}")


def _resolve_once(roots, image, index, leave_out, use_image, stricter) -> Resolution:
    target = image.target
    picks: dict[str, Pick] = {}
    specifiers: dict[str, SpecifierSet] = dict(stricter)
    left_out: dict[str, tuple[str, list[str]]] = {}
    instead: dict[str, tuple[str, list[str]]] = {}
    queue: deque[tuple[Requirement, str]] = deque((Requirement(root), "(asked for)") for root in roots)

    def expand(pick: Pick, extras: set[str], only_extras: bool) -> None:
        for line in pick.requires:
            requirement = Requirement(line)
            wanted = (
                _wanted_by_extras(requirement, target, extras) if only_extras else _applies(requirement, target, extras)
            )
            if wanted:
                queue.append((requirement, f"{pick.name}=={pick.version}"))

    while queue:
        requirement, parent = queue.popleft()
        name = canonicalize_name(requirement.name)
        extras = {canonicalize_name(extra) for extra in requirement.extras}
        if name in leave_out:
            left_out.setdefault(name, (leave_out[name], []))[1].append(f"{parent}: {requirement}")
            continue
        if name in use_image:
            instead.setdefault(name, (use_image[name], []))[1].append(f"{parent}: {requirement}")
            continue
        specifier = specifiers.get(name, SpecifierSet()) & requirement.specifier
        specifiers[name] = specifier
        pick = picks.get(name)
        if pick is not None:
            if not specifier.contains(pick.version, prereleases=True):
                raise _Stricter(name, specifier)
            pick.required_by.append(f"{parent}: {requirement}")
            new_extras = extras - pick.extras
            if new_extras:
                pick.extras |= new_extras
                if pick.source == "image" and not pick.requires:
                    pick.requires = _requirements_of(index, name, pick.version)
                expand(pick, new_extras, only_extras=True)
            continue
        in_image = image.packages.get(name)
        if in_image is not None and specifier.contains(in_image, prereleases=True):
            pick = Pick(name, in_image, "image", required_by=[f"{parent}: {requirement}"], extras=set(extras))
            picks[name] = pick
            if extras:
                pick.requires = _requirements_of(index, name, in_image)
                expand(pick, extras, only_extras=True)
            continue
        wheel = _newest(index, name, specifier)
        if wheel is None:
            raise ResolutionError(
                f"{name}{specifier} (required by {parent}) has no wheel for the host "
                f"(Python {target.python}, glibc {target.glibc}, {target.machine})"
                + (f"; the image has {in_image}" if in_image else "")
            )
        pick = Pick(name, wheel.version, "carried", wheel, index.requirements(wheel), [f"{parent}: {requirement}"],
                    extras=set(extras))  # fmt: skip
        picks[name] = pick
        expand(pick, extras, only_extras=False)
    return Resolution(list(roots), image, picks, left_out, instead)


def _newest(index: Index, name: str, specifier: SpecifierSet) -> Wheel | None:
    wheels = index.wheels(name)
    allowed = set(specifier.filter([wheel.version for wheel in wheels]))
    return next((wheel for wheel in wheels if wheel.version in allowed), None)


def _requirements_of(index: Index, name: str, version: Version) -> list[str]:
    """The Requires-Dist of an image package (for the extras it was asked with), from the index's same version."""
    wheel = next((wheel for wheel in index.wheels(name) if wheel.version == version), None)
    return index.requirements(wheel) if wheel else []


# ---- the lock: what a resolution decided, with the metadata it decided from -----------------------------------


def lock_data(resolution: Resolution, trims: dict[str, str] | None = None) -> dict:
    """What the resolution decided, with the requirements it read; `trims`: files removed from carried wheels."""

    def entry(pick: Pick) -> dict:
        data = {"name": pick.name, "version": str(pick.version)}
        if pick.wheel:
            wheel = pick.wheel
            data |= {"filename": wheel.filename, "url": wheel.url, "size": wheel.size, "sha256": wheel.sha256}
            replaced = resolution.image.packages.get(pick.name)
            if replaced is not None:
                data["image_has"] = str(replaced)
        if pick.extras:
            data["extras"] = sorted(pick.extras)
        if pick.requires:
            data["requires"] = pick.requires
        data["required_by"] = pick.required_by
        return data

    carried = sorted(resolution.carried, key=lambda pick: -pick.wheel.size)
    return {
        "roots": resolution.roots,
        "image": resolution.image.name,
        "carried_bytes": resolution.carried_bytes(),
        "carried": [entry(pick) for pick in carried],
        "left_out": [
            {"name": name, "why": why, "required_by": by} for name, (why, by) in sorted(resolution.left_out.items())
        ],
        "image_instead": [
            {"name": name, "image_has": str(resolution.image.packages[name]), "why": why, "required_by": by}
            for name, (why, by) in sorted(resolution.image_instead.items())
        ],
        "from_image": [entry(pick) for pick in sorted(resolution.from_image, key=lambda pick: pick.name)],
        "trim": [{"path": path, "why": why} for path, why in sorted((trims or {}).items())],
    }


class RecordedIndex:
    """The index as a lock recorded it: its carried wheels and the requirements read from them (no network)."""

    def __init__(self, lock: dict):
        self._wheels: dict[str, list[Wheel]] = {}
        self._requires: dict[tuple[str, str], list[str]] = {}
        for entry in lock["carried"] + lock["from_image"]:
            wheel = Wheel.of_entry(entry)
            self._wheels.setdefault(wheel.name, []).append(wheel)
            self._requires[(wheel.name, str(wheel.version))] = entry.get("requires", [])

    def wheels(self, name: str) -> list[Wheel]:
        return self._wheels.get(name, [])

    def requirements(self, wheel: Wheel) -> list[str]:
        return self._requires[(wheel.name, str(wheel.version))]


def check(lock: dict, image: Image) -> list[str]:
    """What differs between the lock and a resolution over the lock's recorded metadata (empty: it follows)."""
    leave_out = {entry["name"]: entry["why"] for entry in lock["left_out"]}
    use_image = {entry["name"]: entry["why"] for entry in lock["image_instead"]}
    again = lock_data(resolve(lock["roots"], image, RecordedIndex(lock), leave_out, use_image))
    problems = []
    for part in ("carried", "from_image", "image_instead", "left_out"):
        want = {(e["name"], e.get("version", "")) for e in lock[part]}
        got = {(e["name"], e.get("version", "")) for e in again[part]}
        problems += [f"{part}: the lock has {n}=={v}, resolving does not" for n, v in sorted(want - got)]
        problems += [f"{part}: resolving gives {n}=={v}, the lock does not" for n, v in sorted(got - want)]
    if lock["image"] != image.name:
        problems.append(f"the lock was made against image {lock['image']}, not {image.name}")
    return problems


# ---- packing ------------------------------------------------------------------------------------------------------


def pack(lock: dict, image: Image, index: SimpleIndex, out: Path, part_mib: int) -> list[Path]:
    """The carried wheels installed into a prefix here, trimmed, as one tar.xz in parts `pNN` and `bundle.md5`.

    Installing here rather than on the host lets xz see the wheels' contents rather than their zip streams (a
    fifth smaller: torch 2.14's wheel is 529 MiB, its files in tar.xz 417 MiB) and spares the host pip's work.
    Console scripts get `#!/usr/bin/env python3`: the host's python3 is the one that runs them.
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("p[0-9][0-9]"):
        stale.unlink()
    # download() checks each file against the lock's sha256 (a cached one too)
    paths = [str(index.download(Wheel.of_entry(entry))) for entry in lock["carried"]]
    stage = out / "prefix"
    shutil.rmtree(stage, ignore_errors=True)
    target = image.target
    platform_args = [arg for platform in target.platforms() for arg in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
         "--only-binary=:all:", "--python-version", ".".join(map(str, target.python_tuple)),
         "--implementation", "cp", *platform_args, "--target", str(stage), *paths],
        check=True,
    )  # fmt: skip
    for entry in lock["trim"]:
        victim = stage / entry["path"]
        if not victim.exists():
            raise ResolutionError(f"trim {entry['path']}: not in the installed bundle")
        victim.unlink()
    for script in (stage / "bin").glob("*"):
        text = script.read_bytes()
        if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/env python3\n" + text.split(b"\n", 1)[1])
    (stage / "bundle-lock.json").write_text(json.dumps(lock, indent=1) + "\n")
    archive = out / "bundle.tar.xz"
    with open(archive, "wb") as stream:
        tar = subprocess.Popen(["tar", "cf", "-", "-C", str(stage), "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=stream, check=True)
        if tar.wait() != 0:
            raise ResolutionError("tar failed")
    digest = hashlib.md5()
    parts = []
    with open(archive, "rb") as stream:
        while chunk := stream.read(part_mib << 20):
            digest.update(chunk)
            part = out / f"p{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    (out / "bundle.md5").write_text(f"{digest.hexdigest()}  bundle.tar.xz\n")
    archive.unlink()
    shutil.rmtree(stage)
    return parts


def pack_tests(release: str, index: SimpleIndex, out: Path) -> Path:
    """The release's own test suite (`tests/` and the pytest settings in `pyproject.toml`, from its source
    distribution; wheels hold no tests) as `out/tests.tar.xz`, unpacked on the host as /root/vllm-VERSION."""
    name, _, version = release.partition("==")
    sdist = next((f for f in index.files(name) if f["filename"] == f"{name}-{version}.tar.gz"), None)
    if sdist is None:
        raise ResolutionError(f"{release}: the index has no source distribution {name}-{version}.tar.gz")
    # download() takes any file of the index, a source distribution too
    source = index.download(Wheel(name, Version(version), sdist["filename"], sdist["url"], sdist.get("size") or 0,
                                  sdist.get("hashes", {}).get("sha256", "")))  # fmt: skip
    top = f"{name}-{version}"
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "tests.tar.xz"
    with tarfile.open(source) as tar_in, tarfile.open(archive, "w:xz") as tar_out:
        for member in tar_in:
            if member.name.startswith(f"{top}/tests/") or member.name == f"{top}/pyproject.toml":
                tar_out.addfile(member, tar_in.extractfile(member) if member.isfile() else None)
    return archive


# ---- command line -------------------------------------------------------------------------------------------------


def parse_reasons(option: str, items: list[str]) -> dict[str, str]:
    """`NAME=why` items of a command-line option (a reason is required: it goes into the lock)."""
    reasons = {}
    for item in items:
        name, sep, why = item.partition("=")
        if not sep or not why.strip():
            raise SystemExit(f'{option} {item!r}: write NAME="why"')
        reasons[name.strip()] = why.strip()
    return reasons


def summary(lock: dict) -> str:
    lines = [f"{len(lock['carried'])} wheels to carry, {lock['carried_bytes'] / 2**20:.0f} MiB:"]
    for entry in lock["carried"]:
        replaces = f" (image: {entry['image_has']})" if "image_has" in entry else ""
        lines.append(f"  {entry['size'] / 2**20:8.1f} MiB  {entry['name']}=={entry['version']}{replaces}")
    for entry in lock["left_out"]:
        lines.append(f"  left out: {entry['name']} ({entry['why']})")
    for entry in lock["image_instead"]:
        lines.append(f"  the image's {entry['name']}=={entry['image_has']} instead ({entry['why']})")
    for entry in lock["trim"]:
        lines.append(f"  trimmed: {entry['path']} ({entry['why']})")
    lines.append(f"{len(lock['from_image'])} requirements met by the image")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts.bundle", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lock_cmd = commands.add_parser("lock", help="resolve a release against an image's package list")
    lock_cmd.add_argument("roots", nargs="+", help="requirements to bring, e.g. vllm==0.33.0")
    lock_cmd.add_argument("--image", type=Path, default=DEFAULT_IMAGE, help="pip list of the host image (JSON)")
    lock_cmd.add_argument(
        "--leave-out", action="append", default=[], metavar='NAME="why"', help="a requirement not to carry at all"
    )
    lock_cmd.add_argument(
        "--use-image", action="append", default=[], metavar='NAME="why"',
        help="a package whose image version serves although a requirement pins another",
    )  # fmt: skip
    lock_cmd.add_argument(
        "--trim", action="append", default=[], metavar='PATH="why"',
        help="a file (path inside the install prefix) removed from the carried wheels before packing",
    )  # fmt: skip
    lock_cmd.add_argument("--index", default=DEFAULT_INDEX)
    lock_cmd.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where wheels are downloaded")
    lock_cmd.add_argument("--out", type=Path, required=True)
    check_cmd = commands.add_parser("check", help="resolve again from a lock's recorded metadata (offline)")
    check_cmd.add_argument("lock", type=Path)
    check_cmd.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    pack_cmd = commands.add_parser("pack", help="download a lock's carried wheels and split them into parts")
    pack_cmd.add_argument("lock", type=Path)
    pack_cmd.add_argument("out", type=Path)
    pack_cmd.add_argument("--part-mib", type=int, default=57, help="size of each part (a copy's limit less the tree)")
    pack_cmd.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    pack_cmd.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    tests_cmd = commands.add_parser("tests", help="a release's own tests, from its source distribution")
    tests_cmd.add_argument("release", help="e.g. vllm==0.33.0")
    tests_cmd.add_argument("out", type=Path)
    tests_cmd.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    tests_cmd.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)

    image = Image.read(args.image)
    if args.command == "lock":
        index = SimpleIndex(image.target, args.index, args.cache)
        leave_out = parse_reasons("--leave-out", args.leave_out)
        use_image = parse_reasons("--use-image", args.use_image)
        resolution = resolve(args.roots, image, index, leave_out, use_image, log=print)
        lock = {"command": "python -m bench.hosts.bundle " + shlex.join(sys.argv[1:] if argv is None else argv)}
        lock |= lock_data(resolution, parse_reasons("--trim", args.trim))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(lock, indent=1) + "\n")
        print(summary(lock))
        return 0
    if args.command == "tests":
        print(pack_tests(args.release, SimpleIndex(image.target, cache=args.cache), args.out))
        return 0
    lock = json.loads(args.lock.read_text())
    if args.command == "check":
        problems = check(lock, image)
        for problem in problems:
            print(problem)
        verdict = "does not follow" if problems else "follows"
        print(f"{args.lock}: {verdict} from its wheels' requirements and the image {image.name}")
        return 1 if problems else 0
    parts = pack(lock, image, SimpleIndex(image.target, cache=args.cache), args.out, args.part_mib)
    print(f"{len(parts)} parts in {args.out}; " + summary(lock).splitlines()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
