"""Checks deploy/k8s/*.yaml against the programs they run.

No cluster is needed: every manifest is parsed, and the flags, ports,
labels, selectors, sizes, environment names and Secrets they use are
compared with the real zeroshardd and gpt_train (their --helpfull), zsrun's
trainer environment (tools/zsrun_lib.cc), the alert rules' scrape job, and
the Secrets README.md tells the user to create. The last tests mutate a
copy of the manifests and expect the checker to object, so a check that
cannot fail is caught too.

Usage: manifests_test.py ZEROSHARDD GPT_TRAIN ZSRUN_LIB_CC ALERTS_YML
(run from the directory holding the manifests, or with MANIFEST_DIR set).
"""

import copy
import glob
import os
import re
import subprocess
import sys
import unittest

import yaml

DAEMON_BINARY = "zeroshardd"
TRAINER_BINARY = "gpt_train"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Variables a trainer rank must get: what zsrun always sets for the daemons
# and the job, plus the client certificate every rank needs against a TLS
# daemon (docs/security.md).
REQUIRED_TRAINER_ENV = ["ZS_RANK", "ZS_WORLD_SIZE", "ZS_DAEMONS", "ZS_JOB_ID", "ZS_JOB_TOKEN",
                        "ZS_TLS_CERT", "ZS_TLS_KEY", "ZS_TLS_CA"]
FILE_FLAGS = ["tls_cert", "tls_key", "tls_ca", "admin_token_file", "registration_token_file"]
TOKEN_FILE_FLAGS = ["admin_token_file", "registration_token_file"]
DIR_FLAGS = ["checkpoint_dir", "spill_dir"]


# ---------------------------------------------------------------------------
# What the programs and sources say.

def helpfull_flags(binary):
    """Flag names a program defines, from its --helpfull text."""
    out = subprocess.run([binary, "--helpfull"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, check=False).stdout
    flags = set(re.findall(r"^    --([A-Za-z0-9_]+) \(", out, re.M))
    if not flags:
        raise RuntimeError(f"{binary} --helpfull listed no flags:\n{out[:2000]}")
    return flags, out


def zsrun_trainer_env(source):
    """Names zsrun's TrainerEnvironment() sets, from tools/zsrun_lib.cc."""
    with open(source, encoding="utf-8") as f:
        text = f.read()
    start = text.index("TrainerEnvironment(")
    body = text[start:text.index("\n}\n", start)]
    names = set(re.findall(r'\{"([A-Z][A-Z0-9_]*)",', body))
    names |= set(re.findall(r'emplace_back\("([A-Z][A-Z0-9_]*)"', body))
    if "ZS_RANK" not in names:
        raise RuntimeError(f"no trainer environment found in {source}")
    return names


def alert_scrape_job(alerts_yml):
    """The `job` label the alert rules expect on the daemons' `up` series."""
    with open(alerts_yml, encoding="utf-8") as f:
        m = re.search(r'up\{job="([^"]+)"\}', f.read())
    if m is None:
        raise RuntimeError(f"{alerts_yml} has no up{{job=...}} rule")
    return m.group(1)


def readme_secrets(readme):
    """{name: set of keys} from README.md's table of Secrets the user creates."""
    secrets = {}
    section = False
    with open(readme, encoding="utf-8") as f:
        for line in f:
            if line.startswith("## "):
                section = line.strip() == "## Secrets you create"
            if not section:
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 2 or not re.fullmatch(r"`[a-z0-9.-]+`", cells[0]):
                continue
            keys = re.findall(r"`([^`]+)`", cells[1])
            if keys:
                secrets[cells[0].strip("`")] = set(keys)
    return secrets


class Context:
    def __init__(self, daemon_flags, trainer_flags, trainer_help, zsrun_env, scrape_job,
                 user_secrets):
        self.daemon_flags = daemon_flags
        self.trainer_flags = trainer_flags
        # Variables the trainer reads: the $ZS_* its flags' help names (its
        # own and the TLS flags'), and everything zsrun gives a rank.
        self.trainer_env = set(re.findall(r"\$(ZS_[A-Z0-9_]+)", trainer_help)) | zsrun_env
        self.scrape_job = scrape_job
        self.user_secrets = user_secrets


# ---------------------------------------------------------------------------
# Sizes, as each side parses them.

def daemon_bytes(text):
    """zeroshardd's --memory_limit grammar (server/ledger/system_resources.cc):
    digits with an optional K, M, G, T (or KiB ... TiB), powers of 1024;
    None for "auto" (a share of the cgroup limit, so never above it)."""
    if text == "auto":
        return None
    m = re.fullmatch(r"([0-9]+)(|K|KiB|M|MiB|G|GiB|T|TiB)", text)
    if m is None:
        raise ValueError(f"--memory_limit={text} is not something zeroshardd accepts")
    shift = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)[:1]]
    return int(m.group(1)) << shift


def k8s_bytes(quantity):
    """A Kubernetes resource quantity in bytes: Ki/Mi/Gi/Ti/Pi/Ei are powers
    of 1024, k/M/G/T/P/E powers of 1000 (so "32G" is less than "32Gi")."""
    text = str(quantity)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(?:[eE]([0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?",
                     text)
    if m is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    value = float(m.group(1)) * (10 ** int(m.group(2) or 0))
    suffix = m.group(3) or ""
    binary = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
    decimal = {"k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
    if suffix in binary:
        return int(value * 1024 ** binary[suffix])
    if suffix in decimal:
        return int(value * 1000 ** decimal[suffix])
    if suffix == "m":
        return value / 1000
    return int(value)


# ---------------------------------------------------------------------------
# The checker.

def parse_flags(args, where, errors):
    """{name: value} of --name=value arguments; other forms are errors."""
    flags = {}
    for arg in args:
        m = re.fullmatch(r"--([A-Za-z0-9_]+)(?:=(.*))?", str(arg))
        if m is None:
            errors.append(f"{where}: argument {arg!r} is not --flag=value")
            continue
        flags[m.group(1)] = m.group(2) if m.group(2) is not None else "true"
    return flags


def host_port(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


def subset(small, big):
    return all(big.get(k) == v for k, v in (small or {}).items())


def one(docs, kind, errors, component=None):
    found = [d for d in docs if d.get("kind") == kind and (
        component is None or d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        == component)]
    if len(found) != 1:
        errors.append(f"expected one {kind}{' (' + component + ')' if component else ''}, "
                      f"found {len(found)}")
        return None
    return found[0]


def container_of(workload, binary, errors):
    for c in workload["spec"]["template"]["spec"].get("containers", []):
        if c.get("command") and os.path.basename(c["command"][0]) == binary:
            return c
    errors.append(f"{workload['kind']} {workload['metadata']['name']}: no container runs {binary}")
    return None


def resolve_port(container, port, where, errors):
    """The containerPort number a probe or Service's targetPort names."""
    ports = container.get("ports", [])
    for p in ports:
        if port == p.get("name") or port == p.get("containerPort"):
            return p["containerPort"]
    errors.append(f"{where}: port {port!r} is not a port of container {container['name']} "
                  f"({[p.get('name') for p in ports]})")
    return None


def mounted_file(pod_spec, container, path, where, errors):
    """The (volume, key) behind a file path in a container, checking the key exists."""
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(root):
            continue
        volume = next((v for v in pod_spec.get("volumes", []) if v["name"] == mount["name"]),
                      None)
        if volume is None:
            errors.append(f"{where}: volume {mount['name']!r} is mounted but not declared")
            return None, None
        rel = path[len(root):]
        secret = volume.get("secret")
        if secret is not None:
            items = secret.get("items")
            key = rel if items is None else next(
                (i["key"] for i in items if i["path"] == rel), None)
            if key is None:
                errors.append(f"{where}: {path} is not among the items of Secret volume "
                              f"{volume['name']!r}")
            return volume, key
        return volume, None
    errors.append(f"{where}: {path} is on no mounted volume")
    return None, None


def check(docs, ctx):
    """Every disagreement between the manifests and the programs, as text."""
    errors = []
    for d in docs:
        if not d.get("apiVersion") or not d.get("kind") or (
                d.get("kind") != "Kustomization" and not d.get("metadata", {}).get("name")):
            errors.append(f"a document lacks apiVersion, kind or metadata.name: {str(d)[:80]}")
    daemonset = one(docs, "DaemonSet", errors)
    service = one(docs, "Service", errors)
    monitor = one(docs, "ServiceMonitor", errors)
    job = one(docs, "Job", errors)
    if None in (daemonset, service, monitor, job):
        return errors
    secret_refs = []  # (where, secret name, key)

    # --- The daemons.
    dpod = daemonset["spec"]["template"]["spec"]
    dlabels = daemonset["spec"]["template"]["metadata"].get("labels", {})
    if not subset(daemonset["spec"]["selector"]["matchLabels"], dlabels):
        errors.append("DaemonSet selector does not match its pod labels")
    daemon = container_of(daemonset, DAEMON_BINARY, errors)
    if daemon is None:
        return errors
    where = f"DaemonSet container {daemon['name']}"
    flags = parse_flags(daemon.get("args", []), where, errors)
    for name in flags:
        if name not in ctx.daemon_flags:
            errors.append(f"{where}: zeroshardd has no flag --{name}")
    ports = {p.get("name"): p for p in daemon.get("ports", [])}
    for p in daemon.get("ports", []):
        if dpod.get("hostNetwork") and p.get("hostPort", p["containerPort"]) != p["containerPort"]:
            errors.append(f"{where}: with hostNetwork, hostPort {p['hostPort']} must equal "
                          f"containerPort {p['containerPort']}")
    listen_host, listen_port = host_port(flags.get("listen", "127.0.0.1:0"))
    if "grpc" not in ports or ports["grpc"]["containerPort"] != listen_port:
        errors.append(f"{where}: --listen port {listen_port} is not the containerPort named grpc")
    if "metrics_listen" in flags:
        metrics_host, metrics_port = host_port(flags["metrics_listen"])
    else:
        metrics_host, metrics_port = "127.0.0.1", int(flags.get("metrics_port", -1))
    if "metrics" not in ports or ports["metrics"]["containerPort"] != metrics_port:
        errors.append(f"{where}: the metrics port {metrics_port} is not the containerPort "
                      "named metrics")
    if metrics_host.startswith("127.") or listen_host.startswith("127."):
        errors.append(f"{where}: a daemon on loopback cannot be reached from other pods")
    health_port = None
    if "health_listen" in flags:
        _, health_port = host_port(flags["health_listen"])
        if "health" not in ports or ports["health"]["containerPort"] != health_port:
            errors.append(f"{where}: the --health_listen port {health_port} is not the "
                          "containerPort named health")
    tls = all(flags.get(f) for f in ("tls_cert", "tls_key", "tls_ca"))
    if not tls and flags.get("insecure") != "true" and not listen_host.startswith("127."):
        errors.append(f"{where}: --listen={listen_host}:{listen_port} needs --tls_cert, --tls_key "
                      "and --tls_ca (or --insecure)")
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = daemon.get(probe_name)
        if probe is None:
            if probe_name != "startupProbe":
                errors.append(f"{where}: no {probe_name}")
            continue
        for kind in ("grpc", "tcpSocket", "httpGet"):
            if kind not in probe:
                continue
            number = resolve_port(daemon, probe[kind]["port"], f"{where} {probe_name}", errors)
            if kind == "grpc" and tls and number == listen_port:
                errors.append(f"{where} {probe_name}: the kubelet's grpc probe is plaintext "
                              "without a client certificate and cannot pass against a mutual "
                              "TLS port (probe --health_listen instead)")
            if kind == "grpc" and number not in (listen_port, health_port):
                errors.append(f"{where} {probe_name}: grpc.health.v1 is served on the gRPC port "
                              f"{listen_port} and the --health_listen port {health_port} only")
            if probe_name == "livenessProbe" and kind == "grpc":
                errors.append(f"{where}: a gRPC liveness probe would kill a drained daemon "
                              "(NOT_SERVING until it exits): use it for readiness")
            if kind == "httpGet" and (number != metrics_port or
                                      probe["httpGet"].get("path") not in ("/metrics", "/")):
                errors.append(f"{where} {probe_name}: HTTP is served at /metrics and / on the "
                              f"metrics port {metrics_port} only")
    drain = int(flags.get("drain_seconds", 10))
    if dpod.get("terminationGracePeriodSeconds", 30) <= drain:
        errors.append(f"DaemonSet: terminationGracePeriodSeconds must exceed --drain_seconds={drain}")
    liveness = daemon.get("livenessProbe", {})
    if liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3) <= drain:
        errors.append(f"{where}: the liveness probe would kill a daemon while it drains "
                      f"(--drain_seconds={drain})")

    # Memory: the container's limit covers --memory_limit, and so does the
    # shared memory UCX's posix transport allocates it from.
    limits = daemon.get("resources", {}).get("limits", {})
    requests = daemon.get("resources", {}).get("requests", {})
    budget = daemon_bytes(flags.get("memory_limit", "auto"))
    if "memory" not in limits:
        errors.append(f"{where}: no memory limit")
    elif budget is not None and k8s_bytes(limits["memory"]) < budget:
        errors.append(f"{where}: memory limit {limits['memory']} = {k8s_bytes(limits['memory'])} "
                      f"bytes is below --memory_limit={flags['memory_limit']} = {budget} bytes")
    if "memory" in limits and "memory" in requests and \
            k8s_bytes(requests["memory"]) > k8s_bytes(limits["memory"]):
        errors.append(f"{where}: memory request above its limit")
    if budget == 0:
        errors.append(f"{where}: --memory_limit=0 lets the daemon grow until the OOM killer stops it")
    ucx_tls = flags.get("ucx_tls", "posix,cma,self")
    if flags.get("bulk_transport", "ucx") == "ucx" and (
            ucx_tls == "" or {"posix", "sysv", "sm"} & set(ucx_tls.split(","))):
        shm = None
        for mount in daemon.get("volumeMounts", []):
            if mount["mountPath"] == "/dev/shm":
                shm = next((v for v in dpod.get("volumes", []) if v["name"] == mount["name"]), None)
        if shm is None or shm.get("emptyDir", {}).get("medium") != "Memory":
            errors.append(f"{where}: UCX shared memory needs a memory-backed emptyDir at /dev/shm")
        elif budget is not None and "sizeLimit" in shm["emptyDir"] and \
                k8s_bytes(shm["emptyDir"]["sizeLimit"]) < budget:
            errors.append(f"{where}: /dev/shm sizeLimit {shm['emptyDir']['sizeLimit']} is below "
                          f"--memory_limit={flags['memory_limit']}, which UCX allocates there")

    # Files the flags name: on a mounted volume, Secrets' keys present, the
    # admin token unreadable by group and others.
    for name in FILE_FLAGS + DIR_FLAGS:
        if not flags.get(name):
            continue
        volume, key = mounted_file(dpod, daemon, flags[name].rstrip("/") + ("/x" if name in DIR_FLAGS else ""),
                                   f"{where} --{name}", errors)
        if volume is None:
            continue
        if name in FILE_FLAGS:
            if "secret" not in volume:
                errors.append(f"{where}: --{name} should come from a Secret")
                continue
            secret_refs.append((f"{where} --{name}", volume["secret"]["secretName"], key))
        if name in TOKEN_FILE_FLAGS:
            mode = volume["secret"].get("defaultMode", 0o644)
            item_mode = next((i.get("mode") for i in volume["secret"].get("items", [])
                              if i["key"] == key), None)
            if (item_mode if item_mode is not None else mode) & 0o077:
                errors.append(f"{where}: --{name}'s mode must be 0600 or stricter "
                              "(the daemon refuses it otherwise)")
            if dpod.get("securityContext", {}).get("fsGroup") is not None:
                errors.append(f"DaemonSet: fsGroup makes --{name} group-readable, which the "
                              "daemon refuses")
        if name in DIR_FLAGS and "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if not any(d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim
                       for d in docs):
                errors.append(f"{where}: PersistentVolumeClaim {claim} is in no manifest")

    # --- Service and ServiceMonitor.
    if not service["spec"].get("selector") or not subset(service["spec"]["selector"], dlabels):
        errors.append("Service selector does not match the DaemonSet's pod labels")
    service_ports = {}
    for p in service["spec"].get("ports", []):
        number = resolve_port(daemon, p.get("targetPort", p["port"]),
                              f"Service port {p.get('name')}", errors)
        service_ports[p.get("name")] = number
        if dpod.get("hostNetwork") and number is not None and p["port"] != number:
            errors.append(f"Service port {p.get('name')}: with hostNetwork keep port = targetPort")
    if not subset(monitor["spec"]["selector"].get("matchLabels"), service["metadata"].get("labels", {})) \
            or not monitor["spec"]["selector"].get("matchLabels"):
        errors.append("ServiceMonitor selector does not match the Service's labels")
    for endpoint in monitor["spec"].get("endpoints", []):
        if service_ports.get(endpoint.get("port")) != metrics_port:
            errors.append(f"ServiceMonitor endpoint port {endpoint.get('port')!r} is not the "
                          f"Service port of the metrics port {metrics_port}")
        if endpoint.get("path", "/metrics") != "/metrics":
            errors.append("ServiceMonitor endpoint path must be /metrics")
        if endpoint.get("honorLabels") is not True:
            errors.append("ServiceMonitor endpoint needs honorLabels: true: the daemons' `job` "
                          "label is the training job's")
    job_label = monitor["spec"].get("jobLabel")
    scrape_job = service["metadata"]["labels"].get(job_label) if job_label else \
        service["metadata"]["name"]
    if scrape_job != ctx.scrape_job:
        errors.append(f"the daemons' up series would get job={scrape_job!r}; the alert rules "
                      f"expect job={ctx.scrape_job!r}")

    # --- Trainers.
    spec = job["spec"]
    tpod = spec["template"]["spec"]
    trainer = container_of(job, TRAINER_BINARY, errors)
    if trainer is None:
        return errors
    where = f"Job container {trainer['name']}"
    if subset(service["spec"]["selector"], spec["template"]["metadata"].get("labels", {})):
        errors.append("the daemons' Service selects the trainer pods too")
    if spec.get("completionMode") != "Indexed":
        errors.append("Job: completionMode must be Indexed (the completion index is the rank)")
    world = spec.get("completions")
    if spec.get("parallelism") != world:
        errors.append("Job: parallelism must equal completions (every rank runs at once)")
    tflags = parse_flags(trainer.get("args", []), where, errors)
    for name in tflags:
        if name not in ctx.trainer_flags:
            errors.append(f"{where}: gpt_train has no flag --{name}")
    transport = tflags.get("transport", "ucx")
    if transport not in ("stream", flags.get("bulk_transport", "ucx")):
        errors.append(f"{where}: --transport={transport} is neither stream nor the daemons' "
                      f"--bulk_transport={flags.get('bulk_transport', 'ucx')}")
    env = {}
    for e in trainer.get("env", []):
        if e["name"] in env:
            errors.append(f"{where}: {e['name']} set twice")
        env[e["name"]] = e
        if e["name"] not in ctx.trainer_env:
            errors.append(f"{where}: neither gpt_train nor zsrun knows the variable {e['name']}")
    for name in REQUIRED_TRAINER_ENV:
        if name not in env:
            errors.append(f"{where}: {name} is not set")
    for name in ("ZS_RANK", "RANK"):
        if name in env and env[name].get("valueFrom", {}).get("fieldRef", {}).get(
                "fieldPath") != COMPLETION_INDEX:
            errors.append(f"{where}: {name} must come from the pod's completion index")
    for name in ("ZS_WORLD_SIZE", "WORLD_SIZE"):
        if name in env and str(env[name].get("value")) != str(world):
            errors.append(f"{where}: {name}={env[name].get('value')} but completions={world}")
    for name in ("ZS_JOB_TOKEN", "ZS_REGISTRATION_TOKEN"):
        token = env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")
        if name in env and token is None:
            errors.append(f"{where}: {name} must come from a Secret")
        elif token is not None:
            secret_refs.append((f"{where} {name}", token["name"], token["key"]))
    if flags.get("registration_token_file") and "ZS_REGISTRATION_TOKEN" not in env:
        errors.append(f"{where}: the daemons demand a registration token "
                      "(--registration_token_file) and ZS_REGISTRATION_TOKEN is not set")
    daemons_ref = env.get("ZS_DAEMONS", {}).get("valueFrom", {}).get("configMapKeyRef")
    if daemons_ref is None and "ZS_DAEMONS" in env:
        errors.append(f"{where}: ZS_DAEMONS must come from the ConfigMap every rank reads")
    elif daemons_ref is not None:
        cm = next((d for d in docs if d["kind"] == "ConfigMap" and
                   d["metadata"]["name"] == daemons_ref["name"]), None)
        addresses = (cm or {}).get("data", {}).get(daemons_ref["key"])
        if addresses is None:
            errors.append(f"{where}: ConfigMap {daemons_ref['name']} key {daemons_ref['key']} "
                          "is in no manifest")
        else:
            for address in addresses.split(","):
                if not re.fullmatch(r"[^:,\s]+:[0-9]+", address) or \
                        host_port(address)[1] != listen_port:
                    errors.append(f"ZS_DAEMONS address {address!r} is not HOST:{listen_port}")
    for name in ("ZS_TLS_CERT", "ZS_TLS_KEY", "ZS_TLS_CA"):
        if "value" in env.get(name, {}):
            volume, key = mounted_file(tpod, trainer, env[name]["value"], f"{where} {name}",
                                       errors)
            if volume is not None and "secret" in volume:
                secret_refs.append((f"{where} {name}", volume["secret"]["secretName"], key))

    # --- Secrets: in a manifest, or in README.md's list for the user.
    defined = {d["metadata"]["name"]: set(d.get("data", {})) | set(d.get("stringData", {}))
               for d in docs if d["kind"] == "Secret"}
    defined.update({k: v for k, v in ctx.user_secrets.items() if k not in defined})
    used = set()
    for place, name, key in secret_refs:
        used.add(name)
        if name not in defined:
            errors.append(f"{place}: Secret {name} is neither in a manifest nor in README.md")
        elif key is not None and key not in defined[name]:
            errors.append(f"{place}: Secret {name} has no key {key} (README.md lists "
                          f"{sorted(defined[name])})")
    for name in ctx.user_secrets:
        if name not in used:
            errors.append(f"README.md lists Secret {name}, which no manifest uses")

    # --- One image setting.
    kustomization = one(docs, "Kustomization", errors)
    if kustomization is not None:
        names = {i["name"] for i in kustomization.get("images", [])}
        for workload in (daemonset, job):
            for c in workload["spec"]["template"]["spec"]["containers"]:
                if c["image"] not in names:
                    errors.append(f"{workload['kind']} container {c['name']}: image {c['image']} "
                                  "is not the Kustomization's image")
    return errors


# ---------------------------------------------------------------------------

def load_manifests(directory):
    docs, files = [], {}
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            file_docs = [d for d in yaml.safe_load_all(f) if d is not None]
        files[os.path.basename(path)] = file_docs
        docs.extend(file_docs)
    return docs, files


class ManifestsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        zeroshardd, gpt_train, zsrun_lib, alerts = ARGS
        cls.directory = os.environ.get("MANIFEST_DIR", ".")
        cls.docs, cls.files = load_manifests(cls.directory)
        daemon_flags, _ = helpfull_flags(zeroshardd)
        trainer_flags, trainer_help = helpfull_flags(gpt_train)
        cls.ctx = Context(daemon_flags, trainer_flags, trainer_help, zsrun_trainer_env(zsrun_lib),
                          alert_scrape_job(alerts),
                          readme_secrets(os.path.join(cls.directory, "README.md")))

    def test_sources_were_read(self):
        # The facts the checks compare against, so a parser that finds
        # nothing cannot make every check pass.
        for flag in ("listen", "metrics_listen", "memory_limit", "tls_cert", "admin_token_file",
                     "bulk_transport", "drain_seconds"):
            self.assertIn(flag, self.ctx.daemon_flags)
        for name in REQUIRED_TRAINER_ENV + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
            self.assertIn(name, self.ctx.trainer_env)
        self.assertEqual(self.ctx.scrape_job, "zeroshard")
        self.assertIn("zeroshard-job-token", self.ctx.user_secrets)

    def test_manifests_agree_with_the_programs(self):
        self.assertEqual(check(self.docs, self.ctx), [])

    def test_kustomization_lists_every_manifest(self):
        kustomization = self.files["kustomization.yaml"][0]
        self.assertEqual(sorted(kustomization["resources"]),
                         sorted(f for f in self.files if f != "kustomization.yaml"))
        namespace = kustomization.get("namespace")
        self.assertTrue(any(d["kind"] == "Namespace" and d["metadata"]["name"] == namespace
                            for d in self.docs))

    def test_sizes(self):
        self.assertEqual(daemon_bytes("32G"), 32 << 30)
        self.assertEqual(daemon_bytes("32GiB"), 32 << 30)
        self.assertEqual(daemon_bytes("4096"), 4096)
        self.assertIsNone(daemon_bytes("auto"))
        self.assertRaises(ValueError, daemon_bytes, "32Gi")  # zeroshardd refuses it
        self.assertEqual(k8s_bytes("32Gi"), 32 << 30)
        self.assertEqual(k8s_bytes("32G"), 32 * 10 ** 9)
        self.assertEqual(k8s_bytes("1e3"), 1000)
        self.assertEqual(k8s_bytes(1024), 1024)

    # Mutated copies the checker must refuse.
    def assert_rejected(self, mutate, expected):
        docs = copy.deepcopy(self.docs)
        mutate({d["kind"]: d for d in docs})
        errors = check(docs, self.ctx)
        self.assertTrue(any(expected in e for e in errors),
                        f"no error mentioning {expected!r}; got {errors}")

    @staticmethod
    def daemon(k):
        return k["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]

    @staticmethod
    def trainer(k):
        return k["Job"]["spec"]["template"]["spec"]["containers"][0]

    def test_rejects_unknown_daemon_flag(self):
        self.assert_rejected(lambda k: self.daemon(k)["args"].append("--memory_limits=8G"),
                             "no flag --memory_limits")

    def test_rejects_unknown_trainer_flag(self):
        self.assert_rejected(lambda k: self.trainer(k)["args"].append("--world=2"),
                             "gpt_train has no flag --world")

    def test_rejects_listen_port_without_container_port(self):
        def mutate(k):
            args = self.daemon(k)["args"]
            args[:] = ["--listen=0.0.0.0:7071" if a.startswith("--listen=") else a for a in args]
        self.assert_rejected(mutate, "--listen port 7071")

    def test_rejects_service_target_port_typo(self):
        self.assert_rejected(
            lambda k: k["Service"]["spec"]["ports"][1].update(targetPort="metric"),
            "port 'metric' is not a port")

    def test_rejects_selector_mismatch(self):
        self.assert_rejected(
            lambda k: k["Service"]["spec"]["selector"].update({"app.kubernetes.io/name": "zs"}),
            "Service selector")
        self.assert_rejected(
            lambda k: k["ServiceMonitor"]["spec"]["selector"]["matchLabels"].update(
                {"app.kubernetes.io/component": "trainer"}),
            "ServiceMonitor selector")

    def test_rejects_decimal_memory_limit(self):
        # 32G in Kubernetes is 32e9 bytes, less than zeroshardd's 32G.
        self.assert_rejected(lambda k: self.daemon(k)["resources"]["limits"].update(memory="32G"),
                             "below --memory_limit")

    def test_rejects_grpc_probe_on_tls_port(self):
        self.assert_rejected(
            lambda k: self.daemon(k).update(readinessProbe={"grpc": {"port": 7070}}),
            "cannot pass against a mutual TLS port")

    def test_rejects_grpc_liveness_probe(self):
        self.assert_rejected(
            lambda k: self.daemon(k).update(livenessProbe={"grpc": {"port": 7071}}),
            "would kill a drained daemon")

    def test_rejects_health_port_mismatch(self):
        def mutate(k):
            args = self.daemon(k)["args"]
            args[args.index("--health_listen=0.0.0.0:7071")] = "--health_listen=0.0.0.0:7072"
        self.assert_rejected(mutate, "is not the containerPort named health")

    def test_rejects_unknown_trainer_variable(self):
        self.assert_rejected(
            lambda k: self.trainer(k)["env"].append({"name": "ZS_DAEMON", "value": "x:7070"}),
            "the variable ZS_DAEMON")

    def test_rejects_world_size_mismatch(self):
        self.assert_rejected(lambda k: k["Job"]["spec"].update(completions=3, parallelism=3),
                             "but completions=3")

    def test_rejects_undocumented_secret_key(self):
        def mutate(k):
            env = next(e for e in self.trainer(k)["env"] if e["name"] == "ZS_JOB_TOKEN")
            env["valueFrom"]["secretKeyRef"]["key"] = "job.token"
        self.assert_rejected(mutate, "has no key job.token")

    def test_rejects_group_readable_admin_token(self):
        def mutate(k):
            volumes = k["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
            next(v for v in volumes if v["name"] == "admin-token")["secret"]["defaultMode"] = 0o440
        self.assert_rejected(mutate, "0600 or stricter")


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    ARGS = [os.path.abspath(a) for a in sys.argv[1:5]]
    unittest.main(argv=sys.argv[:1] + sys.argv[5:], verbosity=2)
