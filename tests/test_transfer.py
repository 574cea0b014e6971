"""Cache handoff exactness and the runtime's refusals."""

import pytest
import torch

from kvbridge import Mapper
from kvbridge.core.models import load_model
from kvbridge.core.transfer import Bridge
from kvbridge.errors import CompatibilityError, InputError

PROMPTS = [
    "Return a new dictionary initialized from an optional positional argument",
    "The logging module",
    "Create a new instance of the class with the given arguments and keyword arguments, then",
]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[1])


@pytest.fixture(scope="module")
def source(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def identity_bridge(target):
    return Bridge(target, target, Mapper.identity(target.info))


@pytest.mark.parametrize("hold_back", [1, 3])
def test_identity_map_generation_equals_native(identity_bridge, target, hold_back):
    bridge = Bridge(target, target, identity_bridge.mapper, hold_back=hold_back)
    mapped = bridge.generate(PROMPTS, mode="mapped", max_new_tokens=12)
    native = bridge.generate(PROMPTS, mode="native", max_new_tokens=12)
    assert mapped.token_ids == native.token_ids
    # and native-from-cache equals plain generate from scratch, one prompt at a time (no padding at all)
    for i, prompt in enumerate(PROMPTS):
        ids = target.tokenizer(prompt, return_tensors="pt")["input_ids"]
        plain = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                      do_sample=False, pad_token_id=target.tokenizer.pad_token_id)
        assert plain[0, ids.shape[1]:].tolist() == mapped.token_ids[i]


def test_identity_map_scores_equal_native(identity_bridge):
    contexts = PROMPTS
    continuations = [" and keyword arguments.", " is useful", " returns it"]
    mapped = identity_bridge.score(contexts, continuations, mode="mapped")
    native = identity_bridge.score(contexts, continuations, mode="native")
    for m, n in zip(mapped, native):
        assert m.logprob == pytest.approx(n.logprob, abs=1e-4) and m.is_greedy == n.is_greedy
        assert m.correct == n.correct and m.tokens == n.tokens > 0
    # scoring in a batch equals scoring one at a time (padding is handled)
    for i in range(len(contexts)):
        alone = identity_bridge.score([contexts[i]], [continuations[i]], mode="native")[0]
        assert alone.logprob == pytest.approx(native[i].logprob, abs=1e-4)


def test_a_checkpoint_asking_for_beams_still_gets_one_sequence_per_prompt(identity_bridge):
    config = identity_bridge.target.model.generation_config
    saved = config.num_beams, config.num_return_sequences
    config.num_beams, config.num_return_sequences = 3, 2
    try:
        out = identity_bridge.generate(PROMPTS[:2], max_new_tokens=3)
    finally:
        config.num_beams, config.num_return_sequences = saved
    assert len(out.token_ids) == 2 and all(len(t) == 3 for t in out.token_ids)


def test_sampling_runs_and_is_seeded(identity_bridge):
    torch.manual_seed(0)
    a = identity_bridge.generate(PROMPTS[:2], max_new_tokens=6, do_sample=True, temperature=0.8)
    torch.manual_seed(0)
    b = identity_bridge.generate(PROMPTS[:2], max_new_tokens=6, do_sample=True, temperature=0.8)
    assert a.token_ids == b.token_ids and all(len(t) == 6 for t in a.token_ids)


def test_bad_prompts_are_refused(identity_bridge):
    with pytest.raises(InputError, match="empty"):
        identity_bridge.generate(["   "])
    with pytest.raises(InputError, match="positions"):
        identity_bridge.generate(["word " * 600])
    with pytest.raises(InputError, match="at least 2"):
        identity_bridge.pad([[5]])
    # a hold-back longer than a prompt shrinks to what the prompt allows: the source still prefills one token
    long_hold = Bridge(identity_bridge.source, identity_bridge.target, identity_bridge.mapper, hold_back=50)
    assert long_hold.generate(["hi there"], max_new_tokens=3).token_ids == \
        identity_bridge.generate(["hi there"], max_new_tokens=3).token_ids


def test_wrong_pair_is_refused(source, target, tiny_pair):
    identity = Mapper.identity(target.info)
    with pytest.raises(CompatibilityError, match="geometry"):
        Bridge(source, target, identity)  # mapper fitted target→target, given a 2-layer source


def test_different_tokenizers_are_refused(tmp_path, target):
    import conftest
    from transformers import Ministral3ForCausalLM

    tok = conftest.build_tokenizer(tmp_path / "tok", vocab_size=300)
    model = Ministral3ForCausalLM(conftest.ministral3_config(len(tok), 3, 64, 4, 16, theta=50000.0))
    other = load_model(conftest.save_model(model, tok, tmp_path / "other"))
    with pytest.raises(CompatibilityError, match="tokenizers"):
        Bridge(other, target, Mapper.identity(target.info))


def test_revision_mismatch_needs_the_override(target):
    from dataclasses import replace

    recorded = replace(target.info, name_or_path="org/model", revision="c" * 40)
    mapper = Mapper(Mapper.identity(target.info).config.__class__(
        source=recorded, target=recorded, selection=Mapper.identity(target.info).config.selection),
        Mapper.identity(target.info).weights)
    with pytest.raises(CompatibilityError, match="allow-revision-mismatch"):
        Bridge(target, target, mapper)
    Bridge(target, target, mapper, allow_revision_mismatch=True)  # accepted: geometry matches


def test_chunked_map_equals_one_chunk(source, target):
    """Mapping in token chunks (bounded transient memory) builds the same cache as one big chunk."""
    from kvbridge.core.mapper_config import MapperConfig
    from kvbridge.core.models import cache_kv

    g = torch.Generator().manual_seed(0)
    config = MapperConfig(source=source.info, target=target.info,
                          selection={"key": ((0, 1),) * 3, "value": ((0,), (1,), (0, 1))})
    mapper = Mapper(config, {n: torch.randn(s, generator=g) / 8 for n, s in config.weight_shapes().items()})
    whole = Bridge(source, target, mapper, chunk_tokens=1024)
    chunked = Bridge(source, target, mapper, chunk_tokens=3)
    ids, mask = whole.encode(PROMPTS)
    for a, b in zip(*[cache_kv(bridge.mapped_cache(ids, mask)) for bridge in (whole, chunked)]):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=1e-5)


def test_scoring_at_the_position_limit(identity_bridge):
    """Context + continuation may fill every position exactly; one more is refused with a message."""
    limit = identity_bridge.max_positions
    ctx, cont = [4 + i % 300 for i in range(limit - 8)], [5] * 8
    assert len(identity_bridge.score_ids([ctx], [cont], mode="mapped")) == 1
    with pytest.raises(InputError, match="positions"):
        identity_bridge.score_ids([ctx + [6]], [cont], mode="mapped")
    with pytest.raises(InputError, match="vocabulary"):
        identity_bridge.score_ids([[1, 2, 10**6]], [cont], mode="mapped")


def test_scoring_builds_no_autograd_graph():
    """Models are loaded with gradients on: every scoring path must run under no_grad (memory, not values)."""
    from kvbridge import family
    from kvbridge.core.scoring import score_plain

    _, target = family.load_family()
    seen = []
    hook = target.model.register_forward_hook(lambda module, args, out: seen.append(torch.is_grad_enabled()))
    try:
        score_plain(target.model, [1, 5, 9, 12], [7, 3])
    finally:
        hook.remove()
    assert seen == [False]


def test_the_cache_keyword_is_the_one_this_transformers_takes():
    """models.cache_keyword decides `cache` vs `past_key_values` once (5.17 takes past_key_values): it must name
    a parameter of the installed transformers' forward and of generate's model inputs, and the output field."""
    import inspect

    from transformers import Ministral3ForCausalLM

    from kvbridge.core.models import cache_keyword

    assert cache_keyword() in inspect.signature(Ministral3ForCausalLM.forward).parameters
    assert cache_keyword() in inspect.signature(Ministral3ForCausalLM.prepare_inputs_for_generation).parameters
