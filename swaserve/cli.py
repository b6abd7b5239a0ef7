"""`swaserve generate | serve | bench ...`: engine flags are EngineConfig fields
(docs/serving.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

from swaserve.bench.serve import add_args as add_bench_serve_args
from swaserve.config import FLAGS, GROUPS, EngineConfig
from swaserve.sampling.params import SamplingParams
from swaserve.server.reasoning import REASONING_PARSERS
from swaserve.server.tool_parsers import PARSERS


def add_engine_args(p: argparse.ArgumentParser) -> dict[str, Any]:
    """One flag per EngineConfig field, in argument groups (config.GROUPS), each with its
    FLAGS help line, default and choices. Returns the groups by name (`serve` adds one)."""
    hints = typing.get_type_hints(EngineConfig)
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for f in dataclasses.fields(EngineConfig):
        info = FLAGS[f.name]
        g = groups[info.group]
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, info.alias) if info.alias else (flag,)
        if hints[f.name] is bool:
            g.add_argument(*flags, action="store_true", default=f.default,
                           help=f"{info.help} (default: {info.default or 'off'})")
            continue
        hint = str(hints[f.name])
        kind = int if "int" in hint else float if "float" in hint else str
        shown = info.default if info.default is not None else f.default
        g.add_argument(
            *flags, type=kind, default=f.default, choices=info.choices,
            metavar=None if info.choices else f.name.upper(),
            help=f"{info.help} (default: {shown})".replace("%", "%%"),
        )
    _add_vllm_flags(groups, p)
    return groups


def _add_vllm_flags(groups: dict[str, Any], p: argparse.ArgumentParser) -> None:
    """vLLM's common flags that swaserve spells otherwise or needs not, so that a vLLM command
    line works as it is (engine_kwargs maps them)."""
    g = groups["vLLM compatibility"] = p.add_argument_group("vLLM compatibility")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: --cuda-graph-max-bs 0 and "
                        "--piecewise-cuda-graph-max-tokens 0 (default: off)")  # fmt: skip
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="--no-enable-prefix-caching is --disable-prefix-cache "
                   "(default: on)")  # fmt: skip
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted: prefills are always chunked by --max-num-batched-tokens "
                        "(default: on)")  # fmt: skip
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: swaserve never runs a model folder's own code (its model "
                        "architectures are built in) (default: off)")  # fmt: skip
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted: swaserve does not log requests' contents (default: off)")
    g.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="vLLM's form of the speculative decoding flags: method (ngram or "
                        "dflash), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
                        "model (default: none)")  # fmt: skip


# vLLM's --speculative-config keys -> EngineConfig fields
_SPEC_KEYS = {"method": "speculative_algorithm", "model": "speculative_draft_model",
              "num_speculative_tokens": "speculative_num_draft_tokens",
              "prompt_lookup_min": "speculative_ngram_min",
              "prompt_lookup_max": "speculative_ngram_max"}  # fmt: skip


def _speculative_config(spec: Any) -> dict[str, Any]:
    """--speculative-config as EngineConfig fields (ValueError naming a key it cannot take)."""
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {spec!r}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unsupported key(s) {unknown}; swaserve takes "
                         f"{sorted(_SPEC_KEYS)}")  # fmt: skip
    return {_SPEC_KEYS[k]: v for k, v in spec.items()}


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {f: getattr(args, f) for f in EngineConfig.field_names()}
    if getattr(args, "enforce_eager", False):
        kw["cuda_graph_max_bs"], kw["piecewise_cuda_graph_max_tokens"] = 0, 0
    if getattr(args, "enable_prefix_caching", None) is False:
        kw["disable_prefix_cache"] = True
    if getattr(args, "speculative_config", None) is not None:
        kw.update(_speculative_config(args.speculative_config))
    return kw


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """`generate`'s grammar flags as SamplingParams.structured_outputs, parsed (ValueError
    naming the flag: a schema that is not JSON, a regex that does not parse, ...)."""
    from swaserve.sampling.structured import check_syntax, normalise

    if getattr(args, "json_schema", None) is not None:  # `chat` has no grammar flags
        flag, text = "--json-schema", args.json_schema
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text()
            except OSError as e:
                raise ValueError(f"--json-schema: cannot read {text[1:]}: {e.strerror}") from None
        spec: dict | None = {"json": text}
    elif getattr(args, "json_object", False):
        flag, spec = "--json-object", {"json_object": True}
    elif getattr(args, "regex", None) is not None:
        flag, spec = "--regex", {"regex": args.regex}
    elif getattr(args, "choice", None):
        flag, spec = "--choice", {"choice": args.choice}
    else:
        return None
    try:
        spec = normalise(spec)
        check_syntax(spec)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return spec


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """`generate`'s sampling flags; a ValueError names the flag (before any model loads)."""
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "seed": args.sampling_seed}
    try:
        return SamplingParams(**flags, structured_outputs=_structured_outputs(args))
    except ValueError as e:
        name = next((f for f in flags if str(e).startswith(f + " ")), None)
        flag = "--sampling-seed" if name == "seed" else "--" + (name or "").replace("_", "-")
        raise ValueError(flag + str(e)[len(name):] if name else str(e)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Prints each output; 1 when a generation failed (finish_reason "abort"), with a one-line
    error per failed prompt on stderr. Every flag is checked before the model loads."""
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts or not all(prompts):
        print("error: give --prompt TEXT (repeatable, not empty) or prompts on stdin",
              file=sys.stderr)
        return 2
    params = sampling_params(args)
    EngineConfig(**engine_kwargs(args))  # raises on a bad engine flag, before any loading
    from swaserve import Engine

    engine = Engine(**engine_kwargs(args))
    if args.chat:
        outs = engine.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = engine.generate(prompts, params)
    failed = 0
    for i, out in enumerate(outs):
        if out.outputs[0].finish_reason == "abort":
            failed += 1
            which = f"prompt {i + 1} of {len(outs)}: " if len(outs) > 1 else ""
            n = len(out.token_ids)
            print(f"error: {which}generation aborted after {n} token{'s' * (n != 1)} "
                  "(see the log above)", file=sys.stderr)
        print(out.text if len(outs) == 1 else json.dumps({"prompt": out.prompt, "text": out.text}))
    return 1 if failed else 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation in the terminal (swaserve/chat_repl.py): offline, or with --url through a
    running server."""
    from swaserve.chat_repl import ServerChat, repl

    params = sampling_params(args)
    if args.url:
        body: dict[str, Any] = {"max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        if params.top_k > 0:
            body["top_k"] = params.top_k  # vLLM's extension, which swaserve's server takes
        if params.seed is not None:
            body["seed"] = params.seed
        try:
            chat = ServerChat(args.url, args.api_key, body)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        repl(chat, f"{chat.model} at {chat.base}", args.system)
        return 0
    EngineConfig(**engine_kwargs(args))  # raises on a bad engine flag, before any loading
    from swaserve import Engine

    engine = Engine(**engine_kwargs(args))
    try:
        repl(lambda history: engine.chat_stream(history, params), args.model, args.system)
    finally:
        engine.shutdown()
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from swaserve.bench.memory import main_from_config
    from swaserve.engine.engine import resolve_folder

    folder = resolve_folder(args.model)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    result = main_from_config(cfg, args.context, args.kv_cache_gb, args.page_size)
    print(json.dumps(result, allow_nan=False))  # strict JSON: no Infinity or NaN
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from swaserve import Engine
    from swaserve.bench.offline import run_offline_bench

    engine = Engine(**engine_kwargs(args))
    result = run_offline_bench(
        engine, args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range),
        seed=args.bench_seed,
    )
    print(json.dumps(result))
    return 0


def add_server_args(groups: dict[str, Any], p: argparse.ArgumentParser) -> None:
    """`serve`'s own flags, in a "server" group after the engine's."""
    g = groups["server"] = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    g.add_argument(
        "--api-key", default=os.environ.get("SWASERVE_API_KEY"), metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/* (default: $SWASERVE_API_KEY, "
        "else none)",
    )
    g.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model's name in /v1/models and responses; requests may use it or --model's "
        "(default: --model's)",
    )
    g.add_argument(
        "--disable-playground", action="store_true",
        help="do not serve the playground page at / (default: served)",
    )
    g.add_argument("--max-n", type=int, default=16,
                   help="most samples (n) per request (default: %(default)s)")
    g.add_argument(
        "--tool-call-parser", default="auto",
        choices=["auto", *PARSERS],
        help="how tool_choice 'auto' finds tool calls in the model's answers; auto: the format "
        "the chat template's own tool calls use, if it has any (default: %(default)s)",
    )
    g.add_argument(
        "--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
        help="split a thinking model's answers into reasoning_content (its <think> part, or "
        "gpt-oss's analysis channel) and content (default: openai_gptoss for a harmony chat "
        "template, else none: answers whole)",
    )
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="vLLM's flag: tool_choice 'auto' must work, so starting fails when no tool-call "
        "parser is given or implied by the chat template (default: 'auto' works where one is)",
    )
    g.add_argument(
        "--stream-interval", type=int, default=1, metavar="N",
        help="streaming: send a sample's tokens once N are new (its first token and its end "
        "at once); larger N costs the frontend less per token at many streams (default: "
        "%(default)s)",
    )
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of the server and the engine core (default: %(default)s)")
    g.add_argument(
        "--disable-log-stats", action="store_true",
        help="no periodic stats line (throughput, running and waiting requests, KV usage, "
        "prefix hit rate) in the log (default: one every --log-stats-interval while busy)",
    )
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="seconds between stats lines (default: %(default)s)")
    g.add_argument("--allowed-origins", type=json.loads, default=["*"], metavar="JSON",
                   help="CORS: origins whose pages may call the API, a JSON list (default: "
                   '["*"], any, as vLLM)')  # fmt: skip
    g.add_argument("--allowed-methods", type=json.loads, default=["*"], metavar="JSON",
                   help='CORS: allowed methods, a JSON list (default: ["*"])')
    g.add_argument("--allowed-headers", type=json.loads, default=["*"], metavar="JSON",
                   help='CORS: allowed headers, a JSON list (default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies) in cross-origin requests (default: off)")
    g.add_argument(
        "--startup-timeout", type=float, default=900.0, metavar="S",
        help="seconds to wait for the engine cores to load and, over nodes, for the other "
        "nodes to join, before giving up (default: %(default)s)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from swaserve.server.launch import ServerArgs, serve

    if args.model_tag is not None:
        default = EngineConfig.model
        if args.model not in (default, args.model_tag):
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag

    if args.max_n < 1:
        raise ValueError("--max-n must be >= 1")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if not args.startup_timeout > 0:
        raise ValueError("--startup-timeout must be > 0")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    if not args.log_stats_interval > 0:
        raise ValueError("--log-stats-interval must be > 0 (--disable-log-stats turns it off)")
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, flag)
        if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise ValueError(f"--{flag.replace('_', '-')} must be a JSON list of strings, "
                             f"got {value!r}")
    server_args = ServerArgs(
        host=args.host, port=args.port, api_key=args.api_key, max_n=args.max_n,
        log_level=args.log_level, served_model_name=args.served_model_name,
        playground=not args.disable_playground, stream_interval=args.stream_interval,
        startup_timeout=args.startup_timeout, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
    )
    config = EngineConfig(**engine_kwargs(args))
    if config.disaggregation_mode:  # a missing transfer library fails now, not after loading
        from swaserve.disaggregation.transfer import check_transfer_backend

        check_transfer_backend(config.disaggregation_transfer_backend)
    if config.node_rank > 0:  # another machine's ranks: no HTTP
        import logging

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if config.data_parallel_size > 1:  # its data-parallel ranks: engine cores
            from swaserve.server.nodes import run_node as run_core_node

            # joins node 0 before it resolves the model: node 0 hears of any failure from then
            return run_core_node(config, args.log_level)
        from swaserve.distributed.launch import run_node  # its tensor-parallel workers
        from swaserve.engine.engine import resolve_folder

        return run_node(config, resolve_folder(config.model))
    return serve(config, server_args)


def cmd_router(args: argparse.Namespace) -> int:
    from swaserve.disaggregation.router import serve_router

    return serve_router(args.prefill, args.decode, args.host, args.port, args.api_key,
                        args.log_level)


def add_router_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (`swaserve serve --disaggregation-mode prefill`)")
    r.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (`swaserve serve --disaggregation-mode decode`)")
    r.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    r.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    r.add_argument(
        "--api-key", default=os.environ.get("SWASERVE_API_KEY"), metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, and send it to the instances "
        "(they share it) (default: $SWASERVE_API_KEY, else none)",
    )
    r.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="log level (default: %(default)s)")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from swaserve.bench.serve import run_from_args

    return run_from_args(args)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from swaserve.speculative.train_drafter import run

    return run(args)


def _add_sampling_args(group: Any, max_tokens: int) -> None:
    """The sampling flags of `generate` and `chat` (read by `sampling_params`)."""
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="most tokens generated per answer (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0: greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0,
                       help="sample from the k likeliest tokens; 0: all (default: %(default)s)")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="seed of this run's sampling (default: none, --seed's stream)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swaserve")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text offline")
    add_engine_args(g)
    gg = g.add_argument_group("generation")
    gg.add_argument("--prompt", action="append",
                    help="prompt text, repeatable (default: one prompt per line of stdin)")
    _add_sampling_args(gg, max_tokens=64)
    gg.add_argument("--chat", action="store_true",
                    help="wrap each prompt in the chat template (default: off)")
    so = gg.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="SCHEMA",
                    help="hold the output to this JSON schema: its JSON text, or @FILE "
                         "(default: none)")
    so.add_argument("--json-object", action="store_true",
                    help="hold the output to a JSON object (default: off)")
    so.add_argument("--regex", metavar="RE",
                    help="hold the output to this regular expression (default: none)")
    so.add_argument("--choice", action="append", metavar="TEXT",
                    help="hold the output to one of these strings, repeatable (default: none)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with the model in the terminal, offline")
    add_engine_args(c)
    cg = c.add_argument_group("chat")
    cg.add_argument("--system", metavar="TEXT",
                    help="a system message opening the conversation (default: none, the "
                         "template's own)")  # fmt: skip
    cg.add_argument("--url", metavar="URL",
                    help="chat through the OpenAI-compatible server there (e.g. "
                         "http://127.0.0.1:8000) instead of loading the model here (default: "
                         "none, offline)")  # fmt: skip
    cg.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"), metavar="KEY",
                    help="the server's key, with --url (default: $SWASERVE_API_KEY, else "
                         "none)")  # fmt: skip
    _add_sampling_args(cg, max_tokens=256)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it: the same as --model "
                        "(default: --model's)")  # fmt: skip
    add_server_args(add_engine_args(s), s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="OpenAI-compatible front door of prefill/decode pairs")
    add_router_args(r)
    r.set_defaults(func=cmd_router)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    m = bsub.add_parser("memory", help="KV capacity: window-aware pool vs every layer full")
    m.add_argument("--model", default=EngineConfig.model)
    m.add_argument("--context", type=int, default=8192)
    m.add_argument("--kv-cache-gb", type=float, default=2.0)
    m.add_argument("--page-size", type=int, default=16)
    m.set_defaults(func=cmd_bench_memory)
    o = bsub.add_parser("offline", help="batch-1 decode time and offline throughput")
    add_engine_args(o)
    ob = o.add_argument_group("benchmark")
    ob.add_argument("--num-prompts", type=int, default=1000,
                    help="random prompts in the throughput run (default: %(default)s)")
    ob.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024],
                    metavar=("MIN", "MAX"), help="prompt tokens, uniform (default: 100 1024)")
    ob.add_argument("--output-len-range", type=int, nargs=2, default=[100, 1024],
                    metavar=("MIN", "MAX"), help="output tokens, uniform (default: 100 1024)")
    ob.add_argument("--bench-seed", type=int, default=0,
                    help="seed of the random prompts (default: %(default)s)")
    o.set_defaults(func=cmd_bench_offline)
    bs = bsub.add_parser("serve", help="load an OpenAI-compatible server, report latencies")
    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)

    t = sub.add_parser("train-drafter",
                       help="train a DFlash drafter on text the target generates")
    from swaserve.speculative.train_drafter import add_args as add_train_args

    add_train_args(t)
    t.set_defaults(func=cmd_train_drafter)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # a flag or an input the command cannot take
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # a server that is not there (bench serve)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
