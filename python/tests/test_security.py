"""Job tokens and mutual TLS through zeroshard.Client.

Against a plaintext daemon started with --admin_token_file: a client with
another token cannot register a job registered with the job's token
(PERMISSION_DENIED, and the job goes on), and token=None means
$ZS_JOB_TOKEN (which pytest_test.sh exports). Against a daemon serving
mutual TLS (certificates from common/testing/make_test_certs.sh): a client
with tls_cert/tls_key/tls_ca (or $ZS_TLS_*) trains, and one without them, or
with a certificate the daemon does not trust, or trusting another CA, is
refused (UNAVAILABLE)."""

import os
import pathlib
import subprocess
import threading

import numpy as np
import pytest

import zeroshard
from binaries import ROOT, running_daemons

# ZeRO stage 1, world size 1 unless said otherwise; small timeouts so that a
# refused call fails fast.
LAYOUT = zeroshard.Layout([("w", (5, 3), 0), ("b", (5,), 0)])
WRONG_TOKEN = "pytest-wrong-token-0123456789"
# Only used when the suite runs outside pytest_test.sh.
FALLBACK_JOB_TOKEN = "pytest-job-token-0123456789"


@pytest.fixture(autouse=True)
def environment(monkeypatch):
    """$ZS_JOB_TOKEN set (as pytest_test.sh does), no $ZS_TLS_*."""
    if not os.environ.get("ZS_JOB_TOKEN"):
        monkeypatch.setenv("ZS_JOB_TOKEN", FALLBACK_JOB_TOKEN)
    for name in ("ZS_TLS_CERT", "ZS_TLS_KEY", "ZS_TLS_CA"):
        monkeypatch.delenv(name, raising=False)


def _client(daemons, job, rank=0, world_size=1, **kwargs):
    return zeroshard.Client(daemons, job, rank=rank, world_size=world_size,
                            stage=1, bucket_bytes=4096, rpc_timeout=10.0,
                            step_timeout=30.0, **kwargs)


def _initial():
    return np.arange(LAYOUT.total_elements, dtype=np.float32) / 100


def _train_one_step(client):
    """One step on every element; returns the parameters after it."""
    n = LAYOUT.total_elements
    client.push_gradients(0, n, np.ones(n, dtype=np.float32))
    assert client.step(lr=0.1)["step"] == 1
    out = np.zeros(n, dtype=np.float32)
    client.gather_all(out)
    return out


def test_plaintext_to_the_network_needs_insecure(monkeypatch):
    # Creating a client connects to nothing: no daemon needs to be there.
    monkeypatch.delenv("ZS_INSECURE", raising=False)
    daemons = ["127.0.0.1:7070", "10.255.0.1:7070"]
    with pytest.raises(zeroshard.Error) as info:
        _client(daemons, "plain", world_size=2)
    assert info.value.code == "INVALID_ARGUMENT", info.value
    assert "10.255.0.1:7070" in str(info.value)
    assert "ZS_INSECURE=1" in str(info.value)
    _client(daemons, "plain", world_size=2, insecure=True)
    monkeypatch.setenv("ZS_INSECURE", "1")
    _client(daemons, "plain", world_size=2)


# ---- tokens ----

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    admin = tmp_path_factory.mktemp("admin") / "admin.token"
    admin.write_text("pytest-security-admin-token-0123\n")
    admin.chmod(0o600)
    with running_daemons(1, lambda i: [f"--admin_token_file={admin}",
                                       "--activation_arena_bytes=0",
                                       "--bulk_transport="]) as addresses:
        yield addresses


def test_wrong_token_is_permission_denied(daemon):
    owner = _client(daemon, "security-owned")  # token=None: $ZS_JOB_TOKEN
    owner.register_model(LAYOUT, _initial())
    intruder = _client(daemon, "security-owned", token=WRONG_TOKEN)
    with pytest.raises(zeroshard.Error) as info:
        intruder.register_model(LAYOUT, np.zeros(LAYOUT.total_elements, dtype=np.float32))
    assert info.value.code == "PERMISSION_DENIED", info.value
    assert "another token" in str(info.value)
    # Nothing changed: the owner trains on from its own initial values.
    # AdamW's first step with gradient 1: p - lr * (1 + weight_decay * p).
    params, initial = _train_one_step(owner), _initial()
    expected = initial - 0.1 * (1 + 0.01 * initial)
    for offset, numel in zip(LAYOUT.offsets, LAYOUT.numels):
        np.testing.assert_allclose(params[offset:offset + numel],
                                   expected[offset:offset + numel], rtol=1e-5, atol=1e-6)
    owner.leave()


def test_token_defaults_to_environment(daemon, monkeypatch):
    # Rank 0 takes $ZS_JOB_TOKEN implicitly, rank 1 names it: both open the
    # job (registering blocks until both ranks have joined).
    job = "security-env-token"
    clients = [_client(daemon, job, rank=0, world_size=2),
               _client(daemon, job, rank=1, world_size=2,
                       token=os.environ["ZS_JOB_TOKEN"])]
    errors = []

    def register(rank):
        try:
            clients[rank].register_model(LAYOUT, _initial() if rank == 0 else None)
        except zeroshard.Error as e:  # reported below
            errors.append((rank, e.code, str(e)))

    # Daemon threads: when rank 1 is refused, rank 0 waits out its timeout.
    threads = [threading.Thread(target=register, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    threads[1].join(timeout=30)
    assert errors == []
    threads[0].join(timeout=30)
    assert errors == []
    assert not any(t.is_alive() for t in threads), "register_model did not return"
    assert [c.total_elements for c in clients] == [LAYOUT.total_elements] * 2
    for c in clients:
        c.leave()
    # Without $ZS_JOB_TOKEN a client has no token and is refused at once.
    monkeypatch.delenv("ZS_JOB_TOKEN")
    with pytest.raises(zeroshard.Error) as info:
        _client(daemon, job)
    assert info.value.code == "INVALID_ARGUMENT"
    assert "job_token" in str(info.value)


# ---- mutual TLS ----

def _make_test_certs():
    for path in (ROOT / "common" / "testing" / "make_test_certs.sh",
                 ROOT / "common" / "testing" / "make_test_certs"):
        if path.is_file():
            return path
    pytest.skip(f"make_test_certs.sh not found under {ROOT}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(_make_test_certs()), str(out)], check=True,
                   capture_output=True, timeout=60)
    return out


@pytest.fixture(scope="module")
def tls_daemon(certs):
    with running_daemons(1, lambda i: [f"--tls_cert={certs / 'server.crt'}",
                                       f"--tls_key={certs / 'server.key'}",
                                       f"--tls_ca={certs / 'ca.crt'}",
                                       "--activation_arena_bytes=0",
                                       "--bulk_transport="]) as addresses:
        yield addresses


def _tls(certs, name="client", ca="ca"):
    return dict(tls_cert=str(certs / f"{name}.crt"), tls_key=str(certs / f"{name}.key"),
                tls_ca=str(certs / f"{ca}.crt"))


def test_tls_client_trains(tls_daemon, certs):
    client = _client(tls_daemon, "security-tls", **_tls(certs))
    client.register_model(LAYOUT, _initial())
    assert not np.array_equal(_train_one_step(client), _initial())
    client.leave()


def test_tls_files_default_to_environment(tls_daemon, certs, monkeypatch):
    for field, var in (("tls_cert", "ZS_TLS_CERT"), ("tls_key", "ZS_TLS_KEY"),
                       ("tls_ca", "ZS_TLS_CA")):
        monkeypatch.setenv(var, _tls(certs)[field])
    client = _client(tls_daemon, "security-tls-env")
    client.register_model(LAYOUT, _initial())
    client.leave()


@pytest.mark.parametrize("case", ["plaintext", "foreign certificate", "expired certificate",
                                  "daemon not trusted"])
def test_tls_daemon_refuses(tls_daemon, certs, case):
    tls = {"plaintext": {},
           "foreign certificate": _tls(certs, name="stranger"),  # signed by other_ca
           "expired certificate": _tls(certs, name="expired"),
           "daemon not trusted": _tls(certs, ca="other_ca")}[case]
    client = _client(tls_daemon, f"security-refused-{case.split()[0]}", **tls)
    with pytest.raises(zeroshard.Error) as info:
        client.register_model(LAYOUT, _initial())
    assert info.value.code == "UNAVAILABLE", info.value
