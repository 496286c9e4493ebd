"""The keys of the scheduler <-> worker ZeroMQ link: which process holds which, keys read from
files (secret mounts), the key-file generator, and the refusal of tcp:// without keys."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from pagedserve.security.zmq_curve import (
    CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV, CURVE_ENVS, KEY_FILES, SERVER_PUBLIC_ENV, SERVER_SECRET_ENV,
    CurveKeyError, check_internal_transport, curve_env_for, curve_keys_from_env, new_curve_env,
)


@pytest.fixture
def no_keys(monkeypatch):
    for name in CURVE_ENVS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)
    return monkeypatch


def test_each_role_gets_only_its_keys():
    env = {"PATH": "/bin", **new_curve_env(), f"{SERVER_SECRET_ENV}_FILE": "/run/secrets/server_secret"}
    scheduler = curve_env_for("scheduler", env)
    worker = curve_env_for("worker", env)
    frontend = curve_env_for("frontend", env)
    assert set(scheduler) == {"PATH", SERVER_PUBLIC_ENV, SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV,
                              f"{SERVER_SECRET_ENV}_FILE"}
    assert set(worker) == {"PATH", SERVER_PUBLIC_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV}
    assert set(frontend) == {"PATH"}
    assert curve_env_for("replica", env) == env  # a replica is a serve: it hands keys on itself


def test_keys_are_read_from_files(no_keys, tmp_path):
    env = new_curve_env()
    for name in (SERVER_PUBLIC_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV):  # a worker's mounts
        (tmp_path / name).write_text(env[name] + "\n")
        no_keys.setenv(f"{name}_FILE", str(tmp_path / name))
    keys = curve_keys_from_env()
    assert keys.server_public == env[SERVER_PUBLIC_ENV].encode()
    assert keys.client_secret == env[CLIENT_SECRET_ENV].encode() and keys.server_secret is None
    no_keys.setenv(f"{SERVER_SECRET_ENV}_FILE", str(tmp_path / "missing"))
    with pytest.raises(CurveKeyError, match="missing"):
        curve_keys_from_env()


def test_the_generator_writes_owner_only_key_files(no_keys, tmp_path):
    folder = tmp_path / "zmq"
    done = subprocess.run([sys.executable, "-m", "pagedserve.security.zmq_curve", str(folder)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name, file_name in KEY_FILES.items():
        path = folder / file_name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        no_keys.setenv(f"{name}_FILE", str(path))
    keys = curve_keys_from_env()
    assert len({keys.server_public, keys.server_secret, keys.client_public, keys.client_secret}) == 4


def test_tcp_needs_keys_or_the_opt_out_and_ipc_does_not():
    tcp = ("tcp://127.0.0.1:50061", "tcp://127.0.0.1:50062")
    with pytest.raises(CurveKeyError, match="--allow-insecure-internal-transport"):
        check_internal_transport(tcp, None, is_insecure_allowed=False)
    assert check_internal_transport(tcp, None, is_insecure_allowed=True) is True
    assert check_internal_transport(("ipc:///run/p/plans", "ipc:///run/p/results"), None,
                                    is_insecure_allowed=False) is True
    with pytest.raises(CurveKeyError, match="tcp://127.0.0.1:50062"):
        check_internal_transport(("ipc:///run/p/plans", tcp[1]), None, is_insecure_allowed=False)


def test_a_worker_without_its_secret_key_fails_before_loading_its_model(tmp_path):
    from tests.e2e.conftest import build_checkpoint

    model = build_checkpoint(tmp_path / "model", "llama", hidden_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=128, max_position_embeddings=256)
    keys = new_curve_env()
    env = {name: value for name, value in os.environ.items()
           if not any(name.startswith(key) for key in CURVE_ENVS)}
    env.update({SERVER_PUBLIC_ENV: keys[SERVER_PUBLIC_ENV], CLIENT_PUBLIC_ENV: keys[CLIENT_PUBLIC_ENV]})
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "worker", "--model", str(model),
                           "--device", "cpu", "--rank", "0", "--plan-address", "tcp://127.0.0.1:9",
                           "--result-address", "tcp://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert CLIENT_SECRET_ENV in done.stderr
    assert "model_loaded" not in done.stdout + done.stderr  # it failed before the load, not after
