"""The GPU install path: `pip install -c requirements/gpu-constraints.txt ".[verl]"` from this checkout.

Checked with pip's resolver against PyPI (no GPU needed, nothing installed; needs the network, so it is the
command below rather than a test):

    pip install --dry-run --ignore-installed --report /tmp/gpu.json -c requirements/gpu-constraints.txt ".[verl]"

These tests hold the files to what that resolution needs: the constraints agree with verl 0.9.1's own pins (read
from the installed verl's metadata), name each package once, and the `verl` extra brings verl's GPU stack.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "requirements" / "gpu-constraints.txt"


def _pins(lines: list[str]) -> list[tuple[str, str]]:
    pins = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: constraints pin exact versions"
            pins.append((re.sub(r"[-_.]+", "-", requirement.name).lower(), spec.version))
    return pins


def test_constraints_pin_each_package_once_and_agree_with_verls_gpu_pins() -> None:
    pins = _pins(CONSTRAINTS.read_text().splitlines())
    names = [name for name, _ in pins]
    assert len(names) == len(set(names)), "a package is pinned twice"
    pinned = dict(pins)
    assert pinned["verl"] == importlib.metadata.version("verl")
    # verl's [vllm] extra: the stack verl 0.9.1 was released and tested on.
    for requirement in map(Requirement, importlib.metadata.requires("verl")):
        if requirement.marker is not None and requirement.marker.evaluate({"extra": "vllm"}):
            specs = list(requirement.specifier)
            if len(specs) == 1 and specs[0].operator == "==":
                name = requirement.name.lower()
                assert pinned.get(name) == specs[0].version, f"{name}: verl[vllm] pins {specs[0].version}"
    # verl's default V1 trainer imports transfer_queue: pinned to what the CPU test environment runs.
    assert pinned["transferqueue"] == importlib.metadata.version("TransferQueue")


def test_the_verl_extra_brings_verls_gpu_stack_within_the_constraints() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (verl,) = map(Requirement, project["optional-dependencies"]["verl"])
    assert verl.name == "verl" and verl.extras == {"vllm"}
    assert str(verl.specifier) == f"=={dict(_pins(CONSTRAINTS.read_text().splitlines()))['verl']}"
    # DAS's own vLLM range admits the pinned vLLM.
    (vllm,) = [Requirement(r) for r in project["optional-dependencies"]["vllm"] if r.startswith("vllm")]
    assert vllm.specifier.contains(dict(_pins(CONSTRAINTS.read_text().splitlines()))["vllm"])
