"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def event(payload: BaseModel | dict) -> str:
    """One SSE event holding `payload` as compact JSON."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"
