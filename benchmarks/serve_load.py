"""Load and abuse benchmark for `refusion serve`, on loopback only, bounded in time.

    python benchmarks/serve_load.py                       # the bundled model, ~5 minutes on 2 cores
    python benchmarks/serve_load.py --model DIR --server-threads 4 --max-tokens 128

1. Starts `refusion serve` in a subprocess on 127.0.0.1 (a free port).
2. Load: 1, 4, 16 and 64 concurrent clients, each sending streaming chat requests one after the
   other (prompts: the test splits of the model's task families). Per level: aggregate tokens/s (completion
   tokens of all requests / wall time of the level), time to first token (request sent -> first
   chunk carrying a committed token) and latency (-> `data: [DONE]`), p50 and p99; every answer is
   checked against decode() run in this process on the same prompt alone.
3. Abuse: --bad malformed or hostile requests of 25 kinds (each limit the server enforces, invalid
   UTF-8, a 10 MB body, a chunked body over the limit, a stalled body, a nesting bomb, raw garbage,
   a connection dropped mid-stream, a client reading its stream one byte at a time, ...) shuffled
   with --good ordinary requests and sent concurrently. Every bad one must get a 4xx (the dropped
   connection gets nothing, by construction; the slow reader must get its correct answer), every
   good one its correct answer, the server must not crash or log an unhandled error, and its
   resident memory must come back to the idle level measured after the load phase.
4. A screenshot of the web page (headless Chromium, if installed) to benchmarks/results/serve_page.png.

Writes JSON (--out) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx

from refusion.model.checkpoint import load_model
from refusion.bundled import BUNDLED
from refusion.decoding import decode
from refusion.training.data import trained_tasks
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


# ---- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "refusion.cli", "serve", "--port", str(port), "--threads", str(args.server_threads),
           "--body-timeout", str(args.body_timeout), "--max-queue", "512", "--log-level", "warning",
           "--device", args.device, "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    raise SystemExit(f"the server did not start; see {log}")


async def wait_idle(base: str, timeout: float = 30.0) -> None:
    async with httpx.AsyncClient() as c:
        t0 = time.time()
        while time.time() - t0 < timeout:
            h = (await c.get(base + "/health")).json()
            if h["running"] == 0 and h["waiting"] == 0:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the server is not idle after {timeout} s: {h}")


# ---- good requests ----------------------------------------------------------------------------------


async def stream_chat(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, tokens = None, "", 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "ok": False}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("refusion", {}).get("commits"):
                ttft = time.perf_counter() - t0
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"status": 200, "ttft": ttft, "latency": time.perf_counter() - t0, "text": text, "tokens": tokens}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def load_level(base: str, model: str, prompts: list[str], refs: dict, conc: int, per_client: int,
                     max_tokens: int) -> dict:
    results = []
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one_client(k: int) -> None:
            for j in range(per_client):
                p = prompts[(k * per_client + j) % len(prompts)]
                res = await stream_chat(client, base, model, p, max_tokens)
                res["correct"] = res.get("text") == refs[p]
                results.append(res)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(k) for k in range(conc)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    toks = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    lat = [r["latency"] for r in ok]
    return {"clients": conc, "requests": len(results), "ok": len(ok), "correct": sum(r["correct"] for r in results),
            "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall, "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99)}


# ---- hostile requests ---------------------------------------------------------------------------------


def http(path: str, body: bytes, method: str = "POST", extra: str = "", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode() + body


def chat(prompt: str, **kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, **kw}).encode()


async def raw_status(port: int, parts: list[bytes], pause: float = 0.0, timeout: float = 60.0) -> int | None:
    """Send raw bytes (in parts, pausing between them); return the response's status code."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i and pause:
                await asyncio.sleep(pause)
            for k in range(0, len(part), 1 << 20):
                writer.write(part[k: k + (1 << 20)])
                await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        m = re.match(rb"HTTP/1\.[01] (\d{3})", line)
        return int(m.group(1)) if m else None
    except (ConnectionError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def dechunk(data: bytes) -> bytes:
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out, i = b"", 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            return out
        out += body[j + 2: j + 2 + n]
        i = j + 2 + n + 2


def slow_reader(port: int, model: str, prompt: str, max_tokens: int, byte_pause: float) -> tuple[int | None, str]:
    """A streaming request whose client reads the response one byte at a time, with a tiny receive
    buffer, so the server really has to wait for it (blocking socket, run in a thread)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.settimeout(120)
    s.connect(("127.0.0.1", port))
    s.sendall(http("/v1/chat/completions", body))
    data = bytearray()
    while True:
        b = s.recv(1)
        if not b:
            break
        data += b
        time.sleep(byte_pause)
    s.close()
    m = re.match(rb"HTTP/1\.[01] (\d{3})", bytes(data))
    text = ""
    for line in dechunk(bytes(data)).decode().split("\n"):
        if line.startswith("data: {"):
            ch = json.loads(line[6:])
            if ch.get("choices"):
                text += ch["choices"][0]["delta"].get("content") or ""
    return (int(m.group(1)) if m else None), text


async def dropped_mid_stream(port: int, model: str, prompt: str) -> int | None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 400,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http("/v1/chat/completions", body))
    await writer.drain()
    status = None
    try:
        line = await asyncio.wait_for(reader.readline(), 60)
        m = re.match(rb"HTTP/1\.[01] (\d{3})", line)
        status = int(m.group(1)) if m else None
        while b"data: " not in await asyncio.wait_for(reader.readline(), 60):
            pass
    finally:  # hang up hard (RST) in the middle of the stream
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()
    return status


def hostile_kinds(model: str, max_tokens_cap: int) -> dict[str, list[bytes]]:
    """kind -> raw request parts. Each must be answered with a 4xx."""
    path = "/v1/chat/completions"
    ok = {"model": model}
    nest = b"[" * 200_000 + b"]" * 200_000
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'
    chunked_head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunk = b"%x\r\n" % (256 << 10) + b"b" * (256 << 10) + b"\r\n"
    return {
        "malformed_json": [http(path, b'{"messages": [{"role": "user", "content": "hi"}')],
        "invalid_utf8": [http(path, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}')],
        "body_10mb": [http(path, big)],
        "chunked_over_limit": [chunked_head + chunk * 8 + b"0\r\n\r\n"],
        "stalled_body": [http(path, b'{"messages": [', length=400)],  # the rest never comes: 408
        "nesting_bomb": [http(path, nest)],
        "not_an_object": [http(path, b'["messages"]')],
        "missing_messages": [http(path, json.dumps(ok).encode())],
        "wrong_type": [http(path, chat("hi", **ok, max_tokens="16"))],
        "nan_temperature": [http(path, chat("hi", **ok).replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"'))],
        "lone_surrogate": [http(path, b'{"messages": [{"role": "user", "content": "\\ud800"}]}')],
        "unknown_model": [http(path, chat("hi", model="gpt-4o"))],
        "empty_prompt": [http("/v1/completions", json.dumps({**ok, "prompt": ""}).encode())],
        "token_ids_out_of_range": [http("/v1/completions", json.dumps({**ok, "prompt": [10**9]}).encode())],
        "prompt_too_long": [http(path, chat("many words " * 2000, **ok))],
        "max_tokens_over_cap": [http(path, chat("hi", **ok, max_tokens=max_tokens_cap + 1))],
        "huge_integer": [http(path, chat("hi", **ok).replace(b'"max_tokens": 16', b'"max_tokens": ' + b"9" * 400))],
        "n_over_128": [http(path, chat("hi", **ok, n=129))],
        "too_many_stops": [http(path, chat("hi", **ok, stop=["a", "b", "c", "d", "e"]))],
        "unknown_decoder": [http(path, chat("hi", **ok, decoder="beam-search"))],
        "bad_decoder_params": [http(path, chat("hi", **ok, decoder="refusion", slot_size=0))],
        "bad_message": [http(path, json.dumps({**ok, "messages": [{"role": "wizard", "content": 5}]}).encode())],
        "bad_content_length": [http(path, b"{}").replace(b"Content-Length: 2", b"Content-Length: abc")],
        "wrong_method": [b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"],
        "garbage_request_line": [b"\x16\x03\x01 garbage \x00\r\n\r\n"],
    }


async def abuse(port: int, model: str, prompts: list[str], refs: dict, n_bad: int, n_good: int, max_tokens: int,
                max_tokens_cap: int, slow_pause: float, seed: int = 0) -> dict:
    base = f"http://127.0.0.1:{port}"
    kinds = hostile_kinds(model, max_tokens_cap)
    special = ["dropped_mid_stream", "slow_reader"]
    names = list(kinds) + special
    rng = random.Random(seed)
    plan = [("bad", names[i % len(names)]) for i in range(n_bad)] + [("good", None)] * n_good
    rng.shuffle(plan)
    outcomes: dict[str, list] = {k: [] for k in names}
    good: list[bool] = []
    sem = asyncio.Semaphore(32)
    threads = concurrent.futures.ThreadPoolExecutor(64)
    loop = asyncio.get_running_loop()

    async with httpx.AsyncClient(timeout=300) as client:
        async def run(i: int, kind: str, name: str | None) -> None:
            async with sem:
                p = prompts[i % len(prompts)]
                if kind == "good":
                    if i % 2:
                        r = await stream_chat(client, base, model, p, max_tokens)
                        good.append(r.get("text") == refs[p])
                    else:
                        r = await client.post(base + "/v1/chat/completions", json={
                            "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens})
                        good.append(r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == refs[p])
                elif name == "dropped_mid_stream":
                    outcomes[name].append(await dropped_mid_stream(port, model, p))
                elif name == "slow_reader":
                    status, text = await loop.run_in_executor(threads, slow_reader, port, model, p, max_tokens,
                                                              slow_pause)
                    outcomes[name].append((status, text == refs[p]))
                else:
                    outcomes[name].append(await raw_status(port, kinds[name]))

        t0 = time.perf_counter()
        await asyncio.gather(*(run(i, k, n) for i, (k, n) in enumerate(plan)))
        wall = time.perf_counter() - t0
    threads.shutdown()
    per_kind = {}
    for name, outs in outcomes.items():
        if name == "slow_reader":
            passed = all(s == 200 and ok for s, ok in outs)
            statuses = [s for s, _ in outs]
        elif name == "dropped_mid_stream":
            passed = all(s == 200 for s in outs)  # it got its stream, then hung up
            statuses = outs
        else:
            passed = all(s is not None and 400 <= s < 500 for s in outs)
            statuses = outs
        per_kind[name] = {"n": len(outs), "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)},
                          "passed": passed}
    return {"bad": n_bad, "good": n_good, "seconds": wall, "good_correct": sum(good), "kinds": per_kind,
            "all_bad_refused": all(v["passed"] for k, v in per_kind.items() if k not in special),
            "special_passed": all(per_kind[k]["passed"] for k in special)}


# ---- the web page ---------------------------------------------------------------------------------


def screenshot(base: str, prompt: str, out: Path) -> str | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "playwright is not installed"
    if chromium is None:
        return "no chromium installed"
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1000, "height": 720})
        page.goto(base + "/")
        page.wait_for_selector("body[data-state=ready]")
        page.fill("#prompt", prompt)
        page.select_option("#decoder", "refusion")
        page.fill("#max_tokens", "64")
        page.click("#run")
        page.wait_for_selector("body[data-state=done]", timeout=60_000)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    return None


# ---- main -------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled model)")
    ap.add_argument("--clients", default="1,4,16,64", help="concurrency levels")
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level (at least one per client)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bad", type=int, default=1000)
    ap.add_argument("--good", type=int, default=200)
    ap.add_argument("--slow-pause", type=float, default=0.0005, help="seconds between the slow reader's bytes")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--body-timeout", type=float, default=2.0, help="the server's --body-timeout (stalled bodies)")
    ap.add_argument("--tasks", help="prompt families (default: those the model's recipe.toml trains on, "
                                    "else the synthetic ones)")
    ap.add_argument("--prompts", help="a JSON list of prompts (default: the test splits of --tasks)")
    ap.add_argument("--device", default="cpu", help="the server's and the reference answers' device")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_load.json"))
    ap.add_argument("--screenshot", default=str(ROOT / "benchmarks/results/serve_page.png"))
    args = ap.parse_args()

    model_dir = Path(args.model) if args.model else BUNDLED
    name = model_dir.name
    model, tok = load_model(model_dir, dtype=args.dtype, device=args.device), Tokenizer.from_dir(model_dir)
    recipe = model_dir / "recipe.toml"
    names = (args.tasks.split(",") if args.tasks
             else trained_tasks(tomllib.loads(recipe.read_text())["data"]) if recipe.is_file() else None)
    names = names or trained_tasks("synthetic")
    texts = ([ex.prompt for t in names for ex in get_task(t).load("test", n=16, seed=2)] if not args.prompts
             else json.loads(Path(args.prompts).read_text()))
    # the correct answers: decode() in this process, the server's default decoder and settings
    ids = [tok.chat_prompt_ids(t) for t in texts]
    eos = sorted(set(model.config.eos_ids) | {tok.eos_id})
    refs = {t: tok.decode(r.tokens) for t, r in zip(texts, decode(model, ids, "speculative", eos_ids=eos,
                                                                      gen_length=args.max_tokens))}
    del model

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(args.out).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    proc = start_server(args, port, log)
    out: dict = {"model": name, "server_threads": args.server_threads, "max_tokens": args.max_tokens,
                 "device": args.device, "dtype": args.dtype,
                 "cpus": os.cpu_count(), "decoder": "speculative (the default)"}
    try:
        out["rss_start_mb"] = rss_mb(proc.pid)
        levels = []
        for conc in [int(c) for c in args.clients.split(",")]:
            per_client = max(1, args.requests // conc)
            lv = asyncio.run(load_level(base, name, texts, refs, conc, per_client, args.max_tokens))
            print(f"{conc:3d} clients: {lv['tokens_per_s']:.0f} tok/s, TTFT p50 {lv['ttft_p50'] * 1000:.0f} ms, "
                  f"latency p50 {lv['latency_p50']:.2f} s, {lv['correct']}/{lv['requests']} correct", flush=True)
            levels.append(lv)
        out["load"] = levels
        asyncio.run(wait_idle(base))
        time.sleep(3.0)  # the server trims freed memory 2 s into an idle period
        out["rss_idle_mb"] = rss_mb(proc.pid)
        cap = httpx.get(base + "/v1/models").json()["data"][0]["max_tokens_cap"]
        ab = asyncio.run(abuse(port, name, texts, refs, args.bad, args.good, args.max_tokens, cap, args.slow_pause))
        asyncio.run(wait_idle(base))
        time.sleep(3.0)
        ab["rss_after_mb"] = rss_mb(proc.pid)
        ab["rss_idle_mb"] = out["rss_idle_mb"]
        health = httpx.get(base + "/health").json()
        ab["alive"] = proc.poll() is None and health["status"] == "ok"
        logged = log.read_text()
        ab["unhandled_errors_logged"] = logged.count("Traceback") + logged.count("Exception in ASGI")
        out["abuse"] = ab
        print(f"abuse: {ab['bad']} bad of {len(ab['kinds'])} kinds, all refused with a 4xx: {ab['all_bad_refused']}; "
              f"dropped/slow: {ab['special_passed']}; good correct {ab['good_correct']}/{ab['good']}; "
              f"RSS idle {ab['rss_idle_mb']:.0f} MB -> after {ab['rss_after_mb']:.0f} MB; alive {ab['alive']}",
              flush=True)
        if args.screenshot:
            why = screenshot(base, texts[16], Path(args.screenshot))
            shot = Path(args.screenshot).resolve()
            out["screenshot"] = why or str(shot.relative_to(ROOT) if shot.is_relative_to(ROOT) else shot)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    out["seconds"] = time.time() - t_start
    Path(args.out).write_text(json.dumps(out, indent=2))
    print()
    print(table(out))


def table(out: dict) -> str:
    rows = ["| clients | requests | correct | aggregate tok/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in out["load"]:
        rows.append(f"| {lv['clients']} | {lv['requests']} | {lv['correct']} | {lv['tokens_per_s']:.0f} | "
                    f"{lv['ttft_p50'] * 1000:.0f} ms | {lv['ttft_p99'] * 1000:.0f} ms | "
                    f"{lv['latency_p50'] * 1000:.0f} ms | {lv['latency_p99'] * 1000:.0f} ms |")
    ab = out["abuse"]
    rows += ["", "| hostile kind | n | statuses | as required |", "|---|---:|---|---|"]
    for k, v in ab["kinds"].items():
        st = ", ".join(f"{s}: {n}" for s, n in v["statuses"].items())
        rows.append(f"| {k} | {v['n']} | {st} | {'yes' if v['passed'] else 'NO'} |")
    rows.append("")
    rows.append(f"{ab['bad']} hostile requests interleaved with {ab['good']} good ones in {ab['seconds']:.0f} s: "
                f"good answers correct {ab['good_correct']}/{ab['good']}; server alive: {ab['alive']}; unhandled "
                f"errors logged: {ab['unhandled_errors_logged']}; resident memory {ab['rss_idle_mb']:.0f} MB idle "
                f"-> {ab['rss_after_mb']:.0f} MB after.")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
