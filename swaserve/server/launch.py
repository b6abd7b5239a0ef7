"""`swaserve serve`: the EngineCore process + the HTTP frontend (uvicorn) in this process.

Startup: bind the HTTP port (a busy port fails at once, before any model loads), resolve the
model folder (GGUF conversion happens here, once), bind the IPC sockets, start the core
(`python -m swaserve.server.core_process`), wait for its `ready`, then listen on the bound
socket (uvicorn) and only then log "serving on ...".

Data parallelism (`--data-parallel-size D` > 1): D core processes, replica i on cuda:i*T (with
`-tp T` its core is rank 0 of its own T-rank group and spawns the other T - 1 on the next GPUs;
on CPU all T x D processes share the cores), each with its own IPC sockets and CoreClient,
behind one `DPClient` (routing: prefix affinity, then load) and one HTTP server; /metrics
labels every series with `dp_rank`. One replica's core dying (or its tensor-parallel worker:
the core then fails) is the server's end, as with one core: every live request (on any
replica) ends with an error naming the rank, and the server exits.
With `--enable-expert-parallel` (MoE models) the D cores also form one torch.distributed group
whose rendezvous store this process hosts; they step in lockstep (server/core_loop_ep.py), with
`-tp T` each with its T - 1 workers, which join the experts' groups through the same store
(distributed/ep_tp.py). With
`--nnodes N` (plain replicas or expert-parallel ranks) only the first D/N cores run here; the
others' pipes are TCP sockets bound here and handed to their nodes through the store this
process hosts (server/nodes.py); such a core whose link is lost is dead (server/link_watch.py).
Until the cores are ready this process also watches each other node's control pipe (NodeWatch),
so a node that dies, or fails to start, before its cores connect ends the start within seconds
with an error naming the node, its ranks and the reason, not at the start-up timeout
(--startup-timeout, which a node that never joins is left to; meanwhile the log names it every
WAITING_LOG_S).

Watchdog: when the core process exits or reports a fatal error (or, on another node, its link is
lost), every live request ends with an error, new requests get 503, the reason is logged, and
the server exits with status 1 within a few seconds: the surviving cores get GONE_STOP_S to
shut down, and the process ends without the interpreter's teardown (`_exit_now`); a hard
`os._exit(1)` backs that up at EXIT_DEADLINE_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.engine.gc_heap import freeze_startup_heap
from swaserve.sampling.generation_defaults import describe, generation_defaults, sampling_fields

log = logging.getLogger("swaserve.server")
WATCHDOG_PERIOD_S = 0.2
GRACE_S = 1.0  # new requests get 503 this long before the server stops listening
EXIT_DEADLINE_S = 8.0  # after the core is found dead, the process is gone by then
STOP_S = 5.0  # a ready core told to shut down exits by then, or is terminated
GONE_STOP_S = 2.0  # the same once a core died: nothing the survivors hold is worth waiting for
LAST_WORDS_S = 0.2  # a core found gone: its last words may still be on the way
READY_TIMEOUT_S = 900.0  # --startup-timeout's default: loading a large model takes minutes
WAITING_LOG_S = 30.0  # while cores or nodes are still to come, say which this often


@dataclasses.dataclass
class _Cores:
    """What `serve`'s clean-up learns from `_main`: this node's core processes, whether they all
    became ready, and whether one of them died while serving (the watchdog's verdict)."""

    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    ready: bool = False
    gone: bool = False


@dataclasses.dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_n: int = 16
    log_level: str = "info"
    served_model_name: str | None = None  # None: the --model value
    playground: bool = True  # the page at / (--disable-playground turns it off)
    stream_interval: int = 1  # streamed deltas of at least this many tokens (OutputProcessor)
    startup_timeout: float = READY_TIMEOUT_S  # seconds until every engine core is ready
    tool_call_parser: str = "auto"  # tool_choice "auto" (server/tools.py); auto: the template's
    enable_auto_tool_choice: bool = False  # vLLM's flag: no parser is then an error at start
    reasoning_parser: str | None = None  # server/reasoning.py; None: _reasoning_parser's
    log_stats_interval: float = 10.0  # seconds between stats lines (server/stats_log.py); 0: off
    # CORS (vLLM's flags and defaults): origins, methods and headers browsers may use
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def _tool_parser(args: ServerArgs, tokenizer: Any, chat_template: str | None) -> str | None:
    """The parser of tool_choice "auto" (server/tools.py), checked before anything loads."""
    from swaserve.server.tool_parsers import PARSERS
    from swaserve.server.tools import resolve_parser

    template = chat_template or getattr(tokenizer, "chat_template", None)
    parser = resolve_parser(args.tool_call_parser, template)
    if parser is None and args.enable_auto_tool_choice:
        raise ValueError(
            "--enable-auto-tool-choice: this model's chat template implies no tool-call format; "
            f"name one with --tool-call-parser ({', '.join(PARSERS)})"
        )
    if parser is not None:
        log.info("tool_choice 'auto' reads tool calls with the %s parser", parser)
    return parser


def _reasoning_parser(args: ServerArgs, tokenizer: Any, chat_template: str | None) -> str | None:
    """--reasoning-parser, checked; without it openai_gptoss for a harmony chat template
    (gpt-oss's: vLLM reads that format with no flag), else None (answers whole)."""
    from swaserve.server.harmony import is_harmony_template
    from swaserve.server.reasoning import get_reasoning_parser

    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)  # a ValueError naming the choices
        return args.reasoning_parser
    if is_harmony_template(chat_template or getattr(tokenizer, "chat_template", None)):
        log.info("the chat template is harmony's (gpt-oss): answers are read with the "
                 "openai_gptoss reasoning parser")  # fmt: skip
        return "openai_gptoss"
    return None


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template text itself (when it holds Jinja markup)."""
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file")


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of data-parallel replica `rank`: one replica of T tensor-parallel ranks, on
    CUDA from cuda:(local rank x T) (its T ranks: the next T GPUs of its node; local: its index
    among its node's D/N), with a rendezvous of its own (on one machine with --dist-init-addr
    HOST:PORT: HOST:PORT+rank; else a free local port), so that no two replicas' groups meet.
    Over nodes, and with expert parallelism (whose store is at HOST:PORT), the replica's core
    and its T - 1 workers are on one node and meet on a free local port; a rank's place in the
    expert-parallel group travels beside the config (the core's spec)."""
    dp = config.data_parallel_size
    if dp == 1:
        return config
    local = rank % (dp // config.nnodes)
    device, tp = config.device, config.tensor_parallel_size
    if config.torch_device().type == "cuda":
        device = f"cuda:{local * tp}"
    addr = config.dist_init_addr
    if addr is not None and tp > 1 and config.nnodes == 1 and not config.enable_expert_parallel:
        host, _, port = addr.rpartition(":")
        addr = f"{host}:{int(port) + rank}"
    else:
        addr = None  # one process per replica, or one node's: nothing to meet elsewhere
    return dataclasses.replace(
        config, data_parallel_size=1, enable_expert_parallel=False, device=device,
        nnodes=1, node_rank=0, dist_init_addr=addr,
    )  # fmt: skip


def start_core(
    config: EngineConfig,
    folder: Path,
    in_addr: str,
    out_addr: str,
    log_level: str,
    cpu_share: int = 1,
    expert_parallel: dict | None = None,
) -> subprocess.Popen:
    """`cpu_share`: processes sharing this machine's cores (on CPU each gets cores / that);
    `expert_parallel`: the core's place in the group ({"rank", "size", "host", "port"})."""
    spec = {
        "config": dataclasses.asdict(config),
        "folder": str(folder),
        "in_addr": in_addr,
        "out_addr": out_addr,
        "log_level": log_level,
        "cpu_share": cpu_share,
        "expert_parallel": expert_parallel,
    }
    cmd = [sys.executable, "-m", "swaserve.server.core_process", "--spec", json.dumps(spec)]
    return subprocess.Popen(cmd)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not listening yet (connections are refused until
    uvicorn listens on it). Raises ValueError naming the address when it cannot bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is ok
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot bind {host}:{port} (--host/--port): {e.strerror or e}"
        ) from None
    return sock


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup below


def serve(config: EngineConfig, args: ServerArgs) -> int:
    """Runs the server until it is stopped (0) or the core dies (1)."""
    signal.signal(signal.SIGTERM, _exit_on_signal)  # while loading; uvicorn's while serving
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sock = bind_socket(args.host, args.port)  # first: a busy port fails before any loading
    try:
        from swaserve.engine.engine import load_tokenizer, resolve_folder

        folder = resolve_folder(config.model)
        if config.enable_expert_parallel:  # a dense model, or experts that do not split
            from swaserve.distributed.expert_shards import check_expert_parallel
            from swaserve.weights.loader import load_hf_config

            check_expert_parallel(
                load_hf_config(folder), config.data_parallel_size, config.tensor_parallel_size
            )
        tokenizer = load_tokenizer(folder, config.tokenizer)
        defaults = generation_defaults(folder, config.generation_config,
                                       config.override_generation_config)  # fmt: skip
        if defaults:  # as vLLM says it: a request's defaults are not the API's
            log.info("sampling defaults from the model's generation config (requests that leave "
                     "them out): %s", describe(defaults))  # fmt: skip
        chat_template = read_chat_template(config.chat_template)
        tool_parser = _tool_parser(args, tokenizer, chat_template)
        args = dataclasses.replace(
            args, reasoning_parser=_reasoning_parser(args, tokenizer, chat_template))
        tmp = tempfile.mkdtemp(prefix="swaserve-ipc-")
        cores = _Cores()
        try:
            code = asyncio.run(
                _main(config, args, sock, folder, tokenizer, chat_template, tmp, cores,
                      tool_parser, sampling_fields(defaults))  # fmt: skip
            )
        finally:
            wait = (GONE_STOP_S if cores.gone else STOP_S) if cores.ready else 0.01
            for proc in cores.procs:
                _stop(proc, wait)
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        sock.close()
    if cores.gone:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Ends a server whose core died, skipping the interpreter's teardown: after torch it takes
    ~1 s on an idle machine and 5 s or more on a loaded one, and the EXIT_DEADLINE_S timer, a
    daemon thread, cannot run during it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop(proc: subprocess.Popen, wait: float) -> None:
    """A ready core got `shutdown` from CoreClient.close and has `wait` seconds to exit (a core
    still loading gets next to none); then it is terminated."""
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _main(
    config: EngineConfig,
    args: ServerArgs,
    sock: socket.socket,
    folder: Path,
    tokenizer: Any,
    chat_template: str | None,
    tmp: str,
    cores: _Cores,
    tool_parser: str | None = None,
    sampling_defaults: dict | None = None,
) -> int:
    import uvicorn

    from swaserve.server.app import CORS, ServerState, build_app
    from swaserve.server.dp_client import DPClient
    from swaserve.server.ipc import CoreClient
    from swaserve.server.metrics import Metrics
    from swaserve.server.metrics_dp import RankedMetrics
    from swaserve.server.nodes import (
        expert_parallel_spec,
        local_ranks,
        publish_pipes,
        remote_pipes,
        watch_nodes,
    )
    from swaserve.server.stats_log import log_stats

    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    metrics: Any = Metrics() if dp == 1 else RankedMetrics(dp)
    per_rank = [metrics] if dp == 1 else metrics.ranks
    here = local_ranks(config)  # ranks 0..: their cores run here, the others on other nodes
    addrs = [
        (f"ipc://{tmp}/in{suffix}", f"ipc://{tmp}/out{suffix}")
        for suffix in ([""] if dp == 1 else [str(i) for i in here])
    ] + [remote_pipes(config) for _ in range(here.stop, dp)]
    clients = [
        CoreClient(tokenizer, a_in, a_out, config.max_queue, m, args.stream_interval)
        for (a_in, a_out), m in zip(addrs, per_rank)
    ]
    client: Any = clients[0] if dp == 1 else DPClient(clients)
    client.start()
    store = _rank_store(config)  # hosted here while the cores live
    for rank in range(here.stop, dp):
        publish_pipes(store, rank, clients[rank].endpoints())
    nodes = watch_nodes(config, store)  # the other nodes' control pipes, asked until ready
    try:
        for rank in here:
            rconf = replica_config(config, rank)
            ep = None if store is None else expert_parallel_spec(config, rank, store.host,
                                                                 store.port)  # fmt: skip
            a_in, a_out = addrs[rank]
            # on CPU every rank process of this node shares its cores
            proc = start_core(rconf, folder, a_in, a_out, args.log_level,
                              cpu_share=len(here) * tp, expert_parallel=ep)
            cores.procs.append(proc)
            where = "" if dp == 1 else f" (dp rank {rank}, {rconf.device}" + (
                f", {tp} tensor-parallel ranks)" if tp > 1 else ")")
            log.info("engine core process %d is loading %s%s", proc.pid, config.model, where)
        if not await _wait_ready(cores.procs, clients, nodes, args.startup_timeout):
            return 1
        cores.ready = True
        info = client.info or {}
        state = ServerState(
            client=client,
            tokenizer=tokenizer,
            model_name=args.served_model_name or config.model,
            model_path=config.model,
            chat_template=chat_template,
            max_model_len=int(info["max_model_len"]),
            context_by_kv_pool=bool(info.get("context_by_kv_pool", False)),
            vocab_size=int(info["vocab_size"]),
            max_n=args.max_n,
            max_logprobs=config.max_logprobs,
            api_key=args.api_key,
            metrics=metrics,
            created=int(time.time()),
            playground=args.playground,
            disaggregation=info.get("disaggregation"),
            tool_parser=tool_parser,
            reasoning_parser=args.reasoning_parser,
            sampling_defaults=sampling_defaults or {},
            scheduling_policy=config.scheduling_policy,
            cors=CORS(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                      args.allow_credentials),
        )
        server = _server_class()(
            uvicorn.Config(
                build_app(state),
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                timeout_graceful_shutdown=2,
            )
        )

        def on_started() -> None:
            log.info(
                "serving %s on http://%s:%d (engine core pid %s)%s",
                state.model_name,
                args.host,
                args.port,
                ", ".join(str(p.pid) for p in cores.procs),
                f"; playground: http://{args.host}:{args.port}/" if args.playground else "",
            )
            freeze_startup_heap("frontend")  # streams allocate per token from now on

        server.on_started = on_started
        loop = asyncio.get_running_loop()
        watchdog = loop.create_task(_watchdog(cores, clients, client, server))
        stats = (loop.create_task(log_stats(metrics.registry, args.log_stats_interval))
                 if args.log_stats_interval > 0 else None)  # fmt: skip
        try:
            await server.serve(sockets=[sock])
        except OSError as e:  # listen() failed: another process bound the port and listens
            log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
            return 1
        finally:
            watchdog.cancel()
            if stats is not None:
                stats.cancel()
        return 1 if client.dead is not None else 0
    finally:
        client.close()
        for node in nodes:
            node.close()


def _rank_store(config: EngineConfig) -> Any:
    """The rendezvous store of the D core processes, hosted by the frontend (--dist-init-addr,
    else a free local port), with --enable-expert-parallel (their group) or --nnodes (the other
    nodes read their cores' pipes there); None otherwise."""
    from swaserve.server.nodes import spans_nodes

    if not (config.enable_expert_parallel or spans_nodes(config)):
        return None
    from swaserve.distributed.launch import rendezvous_address
    from swaserve.distributed.parallel_state import open_store

    host, port = rendezvous_address(config)
    return open_store(host, port, config.data_parallel_size, is_master=True)


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM once it has shut down, which would kill this process
        before it stops the core and removes the IPC folder; here the signals only stop it.
        `on_started` runs once it listens (uvicorn logs no address for a given socket)."""

        on_started: Callable[[], None] | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and self.on_started is not None:
                self.on_started()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


async def _wait_ready(
    procs: list[subprocess.Popen],
    clients: list[Any],
    nodes: Sequence[Any] = (),
    timeout: float = READY_TIMEOUT_S,
    every: float = WAITING_LOG_S,
) -> bool:
    """Until every core said `ready`; False (logged) when one failed first, when another node
    failed to bring its cores up (`nodes`: node 0's NodeWatch of each, server/nodes.py), or after
    `timeout` seconds. Every `every` seconds it logs what it still waits for: a node that never
    joins (not started, or unable to reach HOST:PORT) looks like one not started yet, so the log
    is how a user tells. `procs[i]` runs `clients[i]`'s core; cores past them run on other nodes
    (their failures arrive as last words, as a lost link once they connected, or from their
    node before that)."""
    start = time.monotonic()
    next_log = start + every
    while True:
        failure = await _startup_failure(procs, clients, nodes)
        if failure is not None:
            log.error("%s", failure)
            return False
        if all(c.ready.is_set() for c in clients):
            return True
        now = time.monotonic()
        if now > start + timeout or now >= next_log:
            waiting = [str(i) for i, c in enumerate(clients) if not c.ready.is_set()]
            absent = [n.name for n in nodes if not n.joined]
            what = ((f" (dp ranks {', '.join(waiting)})" if len(clients) > 1 else "")
                    + (f"; never joined: {', '.join(absent)}" if absent else ""))  # fmt: skip
            if now > start + timeout:
                log.error("engine core not ready after %.0f s (--startup-timeout)%s", timeout,
                          what)  # fmt: skip
                return False
            log.info("waiting for the engine core%s: %.0f s of %.0f s", what, now - start,
                     timeout)  # fmt: skip
            next_log = now + every
        await asyncio.sleep(0.1)


def _startup_failure_now(
    procs: list[subprocess.Popen], clients: list[Any], nodes: Sequence[Any]
) -> str | None:
    """What stops the start, if anything: a core gone (`_first_gone`: its own words are the
    best), else a node that failed before its cores could say anything."""
    gone = _first_gone(procs, clients)
    if gone is not None:
        rank, why = gone
        where = ""
        if len(clients) > 1:
            where = f" (dp rank {rank}" + (
                f", node {rank // len(procs)})" if rank >= len(procs) else ")")
        return f"engine core failed to start{where}: {why}"
    for node in nodes:
        why = node.failure()
        if why is not None:
            cores = "engine cores" if node.num_ranks > 1 else "engine core"
            return f"{node.name}: its {cores} did not come up: {why}"
    return None


async def _startup_failure(
    procs: list[subprocess.Popen], clients: list[Any], nodes: Sequence[Any]
) -> str | None:
    """`_startup_failure_now`, asked again LAST_WORDS_S after a first answer: a core's last
    words may follow its exit, its lost link or its node's report."""
    if _startup_failure_now(procs, clients, nodes) is None:
        return None
    await asyncio.sleep(LAST_WORDS_S)
    return _startup_failure_now(procs, clients, nodes)


def _first_gone(procs: list[subprocess.Popen], clients: list[Any]) -> tuple[int, str] | None:
    """(rank, why) of the first core gone: it reported a fatal error (last words), its process
    exited, or, on another node, its link was lost; one gone without last words (killed) first:
    under expert parallelism the others' errors follow from it. Of those with last words, one
    that blames a peer rank also gone comes after that peer's own (it knows how its worker
    ended). `procs` are this node's (the first ranks); the cores past them run on other nodes,
    len(procs) on each."""
    gone = {}
    for rank, c in enumerate(clients):
        code = procs[rank].poll() if rank < len(procs) else None
        if c.dead is not None:
            gone[rank] = (True, c.dead)
        elif code is not None:
            gone[rank] = (False, f"engine core process {procs[rank].pid} {_exit_reason(code)}")
        elif rank >= len(procs) and c.link_lost():
            node = rank // len(procs)
            gone[rank] = (False, f"lost the link to its engine core on node {node}: its "
                          "process or its machine is gone, or stopped answering")  # fmt: skip
    if not gone:
        return None

    def order(rank: int) -> tuple[bool, bool, int]:
        blames = clients[rank].blames if gone[rank][0] else None
        return gone[rank][0], blames != rank and blames in gone, rank

    rank = min(gone, key=order)
    return rank, gone[rank][1]


async def _gone_settled(
    procs: list[subprocess.Popen], clients: list[Any]
) -> tuple[int, str] | None:
    """`_first_gone`, asked again LAST_WORDS_S after a first answer: a core's last words may
    follow its exit or its lost link, and another rank's death may be the cause."""
    if _first_gone(procs, clients) is None:
        return None
    await asyncio.sleep(LAST_WORDS_S)
    return _first_gone(procs, clients)


async def _watchdog(cores: _Cores, clients: list[Any], client: Any, server: Any) -> None:
    """`clients[i]` talks to `cores.procs[i]`; `client` is what the app uses (one of them, or
    the DPClient over all): failing it ends every live request."""
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        gone = await _gone_settled(cores.procs, clients)
        if gone is None:
            continue
        cores.gone = True
        rank, reason = gone
        if len(clients) > 1:
            reason = f"dp rank {rank}: {reason}"
        client.fail_all(reason)
        if clients[rank].metrics is not None:
            clients[rank].metrics.core_alive.set(0)
        log.error("engine core is gone (%s): answering 503, exiting in %.0f s", reason, GRACE_S)
        timer = threading.Timer(EXIT_DEADLINE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()
        await asyncio.sleep(GRACE_S)
        server.should_exit = True
        return
