"""What reading the source engine's K/V from LMCache costs: ``python -m kvbridge.serving.bench.lmcache_probe``.

Starts an LMCache server (stopped at the end, by its own process id) and a vLLM engine serving the source with
vLLM's ``LMCacheMPConnector`` (the llama-4 override kvbridge gives every engine), has the engine answer prompts of
the given lengths, then reads each stored prefix back as the target's connector does (:class:`LMCacheSource`):
median lookup time (how many tokens are stored) and read time (lookup, retrieve, decode, range check) over
``--repeats`` reads, and the largest difference from transformers' K/V of the same ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbridge.serving.bench.lmcache_probe",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--source", help="source model folder (default: the embedded family's)")
    p.add_argument("--lengths", default="512,1024,1900", help="prompt lengths in tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="reads timed per prompt (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=128, help="the engine's block size (default: %(default)s)")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)

    import torch

    from ... import family
    from ...core.models import cache_kv, load_model, prefill
    from ..engine.config import engine_kwargs
    from ..launch import cpu_defaults
    from ..store.lmcache_store import (
        Geometry,
        LMCacheSource,
        page_layout,
        source_transfer_config,
        start_server,
        stop_server,
    )
    from .ttft import heldout_stream, token_windows

    cpu_defaults()
    source = args.source or family.source_path()
    lengths = [int(x) for x in args.lengths.split(",")]
    process, url = start_server(l1_gb=0.5)
    rows = []
    try:
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(model=source, dtype="float32", max_model_len=max(lengths) + 64, enforce_eager=True,
                                  block_size=args.block_size, max_num_seqs=4, enable_prefix_caching=False,
                                  kv_transfer_config=source_transfer_config(url, timeout_s=10.0)))
        tokenizer = AutoTokenizer.from_pretrained(source)
        stream = heldout_stream(tokenizer)
        prompts = [token_windows(tokenizer, stream, 1, n, seed=i)[0] for i, n in enumerate(lengths)]
        llm.generate([{"prompt_token_ids": q} for q in prompts], SamplingParams(max_tokens=1, temperature=0),
                     use_tqdm=False)
        time.sleep(1.0)
        model = load_model(source, dtype=torch.float32)
        info = model.info
        reader = LMCacheSource(url, source, args.block_size, Geometry(info.num_layers, info.num_kv_heads,
                                                                     info.head_dim),
                               page_layout("cpu", torch.float32, args.block_size, info.head_dim))
        for ids in prompts:
            lookups, reads = [], []
            for _ in range(args.repeats):
                started = time.perf_counter()
                count = reader.stored_tokens(ids, None, len(ids))
                lookups.append(1000 * (time.perf_counter() - started))
                started = time.perf_counter()
                found = reader.lookup(ids, None, len(ids))
                reads.append(1000 * (time.perf_counter() - started))
            error = float("nan")
            if found.tokens:
                x = torch.tensor([ids[:found.tokens]])
                keys, values = cache_kv(prefill(model.model, x, torch.ones_like(x), logits="none")[0])
                error = max(float((a - b).abs().max()) for a, b in zip(found.keys + found.values, keys + values))
            rows.append({"prompt_tokens": len(ids), "stored_tokens": found.tokens, "counted": count,
                         "lookup_ms": round(statistics.median(lookups), 1),
                         "read_ms": round(statistics.median(reads), 1), "max_abs_error": error,
                         "reason": found.reason})
            print(json.dumps(rows[-1]), flush=True)
        reader.close()
    finally:
        stop_server(process)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m kvbridge.serving.bench.lmcache_probe", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
