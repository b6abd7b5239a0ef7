"""PD disaggregation's KV transfer on one GPU (DESIGN §9.3): one request's prompt pages written
through NIXL from a prefill process's VRAM pool into a decode process's, for the Gemma-3-27B
shape (layer pattern, KV heads, head dim and window from the shipped config; no weights, only
the two pools, built by the engine's own layout code: memory/groups.py, memory/kv_pool.py).

For each prompt length (1k, 8k, 32k tokens) and each KV layout:

    window-aware  the engine's pool: full groups send the whole prompt, sliding groups the
                  last window only (pages_to_send.py)
    all-full      every layer full (--disable-hybrid-kv-cache): every layer's pages for the
                  whole prompt

and each page placement (`contiguous`: the request's pages in order, as in a fresh pool, few
large segments; `random`: scattered over the pool, as after churn, one segment per page and
plane): bytes per request, then the write's time (write_pages -> "done" on the sender; the
decode side's notification time beside it), median of --reps after a warm-up write whose
pages are checked on the decode side (each written page holds its source page's bytes, an
unwritten page is untouched). The ceiling: a plain device-to-device copy of the same number
of bytes in one process (torch copy_, CUDA events), GB/s counted as bytes moved once.

Two processes (NIXL's cuda_ipc needs them: nixl_backend.py), each pool made before its NIXL
agent. Prints progress to stderr and a table last; a JSON line per row to
$OUT/pd_transfer.jsonl (OUT defaults to ./bench_out). Exit code 1 if a check fails.

Usage (repo root; nixl-cu13 importable: scripts/nixl_for_device.sh):
    python3 benchmarks/pd_transfer.py [--prompts 1024 8192 32768] [--reps 5]
        [--placements contiguous random] [--kv-dtype bfloat16|float8_e4m3fn]
    python3 benchmarks/pd_transfer.py --device cpu --tiny     (DRAM, a tiny layout: seconds)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swaserve.bench.compare import log  # noqa: E402
from swaserve.memory.groups import GroupLayout, build_layout  # noqa: E402
from swaserve.memory.kv_pool import KVPool  # noqa: E402
from swaserve.memory.pool import NULL_PAGE  # noqa: E402

LAYOUTS = (("window-aware", False), ("all-full", True))
TINY = dict(windows=[24, 24, None] * 2, kv_heads=2, head_dim=16, prompts=[64, 200], reps=2)
CHECK_PAGES = 64  # pages compared at a time on the decode side (a page of all-full 27B: 8 MB)


def model_shape(name: str) -> tuple[list[int | None], int, int]:
    """(window per layer, KV heads, head dim) of a shipped model config."""
    from swaserve.models.blocks import head_dim_of, layer_windows
    from swaserve.weights.loader import SHIPPED_CONFIGS, load_hf_config

    hf = load_hf_config(SHIPPED_CONFIGS / name)
    return layer_windows(hf), int(hf.num_key_value_heads), head_dim_of(hf)


def page_order(num_pages: int, count: int, placement: str, seed: int) -> list[int]:
    """`count` distinct real pages of a pool of `num_pages` (page 0 is NULL)."""
    if placement == "contiguous":
        return list(range(1, count + 1))
    return random.Random(seed).sample(range(1, num_pages), count)


def request_pages(layout: GroupLayout, page_size: int, prompt: int, num_pages: int,
                  placement: str) -> list[tuple[int, int]]:
    """(prefill page, decode page) pairs one request of `prompt` tokens writes: page tables
    holding pages only where pages_to_send reads them, placed per `placement` on each side."""
    from swaserve.disaggregation.pages_to_send import entries_to_send, pages_to_send

    entries = [entries_to_send(g, page_size, prompt, 0) for g in layout.groups]
    count = sum(len(e) for e in entries)
    tables = []
    for seed in (1, 2):  # the two sides place their pages independently
        order = iter(page_order(num_pages, count, placement, seed))
        tables.append([[next(order) if i in e else NULL_PAGE for i in range(e.stop)]
                       for e in entries])
    return pages_to_send(layout, page_size, prompt, tables[0], tables[1])


def make_pool(spec: dict) -> KVPool:
    layout = build_layout(spec["windows"], all_full=spec["all_full"])
    return KVPool(layout, spec["num_pages"], spec["page_size"], spec["kv_heads"],
                  spec["head_dim"], getattr(torch, spec["dtype"]), torch.device(spec["device"]))


def page_bytes_view(pool: KVPool) -> torch.Tensor:
    """The pool as [pages, bytes of one page] (page-major: a page is one block)."""
    return pool.pages.view(torch.uint8).view(pool.num_pages, -1)


def page_marks(pages: torch.Tensor) -> torch.Tensor:
    """The byte every byte of source page p holds: 1..251, never 0 (an unwritten page)."""
    return (pages % 251 + 1).to(torch.uint8)


def check_pages(pool: KVPool, pairs: list[tuple[int, int]], written: set[int]) -> str | None:
    """None if each destination page of `pairs` (the last write) holds its source page's mark
    and the lowest page no write touched (`written`: every page written so far) is still
    zero; else what is wrong."""
    view, dev = page_bytes_view(pool), pool.pages.device
    for start in range(0, len(pairs), CHECK_PAGES):
        part = pairs[start : start + CHECK_PAGES]
        src = torch.tensor([s for s, _ in part], device=dev)
        dst = torch.tensor([d for _, d in part], device=dev)
        if not bool((view[dst] == page_marks(src)[:, None]).all()):
            return f"a page among {dst.tolist()[:8]}... does not hold its source's bytes"
    free = next((p for p in range(1, pool.num_pages) if p not in written), None)
    if free is not None and bool(view[free].any()):
        return f"page {free} was not written but changed"
    return None


def _receiver(conn) -> None:
    """The decode process: on `pool`, a fresh zeroed pool (before its NIXL agent) registered,
    its name and descriptor back; `check`: check_pages; `expect`: the time a notification
    arrives; `exit`. A traceback goes back instead of any answer that failed."""
    from swaserve.disaggregation.transfer import create_transfer_backend

    torch.set_num_threads(1)
    pool = backend = None
    written: set[int] = set()  # pages of this pool any write has reached
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "pool":
                if backend is not None:
                    backend.close()
                pool = backend = None
                if msg[1]["device"] == "cuda":
                    torch.cuda.empty_cache()
                pool, written = make_pool(msg[1]), set()
                backend = create_transfer_backend("nixl", f"decode-{uuid.uuid4().hex[:8]}")
                conn.send(("pool", backend.name, backend.register(pool.pages, pool.layout)))
            elif msg[0] == "expect":
                got: list = []
                deadline = time.monotonic() + msg[1]
                while not got and time.monotonic() < deadline:
                    got = backend.notifications()
                    time.sleep(0)
                conn.send(("landed", time.monotonic() if got else None))
            elif msg[0] == "check":
                written |= {d for _, d in msg[1]}
                conn.send(("checked", check_pages(pool, msg[1], written)))
            else:
                break
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if backend is not None:
            backend.close()


class Receiver:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(there,), daemon=True)
        self.proc.start()

    def ask(self, msg: tuple, timeout: float = 600.0) -> tuple:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the decode process did not answer {msg[0]!r} in {timeout} s")
        answer = self.conn.recv()
        if answer[0] == "error":
            raise RuntimeError("the decode process failed:\n" + answer[1])
        return answer[1:]

    def close(self) -> None:
        self.conn.send(("exit",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def copy_ceiling(src: torch.Tensor, nbytes: int, reps: int) -> list[float]:
    """Seconds per plain copy of `nbytes` of `src` (flat bytes) into a fresh buffer."""
    a = src[:nbytes]
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):  # the first warms up
        if a.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
    return times[1:]


def timed_write(sender: Any, receiver: Receiver, peer: str, pairs: list[tuple[int, int]],
                timeout_s: float) -> dict[str, float]:
    """One write: seconds until write_pages returned (descriptors built, transfer posted),
    until the sender saw "done", and until the decode side had the notification."""
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    receiver.conn.send(("expect", timeout_s))
    t0 = time.monotonic()
    h = sender.write_pages(peer, src, dst, b"bench", timeout_s)
    posted = time.monotonic()
    while (state := sender.poll(h)) == "pending":
        pass
    done = time.monotonic()
    error = sender.error(h)
    sender.release(h)
    if state != "done":
        raise RuntimeError(f"the write failed: {error}")
    assert receiver.conn.poll(timeout_s + 30), "no answer from the decode process"
    kind, landed = receiver.conn.recv()
    if kind == "error" or landed is None:
        raise RuntimeError(f"no notification on the decode side: {landed}")
    return {"post_s": posted - t0, "done_s": done - t0, "notice_s": landed - t0}


def run_rows(args: argparse.Namespace, shape: dict) -> list[dict[str, Any]]:
    from swaserve.disaggregation.pages_to_send import pages_to_send_count
    from swaserve.disaggregation.transfer import create_transfer_backend, segments

    receiver = Receiver()
    rows: list[dict[str, Any]] = []
    try:
        for name, all_full in LAYOUTS:
            layout = build_layout(shape["windows"], all_full=all_full)
            most = max(pages_to_send_count(layout, args.page_size, p) for p in args.prompts)
            spec = dict(windows=shape["windows"], all_full=all_full, num_pages=most + 1,
                        page_size=args.page_size, kv_heads=shape["kv_heads"],
                        head_dim=shape["head_dim"], dtype=args.kv_dtype, device=args.device)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            pool = make_pool(spec)
            view = page_bytes_view(pool)
            view.copy_(page_marks(torch.arange(pool.num_pages, device=pool.pages.device))
                       [:, None].expand(view.shape))
            page_bytes = view[0].numel()
            peer, descriptor = receiver.ask(("pool", spec))
            sender = create_transfer_backend("nixl", f"prefill-{uuid.uuid4().hex[:8]}",
                                             timeout_s=args.timeout)
            sender.register(pool.pages, layout)
            sender.connect(peer, descriptor)
            log(f"{name}: {[(g.kind, g.window, len(g.layers)) for g in layout.groups]}, "
                f"{pool.num_pages} pages of {page_bytes / 2**20:.2f} MiB")
            for prompt in args.prompts:
                for placement in args.placements:
                    pairs = request_pages(layout, args.page_size, prompt, pool.num_pages,
                                          placement)
                    nbytes = len(pairs) * page_bytes
                    first = timed_write(sender, receiver, peer, pairs, args.timeout)
                    (problem,) = receiver.ask(("check", pairs))
                    # bounded time: a slow transport (tcp) gets fewer repetitions
                    reps = max(1, min(args.reps, int(args.budget_s / max(first["done_s"], 1e-6))))
                    writes = [timed_write(sender, receiver, peer, pairs, args.timeout)
                              for _ in range(reps)]
                    copies = copy_ceiling(pool.pages.view(-1).view(torch.uint8), nbytes, reps)
                    med = {k: statistics.median(w[k] for w in writes) for k in writes[0]}
                    copy_s = statistics.median(copies)
                    row = {
                        "model": args.model, "device": args.device, "kv_dtype": args.kv_dtype,
                        "page_size": args.page_size, "layout": name, "prompt_tokens": prompt,
                        "placement": placement, "pages": len(pairs), "bytes": nbytes,
                        "descriptors": len(segments(sender.layout, sender.layout,
                                                    *map(list, zip(*pairs)))),
                        "reps": reps, "correct": problem is None, "problem": problem,
                        "post_ms": med["post_s"] * 1e3, "done_ms": med["done_s"] * 1e3,
                        "notice_ms": med["notice_s"] * 1e3,
                        "done_ms_all": [w["done_s"] * 1e3 for w in writes],
                        "nixl_gb_s": nbytes / med["done_s"] / 1e9,
                        "copy_ms": copy_s * 1e3, "copy_gb_s": nbytes / copy_s / 1e9,
                    }
                    rows.append(row)
                    log(f"{name} {prompt} {placement}: {len(pairs)} pages, "
                        f"{nbytes / 2**20:.1f} MiB, done {row['done_ms']:.2f} ms "
                        f"({row['nixl_gb_s']:.1f} GB/s), copy {row['copy_ms']:.2f} ms"
                        + ("" if problem is None else f"; CHECK FAILED: {problem}"))
            sender.close()
            del pool, view
    finally:
        receiver.close()
    aware = {(r["prompt_tokens"], r["placement"]): r["bytes"] for r in rows
             if r["layout"] == "window-aware"}
    for r in rows:
        r["bytes_vs_window_aware"] = r["bytes"] / aware[r["prompt_tokens"], r["placement"]]
    return rows


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        title, "",
        "| prompt | layout | placement | pages | MiB (x window-aware) | descriptors "
        "| NIXL write ms (GB/s) | posted ms | notice ms | d2d copy ms (GB/s) | NIXL / copy "
        "| check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['layout']} | {r['placement']} | {r['pages']} "
            f"| {r['bytes'] / 2**20:,.1f} ({r['bytes_vs_window_aware']:.2f}x) "
            f"| {r['descriptors']:,} | {r['done_ms']:.2f} ({r['nixl_gb_s']:.1f}) "
            f"| {r['post_ms']:.2f} | {r['notice_ms']:.2f} "
            f"| {r['copy_ms']:.2f} ({r['copy_gb_s']:.1f}) | {r['done_ms'] / r['copy_ms']:.1f}x "
            f"| {'ok' if r['correct'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny layout and prompts (CPU smoke)")
    ap.add_argument("--model", default="gemma-3-27b", help="a shipped config's name")
    ap.add_argument("--prompts", type=int, nargs="+", default=None,
                    help="prompt lengths in tokens (default 1024 8192 32768)")
    ap.add_argument("--placements", nargs="+", choices=["contiguous", "random"],
                    default=["contiguous", "random"])
    ap.add_argument("--reps", type=int, default=None, help="timed writes per row (default 5)")
    ap.add_argument("--budget-s", type=float, default=10.0,
                    help="fewer repetitions where the warm-up write says they take longer")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per write")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args(argv)
    if args.tiny:
        shape = {k: TINY[k] for k in ("windows", "kv_heads", "head_dim")}
        args.model = "tiny"
    else:
        windows, kv_heads, head_dim = model_shape(args.model)
        shape = dict(windows=windows, kv_heads=kv_heads, head_dim=head_dim)
    args.prompts = args.prompts or (TINY["prompts"] if args.tiny else [1024, 8192, 32768])
    args.reps = args.reps or (TINY["reps"] if args.tiny else 5)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    log(f"torch {torch.__version__}, {dev}, {args.model}: KV heads {shape['kv_heads']}, "
        f"head dim {shape['head_dim']}, {args.kv_dtype}, pages of {args.page_size}")
    rows = run_rows(args, shape)
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / "pd_transfer.jsonl"
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "gpu": dev, "torch": torch.__version__}) + "\n")
    log(f"wrote {path}")
    print(table(rows, f"{args.model} KV ({args.kv_dtype}, pages of {args.page_size} tokens) "
                f"through NIXL between two processes on {dev}; median of {args.reps} writes "
                "(write_pages -> done on the sender); ceiling: one device copy of the bytes"))
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
