"""Triton kernels for MLA decode on CUDA devices (tested on CPU under triton's interpreter).

`formats` (no triton import): how each codec's stored row is described to the kernel, and which
codecs have none. `kernels`: the split-K decode kernel and its log-sum-exp merge. `decode`: the
launcher, `mla_decode`. Importing this package imports no triton; `decode` and `kernels` do.
"""
