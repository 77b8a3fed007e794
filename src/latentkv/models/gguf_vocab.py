"""A GGUF's tokenizer as the files a model folder carries: tokenizer.json and tokenizer_config.json.

llama.cpp's converters store a byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2": the
vocabulary as byte-level strings, the merges, a type per token) and name its pre-tokenizer
(`tokenizer.ggml.pre`); the splitting regexes themselves live in llama.cpp's source
(llama-vocab.cpp), so the ones of the models we run are listed here. A GGUF that carries the
original tokenizer.json (`tokenizer.huggingface.json`) is used as is. Special tokens (type
CONTROL) and user-defined ones become added tokens; `add_bos_token` becomes a post-processor that
puts BOS first. The chat template (`tokenizer.chat_template`) and the BOS / EOS strings go to
tokenizer_config.json, where the chat template module reads them.
"""

from __future__ import annotations

import json
from typing import Any

# tokenizer.ggml.pre -> (the regexes that split text before BPE, in order; whether a word that
# is in the vocabulary is taken whole before merging), from llama.cpp's llama-vocab.cpp.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
GLM4 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "gpt-2": ([GPT2], False),
    "deepseek-v3": (DEEPSEEK_V3, False),
    "glm4": ([GLM4], True),
    "glm5": ([GLM4], True),
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class VocabError(ValueError):
    """A GGUF tokenizer we cannot rebuild, said in one line."""


def tokenizer_files(meta: dict[str, Any]) -> dict[str, dict]:
    """GGUF metadata -> {"tokenizer.json": ..., "tokenizer_config.json": ...} (parsed JSON)."""
    config = _tokenizer_config(meta)
    if isinstance(meta.get("tokenizer.huggingface.json"), str):
        return {
            "tokenizer.json": json.loads(meta["tokenizer.huggingface.json"]),
            "tokenizer_config.json": config,
        }
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise VocabError(f"tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise VocabError(
            f"tokenizer pre-type {pre!r} is not one we know the splitting rules of "
            f"({', '.join(sorted(PRE_TOKENIZERS))}); put the model's tokenizer.json beside the GGUF"
        )
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": kind == CONTROL,
            }
            for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
            if kind in (CONTROL, USER_DEFINED)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                *(
                    {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
                    for r in regexes
                ),
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": _bos_processor(meta, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def special_ids(meta: dict[str, Any]) -> tuple[int | None, list[int]]:
    """(BOS id or None, the end-of-sequence ids: EOS, then EOT and EOM when they differ)."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and value not in eos:
            eos.append(value)
    return (bos if isinstance(bos, int) else None), eos


def _bos_processor(meta: dict[str, Any], tokens: list[str]) -> dict | None:
    bos, _ = special_ids(meta)
    if not meta.get("tokenizer.ggml.add_bos_token") or bos is None:
        return None
    piece = tokens[bos]
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": piece, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": piece, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": piece, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {piece: {"id": piece, "ids": [bos], "tokens": [piece]}},
    }


def _tokenizer_config(meta: dict[str, Any]) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos, eos = special_ids(meta)
    config: dict[str, Any] = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token"))}
    if bos is not None and bos < len(tokens):
        config["bos_token"] = tokens[bos]
    if eos and eos[0] < len(tokens):
        config["eos_token"] = tokens[eos[0]]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
