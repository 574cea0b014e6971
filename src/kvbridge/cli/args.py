"""The options several commands share, in one place: the pair, the mapper, the fit's options and levers, the serving
commands' store and LMCache groups; their value types; and the steps every command's arguments go through (a negative
list joined to its flag, --family standing for the pair)."""

from __future__ import annotations

import argparse

from ..errors import KVBridgeError
from ..family import FAMILIES, describe

FAMILY_NAMES = tuple(FAMILIES)
PAIRS = {  # the pair's group for each kind of command: its title, --source's and --target's help
    "models": ("models", "small model that prefills (folder or hub id)",
               "large model that continues (folder or hub id)"),
    "configs": ("models", "source config: folder, config.json, hub id or shipped name",
                "target config: folder, config.json, hub id or shipped name"),
    "engine": ("pair (default: the embedded family and its shipped mapper)", "source model (folder or hub id)",
               "target model, the one vLLM serves (folder or hub id)"),
}
DTYPE_HELP = "model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16"
MISMATCH_HELP = "accept models whose revision differs from the mapper's record (geometry must still match)"


def add_pair(p: argparse.ArgumentParser, kind: str = "models") -> None:
    """--source, --target and their revisions, one group, for each kind of command: ``models``, the commands that
    load both models here (--family stands for the pair; their devices; the mapper is :func:`add_mapper`'s group);
    ``configs``, kvbridge plan (the models' configs only, for a device planned for); ``engine``, the serving commands
    (vLLM serves the target, the connector runs the source and the mapper: the mapper and the connector's options
    join the group; no pair, the embedded family)."""
    title, source, target = PAIRS[kind]
    g = p.add_argument_group(title)
    if kind == "engine":
        g.add_argument("--mapper", help="mapper folder or hub id")
        g.add_argument("--mapper-revision", help="hub revision of the mapper")
    g.add_argument("--source", required=kind == "configs", help=source)
    g.add_argument("--target", required=kind == "configs", help=target)
    if kind == "models":
        g.add_argument("--family", choices=FAMILY_NAMES,
                       help=f"an embedded family's pair instead of --source/--target ({describe()})")
    g.add_argument("--source-revision", help="hub revision (commit, tag or branch) of the source")
    g.add_argument("--target-revision", help="hub revision of the target")
    if kind == "engine":
        _add_connector(g)
    elif kind == "configs":
        g.add_argument("--device", default="cuda", help="the fit's device: cuda (default) or cpu (host and device are "
                                                       "then one memory and add up)")
        g.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    else:
        g.add_argument("--device", default="cpu", help="device of both models, e.g. cpu, cuda, cuda:1 (default: cpu)")
        g.add_argument("--target-device", help="put the target on another device than the source")
        g.add_argument("--dtype", default="auto", help=DTYPE_HELP)


def _add_connector(g) -> None:
    """The serving pair's runtime: what the connector inside vLLM's worker does with the pair."""
    g.add_argument("--allow-revision-mismatch", action="store_true", help=MISMATCH_HELP)
    g.add_argument("--hold-back", type=int, help="prompt tokens the engine computes itself (default: the mapper's)")
    g.add_argument("--recompute", type=float, help="fraction of prefix tokens the target recomputes inside the "
                                                   "connector (default: the mapper's; 0: none)")
    g.add_argument("--connector-device", default="auto",
                   help="device of the source and mapper inside the engine's worker (default: auto: cuda when a GPU "
                        "is there, else cpu)")
    g.add_argument("--connector-dtype", default="auto",
                   help="their dtype, and the engine's unless --dtype is given (default: auto: float32 on CPU, "
                        "bfloat16 on GPU)")


def add_mapper(p: argparse.ArgumentParser, required: bool = True, default_help: str = "") -> None:
    """The mapper of a command that loads the pair here (:func:`add_pair`'s ``models``), in a group of its own."""
    g = p.add_argument_group("mapper")
    g.add_argument("--mapper", required=required, help=f"mapper folder or hub id{default_help}")
    g.add_argument("--mapper-revision", help="hub revision of the mapper")
    g.add_argument("--mapper-device", help="device of the mapper (default: --device)")
    g.add_argument("--allow-revision-mismatch", action="store_true", help=MISMATCH_HELP)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers (--lags, --lever-layers, kvbridge gap's --lengths)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 0,1,2, not {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, e.g. 0,1,2, not {text!r}")
    return values


def windows(text: str) -> tuple[int, ...]:
    """Attention windows in tokens (--oracle-window), each at least 1."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"an attention window is at least 1 token, not {text!r}")
    return values


def layer_count(text: str) -> int | None:
    """A count of source layers, or ``all`` (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of source layers or 'all', not {text!r}") from None


def add_levers(p: argparse.ArgumentParser) -> None:
    """The levers (extra capacity on the layers the plain map serves worst) and the runtime options an artifact
    records; the defaults are FitConfig's."""
    from ..fit.closed_form import FitConfig

    d = FitConfig()
    g = p.add_argument_group("levers", "extra capacity where the plain map loses quality (see kvbridge frontier); "
                                       "the defaults are the frontier's recommended point, chosen on the embedded "
                                       "families")
    _add_lever_layers(g, d)
    _add_lever_mlp(g, d)
    _add_lever_tuning(g, d)
    _add_runtime(p.add_argument_group("runtime options recorded in the artifact (a Bridge uses them unless told "
                                      "otherwise)"), d)


def _add_lever_layers(g, d) -> None:
    """Which target layers get levers, and what their features are."""
    g.add_argument("--lags", type=int_list, default=d.lags,
                   help=f"source tokens t-j feeding target token t on lever layers (default: "
                        f"{','.join(map(str, d.lags))}; 0 alone = no lags)")
    g.add_argument("--lever-inputs", choices=["same", "kv", "kvs"], default=d.lever_inputs,
                   help=f"lever features from the same cache (keys for keys), from keys and values (kv), or from "
                        f"keys, values and the source's final hidden state (kvs: the map then needs the source's "
                        f"prefill, not only its cache) (default: {d.lever_inputs})")
    g.add_argument("--lever-kinds", default=",".join(d.lever_kinds),
                   help=f"target caches that get levers: key, value or key,value (default: {','.join(d.lever_kinds)})")
    g.add_argument("--lever-layers", type=int_list, default=None,
                   help="target layers that get levers (default: the --lever-count layers with the lowest fit R²)")
    g.add_argument("--lever-count", type=int, default=d.lever_count,
                   help=f"how many target layers get levers when --lever-layers is not given "
                        f"(default: {d.lever_count})")
    g.add_argument("--lever-stride", type=int, default=d.lever_stride,
                   help=f"observe every S-th token for the levers' statistics (default: {d.lever_stride})")
    g.add_argument("--lever-top-k", type=layer_count, default=d.lever_top_k,
                   help=f"source layers feeding each lever layer, the best by single-layer R², at most --top-k; "
                        f"all: as many as --top-k (default: {d.lever_top_k or 'all'})")
    g.add_argument("--lever-weighting", choices=["none", "attention"], default=d.lever_weighting,
                   help="attention: weighted ridge for lever layers, each token weighted by the attention its "
                        f"native key receives (default: {d.lever_weighting})")


def _add_lever_mlp(g, d) -> None:
    """The residual MLP on lever layers, and the repeated spans of its calibration rows."""
    g.add_argument("--mlp-hidden", type=int, default=d.mlp_hidden,
                   help=f"width of a residual MLP on lever layers, 0 for none (default: {d.mlp_hidden})")
    g.add_argument("--mlp-steps", type=int, default=d.mlp_steps, help=f"MLP training steps (default: {d.mlp_steps})")
    g.add_argument("--mlp-batch", type=int, default=d.mlp_batch,
                   help=f"observations per MLP step (default: {d.mlp_batch})")
    g.add_argument("--mlp-lr", type=float, default=d.mlp_lr, help=f"MLP learning rate (default: {d.mlp_lr})")
    g.add_argument("--mlp-observations", type=int, default=d.mlp_observations,
                   help="observations the MLP trains on, a seeded sample held in host memory in float32 (twice "
                        f"while standardised): bounds the fit's RAM (default: {d.mlp_observations:,})")
    g.add_argument("--repeat-spans", type=float, default=d.repeat_spans,
                   help="spans of 8-32 tokens (random tokens or another row's text) written twice into each of the "
                        "levers' calibration rows, on average, so that the levers also learn text only the context "
                        f"explains (default: {d.repeat_spans}; 0: the rows as they are)")


def _add_lever_tuning(g, d) -> None:
    """Tuning the levers end to end on the target's output, and the seed of every random step."""
    g.add_argument("--lever-objective", choices=["kv", "output"], default=d.lever_objective,
                   help="kv: levers fitted by mean squared error on the target's K/V; output: then tuned end to end "
                        "on the KL divergence from the target's native next-token distribution (needs Llama-style "
                        f"decoder layers; checked) (default: {d.lever_objective})")
    g.add_argument("--tune-plain", action=argparse.BooleanOptionalAction, default=d.tune_plain,
                   help="with --lever-objective output, also tune the plain linear maps of the lever layers' other "
                        "kinds (e.g. the values of a layer whose keys get a lever) on the same objective: no "
                        f"runtime cost (default: {d.tune_plain})")
    g.add_argument("--tune-steps", type=int, default=d.tune_steps,
                   help=f"tuning steps with --lever-objective output (default: {d.tune_steps})")
    g.add_argument("--tune-batch", type=int, default=d.tune_batch,
                   help=f"calibration rows a tuning step (default: {d.tune_batch})")
    g.add_argument("--tune-lr", type=float, default=d.tune_lr, help=f"tuning learning rate (default: {d.tune_lr})")
    g.add_argument("--tune-rows", type=int, default=d.tune_rows,
                   help="calibration rows kept for tuning, with their lever features, in host memory (a seeded "
                        f"sample beyond; 5%% validate) (default: {d.tune_rows})")
    g.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the MLP training, the repeated spans and the tuning (default: {d.seed})")


def _add_runtime(g, d) -> None:
    """Selective recompute, the attention sink, hold-back and native layers: options a Bridge reads from the
    artifact."""
    from ..core.recompute import CRITERIA

    g.add_argument("--recompute", type=float, default=d.recompute,
                   help=f"fraction of prefix tokens the target recomputes over the mapped cache, those the "
                        f"source found least predictable (see --recompute-by); 0 turns it off (default: "
                        f"{d.recompute})")
    g.add_argument("--recompute-by", choices=CRITERIA, default=d.recompute_by,
                   help="how recompute picks tokens: the source's surprisal (exact, costs the source's vocabulary "
                        "projection), minus the source's logit of each token (one dot product a token), or a bigram "
                        "table of the calibration text stored in the artifact; random: a control that picks tokens "
                        f"blindly (seeded by the prompt), to measure what a criterion adds (default: {d.recompute_by})")
    g.add_argument("--recompute-window", type=int, default=d.recompute_window,
                   help="average each token's --recompute-by score over this many tokens centred on it (odd), so that "
                        "unpredictable spans (names, numbers, text to be recalled) are recomputed whole; 1: each "
                        f"token's own score (default: {d.recompute_window})")
    g.add_argument("--sink", action=argparse.BooleanOptionalAction, default=d.sink,
                   help="the target recomputes each prompt's first token (attention sink)")
    g.add_argument("--hold-back", type=int, default=d.hold_back,
                   help=f"last prompt tokens the target reads itself (default: {d.hold_back})")
    g.add_argument("--native-layers", type=int, default=d.native_layers,
                   help="the target computes its first N layers' keys and values itself (its own prefill, stopped "
                        "there) and the map fills the rest: for a pair whose lost quality sits in a low layer (see "
                        "kvbridge diagnose --oracle); costs N of the target's layers per token (default: "
                        f"{d.native_layers})")


def lever_settings(args) -> dict:
    """FitConfig's lever and runtime fields from :func:`add_levers`' options."""
    kinds = tuple(k.strip() for k in args.lever_kinds.split(",") if k.strip())
    return dict(lags=args.lags, lever_inputs=args.lever_inputs, lever_kinds=kinds, lever_layers=args.lever_layers,
                lever_count=args.lever_count, lever_stride=args.lever_stride, lever_top_k=args.lever_top_k,
                lever_weighting=args.lever_weighting,
                mlp_hidden=args.mlp_hidden,
                mlp_steps=args.mlp_steps, mlp_batch=args.mlp_batch, mlp_lr=args.mlp_lr,
                mlp_observations=args.mlp_observations, repeat_spans=args.repeat_spans,
                lever_objective=args.lever_objective, tune_plain=args.tune_plain, tune_steps=args.tune_steps,
                tune_batch=args.tune_batch,
                tune_lr=args.tune_lr, tune_rows=args.tune_rows, seed=args.seed,
                recompute=args.recompute, recompute_by=args.recompute_by,
                recompute_window=args.recompute_window, sink=args.sink, hold_back=args.hold_back,
                native_layers=args.native_layers)


def add_fit_options(p: argparse.ArgumentParser) -> None:
    """What a fit reads and how it solves (kvbridge fit, and kvbridge plan to price it)."""
    from ..fit.closed_form import FitConfig

    top_k = FitConfig().top_k
    p.add_argument("--num-texts", type=int, default=160,
                   help="calibration sequences (default: 160; the published Ministral-3 mapper used 500)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration sequence (default: 1024)")
    p.add_argument("--stride", type=int, default=2, help="observe every S-th token (default: 2)")
    p.add_argument("--top-k", type=layer_count, default=top_k,
                   help=f"source layers per target layer, the best by single-layer R², or all (the published "
                        f"Ministral-3 mapper's; default: {top_k or 'all'}, chosen on the embedded families: with "
                        f"the levers one beat all four on the deep family's 4-layer source and tied them on "
                        f"deep-pruned's)")
    p.add_argument("--source-depth", type=int, default=None,
                   help="maps read only the source's first D layers, so a transfer's source prefill stops after "
                        "layer D-1 (default: any layer)")
    p.add_argument("--rank", type=int, default=None,
                   help="factor every target layer without levers through this rank (reduced-rank ridge: fewer "
                        "FLOPs per token; default: full rank)")
    p.add_argument("--rank-flops", type=float, default=None,
                   help="or spend this share (0-1) of those layers' full-rank FLOPs, each layer's rank chosen where "
                        "held-out R² gains most per FLOP")
    p.add_argument("--head-blocks", type=int, default=None,
                   help="split every target layer without levers into this many blocks of KV heads, target block g "
                        "reading block g of the source's heads only (the KV head count: head-matched maps; 1/N of "
                        "the FLOPs; default: full maps)")
    p.add_argument("--ridge", type=float, default=0.01,
                   help="ridge, relative to the mean diagonal of the source Gram (default: 0.01)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")
    p.add_argument("--statistics-on", choices=("auto", "device", "host"), default="auto",
                   help="where the float64 statistics live during the fit: the models' GPU (fast: the capture runs "
                        "at its float64 speed), host memory, or auto: the GPU when they fit there with the solve's "
                        "working memory (default)")
    p.add_argument("--heldout-texts", type=int, default=4,
                   help="sequences for the held-out R², cut from the last documents, which the fit then does not "
                        "read (default: 4; 0 to skip)")


def fit_config(args):
    """The FitConfig of :func:`add_fit_options`' and :func:`add_levers`' options (it checks them)."""
    from ..fit.closed_form import FitConfig

    return FitConfig(num_texts=args.num_texts, seq_len=args.seq_len, stride=args.stride, top_k=args.top_k,
                     ridge=args.ridge, batch_size=args.batch_size, heldout_texts=args.heldout_texts,
                     rank=args.rank, rank_flops=args.rank_flops, head_blocks=args.head_blocks,
                     source_depth=args.source_depth, **lever_settings(args))


LIST_FLAGS = ("--lags", "--lever-layers", "--contexts", "--lever-kinds")


def family_pair(args) -> None:
    """--family stands for --source/--target (the commands that take a pair); one of the two is needed."""
    if not (hasattr(args, "family") and hasattr(args, "source")) or args.command == "frontier" \
            or getattr(args, "table", None):  # kvbridge gap --table reads a saved report: no models
        return
    if args.family:
        if args.source or args.target or args.source_revision or args.target_revision:
            raise KVBridgeError("give --family or --source/--target (and their revisions), not both.")
        from .. import family

        args.source, args.target = family.source_path(args.family), family.target_path(args.family)
    elif not (args.source and args.target):
        raise KVBridgeError("give --source and --target (folders or hub ids), or --family "
                            f"{'|'.join(FAMILY_NAMES)} for an embedded family.")


def join_negative_lists(argv: list[str]) -> list[str]:
    """``--lags -1,0`` as ``--lags=-1,0``: argparse takes a value that starts with "-" for an option (and says
    "expected one argument"); joined, the value reaches the check that names what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] in LIST_FLAGS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def add_native_rest(group) -> None:
    from ..serving.engine.config import ServeConfig

    default = ServeConfig(mapper="-", source="-", target="-").native_rest
    group.add_argument("--native-rest", type=int, default=default, metavar="N",
                       help="when a prompt's stored prefix leaves at most N tokens (a conversation's new turn), the "
                            "target computes them itself over the stored prefix and the source does not run; 0: the "
                            f"source prefills them for the mapper, as on the cold path (default: {default})")


def add_store_memory(group) -> None:
    group.add_argument("--store-memory-gb", type=float, default=1.0, metavar="GB",
                       help="blocks the source engine maps ahead are loaded into the target's memory as it announces "
                            "them, up to this much per engine worker (least recently used out first), so that an "
                            "escalated turn reads them from memory; 0: read from the store's folder when a turn needs "
                            "them (default: 1)")


def add_prewarm(p) -> None:
    p.add_argument("--prewarm", action="store_true",
                   help="the source's every request asks the target's server to load its conversation ahead, once "
                        "its blocks are stored (and mapped ahead): an escalated turn then finds its history in the "
                        "target's prefix cache (default: only requests whose kv_transfer_params say "
                        "{\"kvbridge_prewarm\": true}; each costs the target one short request)")


def add_lmcache(p, owner: bool, bench: bool = False) -> None:
    """``--lmcache`` (and, where the command can start a server of its own, its tiers; ``bench``: cascade-bench's,
    a second pair beside the folder's, started or running)."""
    if bench:
        g = p.add_argument_group("LMCache (a second pair beside the folder's: its source stores its K/V in an LMCache "
                                 "server, its target reads them from there: the lmcache way)")
        g.add_argument("--lmcache", metavar="URL|auto",
                       help="also start `kvbridge cascade --lmcache`'s pair, sharing the LMCache server at "
                            "tcp://HOST:PORT or one this command starts and stops (auto); each conversation's source "
                            "turns go to its source too, and the escalated turn to its target as one more way in the "
                            "random order: its TTFT, its answer against the cold path's at the same split, LMCache "
                            "minus folder paired per conversation, and where its loads' time went")
    elif owner:
        g = p.add_argument_group("LMCache (the source engine's K/V in an LMCache server both engines reach, instead of "
                                 "a store folder)")
        g.add_argument("--lmcache", metavar="URL|auto",
                       help="the source engine stores its K/V through vLLM's LMCacheMPConnector in the LMCache server "
                            "at tcp://HOST:PORT, or in one this command starts and stops (auto); the store folder, "
                            "map-ahead and prewarm are then not used")
    else:
        g = p.add_argument_group("LMCache (the source engine's K/V in an LMCache server both engines reach, instead of "
                                 "a store folder)")
        g.add_argument("--lmcache", metavar="URL",
                       help="instead of --store: the LMCache server (tcp://HOST:PORT) a source engine stores its K/V "
                            "in (`kvbridge serve-source --lmcache`, or any vLLM engine with LMCacheMPConnector and "
                            "the source's llama-4 override): the whole chunks of a prompt found there are mapped "
                            "without a source prefill")
        g.add_argument("--lmcache-model", metavar="NAME",
                       help="the model name that source engine was given (LMCache keys by it; default: the source's "
                            "folder, as kvbridge serve-source gives it)")
        return
    g.add_argument("--lmcache-l1-gb", type=float, default=1.0,
                   help="with --lmcache auto: the server's memory tier in GiB (allocated up front; default: 1)")
    g.add_argument("--lmcache-l2", metavar="JSON",
                   help="with --lmcache auto: a second tier, LMCache's --l2-adapter: a disk "
                        "'{\"type\":\"fs\",\"base_path\":DIR}' or Redis "
                        "'{\"type\":\"resp\",\"host\":H,\"port\":P}'")
    if bench:
        g.add_argument("--lmcache-source-url", help="instead of --lmcache, with --source-url: a running `kvbridge "
                                                    "serve-source --lmcache` server (with --lmcache-target-url)")
        g.add_argument("--lmcache-target-url", help="a running `kvbridge serve --lmcache` server reading the LMCache "
                                                    "server that source stores in")
