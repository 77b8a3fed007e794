"""Routed experts streamed from disk, the part that needs a model: attach a streamed expert store
to a loaded model (`attach`), convert a checkpoint's experts into an expert store (`convert`),
plan a `--ram-gb` budget (`planner`), and the synthetic benchmark model (`bench_model`).

The store itself (file format, reader, cache, policies, history) is `latentkv.experts`, below
`latentkv.models`; these modules use the models, so they sit above them and below `runtime`.
"""
