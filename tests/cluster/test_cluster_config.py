"""The cluster's boundary, in one process: torch's env:// variables become a ClusterConfig (or a
one-line refusal), commands that do not run expert-parallel refuse to under torchrun, cluster
flags without torchrun are refused, and the handshake's verdicts name both sides."""

from __future__ import annotations

import pytest

from latentkv.cli import main
from latentkv.cluster.handshake import PROTOCOL, HeadFacts, Hello, head_proof, refusal, worker_proof
from latentkv.config import ClusterConfig, ConfigError, cluster_env

ENV = {
    "WORLD_SIZE": "3",
    "RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_WORLD_SIZE": "1",
}


def test_torch_env_variables_make_the_config():
    assert cluster_env({}) is None and cluster_env({"WORLD_SIZE": "1"}) is None
    env = cluster_env(ENV)
    cfg = ClusterConfig(**env)
    assert (cfg.world_size, cfg.rank, cfg.master_addr, cfg.master_port, cfg.is_head) == (
        3,
        1,
        "10.0.0.1",
        29500,
        False,
    )
    assert cluster_env({**ENV, "TORCHELASTIC_USE_AGENT_STORE": "True"})["agent_store"]
    with pytest.raises(ConfigError, match="must be integers"):
        cluster_env({**ENV, "RANK": "one"})
    with pytest.raises(ConfigError, match="RANK must be in 0..2"):
        ClusterConfig(**{**env, "rank": 3})
    with pytest.raises(ConfigError, match="MASTER_ADDR is empty"):
        ClusterConfig(**{**env, "master_addr": ""})


def test_commands_refuse_what_does_not_apply(monkeypatch, capsys):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    assert main(["plan", "builtin:fixture"]) == 2
    assert "does not run expert-parallel" in capsys.readouterr().err
    assert main(["bench", "attention"]) == 2
    capsys.readouterr()
    monkeypatch.setenv("RANK", "x")
    assert main(["generate", "builtin:fixture", "--prompt-ids", "1"]) == 2
    assert "must be integers" in capsys.readouterr().err
    for key in ENV:
        monkeypatch.delenv(key)
    for flags in (["--cluster-timeout", "5"], ["--no-head-experts"], ["--cluster-secret", "x"]):
        assert main(["generate", "builtin:fixture", "--prompt-ids", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "applies to a cluster: start the command with torchrun" in err


def _hello(**changes) -> Hello:
    base = dict(
        rank=2,
        nonce="n1",
        host="box2",
        protocol=PROTOCOL,
        version="0.1",
        fingerprint="f" * 64,
        model="M",
        expert_format="int4",
        ram_bytes=1 << 30,
        disk_gbps=1.0,
        placement=None,
        share=None,
        proof=None,
    )
    base.update(changes)
    return Hello(**base)


def _facts(**changes) -> HeadFacts:
    base = dict(
        version="0.1",
        fingerprint="f" * 64,
        model="M",
        expert_format="int4",
        placement=None,
        secret=None,
        challenge="c",
    )
    base.update(changes)
    return HeadFacts(**base)


def test_the_verdict_names_what_differs_and_both_sides():
    assert refusal(_hello(), _facts()) is None
    assert "cluster protocol" in refusal(_hello(protocol=PROTOCOL + 1), _facts())
    why = refusal(_hello(fingerprint="e" * 64, model="other"), _facts())
    assert "rank 2 (box2) runs another model: other" in why and "the head M" in why
    assert "streams bf16 experts, the head int4" in refusal(_hello(expert_format="bf16"), _facts())
    assert "placement abc" in refusal(_hello(placement="abc"), _facts())
    assert "placement (none)" in refusal(_hello(), _facts(placement="abc"))
    # the secret: absent on one side, different, or the same (a proof of the head's challenge)
    assert "the head has a cluster secret and rank 2" in refusal(_hello(), _facts(secret="s"))
    assert "rank 2 (box2) has a cluster secret and the head has none" in refusal(_hello(proof="p"), _facts())
    wrong = worker_proof("t", "c", 2, "n1")
    assert "another cluster secret" in refusal(_hello(proof=wrong), _facts(secret="s"))
    assert refusal(_hello(proof=worker_proof("s", "c", 2, "n1")), _facts(secret="s")) is None
    # a proof is bound to the challenge, the rank and the attempt
    assert refusal(_hello(proof=worker_proof("s", "c", 1, "n1")), _facts(secret="s")) is not None
    assert head_proof("s", "n1") != head_proof("s", "n2") and head_proof(None, "n1") is None
