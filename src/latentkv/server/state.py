"""What the server holds: the config, the model once it is loaded, the scheduler that owns it.

The socket comes up first and the weights load in a background thread, so /health can answer
503 + Retry-After while loading (what load balancers and `vllm serve` clients expect). HTTP
handlers never run model steps: they tokenize, submit to the scheduler and turn its events
into responses. The scheduler and the weights live in a child process by default
(`latentkv.engine.remote`), so the event loop and the decode loop run on separate cores.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from latentkv.config import ServerConfig
from latentkv.errors import user_message
from latentkv.server.metrics import Metrics, Snapshot, Throughput

if TYPE_CHECKING:
    from latentkv.config import ModelConfig
    from latentkv.engine.client import EngineClient
    from latentkv.engine.scheduler import Scheduler
    from latentkv.server.prompts import ChatRenderer
    from latentkv.tokenizer import Tokenizer

log = logging.getLogger("latentkv.server")


@dataclass
class Ready:
    """Everything a request needs once loading is done."""

    cfg: ModelConfig
    tokenizer: Tokenizer | None  # None: the model folder has no tokenizer.json (token ids only)
    directory: Path
    scheduler: EngineClient  # engine.scheduler.Scheduler here, or engine.remote.EngineProcess
    max_model_len: int
    stop_ids: tuple[int, ...]  # the model's end-of-sequence ids
    chat: ChatRenderer
    created: int  # unix time the model came up (for /v1/models)
    metrics: Metrics | None = None  # the server's (per-request timings are observed into it)


class ServerState:
    """Loading -> ready (or failed). `ready` is None until the model serves."""

    def __init__(self, config: ServerConfig, on_failure: Callable[[], None] | None = None):
        self.config = config
        self.ready: Ready | None = None
        self.error: str | None = None
        self.started = time.monotonic()
        self.throughput = Throughput()
        self.metrics = Metrics(
            config.served_model_name, self.snapshot, max_model_len=config.max_model_len or 1 << 20
        )
        self._on_failure = on_failure

    @property
    def loading(self) -> bool:
        return self.ready is None and self.error is None

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="latentkv-load", daemon=True).start()

    def _load(self) -> None:
        try:
            self.ready = load(self.config, self.metrics)
            log.info("ready: serving %s as %r", self.config.model, self.config.served_model_name)
        except Exception as exc:  # noqa: BLE001 - reported, then the server shuts down
            self.error = user_message(exc)
            print(f"latentkv serve: error: loading {self.config.model} failed: {self.error}", file=sys.stderr)
            if self._on_failure is not None:
                self._on_failure()

    def shutdown(self) -> None:
        if self.ready is not None:
            self.ready.scheduler.shutdown()

    def snapshot(self) -> Snapshot:
        """What /metrics reads of the engine at a scrape."""
        stats = self.ready.scheduler.stats() if self.ready is not None else None
        return Snapshot(stats is not None, stats, self.throughput.rates())

    def sample_throughput(self) -> None:
        if self.ready is not None:
            stats = self.ready.scheduler.stats()
            self.throughput.sample(stats.prompt_tokens_total, stats.generation_tokens_total)


def load(config: ServerConfig, metrics: Metrics | None = None) -> Ready:
    """Load the tokenizer and start the scheduler: in the engine process (which loads the
    weights there, `latentkv.engine.remote`), or here on a worker thread."""
    from latentkv.config import ModelConfig
    from latentkv.models.registry import resolve
    from latentkv.runtime import stop_ids
    from latentkv.server.prompts import ChatRenderer
    from latentkv.tokenizer import Tokenizer

    directory = resolve(config.model)
    cfg = ModelConfig.from_hf(directory)
    context = cfg.max_position_embeddings
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens")
    tokenizer = Tokenizer.of_model(directory)
    if config.engine_process:
        from latentkv.engine.remote import EngineProcess

        scheduler = EngineProcess(config, max_model_len, cfg.vocab_size)
    else:
        scheduler = _local_scheduler(config, max_model_len)
    return Ready(
        cfg=cfg,
        tokenizer=tokenizer,
        directory=Path(directory),
        scheduler=scheduler,
        max_model_len=max_model_len,
        stop_ids=stop_ids(cfg, directory),
        chat=ChatRenderer.for_model(tokenizer, Path(directory)),
        created=int(time.time()),
        metrics=metrics,
    )


def _local_scheduler(config: ServerConfig, max_model_len: int) -> Scheduler:
    """The weights and the scheduler's worker thread in this process (`--no-engine-process`)."""
    from latentkv.engine.scheduler import Scheduler
    from latentkv.runtime import load as load_model

    loaded = load_model(
        config.model,
        config.engine,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        draft_tokens=config.speculative_draft_tokens,
    )
    scheduler = Scheduler.for_server(config, loaded, max_model_len)
    scheduler.start()
    return scheduler
