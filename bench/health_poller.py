"""Polls a server's /health until its stdin closes, then prints the latencies as JSON:
`[[seconds, ok], ...]`. Run as its own process (`python bench/health_poller.py URL [EVERY_S]`)
by bench/edge_load.py and tests/test_server_limits.py: polling from the process that sends the
large bodies would add that process's own GIL waits to what is measured."""

import json
import sys
import threading
import time

import httpx


def main() -> None:
    url = sys.argv[1]
    every = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
    out: list[list] = []
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                ok = c.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append([time.perf_counter() - t, ok])
            time.sleep(every)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
