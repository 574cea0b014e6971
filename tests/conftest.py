"""Tiny real checkpoints built on the fly: a BPE tokenizer and randomly initialised decoders.

They go through exactly the loading path of hub checkpoints (``save_pretrained`` → folder →
``kvbridge.core.models.load_model``), including a multimodal Ministral-3 (``Mistral3ForConditionalGeneration``).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the cores shared among pytest-xdist's workers (`-n 2`: one thread each), else two threads
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


def corpus_texts(n: int = 400) -> list[str]:
    """Real English text available offline: docstrings of the standard library."""
    import collections  # noqa: E401
    import email
    import json
    import logging
    import pathlib
    import textwrap
    import typing

    texts = []
    for module in (collections, email, json, logging, pathlib, textwrap, typing, inspect, os):
        for name, obj in vars(module).items():
            doc = inspect.getdoc(obj) if not name.startswith("_") else None
            if doc and len(doc) > 80:
                texts.append(" ".join(doc.split()))
    texts = sorted(set(texts))
    return (texts * (1 + n // max(len(texts), 1)))[:n]


def model_info(name: str, layers: int, kv_heads: int, head_dim: int, *, rope=None, max_positions: int = 4096,
               revision: str | None = None, architecture: str = "Ministral3ForCausalLM", tokenizer: str = "tok"):
    """A ModelInfo by keyword (the one way tests build one): geometry first, identity and RoPE defaulted."""
    from kvbridge.core.models import ModelInfo
    from kvbridge.core.rope import RopeSpec

    return ModelInfo(name_or_path=name, revision=revision, architecture=architecture, num_layers=layers,
                     num_kv_heads=kv_heads, head_dim=head_dim, max_positions=max_positions,
                     rope=rope or RopeSpec("llama", "default", head_dim), tokenizer_sha256=tokenizer)


def build_tokenizer(directory, vocab_size: int = 320):
    """The embedded family's tokenizer recipe at a tiny vocabulary, trained on stdlib docstrings."""
    from kvbridge.family.training.train import train_tokenizer

    tokenizer = train_tokenizer(corpus_texts(200), vocab_size)
    tokenizer.save_pretrained(directory)
    return tokenizer


def long_recall(pair, long_rows) -> tuple[float, float, float]:
    """(target, source, target's floor) accuracy at recalling a random span stated ≥ 900 tokens earlier in
    ``long_rows`` (the family task), for an embedded family's ``(source, target)``."""
    from kvbridge.core.scoring import score_plain
    from kvbridge.measure.evaluate import frequent_ids, recall_items

    source, target = pair
    ctx, floor_ctx, cont = recall_items(long_rows, frequent_ids(long_rows, set(target.tokenizer.all_special_ids),
                                                                1024))
    assert min(len(c) for c in ctx) > 900 + 16  # the repeat starts ≥ 900 tokens after the early span

    def accuracy(model, contexts):
        scores = [score_plain(model, c, k) for c, k in zip(contexts, cont)]
        return sum(s.correct for s in scores) / sum(s.tokens for s in scores)

    return accuracy(target.model, ctx), accuracy(source.model, ctx), accuracy(target.model, floor_ctx)


def ministral3_config(vocab: int, layers: int, hidden: int, kv_heads: int, head_dim: int, theta: float, **extra):
    from transformers import Ministral3Config

    return Ministral3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=kv_heads * 2, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        rope_parameters=dict(YARN, rope_theta=theta), **extra)


def save_model(model, tokenizer, directory):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(source_dir, target_dir, texts_file): 2-layer source and 3-layer target Ministral3, one tokenizer."""
    from transformers import Ministral3ForCausalLM

    root = tmp_path_factory.mktemp("pair")
    tokenizer = build_tokenizer(root / "tok")
    vocab = len(tokenizer)
    torch.manual_seed(0)
    source = Ministral3ForCausalLM(ministral3_config(vocab, 2, 48, 2, 16, theta=10000.0)).eval()
    target = Ministral3ForCausalLM(ministral3_config(vocab, 3, 64, 4, 16, theta=50000.0)).eval()
    texts = root / "texts.txt"
    texts.write_text("\n".join(corpus_texts(300)) + "\n", encoding="utf-8")
    return save_model(source, tokenizer, root / "source"), save_model(target, tokenizer, root / "target"), str(texts)


@pytest.fixture(scope="module")
def tiny_models(tiny_pair):
    """The tiny pair loaded: (source, target, texts)."""
    from kvbridge import load_model
    from kvbridge.fit.texts import read_texts

    source, target, texts = tiny_pair
    return load_model(source), load_model(target), read_texts(texts)


# FitConfig settings that fit the tiny pair in seconds, levers on, no recompute (the fast-map tests' base)
TINY_FIT = dict(num_texts=8, seq_len=64, heldout_texts=2, mlp_steps=20, tune_steps=5, recompute=0.0, hold_back=4)


def mapped(mapper, source_model, ids):
    """``mapper``'s target keys and values from ``source_model``'s cache of ``ids`` (no padding)."""
    from kvbridge.core.models import prefill_content

    keys, values, _ = prefill_content(source_model.model, ids, torch.ones_like(ids))
    return mapper.map(keys, values)


# fit options that make a mapper of the tiny pair in seconds, with the default levers on
FAST_FIT = ["--num-texts", "8", "--seq-len", "64", "--heldout-texts", "2", "--mlp-steps", "30", "--tune-steps", "10",
            "--hold-back", "4", "--quiet"]


@pytest.fixture(scope="session")
def fast_mapper(tiny_pair, tmp_path_factory):
    """A mapper folder of the tiny pair fitted once through the CLI with FAST_FIT; copy it before writing in it."""
    from kvbridge.cli import main

    source, target, texts = tiny_pair
    out = tmp_path_factory.mktemp("fast") / "mapper"
    assert main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(out), *FAST_FIT]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory, tiny_pair):
    """A multimodal Mistral3ForConditionalGeneration checkpoint whose decoder is a tiny Ministral3."""
    from transformers import (
        AutoTokenizer,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralVisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[1])
    text = ministral3_config(len(tokenizer), 2, 64, 4, 16, theta=50000.0)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=16, head_dim=16)
    torch.manual_seed(1)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=len(tokenizer) - 1,
                            tie_word_embeddings=False)
    model = Mistral3ForConditionalGeneration(config).eval()
    return save_model(model, tokenizer, tmp_path_factory.mktemp("vlm") / "ministral3-vlm"), model


@pytest.fixture(scope="session")
def family_fast_mapper(tmp_path_factory):
    """A mapper of the embedded family fitted in seconds (levers on, no selective recompute, hold-back 1): what the
    serving tests compare vLLM against Bridge with."""
    from kvbridge import family
    from kvbridge.fit import FitConfig, fit_mapper

    torch.manual_seed(0)
    source, target = family.load_family()
    config = FitConfig(num_texts=16, seq_len=256, heldout_texts=2, mlp_steps=50, tune_steps=10, top_k=1, lever_top_k=1,
                       recompute=0.0, hold_back=1)
    out = tmp_path_factory.mktemp("family") / "mapper"
    fit_mapper(source, target, family.calibration_texts(), config, progress=False).save_pretrained(out)
    return str(out)


@functools.cache
def vllm_ready() -> str | None:
    """Why vLLM cannot run here (None: it can): the serving tests need `pip install "kvbridge[serve]"`."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # an import error, or torchvision's operator error beside a CPU torch
        return f"vLLM does not import: {exc}"
    return None


@functools.cache
def lmcache_ready() -> str | None:
    """Why LMCache cannot run here (None: it can); it needs vLLM too."""
    try:
        import lmcache  # noqa: F401
    except Exception as exc:
        return f"lmcache does not import: {exc}"
    return vllm_ready()


def pytest_runtest_setup(item):
    """A test marked ``vllm`` (or ``lmcache``) is skipped where that stack does not import, except in CI, which
    installs it (the serve extra): there it fails. Checked when such a test first runs, not at collection: importing
    vLLM takes seconds, and a worker that runs none of these tests never pays for it."""
    for name, ready in (("vllm", vllm_ready), ("lmcache", lmcache_ready)):
        if item.get_closest_marker(name) is not None and ready() and not os.environ.get("CI"):
            pytest.skip(ready())


def in_process_llm(**kwargs):
    """A vLLM ``LLM`` whose engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it starts in
    about 3 s here instead of about 20 s for a core process of its own (the same scheduler, worker and connectors,
    one role each; the servers the serving tests launch keep vLLM's own process layout). The variable is set only
    while the engine is built, so that the servers started later do not inherit it.

    vLLM's CPU worker rebinds its kernel overrides by scanning every loaded module's globals, and stops at an object
    whose ``vars()`` is not a mapping: llvmlite's ctypes wrappers (numba, which LMCache and lm-eval import, holds
    them). An engine core process of its own never loads them; here they are set aside while the engine is built."""
    from vllm import LLM

    hidden = _unscannable_globals()
    for namespace, name, _ in hidden:
        del namespace[name]
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            return LLM(**kwargs)
    finally:
        for namespace, name, value in hidden:
            namespace[name] = value


def _unscannable_globals() -> list[tuple[dict, str, object]]:
    """(module globals, name, value) of every module-level value with a ``__dict__`` that is not a mapping."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                    found.append((namespace, name, value))
            except TypeError:  # vars() refuses it: the scan reads no __dict__ from it either
                continue
    return found


# the serving modules' fixtures that start vLLM engines, servers or an LMCache server (set up once per module)
ENGINE_FIXTURES = {"engine", "engines", "servers", "server", "client", "lmcache"}


# the longest files first (pytest-xdist hands whole files to its workers in this order, so that none starts late)
FIRST = ("test_serving_server.py", "test_serving_store.py", "test_serving_lmcache.py", "test_serving_engine.py",
         "test_serving_tp.py")


def pytest_collection_modifyitems(config, items):
    """A test that needs an engine fixture is marked ``engine``: ``pytest -m "not engine"`` runs the rest. The files
    that start engines run first."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # (stable: the rest keep their order)
