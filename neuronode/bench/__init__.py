"""Benchmarks behind `neuronode bench`: each starts real processes and returns one JSON-able dict.

A benchmark measures its reference (for `sync`: torch.distributed gloo all_reduce) in the same
run, on the same machine, so the ratio is meaningful even where absolute numbers are not.
"""
