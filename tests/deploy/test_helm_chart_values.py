"""What each value does to the rendered pods (render.VALUE_SETS, rendered offline by tests/deploy/render.py): the
drain fits the grace period; every pod is non-root with a read-only root and no capabilities, and only the router
has a token; resources; the image digest; GPUs; the model volume; API keys, JWTs, mTLS, public TLS and the KV key
as files from their Secrets; the Redis password; an external Redis; the `helm test` pod. How the objects connect
(flags, ports, policies, autoscalers) is tests/deploy/test_helm_chart_wiring.py."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import pytest

from tests.deploy.cli_flags import flag_value
from tests.deploy.render import DIGEST, NAMESPACE, VALUE_SETS, pdserve_argvs, rendered

pytest.importorskip("helm_python", reason="helm-python-sdk (pip install -e '.[test]')")

SERVICES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")


# -- drain, security, resources ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "gpu"])
def test_the_grace_period_covers_the_prestop_wait_and_the_drain(name):
    r = rendered(name)
    for role in WORKERS:
        _, spec = r.pod_of(role)
        c = r.container(role)
        drain_s = float(flag_value(c["args"], "--drain-timeout-s"))
        assert drain_s == r.merged[role]["drainTimeoutS"]
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain_s + 10, role
    assert r.pod_of("decode")[1]["terminationGracePeriodSeconds"] == (140 if name == "gpu" else 50)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_pod_runs_as_non_root_with_a_read_only_root_and_no_capabilities(name):
    r = rendered(name)
    for where, _, spec in r.pods():
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        mounted = set()
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert (sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"]) == (True, False), (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] >= 10000, (where, c["name"])
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and not tmp[0].get("readOnly"), (where, c["name"])  # the one writable place
            mounted |= {m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"] and mounted <= set(volumes), where


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_only_the_router_mounts_a_token_and_its_role_only_reads_endpointslices(name):
    r = rendered(name)
    for where, meta, spec in r.pods():
        expected = meta["labels"]["app.kubernetes.io/component"] == "router"
        assert spec["automountServiceAccountToken"] is expected, where
    (role,) = r.of("Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list"]}]
    (binding,) = r.of("RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": r.pod_of("router")[1]["serviceAccountName"]}]
    assert r.of("ServiceAccount")[0]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_container_requests_cpu_and_memory_and_limits_memory(name):
    for where, _, spec in rendered(name).pods():
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], (where, c["name"])


def test_image_digest_pins_every_pdserve_container():
    for where, _, spec in rendered("gpu").pods():
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"].startswith("redis"):
                continue
            assert c["image"] == f"registry.example/pdserve@{DIGEST}", where
    images = {c["image"] for _, _, s in rendered("default").pods() for c in s["containers"]}
    assert images == {"pdserve:cpu", f"redis:{rendered('default').merged['redis']['image']['tag']}"}


# -- GPUs and the model ----------------------------------------------------------------------------------------------


def test_gpu_values_reach_the_workers_and_not_the_router():
    r = rendered("gpu")
    for role in WORKERS:
        _, spec = r.pod_of(role)
        c = r.container(role)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
        assert flag_value(c["args"], "--device") == "cuda" and flag_value(c["args"], "--dtype") == "bfloat16"
        assert flag_value(c["args"], "--quantization") == "int8-dynamic"  # model.quantization: both pools alike
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["runtimeClassName"] == "nvidia"
    _, router = r.pod_of("router")
    assert "nvidia.com/gpu" not in str(router) and "runtimeClassName" not in router
    for role in WORKERS:
        c = rendered("default").container(role)
        assert "nvidia.com/gpu" not in c["resources"]["limits"] and flag_value(c["args"], "--device") == "cpu"
        assert flag_value(c["args"], "--quantization") == "none"


@pytest.mark.parametrize("name", ["default", "gpu"])
def test_the_model_directory_lies_on_the_model_volume_in_every_service(name):
    r = rendered(name)
    m = r.merged["model"]
    for role in SERVICES:
        _, spec = r.pod_of(role)
        c = r.container(role)
        (mount,) = [v for v in c["volumeMounts"] if v["name"] == "model"]
        assert mount["readOnly"] is True
        assert flag_value(c["args"], "--model").startswith(mount["mountPath"] + "/")
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        init = [i["name"] for i in spec.get("initContainers", [])]
        if m["volume"]["type"] == "persistentVolumeClaim":
            assert volume["persistentVolumeClaim"] == {"claimName": m["volume"]["claimName"], "readOnly": True}
            assert init == []
        else:
            assert "emptyDir" in volume and init == ["build-tiny-model"]
            (builder,) = spec["initContainers"]
            assert flag_value(builder["args"], "--out") == m["path"]


# -- security values -----------------------------------------------------------------------------------------------


def mounted_file(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in ``container``, through its volume mounts and secret volumes."""
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            rel = path[len(mount["mountPath"]) + 1:]
            (item,) = [i for i in volume["secret"]["items"] if i["path"] == rel]
            return volume["secret"]["secretName"], item["key"]
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def test_security_values_reach_every_service_as_files_from_their_secrets():
    r = rendered("tls")
    for role in SERVICES:
        _, spec = r.pod_of(role)
        c = r.container(role)
        files = {flag: mounted_file(spec, c, flag_value(c["args"], flag))
                 for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-file", "--api-key-file",
                              "--jwt-public-key-file")}
        assert files == {
            "--tls-cert-file": ("rel-pdserve-tls", "tls.crt"), "--tls-key-file": ("rel-pdserve-tls", "tls.key"),
            "--tls-ca-file": ("rel-pdserve-tls", "ca.crt"), "--api-key-file": ("rel-pdserve-auth", "api-keys"),
            "--jwt-public-key-file": ("jwt", "jwt.pem"),
        }
        assert flag_value(c["args"], "--tls-server-name") == "pdserve-worker"
        assert flag_value(c["args"], "--jwt-issuer") == "https://id.example"
        kv_key = flag_value(c["args"], "--kv-encryption-key-file")
        assert (kv_key is not None) == (role != "router")
        if kv_key:
            assert mounted_file(spec, c, kv_key) == ("kv-key", "kv.key")
    router = r.container("router")
    _, spec = r.pod_of("router")
    public_cert = flag_value(router["args"], "--public-tls-cert-file")
    assert mounted_file(spec, router, public_cert) == ("public-cert", "tls.crt")
    assert flag_value(router["args"], "--rate-limit-requests-per-min") == "600"
    keys = r.secret_value("rel-pdserve-auth", "api-keys").splitlines()
    assert [k for k in keys if not k.startswith("#")] == ["key-one", "key-two"]
    tls = r.named("Secret", "rel-pdserve-tls")
    assert tls["type"] == "kubernetes.io/tls" and r.secret_value("rel-pdserve-tls", "ca.crt") == "CA PEM"


def test_the_redis_password_reaches_the_url_percent_encoded_and_redis_server_on_stdin():
    r = rendered("tls")
    url = urlsplit(r.secret_value("rel-pdserve-redis", "redis-url"))
    assert unquote(url.password) == "p@ss word/1" == r.secret_value("rel-pdserve-redis", "redis-password")
    assert (url.hostname, url.port) == ("rel-pdserve-redis", 6379)
    redis = r.container("redis")
    assert "$REDIS_PASSWORD" in redis["args"][0] and "p@ss" not in str(redis)  # never on the command line
    generated = rendered("default").secret_value("rel-pdserve-redis", "redis-password")
    assert re.fullmatch(r"[A-Za-z0-9]{32}", generated)


def test_an_external_redis_replaces_the_bundled_one():
    r = rendered("external-redis")
    assert not [o for o in r.objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"
                and o["kind"] != "Secret"]
    for role in SERVICES:
        assert r.env_value(r.container(role), "PDSERVE_REDIS_URL") == "rediss://:s3cret@redis.example:6380/0"
        _, spec = r.pod_of(role)
        assert mounted_file(spec, r.container(role), "/etc/pdserve/auth/api-keys") == ("my-keys", "api-keys")


# -- helm test -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_helm_test_pod_sends_a_request_through_the_router_service(name):
    r = rendered(name)
    pod = r.named("Pod", "rel-pdserve-test-generate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (c,) = pod["spec"]["containers"]
    service = r.named("Service", "rel-pdserve-router")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    if r.merged["router"]["publicTls"]["enabled"]:  # gRPC has TLS: the plaintext HTTP front instead
        assert c["command"] == ["python", "-c"]
        assert c["args"][1] == f"http://rel-pdserve-router:{ports['http']}"  # the script's base URL
        compile(c["args"][0], "test-generate", "exec")  # it runs for real in test_helm_chart_loopback.py
    else:
        (argv,) = [argv for where, argv in pdserve_argvs(r) if where.startswith("Pod/")]
        assert argv[:2] == ["generate", "$PROMPT"] or argv[:2] == ["generate", r.merged["tests"]["prompt"]]
        assert flag_value(argv, "--router") == f"rel-pdserve-router:{ports['grpc']}"
        assert flag_value(argv, "--max-tokens") == "4"
    keys_on = bool(r.merged["auth"]["apiKeys"] or r.merged["auth"]["existingSecret"])
    if keys_on:  # the first key of the mounted key file
        assert "/etc/pdserve/auth/api-keys" in " ".join(c["args"])
        secret = r.merged["auth"]["existingSecret"] or "rel-pdserve-auth"
        assert mounted_file(pod["spec"], c, "/etc/pdserve/auth/api-keys") == (secret, "api-keys")
