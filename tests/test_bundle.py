"""The offline-host bundle's resolution (bench/hosts/bundle.py): which wheels a release needs beyond a host image,
read from the wheels' own requirements, over a small made-up index; then the committed lock of vLLM 0.33 resolved
again from its recorded metadata against the committed image list, as CI's dry run."""

import json
from pathlib import Path

import pytest
from packaging.version import Version

from bench.hosts.bundle import (
    DEFAULT_IMAGE,
    Image,
    ResolutionError,
    Target,
    Wheel,
    best_wheel_per_version,
    check,
    lock_data,
    resolve,
)

HOST = Target(python="3.12.3", glibc="2.39")
RELEASES = Path(__file__).resolve().parents[1] / "bench" / "hosts" / "releases"


class FakeIndex:
    """name -> {version: requires}; every version has one pure-Python wheel."""

    def __init__(self, packages: dict[str, dict[str, list[str]]]):
        self.packages = packages

    def wheels(self, name):
        versions = sorted(self.packages.get(name, {}), key=Version, reverse=True)
        return [Wheel(name, Version(v), f"{name}-{v}-py3-none-any.whl", "", 1 << 20, "") for v in versions]

    def requirements(self, wheel):
        return self.packages[wheel.name][str(wheel.version)]


def image(**packages):
    return Image("test-image", HOST, {name: Version(v) for name, v in packages.items()})


def picked(resolution):
    return {name: (str(pick.version), pick.source) for name, pick in resolution.picks.items()}


def test_the_image_serves_what_it_satisfies_and_the_rest_is_carried_at_its_newest():
    index = FakeIndex({
        "app": {"1.0": ["lib>=2", "tool<3", "helper"]},
        "lib": {"1.0": [], "2.0": ["deep"], "2.5": ["deep>=1.1"]},
        "tool": {"2.0": [], "3.0": []},
        "helper": {"1.0": []},
        "deep": {"1.0": [], "1.1": [], "1.2": []},
    })  # fmt: skip
    got = picked(resolve(["app==1.0"], image(lib="1.0", tool="2.0", deep="1.1"), index))
    assert got == {
        "app": ("1.0", "carried"),
        "lib": ("2.5", "carried"),  # the image's 1.0 is too old: the newest that satisfies
        "tool": ("2.0", "image"),  # the image's satisfies tool<3 though 3.0 exists
        "helper": ("1.0", "carried"),
        "deep": ("1.1", "image"),  # asked for by the carried lib 2.5, met by the image
    }


def test_markers_are_those_of_the_host_not_of_this_machine():
    index = FakeIndex({
        "app": {"1.0": ['old-only; python_version < "3.12"', 'host-only; python_version >= "3.12"',
                        'arm-only; platform_machine == "aarch64"', 'linux-only; sys_platform == "linux"']},
        "old-only": {"1.0": []}, "host-only": {"1.0": []}, "arm-only": {"1.0": []}, "linux-only": {"1.0": []},
    })  # fmt: skip
    assert set(resolve(["app"], image(), index).picks) == {"app", "host-only", "linux-only"}


def test_extras_bring_their_own_requirements_and_only_where_asked():
    index = FakeIndex({
        "app": {"1.0": ["web[standard]", "cli"]},
        "web": {"1.0": ["core", 'fast; extra == "standard"', 'slow; extra == "legacy"']},
        "cli": {"1.0": ["web"]},
        "core": {"1.0": []}, "fast": {"1.0": []}, "slow": {"1.0": []},
    })  # fmt: skip
    assert set(resolve(["app"], image(), index).picks) == {"app", "web", "cli", "core", "fast"}
    # the same extra on a package the image already has: its extra's requirements still come (its own
    # requirements are the image's business)
    assert set(resolve(["app"], image(web="1.0", core="1.0"), index).picks) == {"app", "web", "cli", "fast"}


def test_a_later_stricter_requirement_repicks_what_was_picked_before_it():
    index = FakeIndex({
        "app": {"1.0": ["lib", "pin"]},
        "pin": {"1.0": ["lib<2"]},
        "lib": {"1.5": [], "2.0": ["only-in-two"]},
        "only-in-two": {"1.0": []},
    })  # fmt: skip
    assert picked(resolve(["app"], image(), index)) == {
        "app": ("1.0", "carried"), "pin": ("1.0", "carried"), "lib": ("1.5", "carried"),
    }  # fmt: skip


def test_left_out_and_image_instead_are_recorded_with_who_asked():
    index = FakeIndex({"app": {"1.0": ["video", "cudnn==9.24"]}, "video": {"1.0": []}, "cudnn": {"9.24": []}})
    resolution = resolve(
        ["app"], image(cudnn="9.19"), index, leave_out={"video": "decoding only"}, use_image={"cudnn": "same API"}
    )
    assert set(resolution.picks) == {"app"}
    lock = lock_data(resolution)
    assert lock["left_out"] == [{"name": "video", "why": "decoding only", "required_by": ["app==1.0: video"]}]
    assert lock["image_instead"] == [
        {"name": "cudnn", "image_has": "9.19", "why": "same API", "required_by": ["app==1.0: cudnn==9.24"]}
    ]
    with pytest.raises(ResolutionError, match="has no cudnn"):
        resolve(["app"], image(), index, use_image={"cudnn": "same API"})


def test_a_requirement_with_no_wheel_for_the_host_names_who_asked_for_it():
    index = FakeIndex({"app": {"1.0": ["lib>=3"]}, "lib": {"2.0": []}})
    with pytest.raises(ResolutionError, match=r"lib>=3 \(required by app==1.0\) has no wheel.*the image has 2.0"):
        resolve(["app"], image(lib="2.0"), index)


def test_wheels_are_chosen_by_the_hosts_tags():
    def wheel(filename):
        return Wheel("x", Version(filename.split("-")[1]), filename, "", 0, "")

    files = [
        wheel("x-3.0-cp311-cp311-manylinux_2_28_x86_64.whl"),  # another Python
        wheel("x-2.9-cp312-cp312-manylinux_2_40_x86_64.whl"),  # a newer glibc than the host's 2.39
        wheel("x-2.8-cp312-cp312-manylinux_2_28_aarch64.whl"),  # another machine
        wheel("x-2.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
        wheel("x-2.0-py3-none-any.whl"),
        wheel("x-1.0-cp312-cp312-manylinux2014_x86_64.whl"),
    ]
    best = best_wheel_per_version(files, HOST)
    assert [w.filename for w in best] == ["x-2.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                                          "x-1.0-cp312-cp312-manylinux2014_x86_64.whl"]  # fmt: skip


def test_the_committed_vllm_lock_follows_from_its_wheels_and_the_image():
    """CI's dry run: the lock's carried wheels, what it leaves to the image and what it leaves out are what resolving
    vLLM 0.33 again over the requirements recorded from those wheels gives against the committed image list."""
    lock = json.loads((RELEASES / "vllm-0.33.0.json").read_text())
    host_image = Image.read(DEFAULT_IMAGE)
    assert check(lock, host_image) == []
    carried = {entry["name"]: entry["version"] for entry in lock["carried"]}
    assert carried["vllm"] == "0.33.0" and carried["torch"] == "2.14.0"
    assert lock["carried_bytes"] == sum(entry["size"] for entry in lock["carried"])


def test_a_lock_stops_following_when_the_image_changes():
    lock = json.loads((RELEASES / "vllm-0.33.0.json").read_text())
    host_image = Image.read(DEFAULT_IMAGE)
    packages = dict(host_image.packages)
    packages["transformers"] = Version("5.0.0")  # older than vLLM 0.33 accepts: it would have to travel
    problems = check(lock, Image(host_image.name, host_image.target, packages))
    assert any("transformers" in problem for problem in problems), problems
