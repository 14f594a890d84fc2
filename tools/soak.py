"""Soak a running configuration: random concurrent requests against a real ``serve``, then a
restart on the same disk cache, checking what a user relies on.

Starts ``dflash-server serve --port PORT SERVE_ARGS...`` (the built-in model unless
``--model`` is among them), then ``--rounds`` rounds of ``--threads`` client threads, each
sending ``--per-thread`` chat requests (streamed or not, some streams dropped after three
events) built from 12 stretches of this repository's README (200-6000 characters, so long
ones page a small KV Flash pool and some exceed the context: they must get a 400) and five
short questions. With ``--variety`` the requests also vary temperature (seeded), stops,
logprobs and max_tokens 1-64; without it they are greedy with 16 or 48 tokens, so most
repeat. Checks: every failure is a 4xx with a message (anything else is listed), the server
stays healthy and exits 0 on SIGTERM, and every repeat of a greedy or seeded request got the
same text (concurrency, prefix-cache hits, stream vs non-stream, drafted vs plain steps);
``--restart``: a fresh server on the same ``--kv-cache-dir`` answers 25 of those requests
with the same text (restart from disk == warm). Exit status 1 on any divergence or
unexpected error.

    python tools/soak.py [--port 8123] [--rounds 3] [--threads 6] [--per-thread 8] [--variety]
                         [--restart] [--seed 0] -- --parallel 4 --kvflash 512 \\
                         --kv-cache-dir /tmp/kvc --ddtree-budget 4 --lookup 5 --max-ctx 2048
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class Soak:
    def __init__(self, args):
        self.args, self.url = args, f"http://127.0.0.1:{args.port}"
        self.results: dict[str, list[str]] = {}
        self.errors: list[tuple] = []
        self.lock = threading.Lock()
        text, rng = (ROOT / "README.md").read_text(), random.Random(args.seed)
        self.prompts = []
        for _ in range(12):
            a = rng.randrange(0, len(text) - 8000)
            self.prompts.append(f"Summarise this text in two sentences.\n\n{text[a:a + rng.choice([200, 800, 3000, 6000])]}")
        self.prompts += ["Write a Python function that reverses a string.", "What is 17 * 23?",
                         "Tell me a joke about cats.", "List three prime numbers.", "Explain recursion briefly."]

    def start(self) -> subprocess.Popen:
        log = open(self.args.log, "a")
        proc = subprocess.Popen(["dflash-server", "serve", "--port", str(self.args.port), *self.args.serve],
                                stdout=log, stderr=subprocess.STDOUT)
        for _ in range(1200):
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    return proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited at start ({proc.returncode}); see {self.args.log}")
            time.sleep(0.5)
        proc.kill()
        raise SystemExit("the server did not start in 10 minutes")

    def body(self, rng: random.Random) -> dict:
        b = {"messages": [{"role": "user", "content": rng.choice(self.prompts)}]}
        if not self.args.variety:
            return {**b, "max_tokens": rng.choice([16, 48]), "temperature": 0}
        b["max_tokens"] = rng.choice([1, 5, 16, 40, 64])
        b["temperature"] = rng.choice([0, 0, 0.8])
        if b["temperature"]:
            b["seed"] = rng.randrange(1000)
        if rng.random() < 0.2:
            b["stop"] = rng.choice([["."], ["\n"], ["the", "and"]])
        if rng.random() < 0.2:
            b["logprobs"], b["top_logprobs"] = True, rng.choice([0, 2, 5])
        return b

    def failed(self, kind: str, status: int, text: str) -> None:
        with self.lock:
            self.errors.append((kind, status, text[:160]))

    def keep(self, b: dict, text: str) -> None:
        with self.lock:
            self.results.setdefault(json.dumps(b, sort_keys=True), []).append(text)

    def other_endpoint(self, b: dict, endpoint: str) -> None:
        """``b`` (a chat body) as an Anthropic message or a raw completion, non-streamed."""
        if endpoint == "messages":
            body = {"model": self.model, "max_tokens": b["max_tokens"], "messages": b["messages"],
                    "temperature": b.get("temperature", 0), **({"stop_sequences": b["stop"]} if "stop" in b else {})}
        else:
            body = {"prompt": b["messages"][0]["content"], "max_tokens": b["max_tokens"],
                    "temperature": b.get("temperature", 0), **({"seed": b["seed"]} if "seed" in b else {})}
        r = httpx.post(f"{self.url}/v1/{endpoint}", json=body, timeout=600)
        if r.status_code != 200:
            return self.failed(endpoint, r.status_code, r.text)
        j = r.json()
        text = "".join(c.get("text", "") for c in j["content"]) if endpoint == "messages" else j["choices"][0]["text"]
        if endpoint == "completions" or "seed" not in b:   # (Anthropic requests take no seed)
            self.keep({**body, "endpoint": endpoint}, text)

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(self.args.per_thread):
            b = self.body(rng)
            stream = rng.random() < 0.5
            drop = stream and rng.random() < 0.25
            endpoint = rng.choice(["messages", "completions"]) if self.args.variety and rng.random() < 0.3 else None
            try:
                if endpoint is not None:
                    self.other_endpoint(b, endpoint)
                    continue
                if not stream:
                    r = httpx.post(self.url + "/v1/chat/completions", json=b, timeout=600)
                    if r.status_code != 200:
                        self.failed("status", r.status_code, r.text)
                    else:
                        self.keep(b, r.json()["choices"][0]["message"]["content"])
                    continue
                parts, events = [], 0
                with httpx.stream("POST", self.url + "/v1/chat/completions", json={**b, "stream": True},
                                  timeout=600) as r:
                    if r.status_code != 200:
                        self.failed("stream status", r.status_code, r.read().decode(errors="replace"))
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        d = json.loads(line[6:])
                        if d.get("choices") and d["choices"][0]["delta"].get("content"):
                            parts.append(d["choices"][0]["delta"]["content"])
                        events += 1
                        if drop and events >= 3:
                            break
                if not drop:
                    self.keep(b, "".join(parts))
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                self.failed("exception", 0, repr(e))

    def run(self) -> int:
        a, bad = self.args, 0
        srv = self.start()
        t0 = time.time()
        for rnd in range(a.rounds):
            threads = [threading.Thread(target=self.worker, args=(1000 * rnd + k + a.seed * 100000,))
                       for k in range(a.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print(f"round {rnd}: {time.time() - t0:.0f} s, {len(self.errors)} refused or failed", flush=True)
        health = httpx.get(self.url + "/health").json()
        print("health", health)
        if health.get("status") != "ok":
            bad += 1
        for key, outs in self.results.items():
            b = json.loads(key)
            if (not b.get("temperature") or "seed" in b) and len(set(outs)) > 1:
                bad += 1
                print("DIVERGED", {k: v for k, v in b.items() if k != "messages"}, [o[:70] for o in outs])
        print(f"{len(self.results)} distinct requests, {sum(len(v) > 1 for v in self.results.values())} repeated")
        kinds = collections.Counter((k, s, t[:90]) for k, s, t in self.errors)
        for (kind, status, text), n in kinds.items():
            ok = 400 <= status < 500 and '"message"' in text
            bad += 0 if ok else n
            print(f"{'refused' if ok else 'UNEXPECTED'} x{n}: {kind} {status} {text}")
        srv.send_signal(signal.SIGTERM)
        code = srv.wait(120)
        print("exit status", code)
        bad += code != 0
        if a.restart:
            srv = self.start()
            replayed = 0
            for key, outs in list(self.results.items()):
                b = json.loads(key)
                if not (not b.get("temperature") or "seed" in b) or "endpoint" in b or replayed >= 25:
                    continue
                replayed += 1
                r = httpx.post(self.url + "/v1/chat/completions", json=b, timeout=600)
                got = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"status {r.status_code}"
                if got != outs[0]:
                    bad += 1
                    print("RESTART DIVERGED", b.get("max_tokens"), repr(got[:70]), repr(outs[0][:70]))
            hits = [m for m in httpx.get(self.url + "/metrics").text.splitlines()
                    if m.startswith("dflash_prefix_cache_disk_hits_total")]
            print(f"restart: {replayed} replayed,", *hits)
            srv.send_signal(signal.SIGTERM)
            bad += srv.wait(120) != 0
        print("FAILED" if bad else "OK", f"({bad} problems)")
        return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--per-thread", type=int, default=8)
    ap.add_argument("--variety", action="store_true", help="vary sampling, stops, logprobs and lengths")
    ap.add_argument("--restart", action="store_true", help="then replay greedy/seeded requests on a fresh server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="soak-server.log", help="the server's output (appended)")
    ap.add_argument("serve", nargs="*", help="arguments for dflash-server serve (after --)")
    return Soak(ap.parse_args()).run()


if __name__ == "__main__":
    sys.exit(main())
