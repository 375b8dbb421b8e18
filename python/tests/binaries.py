"""The binaries the tests run: zeroshardd daemons on loopback, and zsctl."""

import contextlib
import os
import pathlib
import json
import re
import subprocess
import sys

import pytest

HERE_DIR = pathlib.Path(__file__).resolve().parent
# python/tests -> the runfiles' (or the workspace's) root.
ROOT = HERE_DIR.parents[1]


def _binary(env_var, package, name):
    # pytest_test.sh sets ZEROSHARDD; in runfiles the binaries sit under
    # their package; otherwise a `bazel build` left them in bazel-bin.
    candidates = [os.environ.get(env_var), ROOT / package / name,
                  ROOT / "bazel-bin" / package / name]
    for path in candidates:
        if path is not None and os.access(path, os.X_OK):
            return str(path)
    pytest.skip(f"{name} not found (tried {[str(c) for c in candidates]})")


def daemon_binary():
    return _binary("ZEROSHARDD", "server", "zeroshardd")


def zsctl_binary():
    return _binary("ZSCTL", "tools", "zsctl")


@contextlib.contextmanager
def running_daemons(count, extra_args=lambda index: [], procs=None):
    """Starts `count` daemons on 127.0.0.1:0 and yields their addresses;
    kills them on exit. extra_args(i) gives daemon i's other flags; the
    daemons' Popen objects are appended to `procs` when given."""
    binary = daemon_binary()
    procs = [] if procs is None else procs
    addresses = []
    try:
        for i in range(count):
            proc = subprocess.Popen(
                [binary, "--listen=127.0.0.1:0", *extra_args(i)],
                stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            prefix = "zeroshardd listening on "
            said = []
            while not said or not said[-1].startswith(prefix):
                line = proc.stdout.readline()
                assert line, f"daemon exited after saying {said!r}"
                said.append(line)
            addresses.append(said[-1][len(prefix):].strip())
        yield addresses
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def daemon_with_metrics(extra_args=()):
    """One daemon started with `extra_args` and --metrics_port=0: yields
    (its address, its /metrics port)."""
    procs = []
    with running_daemons(1, lambda i: [*extra_args, "--metrics_port=0"], procs) as addresses:
        port = None
        for line in procs[0].stdout:
            m = re.match(r"zeroshardd metrics on port (\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port is not None, "the daemon printed no metrics port"
        yield addresses[0], port


def run_workers(script, configs, outputs, timeout=240):
    """Runs `script` (beside this file) once per rank, as
    `python3 script CONFIG_JSON OUTPUT`, all at once; asserts each exits 0
    within `timeout` seconds and kills any still running."""
    workers = [subprocess.Popen([sys.executable, str(HERE_DIR / script),
                                 json.dumps(config), str(out)])
               for config, out in zip(configs, outputs)]
    for rank, worker in enumerate(workers):
        try:
            assert worker.wait(timeout=timeout) == 0, f"rank {rank} failed"
        finally:
            if worker.poll() is None:
                worker.kill()
