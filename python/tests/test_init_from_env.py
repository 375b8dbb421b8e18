"""zeroshard.torch.init_from_env: the client config from zsrun's and
torchrun's variables, and zeroshard.Error naming what is missing."""

import pytest

import zeroshard
from zeroshard.torch import init_from_env

ALL = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "ZS_RANK", "ZS_WORLD_SIZE",
       "ZS_DAEMONS", "ZS_JOB_ID", "TORCHELASTIC_RUN_ID", "ZS_TRANSPORT", "ZS_UCX_TLS"]


@pytest.fixture
def env(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_zsrun_variables(env):
    env.setenv("ZS_RANK", "1")
    env.setenv("ZS_WORLD_SIZE", "4")
    env.setenv("ZS_DAEMONS", "10.0.0.1:7070,10.0.0.2:7070")
    env.setenv("ZS_JOB_ID", "gpt-7")
    assert init_from_env() == {"rank": 1, "world_size": 4, "job_id": "gpt-7",
                               "daemons": ["10.0.0.1:7070", "10.0.0.2:7070"]}


def test_torchrun_variables_win_and_run_id_names_the_job(env):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")
    env.setenv("ZS_RANK", "0")
    env.setenv("ZS_DAEMONS", "node0:7070")
    env.setenv("TORCHELASTIC_RUN_ID", "run42")
    config = init_from_env(replicas=2, rpc_timeout=30.0)
    assert config == {"rank": 3, "world_size": 8, "daemons": ["node0:7070"],
                      "job_id": "run42", "replicas": 2, "rpc_timeout": 30.0}


def test_zsrun_transport_is_the_clients_unless_given(env):
    for name, value in {"ZS_RANK": "0", "ZS_WORLD_SIZE": "1", "ZS_DAEMONS": "127.0.0.1:1",
                        "ZS_JOB_ID": "j", "ZS_TRANSPORT": "ucx",
                        "ZS_UCX_TLS": "posix,cma,self"}.items():
        env.setenv(name, value)
    config = init_from_env()
    assert config["transport"] == "ucx" and config["ucx_tls"] == "posix,cma,self", config
    assert init_from_env(transport="stream")["transport"] == "stream"
    assert "ucx_tls" not in init_from_env(transport="stream")
    assert init_from_env(ucx_tls="tcp")["ucx_tls"] == "tcp"
    env.setenv("ZS_TRANSPORT", "grpc")
    config = init_from_env()
    assert config["transport"] == "grpc" and "ucx_tls" not in config, config
    assert init_from_env(transport="ucx")["ucx_tls"] == "posix,cma,self"
    env.setenv("ZS_TRANSPORT", "stream")
    assert init_from_env()["transport"] == "stream"


def test_keywords_replace_missing_variables(env):
    config = init_from_env(rank=0, world_size=1, daemons=["127.0.0.1:1"],
                           job_id="j")
    assert config == {"rank": 0, "world_size": 1, "daemons": ["127.0.0.1:1"],
                      "job_id": "j"}


@pytest.mark.parametrize("setup,names", [
    ({}, "RANK or ZS_RANK"),
    ({"RANK": "0"}, "WORLD_SIZE or ZS_WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "ZS_DAEMONS"),
    ({"RANK": "0", "WORLD_SIZE": "2", "ZS_DAEMONS": "a:1",
      "TORCHELASTIC_RUN_ID": "none"}, "ZS_JOB_ID"),
    ({"RANK": "-1"}, "RANK: must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE: must be a whole number"),
])
def test_missing_or_malformed_variables_raise(env, setup, names):
    for name, value in setup.items():
        env.setenv(name, value)
    with pytest.raises(zeroshard.Error) as raised:
        init_from_env()
    assert raised.value.code == "INVALID_ARGUMENT"
    assert names in str(raised.value)
