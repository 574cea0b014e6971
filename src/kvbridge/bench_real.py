"""Latency at the real Ministral-3 geometry, no downloads: ``python -m kvbridge.bench_real``.

Builds randomly initialised Ministral-3-3B and -8B text decoders from the text configs shipped in
``kvbridge/configs`` (26 vs 34 layers, hidden 3072 vs 4096, 8 KV heads × 128, YaRN θ=1e6 ×16,
original 16,384), a random mapper at the published artifact's geometry (top_k = 26: every target
layer reads all source layers; 1.85 B parameters), and prints the card's latency table. Random
weights are valid for timing: the work does not depend on the values. Meant for one H100/H200-class
GPU in bf16 (about 8 minutes for 64 … 16,384 tokens); ``--tiny`` shrinks the models for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CONFIGS = Path(__file__).parent / "configs"


class _VocabOnly:
    """What the benchmark needs of a tokenizer (random ids, no text)."""

    def __init__(self, vocab: int):
        self.vocab, self.bos_token_id, self.eos_token_id, self.pad_token_id = vocab, 1, 2, 11
        self.all_special_ids = [0, 1, 2, 11]

    def __len__(self) -> int:
        return self.vocab


def build(name: str, device, dtype, tiny: bool):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    from .models import LoadedModel, ModelInfo
    from .rope import rope_spec

    data = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:  # same structure, CPU-sized
        data.update(hidden_size=data["hidden_size"] // 32, intermediate_size=data["intermediate_size"] // 32,
                    num_hidden_layers=max(2, data["num_hidden_layers"] // 8), num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512)
    config = Ministral3Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Ministral3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    info = ModelInfo(f"random:{name}", None, "Ministral3ForCausalLM", config.num_hidden_layers,
                     config.num_key_value_heads, config.head_dim, config.max_position_embeddings, rope_spec(model),
                     "random-weights")
    return LoadedModel(model=model, tokenizer=_VocabOnly(config.vocab_size), info=info)


def random_mapper(source, target, device, dtype):
    from .mapper import Mapper, MapperConfig

    all_layers = tuple(range(source.info.num_layers))
    selection = {kind: (all_layers,) * target.info.num_layers for kind in ("key", "value")}
    config = MapperConfig(source=source.info, target=target.info, selection=selection, fit={"kind": "random"})
    scale = 1.0 / (len(all_layers) * source.info.kv_features) ** 0.5
    weights = {}
    for name, shape in config.weight_shapes().items():
        weights[name] = torch.randn(shape, device=device, dtype=dtype) * scale
    return Mapper(config, weights)


def main(argv=None) -> None:
    from .bench import bench_table, device_name, run_bench
    from .transfer import Bridge

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="64,512,1024,2048,4096,8192,16384")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="tokens mapped per GEMM (bounds transient memory)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models of the same structure (smoke test)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    source = build("ministral3-3b-text", args.device, dtype, args.tiny)
    target = build("ministral3-8b-text", args.device, dtype, args.tiny)
    mapper = random_mapper(source, target, args.device, dtype)
    bridge = Bridge(source, target, mapper, chunk_tokens=args.chunk_tokens)
    params = mapper.config.num_parameters()
    where = device_name(torch.device(args.device))
    print(f"{where}; {args.dtype}; random weights at the published geometry"
          f"{' (tiny)' if args.tiny else ''}; mapper {params / 1e9:.3f} B parameters; "
          f"built in {time.perf_counter() - start:.0f} s\n", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = run_bench(bridge, contexts, args.warmup, args.trials)
    print(bench_table(rows))
    for r in rows:
        print(f"peak memory at {r.context_tokens:,} tokens: native {r.peak_memory_native_bytes / 2**30:.2f} GiB, "
              f"source+map {r.peak_memory_cold_bytes / 2**30:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "dtype": args.dtype, "tiny": args.tiny,
                                               "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
