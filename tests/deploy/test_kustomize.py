"""The kustomize subset the deploy tests render with behaves like kustomize where the overlays rely on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.kustomize import (
    Unsupported,
    add_labels,
    build,
    config_map_hash,
    set_image,
    strategic_merge,
)


@pytest.mark.parametrize(
    ("config_map", "expected"),
    [
        # Vectors of kustomize's api/hasher/hasher_test.go (TestConfigMapHash).
        ({"kind": "ConfigMap"}, "6ct58987ht"),
        ({"kind": "ConfigMap", "data": {"one": ""}}, "9g67k2htb6"),
        ({"kind": "ConfigMap", "data": {"two": 2, "one": "", "three": 3}}, "7757f9kkct"),
        ({"kind": "ConfigMap", "data": {"one": ""}, "binaryData": {"two": ""}}, "698h7c7t9m"),
    ],
)
def test_config_map_hash_matches_kustomize(config_map: dict[str, object], expected: str) -> None:
    assert config_map_hash(config_map) == expected


def test_strategic_merge_keyed_lists_merge_others_replace() -> None:
    base = {
        "containers": [
            {"name": "a", "image": "a:1", "env": [{"name": "X", "value": "1"}], "args": ["--p", "1"]},
            {"name": "b", "image": "b:1"},
        ]
    }
    patch = {
        "containers": [
            {"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}], "args": ["--q"]},
            {"name": "c", "image": "c:1"},
        ]
    }
    merged = strategic_merge(base, patch)
    assert [c["name"] for c in merged["containers"]] == ["a", "b", "c"]
    first = merged["containers"][0]
    assert first["env"] == [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]
    assert first["args"] == ["--q"]  # args has no merge key: replaced
    assert first["image"] == "a:1"
    assert strategic_merge({"a": 1, "b": 2}, {"b": None}) == {"a": 1}  # null deletes
    assert base["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # inputs untouched


def test_strategic_merge_refuses_directives() -> None:
    with pytest.raises(Unsupported):
        strategic_merge({"containers": [{"name": "a"}]}, {"containers": [{"name": "a", "$patch": "delete"}]})


def test_labels_with_selectors_follow_kustomize_field_specs() -> None:
    policy = {
        "kind": "NetworkPolicy",
        "metadata": {"name": "p"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "d"}},
            "ingress": [
                {"from": [{"podSelector": {}}, {"podSelector": {"matchExpressions": []}}]},
                {"from": [{"podSelector": {"matchLabels": {"role": "p"}}}]},
            ],
        },
    }
    add_labels(policy, {"part-of": "x"})
    assert policy["metadata"]["labels"] == {"part-of": "x"}
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "d", "part-of": "x"}
    peers = policy["spec"]["ingress"][0]["from"]
    assert peers == [{"podSelector": {}}, {"podSelector": {"matchExpressions": []}}]  # not created
    assert policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"] == {
        "role": "p",
        "part-of": "x",
    }
    service = {"kind": "Service", "metadata": {"name": "s"}, "spec": {}}
    add_labels(service, {"part-of": "x"})
    assert service["spec"]["selector"] == {"part-of": "x"}  # created


def test_labels_without_selectors_leave_selectors_alone() -> None:
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {"metadata": {"labels": {"app": "d"}}},
        },
    }
    add_labels(deployment, {"part-of": "x"}, selectors=False, templates=True)
    assert deployment["metadata"]["labels"] == {"part-of": "x"}
    assert deployment["spec"]["selector"]["matchLabels"] == {"app": "d"}
    assert deployment["spec"]["template"]["metadata"]["labels"] == {"app": "d", "part-of": "x"}
    add_labels(deployment, {"team": "y"}, selectors=False, templates=False)
    assert deployment["spec"]["template"]["metadata"]["labels"] == {"app": "d", "part-of": "x"}


def test_deprecated_common_labels_are_refused(tmp_path: Path) -> None:
    # kustomize 5 warns that commonLabels is deprecated; the overlays use labels instead.
    _write(tmp_path, {"kustomization.yaml": "commonLabels:\n  a: b\nresources: []\n"})
    with pytest.raises(Unsupported, match="commonLabels"):
        build(tmp_path)


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - name: web
          image: web:1
          envFrom: [{configMapRef: {name: settings}}]
      volumes: [{name: conf, configMap: {name: settings}}]
"""


def test_generator_hash_suffix_rewrites_references_and_follows_content(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": (
                "resources: [deployment.yaml]\n"
                "configMapGenerator:\n  - name: settings\n    files: [app.toml]\n"
            ),
            "base/deployment.yaml": DEPLOYMENT,
            "base/app.toml": "a = 1\n",
            "overlay/kustomization.yaml": "namespace: prod\nresources: [../base]\n",
        },
    )
    resources = build(tmp_path / "overlay")
    config_map = next(r for r in resources if r["kind"] == "ConfigMap")
    name = config_map["metadata"]["name"]
    assert name.startswith("settings-") and len(name) == len("settings-") + 10
    assert config_map["metadata"]["namespace"] == "prod"
    pod = next(r for r in resources if r["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"]["name"] == name
    assert pod["containers"][0]["envFrom"][0]["configMapRef"]["name"] == name
    (tmp_path / "base/app.toml").write_text("a = 2\n")
    assert (
        next(r for r in build(tmp_path / "overlay") if r["kind"] == "ConfigMap")["metadata"]["name"] != name
    )


def test_patch_by_kind_and_name(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "kustomization.yaml": "resources: [deployment.yaml]\npatches:\n  - path: patch.yaml\n",
            "deployment.yaml": DEPLOYMENT,
            "patch.yaml": (
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n"
                "spec: {replicas: 3, template: {spec: {containers: [{name: web, image: web:2}]}}}\n"
            ),
        },
    )
    deployment = build(tmp_path)[0]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "web:2"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["envFrom"]  # kept


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [deployment.yaml]\nreplicas: [{name: web, count: 2}]\n",  # unsupported key
        "resources: [deployment.yaml]\nimages: [{name: web, newTagg: '2'}]\n",  # unknown images field
        "resources: [deployment.yaml]\ncomponents: [.]\n",  # a Kustomization is not a component
        "resources: [deployment.yaml]\npatches:\n  - patch: '[{op: move, from: /a, path: /b}]'\n"
        "    target: {kind: Deployment, name: web}\n",  # a JSON6902 operation outside the subset
        "resources: [deployment.yaml]\npatches:\n  - patch: '[{op: add, path: /a, value: 1}]'\n",  # no target
        "resources: [deployment.yaml]\npatches:\n  - path: missing-target.yaml\n",
        "resources: [deployment.yaml, deployment.yaml]\n",  # the same resource twice
    ],
)
def test_what_the_subset_cannot_render_fails(tmp_path: Path, kustomization: str) -> None:
    _write(
        tmp_path,
        {
            "kustomization.yaml": kustomization,
            "deployment.yaml": DEPLOYMENT,
            "missing-target.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: other}\n",
        },
    )
    with pytest.raises(Unsupported):
        build(tmp_path)


@pytest.mark.parametrize(
    ("image", "entry", "expected"),
    [
        ("web", {"name": "web", "newTag": "2"}, "web:2"),
        ("web:1", {"name": "web", "newName": "r.io/w"}, "r.io/w:1"),
        ("r.io:5000/web:1", {"name": "r.io:5000/web", "newTag": "2"}, "r.io:5000/web:2"),  # a port, not a tag
        ("r.io:5000/web", {"name": "r.io:5000/web", "newName": "x"}, "x"),
        ("web:1@sha256:aa", {"name": "web", "digest": "sha256:bb"}, "web@sha256:bb"),
        ("web:1", {"name": "we", "newTag": "2"}, "web:1"),  # names match whole
        ("other/web:1", {"name": "web", "newTag": "2"}, "other/web:1"),
    ],
)
def test_images_match_the_name_and_change_name_tag_or_digest(
    image: str, entry: dict[str, str], expected: str
) -> None:
    resource = {"kind": "Pod", "spec": {"containers": [{"name": "c", "image": image}]}}
    set_image(resource, entry)
    assert resource["spec"]["containers"][0]["image"] == expected


def test_images_reach_container_lists_at_any_depth_of_any_kind() -> None:
    custom = {
        "kind": "Anything",
        "spec": {
            "roles": [
                {"template": {"spec": {"initContainers": [{"name": "a", "image": "web:1"}]}}},
                {"template": {"spec": {"containers": [{"name": "b", "image": "web:1"}]}}},
            ],
            "image": "web:1",  # not inside a container list: left alone
        },
    }
    set_image(custom, {"name": "web", "newTag": "2"})
    roles = custom["spec"]["roles"]
    assert roles[0]["template"]["spec"]["initContainers"][0]["image"] == "web:2"
    assert roles[1]["template"]["spec"]["containers"][0]["image"] == "web:2"
    assert custom["spec"]["image"] == "web:1"


def test_components_run_on_the_resources_before_the_kustomizations_own_transformers(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "kustomization.yaml": (
                "resources: [deployment.yaml]\ncomponents: [tag]\n"
                "patches:\n  - path: sidecar.yaml\n"  # adds a container after the component ran
            ),
            "deployment.yaml": DEPLOYMENT,
            "sidecar.yaml": (
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n"
                "spec: {template: {spec: {containers: [{name: side, image: web:1}]}}}\n"
            ),
            "tag/kustomization.yaml": (
                "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\n"
                "resources: [role.yaml]\nimages: [{name: web, newTag: '2'}]\n"
            ),
            "tag/role.yaml": "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: r}\n",
        },
    )
    resources = build(tmp_path)
    assert [r["kind"] for r in resources] == ["Deployment", "Role"]
    containers = resources[0]["spec"]["template"]["spec"]["containers"]
    assert [c["image"] for c in containers] == ["web:2", "web:1"]  # as kustomize: the component ran first
    with pytest.raises(Unsupported, match="Component"):
        build(tmp_path / "tag")  # a component is not built alone


def test_json6902_add_replace_remove_and_a_target_selecting_nothing(tmp_path: Path) -> None:
    ops = (
        "[{op: replace, path: /spec/template/spec/containers/0/image, value: web:3},"
        " {op: add, path: /spec/template/spec/containers/-, value: {name: x, image: x:1}},"
        " {op: remove, path: /spec/template/spec/volumes}]"
    )
    _write(
        tmp_path,
        {
            "kustomization.yaml": (
                "resources: [deployment.yaml]\npatches:\n"
                f"  - patch: '{ops}'\n    target: {{kind: Deployment, name: web}}\n"
                f"  - patch: '{ops}'\n    target: {{kind: Deployment, name: other}}\n"
            ),
            "deployment.yaml": DEPLOYMENT,
        },
    )
    pod = build(tmp_path)[0]["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == ["web:3", "x:1"]
    assert "volumes" not in pod
