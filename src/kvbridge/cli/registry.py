"""Every ``kvbridge`` command in one table: its name, its line in ``kvbridge --help``, the function that adds its
options to a parser (and sets the parser's description), the function that runs it, and how its arguments are read.
``kvbridge --help`` and :func:`kvbridge.cli.app.main`'s dispatch are built from it.

The modules it names import only the standard library and kvbridge's light modules at their top: each handler
imports what it needs (the measurements, transformers, vLLM, lm-eval) when it runs, so ``kvbridge --help`` never
loads vLLM.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..version import __version__
from . import fitting, load_bench, measuring, release, serve, serve_bench
from .console import EPILOG


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # its line in `kvbridge --help`
    add: Callable[[argparse.ArgumentParser], None] | None  # its options; None: every argument is passed on as is
    run: Callable[[argparse.Namespace], int]
    serving: bool = False  # parsed by a parser of its own (`kvbridge NAME --help`), not by kvbridge's
    rest: str | None = None  # the attribute that gets the arguments it does not know (for vLLM, a server, lm-eval)


COMMANDS = (
    Command("fit", "fit a mapper from source to target on calibration texts",
            fitting.add_fit, fitting.run_fit),
    Command("plan", "predict a fit's and the runtime's memory from the two configs alone",
            fitting.add_plan, fitting.run_plan),
    Command("generate", "answer a prompt from a mapped cache (optionally beside native)",
            measuring.add_generate, measuring.run_generate),
    Command("demo", "the whole job on the embedded family: fit, verify, transfer, retention, latency",
            measuring.add_demo, measuring.run_demo),
    Command("frontier", "retention vs time to first token over a grid of lever settings",
            measuring.add_frontier, measuring.run_frontier),
    Command("bench", "latency table: native prefill vs source prefill + map, with FLOP limits",
            measuring.add_bench, measuring.run_bench),
    Command("eval", "native vs mapped (vs source) on lm-evaluation-harness tasks, the card's table",
            measuring.add_eval, measuring.run_eval),
    Command("gap", "what the mapped target keeps of the target's lead over the source, on third-party text: gap "
                   "recovered, free generation, TTFT",
            measuring.add_gap, measuring.run_gap),
    Command("diagnose", "per-layer R², attention-output cosine, next-token KL and top-1 agreement",
            measuring.add_diagnose, measuring.run_diagnose),
    Command("inspect", "show a mapper's pair, geometry, selection and fit summary",
            release.add_inspect, release.run_inspect),
    Command("lm-eval", "lm-evaluation-harness's own command line, with the kvbridge model registered",
            None, measuring.run_lm_eval, rest="lm_eval_args"),
    Command("serve", "vLLM's OpenAI-compatible server for the target, prefixes mapped by the kvbridge connector",
            serve.add_serve, serve.run_serve, serving=True, rest="vllm_args"),
    Command("serve-source", "vLLM's server for the source, storing its KV (mapped ahead) for a target server to read",
            serve.add_serve_source, serve.run_serve_source, serving=True, rest="vllm_args"),
    Command("cascade", "a source server and a target server that reads the source's stored KV when a conversation "
                       "escalates",
            serve.add_cascade, serve.run_cascade, serving=True, rest="vllm_args"),
    Command("serve-bench", "time to first token through vLLM, native vs mapped, at several lengths and concurrencies",
            serve_bench.add_serve_bench, serve_bench.run_serve_bench, serving=True, rest="serve_args"),
    Command("cascade-bench", "escalated turns' TTFT through the cascade: stored, prewarmed and cold against native",
            serve_bench.add_cascade_bench, serve_bench.run_cascade_bench, serving=True, rest="vllm_args"),
    Command("load-bench", "serving under load: one Poisson trace against plain vLLM and kvbridge",
            load_bench.add_load_bench, load_bench.run_load_bench, serving=True, rest="serve_args"),
    Command("serve-eval", "the family tasks' retention through vLLM next to Bridge's",
            serve_bench.add_serve_eval, serve_bench.run_serve_eval, serving=True),
    Command("card", "write a Hub model card, artifact_manifest.json and example.py into an artifact",
            release.add_card, release.run_card),
    Command("push", "verify an artifact, then upload it to the Hugging Face Hub",
            release.add_push, release.run_push),
    Command("verify", "check a mapper's files, checksums and tensor shapes (exit 1 on any problem)",
            release.add_verify, release.run_verify),
)
BY_NAME = {command.name: command for command in COMMANDS}


def parser() -> argparse.ArgumentParser:
    """``kvbridge``'s parser: every command listed; the serving commands and lm-eval as names only (they read their
    own arguments)."""
    p = argparse.ArgumentParser(
        prog="kvbridge",
        description="Cross-model KV-cache transfer: a small model prefills, a linear mapper converts its cache, "
                    "a larger model of the same family continues without prefilling.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if command.serving:
            sub.add_parser(command.name, help=f"{command.summary} (kvbridge {command.name} --help)", add_help=False)
        elif command.add is None:
            sub.add_parser(command.name, help=command.summary, add_help=False)
        else:
            command.add(sub.add_parser(command.name, help=command.summary))
    return p


def own_parser(command: Command) -> argparse.ArgumentParser:
    """A serving command's parser, ``kvbridge NAME``."""
    p = argparse.ArgumentParser(prog=f"kvbridge {command.name}")
    command.add(p)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments of ``kvbridge ARGV...``: ``command`` names the command; a serving command's also ``argv``
    (its own arguments) and, where it passes on what it does not know, those under its ``rest``."""
    command = BY_NAME.get(argv[0]) if argv else None
    if command is None or not (command.serving or command.add is None):
        return parser().parse_args(argv)
    if command.add is None:  # everything after the name is the tool's own (lm-eval's parser)
        return argparse.Namespace(command=command.name, **{command.rest: argv[1:]})
    p = own_parser(command)
    if command.rest:
        args, rest = p.parse_known_args(argv[1:])
        setattr(args, command.rest, rest)
    else:
        args = p.parse_args(argv[1:])
    args.command, args.argv = command.name, list(argv[1:])
    return args
