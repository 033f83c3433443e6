"""What corrallm's stack costs below the pipeline: the floors a request through it cannot
go under, on the same pinned core (issue 18: where does a request's CPU go?).

    .venv/bin/python bench/floors.py [--seconds 4] [--runs 3]

Four servers, each alone on the proxy's CPU (bench/overhead.py's `cpu_plan`), loaded in
turn by `wrk -c 64` from the other CPU, against the same static nginx upstream:

- `uvicorn static`: uvicorn (uvloop, httptools) and an ASGI app answering 10 bytes. The
  server's own floor.
- `uvicorn + client relay`: the same, relaying each POST through corrallm's upstream
  client (`http/client.py`) to the static nginx: the floor of any relay on this stack.
- `corrallm GET /health`: `corrallm serve` with its own connection class, answering
  /health: the server, the connection and the app's dispatch.
- `corrallm chat`: a chat completion through the whole pipeline (a pure-proxy config).

Per server: req/s (the median run) and its CPU µs per request (from /proc, all its
threads). The difference between the last two rows is what the pipeline costs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead as o

BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'


def serve(kind: str, port: int, upstream: int) -> None:
    """The ASGI floor apps (run in a child process: `floors.py --serve KIND PORT UP`)."""
    import uvicorn

    from corrallm.http.client import Client

    client: Client | None = None
    url = f"http://127.0.0.1:{upstream}/v1/chat/completions"
    headers = [(b"content-type", b"application/json")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal client
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = b'{"ok":true}'
        if kind == "relay":
            client = client or Client()
            async with await client.request("POST", url, body, headers) as response:
                chunks = []
                while (chunk := await response.next_chunk()) is not None:
                    chunks.append(chunk)
                data = b"".join(chunks)
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


def measure(
    procs: o.Procs, wrk: str, name: str, proc: Any, url: str, post: bool, seconds: float, runs: int
) -> dict[str, Any]:
    lua = procs.tmp / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{BODY.decode()}'\n"
    )
    cmd = [wrk, "-t", "1", "-c", "64"] + (["-s", str(lua)] if post else [])
    pin = o.pinner(procs.pins.get("client"))
    subprocess.run([*cmd, "-d", "1s", url], capture_output=True, preexec_fn=pin, check=True)
    rates, costs = [], []
    for _ in range(runs):
        cpu0 = o.session_usage(proc.pid)[0]
        out = subprocess.run(
            [*cmd, "-d", f"{seconds:g}s", url],
            capture_output=True,
            text=True,
            preexec_fn=pin,
            check=True,
        ).stdout
        cpu = o.session_usage(proc.pid)[0] - cpu0
        done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        rates.append(done / seconds)
        costs.append(cpu / done * 1e6)
    return {
        "name": name,
        "rps": statistics.median(rates),
        "us": statistics.median(costs),
        "spread": (min(rates), max(rates)),
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(argv[1], int(argv[2]), int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="length of each wrk run (4)")
    p.add_argument("--runs", type=int, default=3, help="wrk runs per server (3); medians kept")
    args = p.parse_args(argv)
    nginx, wrk = o.find_nginx(), shutil.which("wrk")
    if nginx is None or wrk is None:
        print("needs nginx and wrk: apt-get install -y nginx wrk", file=sys.stderr)
        return 2
    procs = o.Procs(Path(tempfile.mkdtemp(prefix="corrallm-floors-")), o.cpu_plan())
    rows = []
    try:
        upstream, _ = o.start_static_upstream(procs, nginx)
        for kind, name in (("static", "uvicorn static"), ("relay", "uvicorn + client relay")):
            port = o.free_port()
            cmd = [o.PY, str(Path(__file__).resolve()), "--serve", kind, str(port), str(upstream)]
            proc = procs.start(kind, cmd, "proxy")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            procs.wait_healthy(kind, proc, url)
            rows.append(measure(procs, wrk, name, proc, url, True, args.seconds, args.runs))
            os.killpg(proc.pid, signal.SIGTERM)
        target = o.start_corrallm(procs, upstream, upstream)
        proc = next(p for n, p in procs.running if n == "corrallm")
        health = target.chat_url.replace("/v1/chat/completions", "/health")
        rows.append(
            measure(
                procs, wrk, "corrallm GET /health", proc, health, False, args.seconds, args.runs
            )
        )
        rows.append(
            measure(
                procs, wrk, "corrallm chat", proc, target.chat_url, True, args.seconds, args.runs
            )
        )
    finally:
        procs.close()
    print("| server | req/s c=64 (median) | runs min..max | CPU µs/request |")
    print("|---|---:|---:|---:|")
    for r in rows:
        lo, hi = r["spread"]
        print(f"| {r['name']} | {r['rps']:.0f} | {lo:.0f}..{hi:.0f} | {r['us']:.1f} |")
    print(
        f"\n- proxy pinned to CPUs {sorted(procs.pins.get('proxy', ()))}, wrk and nginx to "
        f"{sorted(procs.pins.get('client', ()))}; the pipeline's own cost is the last row "
        "minus the second"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
