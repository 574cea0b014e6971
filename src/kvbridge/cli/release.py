"""The commands about a mapper artifact itself: ``kvbridge inspect`` (what it holds), ``verify`` (its integrity),
``card`` (its model card) and ``push`` (to the Hugging Face Hub)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import KVBridgeError
from .console import EPILOG, clip, log


def add_inspect(p: argparse.ArgumentParser) -> None:
    """`kvbridge inspect`'s options."""
    p.add_argument("mapper", help="mapper folder or hub id")
    p.add_argument("--revision", help="hub revision of the mapper")
    p.add_argument("--json", action="store_true", help="print mapper.json instead of the summary")


def run_inspect(args) -> int:
    from ..core.artifact import CONFIG_FILE, read_run_report, resolve
    from ..core.mapper import check_mapper
    from ..core.mapper_config import read_config

    directory = resolve(args.mapper, args.revision)
    problems = check_mapper(directory)
    if problems:  # nothing of an artifact that fails verification can be trusted, its summary included
        raise KVBridgeError(f"{directory} fails verification ({'; '.join(problems[:2])}); nothing to show. "
                            "`kvbridge verify` lists every problem; re-download or refit the mapper.")
    config = read_config(directory)
    run = read_run_report(directory)
    if args.json:
        print((Path(directory) / CONFIG_FILE).read_text(encoding="utf-8"), end="")
        return 0
    data = config.to_dict()
    f = config.fit
    print(f"mapper    {directory}")
    for role in ("source", "target"):
        m = getattr(config, role)
        print(f"{role:9s} {m.name_or_path} @ {m.revision or '(local, no revision)'}  [{m.architecture}]")
        print(f"          {m.num_layers} layers × {m.num_kv_heads} kv heads × {m.head_dim} dims; "
              f"RoPE {m.rope.rope_type} "
              f"{ {k: v for k, v in m.rope.parameters.items() if k not in ('rope_type', 'type')} }")
    print(f"tokenizer {config.source.tokenizer_sha256[:16]}…")
    print(f"params    {data['num_parameters']:,} ({data['num_parameters'] * 4 / 1e9:.3f} GB float32)")
    for kind in ("key", "value"):
        sel = config.selection[kind]
        sizes = sorted({len(s) for s in sel})
        print(f"{kind:9s} top_k {sizes[0] if len(sizes) == 1 else sizes}; selection per target layer: "
              f"{clip(str([list(s) for s in sel]), 100)}")
    if isinstance(f.get("settings"), dict):
        s = f["settings"]
        seconds = f"{run['fit_seconds']} s" if "fit_seconds" in run else "time not recorded"
        print(f"fit       {s.get('num_texts')} texts × {s.get('seq_len')} tokens, stride {s.get('stride')}, "
              f"{_count(f.get('observations'))} observations, ridge {s.get('ridge')}, {seconds}")
        print(f"          corpus sha256 {str(f.get('calibration_sha256', '?'))[:16]}…")
        for kind in ("key", "value"):
            fitted, held = f.get(f"{kind}_r2_fit_mean"), f.get(f"{kind}_r2_heldout_mean")
            print(f"R² {kind:6s} fit {_number(fitted)}" + (f", held-out {_number(held)}" if held is not None else ""))
    from ..measure.bench import map_flops

    print(f"map       {map_flops(config, 1) / 1e6:,.3f} MFLOP per token (keys and values)")
    for kind in ("key", "value"):  # fast maps: reduced rank, head blocks (1: the full map)
        if config.ranks.get(kind):
            print(f"rank      {kind}s per target layer (0: full): {clip(str(list(config.ranks[kind])), 100)}")
        if config.heads.get(kind):
            print(f"heads     {kind}s per target layer, blocks of KV heads (1: full): "
                  f"{clip(str(list(config.heads[kind])), 80)}")
    for v in config.levers:
        print(f"lever     {v.kind}s of target layer {v.layer}: {'+'.join(v.inputs) or v.kind + 's'} at lags "
              f"{','.join(map(str, v.lags))}" + (f", residual MLP {v.hidden}" if v.hidden else ""))
    tune = f.get("tune")
    if isinstance(tune, dict):
        print(f"tuned     on the target's output: validation KL {_number(tune.get('validation_kl_before'))} → "
              f"{_number(tune.get('validation_kl_after'))} "
              f"({'kept' if tune.get('kept') else 'not kept: it did not help'})")
    elif f.get("kind"):
        print(f"fit       {f['kind']}")
    return 0


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _number(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "?"


def add_verify(p: argparse.ArgumentParser) -> None:
    """`kvbridge verify`'s options."""
    p.add_argument("mapper", help="mapper folder or hub id")
    p.add_argument("--revision", help="hub revision of the mapper")


def run_verify(args) -> int:
    from ..core.artifact import ARTIFACT_FILES, RUN_REPORT_FILE, leftovers, resolve
    from ..core.mapper import check_mapper

    directory = resolve(args.mapper, args.revision, files=ARTIFACT_FILES)
    problems = check_mapper(directory)
    for p in leftovers(directory):
        print(f"NOTE  {p.name} beside it is left from an interrupted save; the next save there removes it",
              file=sys.stderr)
    if problems:
        for p in problems:
            print(f"FAIL  {p}", file=sys.stderr)
        print(f"{directory}: {len(problems)} problem(s). Re-download or refit the mapper.", file=sys.stderr)
        return 1
    print(f"OK    {directory}: checksums match, mapper.json valid, all tensor names, shapes and dtypes as recorded, "
          f"no NaN or Inf ({RUN_REPORT_FILE} and the card files README.md, artifact_manifest.json, example.py, if "
          "present, describe the mapper and are deliberately not covered)")
    return 0


def add_card(p: argparse.ArgumentParser) -> None:
    """`kvbridge card`'s options."""
    p.description = ("Adds README.md (a Hub model card: the pair with revisions and fingerprints, the fit, retention "
                     "and latency tables rendered from result files, usage, limitations), artifact_manifest.json "
                     "(provenance, file hashes, result summaries) and example.py (a runnable cache handoff) to a "
                     "mapper folder. Figures come only from the files given; what was not measured is said to be "
                     "missing. The three files stay outside checksums.sha256 (the mapper's identity).")
    p.epilog = EPILOG
    p.add_argument("mapper", help="mapper folder (kvbridge fit --out)")
    p.add_argument("--eval", help="folder `kvbridge eval --out` wrote (results.json): the retention table")
    p.add_argument("--bench", help="file `kvbridge bench --json` wrote: the latency table")
    p.add_argument("--frontier", help="folder `kvbridge frontier --out` wrote: retention against speed")
    p.add_argument("--demo", help="demo.json `kvbridge demo --out` wrote: family-task retention and latency")
    p.add_argument("--repo-id", help="hub id the artifact will be pushed to, for the usage snippets")
    p.add_argument("--license", default="mit", help="license of the mapper in the card's metadata (default: mit)")
    p.add_argument("--force", action="store_true",
                   help="replace README.md, example.py or artifact_manifest.json even when an earlier card did not "
                        "write them (by default those are refused, so a file of yours is never overwritten)")


def run_card(args) -> int:
    from ..release.card import write_card

    written = write_card(args.mapper, eval_dir=args.eval, bench_json=args.bench, frontier_dir=args.frontier,
                         demo_json=args.demo, repo_id=args.repo_id, license_id=args.license, force=args.force)
    print("written: " + ", ".join(str(p) for p in written))
    missing = [what for what, given in (("retention (--eval or --demo)", args.eval or args.demo),
                                        ("latency (--bench or --demo)", args.bench or args.demo)) if not given]
    if missing:
        print(f"the card says these were not measured: {', '.join(missing)}")
    return 0


def add_push(p: argparse.ArgumentParser) -> None:
    """`kvbridge push`'s options."""
    p.description = ("Verifies the artifact, creates the hub repo if needed and uploads the artifact's files (and its "
                     "card, if `kvbridge card` wrote one) in one commit, then prints the commit to pin. Needs a token "
                     "with write access (`hf auth login` or HF_TOKEN).")
    p.epilog = EPILOG
    p.add_argument("mapper", help="mapper folder")
    p.add_argument("--repo-id", required=True, help="owner/name on the hub")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to main")
    p.add_argument("--token", help="hub token (default: the one `hf auth login` stored, or HF_TOKEN)")


def run_push(args) -> int:
    from ..core.artifact import KNOWN_FILES
    from ..core.hub import push_folder
    from ..core.mapper import require_verified
    from ..errors import ArtifactError
    from ..release.card import CARD_FILE

    folder = require_verified(args.mapper, "pushed")
    files = sorted(n for n in KNOWN_FILES if (folder / n).is_file())
    stale = sorted(KNOWN_FILES - set(files))  # a card or fit report of an earlier push must not describe this one
    if CARD_FILE not in files:
        log(f"note: {folder} has no model card; `kvbridge card {folder}` writes one (README.md).")
    commit, url, pr = push_folder(folder, args.repo_id, files, ArtifactError, private=args.private,
                                  create_pr=args.create_pr, token=args.token, delete=stale)
    print(f"pushed {len(files)} files to {args.repo_id}: {pr or url}")
    print(f"pin this commit: Mapper.from_pretrained({args.repo_id!r}, revision={commit!r})"
          f"  (CLI: --mapper {args.repo_id} --mapper-revision {commit})")
    return 0
