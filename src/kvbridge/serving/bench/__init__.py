"""Benchmarks through running servers: time to first token (:mod:`.ttft`), cascades, load, quality, LMCache reads."""
