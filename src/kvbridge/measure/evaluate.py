"""Retention: what a mapped cache keeps of the target's quality, on tasks with known floors.

Definitions (docs/measures.md in the repository), for a score where higher is better:

    raw retention              = mapped / native
    floor-normalized retention = (mapped − floor) / (native − floor)
    gap recovered              = (mapped − source) / (native − source)

Gap recovered is the lead figure: the share of what the target adds over the source alone that survives the map.
Floor-normalized retention counts what the source already knows as kept (a map adding nothing over the source can
score ~90 % where the source is nearly as good as the target); gap recovered does not. It means something only where
the target beats the source beyond noise (:func:`target_leads`); tables say so instead of printing noise.

Perplexity is lower-is-better; its retention is taken in the same spirit, on log-perplexity
(per-token negative log-likelihood), with the target's *no-context* perplexity as the floor:

    raw retention              = native_ppl / mapped_ppl
    floor-normalized retention = (log floor_ppl − log mapped_ppl) / (log floor_ppl − log native_ppl)

i.e. the share of the benefit the target draws from its context that survives the transfer.

Family tasks (held-out text, never trained or calibrated on), each row ``BOS + seq_len−1`` tokens:

* ``perplexity``: the last ``scored`` tokens given the rest as context;
* ``cloze``: 4-way choice of the true 32-token continuation against the same span of three other
  documents, by the continuing model's log-likelihood (floor 25 %);
* ``recall (random)``: a 16-token span of distinct random tokens (from the held-out rows' 1,024 most
  frequent) placed early in the context recurs near the end; after its first token, the model must
  reproduce the other 15 (teacher-forced top-1 token accuracy);
* ``recall (real)``: the same with a real-text span of another held-out document;
* ``recall (document)`` (the frontier's fifth task, ``predictable=True``): the document's own early text (16
  tokens from position 8-39, ordinary predictable text that the recompute criterion has no reason to pick)
  recurs near the end; its floor replaces the early occurrence with another document's text.
  The floors are measured, not assumed: the target's accuracy on the same contexts without the
  early occurrence (≈ 1/1,024 for random spans; what plain language modelling guesses for real text).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace

import torch

from ..core.scoring import score_plain
from ..core.transfer import Bridge
from ..errors import InputError, NumericalError

SPAN = 16
CHOICE_TOKENS = 32


@dataclass
class TaskResult:
    task: str
    metric: str
    native: float
    mapped: float
    source: float
    floor: float
    items: int
    higher_is_better: bool = True
    # per-item values whose mean gives each mode's score (perplexity: mean NLL per token, exponentiated);
    # mode → list, for a bootstrap over documents
    per_item: dict | None = field(default=None, repr=False, compare=False)
    # each item's document (the index of the text its row starts in): a paired bootstrap resamples documents
    keys: list | None = field(default=None, repr=False, compare=False)
    # whether native's context benefit over the floor is beyond noise (paired 95 % interval above zero), decided
    # once on the whole sample (None: native beats the floor at all); a cell without one has no retention to keep
    benefit: bool | None = field(default=None, repr=False, compare=False)

    def resampled(self, index: list[int]) -> TaskResult:
        """The same task on the items ``index`` (with repeats): one bootstrap replicate."""
        def agg(values):
            mean = sum(values[i] for i in index) / len(index)
            return mean if self.higher_is_better else math.exp(mean)

        p = self.per_item
        return replace(self, **{m: agg(p[m]) for m in ("native", "mapped", "source", "floor") if m in p},
                       items=len(index))

    @property
    def raw_retention(self) -> float:
        if self.higher_is_better:
            return self.mapped / self.native if self.native else float("nan")
        return self.native / self.mapped

    @property
    def floor_normalized_retention(self) -> float:
        if self.higher_is_better:
            return retention(self.native, self.mapped, self.floor)[1]
        lf, lm, ln = math.log(self.floor), math.log(self.mapped), math.log(self.native)
        return (lf - lm) / (lf - ln) if lf != ln else float("nan")

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "per_item"}
        return data | {"raw_retention": self.raw_retention,
                       "floor_normalized_retention": self.floor_normalized_retention}


def retention(native: float, mapped: float, floor: float) -> tuple[float, float]:
    """(raw, floor-normalized) retention of a higher-is-better score, as fractions."""
    raw = mapped / native if native else float("nan")
    norm = (mapped - floor) / (native - floor) if native != floor else float("nan")
    return raw, norm


def heldout_rows(tokenizer, texts: list[str], n: int, seq_len: int) -> torch.Tensor:
    """(n, seq_len) rows: BOS + the first seq_len − 1 tokens of the first n documents long enough."""
    return document_rows(tokenizer, texts, n, seq_len)[0]


def document_rows(tokenizer, texts: list[str], n: int, seq_len: int, pack: bool = False
                  ) -> tuple[torch.Tensor, list[int]]:
    """``(rows, keys)``: (n, seq_len) rows, BOS + the first seq_len − 1 tokens of the first n documents long enough,
    and each row's document index in ``texts``. With ``pack``, when fewer than n documents are that long, the rows
    are the documents packed end to end instead (EOS between, as calibration windows are), each keyed by the
    document it starts in: a context of several files, as a long prompt often is."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    body = seq_len - len(bos)
    encoded, rows, keys = [], [], []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        encoded.append(ids)
        if len(ids) >= body:
            rows.append(bos + ids[:body])
            keys.append(i)
        if len(rows) == n:
            return torch.tensor(rows, dtype=torch.long), keys
    if not pack:
        raise InputError(f"only {len(rows)} held-out documents have {seq_len} tokens; ask for fewer items.")
    stream, starts = [], []
    for i, ids in enumerate(encoded):  # every text was read above: the loop only returns early when rows suffice
        starts.append((len(stream), i))
        stream += ids
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    if len(stream) < n * body:
        raise InputError(f"the held-out texts hold {len(stream):,} tokens, not enough for {n} rows of {seq_len} "
                         "tokens even packed end to end; ask for fewer items.")
    rows = [bos + stream[r * body : (r + 1) * body] for r in range(n)]
    keys = [max(i for at, i in starts if at <= r * body) for r in range(n)]
    return torch.tensor(rows, dtype=torch.long), keys


BANDS = ((1, 128), (128, 256), (256, 384), (384, 512), (512, 768), (768, 1024), (1024, 1536), (1536, 2048))


@torch.no_grad()
def band_perplexity(model, rows: torch.Tensor, bands=BANDS, batch_size: int = 4) -> dict[str, float]:
    """Perplexity of the tokens at positions [lo, hi) of each row (one forward pass per row, full context).

    Position p is the token predicted from positions < p; bands past the rows' length are left out.
    A model that uses a long context well gets *lower* perplexity in later bands.
    """
    device = next(model.parameters()).device
    nll = torch.zeros(rows.shape[1], dtype=torch.float64)
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i : i + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T−1, V)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T−1)
        nll[1:] += loss.sum(0).double().cpu()
    per_token = nll / rows.shape[0]
    return {f"{lo}-{hi}": round(math.exp(float(per_token[lo:hi].mean())), 3)
            for lo, hi in bands if hi <= rows.shape[1]}


def _score(bridge: Bridge, contexts, continuations, mode, batch_size, per_context: int = 1):
    """Scores in batches of ``batch_size`` contexts (each with ``per_context`` continuations sharing its prefix)."""
    out, k = [], per_context
    for i in range(0, len(contexts), batch_size):
        out += bridge.score_ids(contexts[i : i + batch_size], continuations[k * i : k * (i + batch_size)], mode,
                                per_context=k)
    return out


def _modes(reference: TaskResult | None) -> tuple[str, ...]:
    """Modes a task must run: all three, or only ``mapped`` when a reference run on the same rows gives the rest."""
    return ("mapped",) if reference is not None else ("native", "mapped", "source")


def _result(task: str, metric: str, items: dict, floor: float | list | None, n: int, reference: TaskResult | None,
            higher_is_better: bool = True) -> TaskResult:
    """A TaskResult from per-item values (mode → list; mean, or exp(mean NLL) for perplexity)."""
    agg = (lambda v: sum(v) / len(v)) if higher_is_better else (lambda v: math.exp(sum(v) / len(v)))  # noqa: E731
    if reference is not None:
        return replace(reference, mapped=agg(items["mapped"]), per_item=(reference.per_item or {}) | items)
    if isinstance(floor, list):
        items = items | {"floor": floor}
        floor = agg(floor)
    values = {m: agg(v) for m, v in items.items()}
    return TaskResult(task, metric, values["native"], values["mapped"], values["source"], floor, n, higher_is_better,
                      per_item=items)


def task_perplexity(bridge: Bridge, rows: torch.Tensor, scored: int = 64, batch_size: int = 8,
                    reference: TaskResult | None = None) -> TaskResult:
    ctx = [r[:-scored].tolist() for r in rows]
    cont = [r[-scored:].tolist() for r in rows]
    nll = {m: [-s.logprob / scored for s in _score(bridge, ctx, cont, m, batch_size)] for m in _modes(reference)}
    floor = None
    if reference is None:
        bos = [bridge.tokenizer.bos_token_id]  # the no-context floor: the target after BOS alone
        floor = [-score_plain(bridge.target.model, bos, c).logprob / scored for c in cont]
    return _result("perplexity", f"ppl of last {scored} of {rows.shape[1]} tokens", nll, floor, len(rows), reference,
                   higher_is_better=False)


def cloze_items(rows: torch.Tensor, context: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per row: its first ``context`` tokens and four CHOICE_TOKENS-token choices, the truth first.

    Distractors are the same span of three other documents (offsets n/4, 2n/4, 3n/4; needs n >= 4).
    """
    n = len(rows)
    step = n // 4
    return [(rows[i, :context].tolist(),
             [rows[(i + j * step) % n, context : context + CHOICE_TOKENS].tolist() for j in range(4)])
            for i in range(n)]


def chose_truth(scores: list[float]) -> bool:
    """The truth (choice 0) strictly beats every distractor: a tie is a wrong answer, not a lucky one."""
    if not all(math.isfinite(s) for s in scores):
        raise NumericalError(f"a cloze item has non-finite scores {scores}; nothing can be ranked.")
    return all(scores[0] > s for s in scores[1:])


def task_cloze(bridge: Bridge, rows: torch.Tensor, context: int, batch_size: int = 8,
               reference: TaskResult | None = None) -> TaskResult:
    n = len(rows)
    if n < 4:
        raise InputError("the cloze task needs at least 4 held-out rows.")
    ctx, cont = [], []
    for c, choices in cloze_items(rows, context):
        ctx.append(c)
        cont += choices
    acc = {}
    for mode in _modes(reference):  # each context prefilled once, its four choices read from the same prefix
        scores = [s.logprob for s in _score(bridge, ctx, cont, mode, batch_size, per_context=4)]
        acc[mode] = [float(chose_truth(scores[4 * i : 4 * i + 4])) for i in range(n)]
    return _result("cloze", f"4-way accuracy ({CHOICE_TOKENS}-token continuations after {context} tokens)", acc,
                   0.25, n, reference)


def frequent_ids(rows: torch.Tensor, reserved: set[int], n: int) -> list[int]:
    """The ``n`` most frequent token ids in ``rows`` (special tokens excluded), most frequent first."""
    counts = torch.bincount(rows.flatten())
    for i in reserved:
        if i < counts.numel():
            counts[i] = 0
    order = torch.argsort(counts, descending=True)
    return [int(i) for i in order[: min(n, int((counts > 0).sum()))]]


def recall_items(rows: torch.Tensor, alphabet: list[int] | None, seed: int = 0, given: int = 1):
    """Place a SPAN-token span early in each row and again near the end.

    The span is random distinct tokens from ``alphabet``, or, with ``alphabet=None``, real text: the
    same-position span of another row. Returns ``(contexts, floor_contexts, continuations)``: contexts
    run up to and including the repeat's first ``given`` tokens; floor contexts are the same without
    the early occurrence (what the model could guess without recalling); continuations are the rest
    of the span.
    """
    rng = random.Random(seed)
    n, seq = rows.shape
    ctx, floor_ctx, cont = [], [], []
    for i, row in enumerate(rows.tolist()):
        a, b = rng.randrange(8, 40), rng.randrange(seq - 64, seq - SPAN)
        if alphabet is None:
            span = rows[(i + 1 + rng.randrange(n - 1)) % n, b : b + SPAN].tolist()
        else:
            span = rng.sample(alphabet, SPAN)  # distinct tokens: the repeat is unambiguous
        without = list(row)
        without[b : b + SPAN] = span
        with_early = list(without)
        with_early[a : a + SPAN] = span
        ctx.append(with_early[: b + given])
        floor_ctx.append(without[: b + given])
        cont.append(span[given:])
    return ctx, floor_ctx, cont


def document_recall_items(rows: torch.Tensor, seed: int = 0, given: int = 1):
    """:func:`recall_items` for the document's own early text: the SPAN tokens at [a, a + SPAN) (a in 8..39) recur
    at [b, b + SPAN) near the end; the floor contexts carry another row's tokens at [a, a + SPAN) instead."""
    rng = random.Random(seed)
    n, seq = rows.shape
    ctx, floor_ctx, cont = [], [], []
    for i, row in enumerate(rows.tolist()):
        a, b = rng.randrange(8, 40), rng.randrange(seq - 64, seq - SPAN)
        span = row[a : a + SPAN]
        with_early = list(row)
        with_early[b : b + SPAN] = span
        without = list(with_early)
        without[a : a + SPAN] = rows[(i + 1 + rng.randrange(n - 1)) % n, a : a + SPAN].tolist()
        ctx.append(with_early[: b + given])
        floor_ctx.append(without[: b + given])
        cont.append(span[given:])
    return ctx, floor_ctx, cont


def task_document_recall(bridge: Bridge, rows: torch.Tensor, batch_size: int = 8,
                         reference: TaskResult | None = None) -> TaskResult:
    """Recall the document's own early text near the end: a span no recompute criterion singles out."""
    ctx, floor_ctx, cont = document_recall_items(rows)

    def accuracy(contexts, mode):
        return [s.correct / s.tokens for s in _score(bridge, contexts, cont, mode, batch_size)]

    acc = {mode: accuracy(ctx, mode) for mode in _modes(reference)}
    distance = rows.shape[1] - 64 - 40
    return _result("recall (document)", f"token accuracy, the document's own early {SPAN} tokens, ≥{distance} "
                   "tokens back", acc, None if reference is not None else accuracy(floor_ctx, "native"), len(rows),
                   reference)


def task_recall(bridge: Bridge, rows: torch.Tensor, alphabet_size: int | None = 1024,
                batch_size: int = 8, reference: TaskResult | None = None) -> TaskResult:
    """Recall a span stated early: random distinct tokens of the ``alphabet_size`` most frequent tokens,
    or (``alphabet_size=None``) a real-text span of another document. The floor is measured: the
    target's accuracy on the same contexts without the early occurrence."""
    alphabet = None if alphabet_size is None else frequent_ids(rows, set(bridge.tokenizer.all_special_ids),
                                                               alphabet_size)
    ctx, floor_ctx, cont = recall_items(rows, alphabet)

    def accuracy(contexts, mode):  # every item has SPAN − 1 tokens: the mean of item accuracies is the token accuracy
        return [s.correct / s.tokens for s in _score(bridge, contexts, cont, mode, batch_size)]

    acc = {mode: accuracy(ctx, mode) for mode in _modes(reference)}
    what = "real-text span" if alphabet is None else f"random span of {len(alphabet)} frequent tokens"
    distance = rows.shape[1] - 64 - 40  # at least this many tokens between the early span and its repeat
    return _result(f"recall ({'real' if alphabet is None else 'random'})",
                   f"token accuracy, {SPAN}-token {what}, ≥{distance} tokens back", acc,
                   None if reference is not None else accuracy(floor_ctx, "native"), len(rows), reference)


def family_tasks(bridge: Bridge, texts: list[str], items: int = 32, seq_len: int = 256,
                 reference: list[TaskResult] | None = None, batch_size: int = 8, predictable: bool = False,
                 pack: bool = False) -> list[TaskResult]:
    """Run the four family tasks (five with ``predictable``: + ``recall (document)``) on ``items`` held-out
    documents of ``seq_len`` tokens (``pack``: documents packed end to end when too few are that long).

    With ``reference`` (the results of an earlier run on the same texts, items and length), only the
    mapped mode runs and native, source and floors are copied: what a sweep over mappers needs.
    """
    rows, keys = document_rows(bridge.tokenizer, texts, items, seq_len, pack)
    ref = reference or [None] * (5 if predictable else 4)
    results = [
        task_perplexity(bridge, rows, scored=seq_len // 4, batch_size=batch_size, reference=ref[0]),
        task_cloze(bridge, rows, context=seq_len - CHOICE_TOKENS, batch_size=batch_size, reference=ref[1]),
        task_recall(bridge, rows, batch_size=batch_size, reference=ref[2]),
        task_recall(bridge, rows, alphabet_size=None, batch_size=batch_size, reference=ref[3]),
    ]
    if predictable:
        results.append(task_document_recall(bridge, rows, batch_size=batch_size, reference=ref[4]))
    results = [replace(r, keys=keys) for r in results]
    return [replace(r, benefit=r.benefit if reference else has_benefit(r)) for r in results]


def has_benefit(result: TaskResult, replicates: int = 1000, seed: int = 0) -> bool:
    """Whether native beats the floor beyond noise: the 95 % bootstrap interval of native − floor (per item where
    the floor is measured per item; perplexity on NLL), resampling documents (``keys``; items alone without them),
    lies above zero. Where it does not, the target draws no measurable benefit from the context, and a retention
    of it would be noise over a near-zero gap."""
    p = result.per_item or {}
    if "native" not in p:
        return counted(result)
    floor = p.get("floor", [result.floor] * len(p["native"]))
    sign = 1.0 if result.higher_is_better else -1.0
    gaps = [sign * (n - f) for n, f in zip(p["native"], floor)]
    groups: dict = {}
    for i, key in enumerate(result.keys or range(len(gaps))):
        groups.setdefault(key, []).append(gaps[i])
    docs = list(groups.values())
    rng = random.Random(seed)
    means = []
    for _ in range(replicates):
        drawn = [g for _ in docs for g in docs[rng.randrange(len(docs))]]
        means.append(sum(drawn) / len(drawn))
    return sorted(means)[int(0.025 * replicates)] > 0


def mean_retention(results: list[TaskResult]) -> float:
    """Mean floor-normalized retention over the tasks where native beats the floor (NaN if none)."""
    defined = [_cell(r) for r in results if counted(r)]
    return sum(defined) / len(defined) if defined else float("nan")


def _cell(r: TaskResult) -> float:
    """A counted cell's floor-normalized retention; 0 where native does not beat the floor in this sample (a
    bootstrap replicate of a cell counted on the whole sample can draw such items: no benefit there, nothing kept;
    the ratio of two negative gaps would read as retention)."""
    beats = (r.native > r.floor) if r.higher_is_better else (r.native < r.floor)
    return r.floor_normalized_retention if beats else 0.0


def capped_mean_retention(results: list[TaskResult]) -> float:
    """:func:`mean_retention` with each task's cell held to [0 %, 100 %]: a cell above native means the transfer
    found something the task rewards, not that it beat the target, and one below zero (worse than no context) keeps
    nothing of the benefit (the headline figure; the uncapped mean stays beside it)."""
    defined = [min(max(_cell(r), 0.0), 1.0) for r in results if counted(r)]
    return sum(defined) / len(defined) if defined else float("nan")


def bootstrap_interval(runs: list[list[TaskResult]], replicates: int = 1000, seed: int = 0,
                       level: float = 0.95, statistic=mean_retention) -> tuple[float, float]:
    """Percentile interval of ``statistic`` (default :func:`mean_retention`) over all tasks of ``runs`` when
    documents are resampled (:func:`paired_replicates`)."""
    return percentile_interval(paired_replicates(runs, statistic, replicates, seed), level)


def paired_replicates(runs: list[list[TaskResult]], statistic=capped_mean_retention, replicates: int = 1000,
                      seed: int = 0, grouped: bool = False) -> list[float]:
    """``statistic`` of the tasks of ``runs`` under ``replicates`` resamples of documents, paired across runs.

    Each run is one :func:`family_tasks` call (one length; its tasks share rows). A replicate draws documents
    with replacement from every document any run read, and each run keeps the items of the drawn documents
    (a document read at two lengths is drawn, or not, at both: the lengths' figures are not independent, and an
    interval that resampled them apart would be too narrow). ``runs`` may hold the same rows for several
    mappers (a point and the best one, the mapped and the source figures): their differences are paired too.
    Results without document keys count each item as its own document. ``grouped``: ``statistic`` receives the
    replicate's results run by run (a list per run) instead of one flat list."""
    rng = random.Random(seed)
    keyed = [[r.keys or [("item", i, k) for k in range(r.items)] for r in run] for i, run in enumerate(runs)]
    documents = sorted({k for run in keyed for keys in run for k in keys})
    where = [[{} for _ in run] for run in runs]  # per run, per task: document → its item indices
    for i, run in enumerate(keyed):
        for j, keys in enumerate(run):
            for item, key in enumerate(keys):
                where[i][j].setdefault(key, []).append(item)
    values = []
    for _ in range(replicates):
        drawn_docs = [documents[rng.randrange(len(documents))] for _ in documents]
        drawn = []
        for run, maps in zip(runs, where):
            drawn.append([])
            for result, items in zip(run, maps):
                index = [i for d in drawn_docs for i in items.get(d, ())]
                if index:
                    drawn[-1].append(result.resampled(index))
        values.append(statistic(drawn if grouped else [r for run in drawn for r in run]))
    return values


def percentile_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap replicates (NaNs dropped)."""
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan"), float("nan")
    return values[int((1 - level) / 2 * len(values))], values[min(len(values) - 1, int((1 + level) / 2 * len(values)))]


def mapped_minus_source(result: TaskResult, replicates: int = 1000, seed: int = 0, level: float = 0.95,
                        mode: str = "mapped") -> tuple[float, float]:
    """Paired bootstrap interval of the mapped score (``mode="native"``: the target's own) minus the source's over a
    task's documents, in the task's own unit, signed so that below zero means that mode does worse than the source
    (perplexity: the source's mean NLL per token minus the mode's). "Below the source" is only said when the whole
    interval is below zero."""
    sign = 1.0 if result.higher_is_better else -1.0
    diff = [sign * (m - s) for m, s in zip(result.per_item[mode], result.per_item["source"])]
    runs = [[replace(result, per_item={"mapped": diff, "native": diff, "source": diff}, higher_is_better=True)]]
    return bootstrap_interval(runs, replicates, seed, level, statistic=lambda drawn: drawn[0].mapped)


def counted(r: TaskResult) -> bool:
    """Retention means something only where native beats the floor (there is a context benefit; beyond noise
    where :func:`has_benefit` decided it)."""
    if r.benefit is not None:
        return r.benefit
    return (r.native > r.floor) if r.higher_is_better else (r.native < r.floor)


def gap_recovered(r: TaskResult) -> float:
    """(mapped − source) ÷ (native − source) as a fraction (perplexity: on log-perplexity); NaN where native equals
    the source. 1: the mapped target is as good as the target's own prefill; 0: no better than the source alone."""
    if r.higher_is_better:
        n, m, s = r.native, r.mapped, r.source
    else:
        n, m, s = -math.log(r.native), -math.log(r.mapped), -math.log(r.source)
    return (m - s) / (n - s) if n != s else float("nan")


def has_source(r: TaskResult) -> bool:
    """Whether the result measured the source alone per item (what gap recovered and its interval need)."""
    return bool(r.per_item) and all(m in r.per_item for m in ("native", "mapped", "source"))


def target_leads(r: TaskResult, replicates: int = 1000, seed: int = 0) -> bool:
    """Whether the target beats the source beyond noise: the paired 95 % interval of native − source (over
    documents) lies above zero. Where it does not, there is no gap to recover and its ratio is noise."""
    return has_source(r) and mapped_minus_source(r, replicates, seed, mode="native")[0] > 0


def gap_interval(r: TaskResult, replicates: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Paired bootstrap interval of :func:`gap_recovered`, resampling documents (native, mapped and source together)."""
    return bootstrap_interval([[r]], replicates, seed, level, statistic=lambda drawn: gap_recovered(drawn[0]))


def gap_cell(r: TaskResult) -> str:
    """Gap recovered with its interval, or why there is none (no source measured; target not ahead of the source)."""
    if not has_source(r):
        return "—"
    if not target_leads(r):
        return "n/s (target ≈ source)"
    lo, hi = gap_interval(r)
    return f"{100 * gap_recovered(r):.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def retention_table(results: list[TaskResult]) -> str:
    """Markdown table in the published card's spirit, plus a mean row over tasks where native beats the floor;
    gap recovered (with its interval) beside the source where the source was measured per item."""
    def fmt(r: TaskResult, v: float) -> str:
        return f"{v:.2f}" if not r.higher_is_better else f"{100 * v:.2f}%"

    lines = ["| Task | Metric | Native | Mapped | Source alone | Gap recovered [95 %] | Floor | Raw retention | "
             "Floor-normalized retention |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        kept = (f"{100 * r.raw_retention:.2f}% | {100 * r.floor_normalized_retention:.2f}%" if counted(r)
                else "n/a | n/a")
        lines.append(f"| {r.task} | {r.metric} | {fmt(r, r.native)} | {fmt(r, r.mapped)} | {fmt(r, r.source)} | "
                     f"{gap_cell(r)} | {fmt(r, r.floor)} | {kept} |")
    defined = [r for r in results if counted(r)]
    if defined:
        raw = sum(r.raw_retention for r in defined) / len(defined)
        norm = sum(r.floor_normalized_retention for r in defined) / len(defined)
        label = "**Mean**" if len(defined) == len(results) else f"**Mean** ({len(defined)} of {len(results)} tasks)"
        lines.append(f"| {label} | | | | | | | {100 * raw:.2f}% | {100 * norm:.2f}% |")
    return "\n".join(lines)
