#!/usr/bin/env python3
"""Bug 31's scenario in a loop (docs/reliability.md, session 35): a fresh mirrored queue
whose mirrors never start their sync.

Starts a 3-node cluster of the release binaries in BINDIR (warren, warrenctl) on
127.0.77.{1,2,3} with `ha-mode: all` (automatic sync) on `^ha\\.`, then, ITERATIONS
times, through the nodes in turn: declares the campaign's four durable queues back to back
over the management API (`ha.q0`, `ha.q1`, `ha.dl.source`, `ha.dl.target`, as
warren-chaos does at the start of every run), waits until each lists both mirrors
synchronised, and deletes them. An iteration that is not synchronised within LIMIT
seconds stops the loop; the nodes' logs are kept and their folder printed (exit 1).
Otherwise the folder is removed (exit 0).

    python3 docs/campaign/declare-sync-loop.py target/release 3000 20

Set NODE_LOG for the nodes' log filter (default: info, with GM and mirror debug logs).
"""
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

IPS = ["127.0.77.1", "127.0.77.2", "127.0.77.3"]
QUEUES = ["ha.q0", "ha.q1", "ha.dl.source", "ha.dl.target"]
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
NODE_LOG = os.environ.get(
    "NODE_LOG",
    "info,openraft=warn,warren::gm=debug,warren::runtime::gm_host=debug,"
    "warren::runtime::mirror_host=debug,warren::mirror=debug",
)


def call(method, ip, path, body=None):
    req = urllib.request.Request(
        f"http://{ip}:15672{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": AUTH, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
            return r.status, (json.loads(text) if text else None)
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def config(i, folder):
    members = "".join(
        f'[[cluster.initial_members]]\nid = {n}\nlink = "{ip}:25672"\n\n'
        for n, ip in enumerate(IPS, 1)
    )
    ip = IPS[i - 1]
    return (
        f'[node]\nname = "warren{i}@loop"\ndata_dir = "{folder}/data{i}"\n'
        f'[amqp]\nlisten = "{ip}:5672"\n[admin]\nlisten = "{ip}:5679"\n'
        f'[management]\nlisten = "{ip}:15672"\n[prometheus]\nlisten = "{ip}:15692"\n'
        f'[cluster]\nnode_id = {i}\ncluster_id = "loop"\nlisten = "{ip}:25672"\n{members}'
    )


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    bindir, iterations, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    # Stopped with SIGTERM (a timeout, a kill), the nodes are stopped and the folder goes too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = tempfile.mkdtemp(prefix="declare-sync-loop.")
    nodes = []
    keep = False
    try:
        env = dict(os.environ, RUST_LOG=NODE_LOG, NO_COLOR="1")
        for i in (1, 2, 3):
            path = f"{folder}/node{i}.toml"
            with open(path, "w") as f:
                f.write(config(i, folder))
            log = open(f"{folder}/node{i}.log", "w")
            nodes.append(
                subprocess.Popen(
                    [f"{bindir}/warren", "--config", path], stdout=log, stderr=log, env=env
                )
            )
        ctl = [f"{bindir}/warrenctl", "--node", f"{IPS[0]}:5679"]
        policy = ["set_policy", "ha", "^ha\\.", '{"ha-mode":"all","ha-sync-mode":"automatic"}',
                  "--apply-to", "queues"]
        deadline = time.time() + 30
        while subprocess.run(ctl + policy, capture_output=True).returncode != 0:
            if time.time() > deadline:
                print("the cluster did not take the policy within 30 s")
                keep = True
                return 1
            time.sleep(0.2)
        for it in range(iterations):
            ip = IPS[it % len(IPS)]
            for q in QUEUES:
                status, _ = call("PUT", ip, f"/api/queues/%2f/{q}", {"durable": True})
                if status not in (201, 204):
                    print(f"iteration {it}: declaring {q} through {ip}: HTTP {status}")
            start, pending = time.time(), set(QUEUES)
            while pending and time.time() - start < limit:
                for q in sorted(pending):
                    status, body = call("GET", ip, f"/api/queues/%2f/{q}")
                    synced = (body or {}).get("synchronised_slave_nodes") or []
                    if status == 200 and len(synced) == len(IPS) - 1:
                        pending.discard(q)
                time.sleep(0.05)
            if pending:
                print(f"iteration {it}: NOT synchronised within {limit} s: {sorted(pending)}; "
                      f"logs kept in {folder}")
                keep = True
                return 1
            if it % 100 == 0:
                print(f"iteration {it}: synchronised in {time.time() - start:.2f} s", flush=True)
            for q in QUEUES:
                call("DELETE", ip, f"/api/queues/%2f/{q}")
        print(f"{iterations} iterations, every queue synchronised within {limit} s")
        return 0
    finally:
        for p in nodes:
            p.terminate()
        for p in nodes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
