#!/usr/bin/env python3
"""How long the management API takes to list many queues (issue 19: "a listing of 10,000
queues answers in under 200 ms"). Not part of CI; prints figures, exits non-zero when a run
fails (a node that does not start, an import refused, a listing with the wrong count).

    python3 .ci/bench-mgmt-list.py [--warren target/release/warren] [--queues 10000] [--runs 20]

Starts a release `warren` (single node, storage on, a fresh folder under /tmp) with its
management listener on a free loopback port, imports N durable queues in one
`POST /api/definitions`, then times (wall clock of the whole HTTP exchange, body read)
`GET /api/queues`, `GET /api/queues/%2F`, a page of 100 sorted by name, a `columns`
projection and one queue's page, RUNS times each; prints min / median / p90 / max in ms and the body size.
With `--policies P` (default 10) the import also carries P policies that match no queue,
so every listed queue is matched against them, and a policy set and cleared on one queue
(`PUT` and `DELETE /api/policies/%2F/bench`, which reshape every live queue of the vhost)
is timed too.
"""
import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, method, path, body=None, timeout=120):
    req = urllib.request.Request(base + path, method=method, data=body)
    req.add_header("Authorization", AUTH)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def report(name, times, note):
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
    print(f"{name:32} {times[0]:7.1f} {statistics.median(times):7.1f} "
          f"{p90:7.1f} {times[-1]:7.1f}   {note}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warren", default="target/release/warren")
    ap.add_argument("--queues", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--policies", type=int, default=10)
    a = ap.parse_args()
    data = tempfile.mkdtemp(prefix="bench-mgmt-")
    amqp, admin, mgmt = free_port(), free_port(), free_port()
    config = os.path.join(data, "warren.toml")
    with open(config, "w") as f:
        f.write(
            f'[node]\nname = "bench@localhost"\ndata_dir = "{data}/data"\n'
            f'[amqp]\nlisten = "127.0.0.1:{amqp}"\n[admin]\nlisten = "127.0.0.1:{admin}"\n'
            f'[management]\nlisten = "127.0.0.1:{mgmt}"\n[prometheus]\nlisten = ""\n'
        )
    log = open(os.path.join(data, "node.log"), "w")
    node = subprocess.Popen([a.warren, "--config", config], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{mgmt}"
    failed = False
    try:
        deadline = time.time() + 30
        while True:
            try:
                call(base, "GET", "/api/overview", timeout=2)
                break
            except OSError:
                if time.time() > deadline or node.poll() is not None:
                    print("FAIL: the node did not answer within 30 s", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        defs = {
            "queues": [
                {"name": f"q{i:05}", "vhost": "/", "durable": True,
                 "auto_delete": False, "arguments": {}}
                for i in range(a.queues)
            ],
            "policies": [
                {"name": f"p{k}", "vhost": "/", "pattern": f"^p{k}\\.", "apply-to": "queues",
                 "definition": {"max-length": 1000 + k}, "priority": 0}
                for k in range(a.policies)
            ],
        }
        t0 = time.perf_counter()
        status, _ = call(base, "POST", "/api/definitions", json.dumps(defs).encode())
        took = time.perf_counter() - t0
        print(f"import of {a.queues} durable queues and {a.policies} policies: "
              f"HTTP {status} in {took * 1000:.0f} ms")
        if status != 204:
            return 1
        cases = [
            ("GET /api/queues", "/api/queues", a.queues),
            ("GET /api/queues/%2F", "/api/queues/%2F", a.queues),
            ("GET page 1 of 100, sorted", "/api/queues?page=1&page_size=100&sort=name", None),
            ("GET columns=name,messages", "/api/queues?columns=name,messages", a.queues),
            ("GET one queue", f"/api/queues/%2F/q{a.queues // 2:05}", None),
        ]
        print(f"{'request':32} {'min':>7} {'median':>7} {'p90':>7} {'max':>7}   body")
        for name, path, count in cases:
            times = []
            size = 0
            for _ in range(a.runs):
                t0 = time.perf_counter()
                status, body = call(base, "GET", path)
                times.append((time.perf_counter() - t0) * 1000)
                size = len(body)
                got = json.loads(body)
                n = len(got) if isinstance(got, list) else got.get("total_count")
                one = path.rsplit("/", 1)[-1]
                if isinstance(got, dict) and "name" in got and got["name"] != one:
                    print(f"FAIL: {name}: answered for {got['name']}", file=sys.stderr)
                    failed = True
                if status != 200 or (count is not None and n != count):
                    print(f"FAIL: {name}: HTTP {status}, {n} items", file=sys.stderr)
                    failed = True
            report(name, times, f"{size / 1e6:.2f} MB")
        policy = json.dumps({"pattern": f"^q{a.queues // 2:05}$", "apply-to": "queues",
                             "definition": {"max-length": 5}}).encode()
        times = {"PUT": [], "DELETE": []}
        for _ in range(a.runs):
            for method, body, want in (("PUT", policy, (201, 204)), ("DELETE", None, (204,))):
                t0 = time.perf_counter()
                status, _ = call(base, method, "/api/policies/%2F/bench", body)
                times[method].append((time.perf_counter() - t0) * 1000)
                if status not in want:
                    print(f"FAIL: {method} /api/policies/%2F/bench: HTTP {status}",
                          file=sys.stderr)
                    failed = True
        report("PUT /api/policies/%2F/bench", times["PUT"], "")
        report("DELETE /api/policies/%2F/bench", times["DELETE"], "")
        return 1 if failed else 0
    finally:
        node.terminate()
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
