"""The OpenAI-compatible HTTP server (`latentkv serve`).

app.py          routes, the API-key gate, startup (weights load after the socket is up)
state.py        the loaded model, tokenizer and EngineClient (the engine's scheduler owns the model)
protocol.py     request and response models (OpenAI's wire format, vLLM's extensions)
prompts.py      prompts -> token ids; chat messages through the sandboxed chat template
completions.py  POST /v1/completions        chat.py   POST /v1/chat/completions
generation.py   what both share: limits, sampling parameters, usage, JSON vs SSE answers
choices.py      scheduler handles -> text pieces (stop strings), merged across choices
text.py         stop strings (the Detokenizer is latentkv.tokenizer's)
logprobs.py     the completions and chat logprobs formats
errors.py       {"error": {message, type, param, code}} for every failure
sse.py          `data: {json}` events and `data: [DONE]`
metrics.py      GET /metrics (Prometheus text)
"""
