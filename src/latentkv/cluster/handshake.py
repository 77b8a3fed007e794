"""What a rank tells the head when it joins, and the head's answer (plain JSON in the store).

A worker is refused, with one line on both sides, when it runs another cluster protocol, another
model (the checkpoint's fingerprint), another expert format, another placement (when either side
was given one), or when the two sides disagree on the shared secret. The secret itself never
crosses the wire: the head publishes a random challenge, the worker answers with
HMAC-SHA256(secret, challenge | rank | its nonce), and the head's verdict carries
HMAC-SHA256(secret, nonce | "head"), so each side checks the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field

PROTOCOL = 1  # the wire format and handshake; ranks of another protocol are refused


@dataclass
class Hello:
    """A worker's introduction."""

    rank: int
    nonce: str  # random per start, names this attempt (a rank restarted says hello again)
    host: str
    protocol: int
    version: str  # latentkv's
    fingerprint: str  # the checkpoint's
    model: str  # the MODEL argument, for messages
    expert_format: str
    ram_bytes: int
    disk_gbps: float | None  # None: not measured (no store here yet)
    placement: str | None  # the digest of its --placement file, if given
    share: dict | None  # the placement its share store was written for (Placement.to_json()), if any
    proof: str | None  # HMAC of the challenge with the secret; None: this rank has no secret

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Hello:
        return cls(**json.loads(data))


@dataclass
class Verdict:
    """The head's answer to one hello."""

    ok: bool
    reason: str = ""
    epoch: int = 0
    placement: dict | None = None  # Placement.to_json()
    cache_bytes: int = 0  # this rank's expert cache budget
    max_rows: int = 1  # rows of one pass (max_num_seqs x (1 + draft tokens)): sizes the working set
    proof: str | None = None  # the head's HMAC of the worker's nonce; None: the head has no secret
    extra: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Verdict:
        return cls(**json.loads(data))


def worker_proof(secret: str | None, challenge: str, rank: int, nonce: str) -> str | None:
    if secret is None:
        return None
    return hmac.new(secret.encode(), f"{challenge}|{rank}|{nonce}".encode(), hashlib.sha256).hexdigest()


def head_proof(secret: str | None, nonce: str) -> str | None:
    if secret is None:
        return None
    return hmac.new(secret.encode(), f"{nonce}|head".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class HeadFacts:
    """What the head compares a hello against."""

    version: str
    fingerprint: str
    model: str
    expert_format: str
    placement: str | None  # the digest of the head's --placement, if given
    secret: str | None
    challenge: str


def refusal(hello: Hello, head: HeadFacts) -> str | None:
    """Why the head refuses this worker (one line, naming both sides), or None."""
    who = f"rank {hello.rank} ({hello.host})"
    if hello.protocol != PROTOCOL:
        return (
            f"{who} speaks cluster protocol {hello.protocol} (latentkv {hello.version}), the head "
            f"{PROTOCOL} (latentkv {head.version}): run the same latentkv on every machine"
        )
    if hello.fingerprint != head.fingerprint:
        return (
            f"{who} runs another model: {hello.model} (fingerprint {hello.fingerprint[:16]}), the head "
            f"{head.model} (fingerprint {head.fingerprint[:16]}): start every rank with the same checkpoint"
        )
    if hello.expert_format != head.expert_format:
        return (
            f"{who} streams {hello.expert_format} experts, the head {head.expert_format}: give every rank "
            "the same --weight-dtype / --expert-dtype"
        )
    if (hello.placement or head.placement) and hello.placement != head.placement:
        return (
            f"{who} was started with placement {hello.placement or '(none)'}, the head with "
            f"{head.placement or '(none)'}: give every rank the same --placement FILE (or none)"
        )
    if (head.secret is None) != (hello.proof is None):
        has, lacks = (who, "the head") if head.secret is None else ("the head", who)
        return f"{has} has a cluster secret and {lacks} has none: set the same LATENTKV_CLUSTER_SECRET on every rank"
    expected = worker_proof(head.secret, head.challenge, hello.rank, hello.nonce)
    if expected is not None and not hmac.compare_digest(expected, hello.proof or ""):
        return f"{who} presents another cluster secret: set the same LATENTKV_CLUSTER_SECRET on every rank"
    return None
