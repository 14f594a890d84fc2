"""Prometheus metrics (own registry, so several apps in one process do not collide).

Engine-side counters (speculative decoding, prefix cache) are read defensively from
``GenerationResult.extra`` / ``cached_tokens``: they stay at zero until the engine
reports them.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class _EngineCollector:
    """The step loop's counters, read from ``Engine.stats()`` at scrape time: slots,
    running / waiting sequences, steps, step time, and decode rows per step (a histogram)."""

    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self):
        self.engine = None

    def describe(self):
        return []

    def collect(self):
        if self.engine is None:
            return
        try:
            st = self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must never fail on a racing step
            return
        if st is None:
            return
        for key, doc in (("slots_total", "sequence slots"), ("slots_busy", "sequence slots holding a request"),
                         ("waiting", "requests waiting for a slot"), ("running", "sequences decoding"),
                         ("prefilling", "sequences prefilling")):
            yield GaugeMetricFamily(f"dflash_engine_{key}", doc, value=st[key])
        for key, name, doc in (("steps", "steps", "engine steps run"),
                               ("step_s", "step_seconds", "seconds spent in engine steps"),
                               ("decode_rows", "decode_rows", "decode rows run (one per sequence per step)"),
                               ("prefill_tokens", "prefill_tokens", "prompt tokens prefilled by engine steps")):
            yield CounterMetricFamily(f"dflash_engine_{name}", doc, value=st[key])
        pf = st.get("pflash") or {}
        if pf.get("enabled"):
            for key, name, doc in (("calls", "compressions", "prompts compressed by PFlash"),
                                   ("raw_tokens", "raw_tokens", "prompt tokens before PFlash compression"),
                                   ("compressed_tokens", "compressed_tokens", "prompt tokens PFlash kept"),
                                   ("drafter_s", "drafter_seconds", "seconds the PFlash drafter ran")):
                yield CounterMetricFamily(f"dflash_pflash_{name}", doc, value=pf[key])
            yield GaugeMetricFamily("dflash_pflash_compression_ratio", "kept / raw prompt tokens, all compressions",
                                    value=pf["compression_ratio"] or 0.0)
        sizes = st["batch_sizes"]
        buckets, acc = [], 0
        for le in self.BATCH_BUCKETS:
            acc = sum(n for b, n in sizes.items() if b <= le)
            buckets.append((str(le), acc))
        buckets.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily("dflash_engine_batch_size", "decode rows per engine step", buckets=buckets,
                                    sum_value=sum(b * n for b, n in sizes.items()))


class _CacheCollector:
    """Prefix-cache counters read from the engine at scrape time (memory index and disk
    cache keep their own counts; reading ints across threads is safe here)."""

    MEMORY = {"hits": "prefix snapshots restored from memory", "misses": "lookups without a memory hit",
              "evictions": "memory snapshots evicted", "tokens_saved": "prompt tokens restored from memory"}
    DISK = {"hits": "snapshots restored from disk", "misses": "disk lookups without a hit",
            "reads": "snapshot files read", "writes": "snapshot files written",
            "evictions": "snapshot files evicted by the budget", "errors": "bad files and failed writes",
            "dropped": "snapshot writes dropped while the writer was behind"}

    def __init__(self):
        self.engine = None

    def describe(self):
        return []

    def collect(self):
        try:
            st = self.engine.stats() if self.engine is not None else None
            cache = st["cache"] if st is not None else None
        except Exception:  # noqa: BLE001 - a scrape never fails on introspection
            cache = None
        if not cache:
            return
        prefix, disk = cache["prefix"], cache["disk"]
        for key, doc in self.MEMORY.items():
            v = prefix.get(key)
            if isinstance(v, int):
                yield CounterMetricFamily(f"dflash_prefix_cache_memory_{key}", doc, value=v)
        for key, doc in (("slots", "memory snapshots held"), ("total_bytes", "bytes of memory snapshots")):
            v = prefix.get(key)
            if isinstance(v, int):
                yield GaugeMetricFamily(f"dflash_prefix_cache_memory_{key}", doc, value=v)
        if disk.get("enabled"):
            stats = disk
            for key, doc in self.DISK.items():
                if isinstance(stats.get(key), int):
                    yield CounterMetricFamily(f"dflash_prefix_cache_disk_{key}", doc, value=stats[key])
            for key in ("files", "bytes"):
                if isinstance(stats.get(key), int):
                    yield GaugeMetricFamily(f"dflash_prefix_cache_disk_{key}", f"snapshot {key} on disk",
                                            value=stats[key])


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.cache = _CacheCollector()
        r.register(self.cache)
        self.engine_stats = _EngineCollector()
        r.register(self.engine_stats)
        p = "dflash_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.generations = Counter(p + "generations", "finished generations by finish reason",
                                   ["finish_reason"], registry=r)
        self.stream_errors = Counter(p + "stream_errors", "streamed responses that ended with an error event",
                                     ["api", "status"], registry=r)
        self.rejected_requests = Counter(p + "rejected_requests", "requests refused because the queue was full",
                                registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge(p + "requests_running", "requests being generated", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_tokens = Counter(p + "prompt_cached_tokens", "prompt tokens restored from a cache",
                                     registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submit to first token (queue included)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "time spent waiting for the engine",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.duration = Histogram(p + "generation_duration_seconds", "engine time per request",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_tps = Histogram(p + "decode_tokens_per_second", "decode speed per request",
                                    buckets=_TPS_BUCKETS, registry=r)
        self.last_decode_tps = Gauge(p + "last_decode_tokens_per_second", "decode speed of the last request",
                                     registry=r)
        self.prefill_tps = Gauge(p + "last_prefill_tokens_per_second", "prefill speed of the last request",
                                 registry=r)
        # speculative decoding and cache (filled once the engine reports them)
        self.spec_drafted = Counter(p + "spec_draft_tokens", "draft tokens proposed", registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.spec_steps = Counter(p + "spec_verify_steps", "speculative verify passes", registry=r)
        self.spec_plain = Counter(p + "spec_plain_steps", "decode steps the adaptive block size ran without a draft",
                                  registry=r)
        self.spec_tau = Gauge(p + "spec_last_acceptance_length", "tokens committed per verify pass (last request)",
                              registry=r)
        self.spec_tree = Counter(p + "spec_tree_steps", "verify passes over a DDTree (their drafted tokens are "
                                 "its nodes)", registry=r)
        self.spec_lookup = Counter(p + "spec_lookup_steps", "verify passes over prompt-lookup drafts (tokens copied "
                                   "where the context repeats) instead of the draft's", registry=r)
        self.cache_hits = Counter(p + "prefix_cache_hits", "requests that restored a cached prefix",
                                  registry=r)

        self.kvflash = {k: Gauge(p + "kvflash_" + k, help_, registry=r) for k, help_ in (
            ("pool_tokens", "KV Flash pool slots per attention layer, summed over stages"),
            ("resident_chunks", "KV chunks resident in the pools (after the last request)"),
            ("paged_chunks", "KV chunks paged out to host memory (after the last request)"),
            ("page_ins", "KV chunks paged back in since start"),
            ("page_outs", "KV chunks paged out since start"),
            ("host_bytes", "bytes of paged-out KV in host memory"),
            ("device_kv_bytes", "bytes of attention KV on the devices"))}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- scheduler hooks (called from the worker thread) -----------------------------
    def queue_changed(self, depth: int, running: int) -> None:
        self.queue_depth.set(depth)
        self.running.set(int(running))

    def token(self, job, now: float) -> None:
        if job.t_first is None:
            self.ttft.observe(now - job.t_submit)
            self.queue_wait.observe((job.t_start or now) - job.t_submit)
        elif job.t_last is not None:
            self.itl.observe(now - job.t_last)

    def rejected(self) -> None:
        self.rejected_requests.inc()

    def skipped(self, job) -> None:
        self.generations.labels("cancelled").inc()

    def failed(self, job) -> None:
        self.generations.labels("error").inc()

    def finished(self, job, result) -> None:
        self.generations.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generated_tokens.inc(result.completion_tokens)
        if result.cached_tokens:
            self.cached_tokens.inc(result.cached_tokens)
            self.cache_hits.inc()
        self.duration.observe(result.prefill_s + result.decode_s)
        tps = result.decode_tokens_per_s
        if tps > 0:
            self.decode_tps.observe(tps)
            self.last_decode_tps.set(tps)
        if result.prefill_s > 0:
            self.prefill_tps.set(result.prompt_tokens / result.prefill_s)
        kv = (result.extra or {}).get("kvflash") if isinstance(result.extra, dict) else None
        if isinstance(kv, dict):
            for key, gauge in self.kvflash.items():
                if isinstance(kv.get(key), int):
                    gauge.set(kv[key])
        spec = (result.extra or {}).get("spec") if isinstance(result.extra, dict) else None
        if isinstance(spec, dict):
            for key, counter in (("proposed", self.spec_drafted), ("accepted", self.spec_accepted),
                                 ("steps", self.spec_steps), ("plain_steps", self.spec_plain),
                                 ("tree_steps", self.spec_tree), ("lookup_steps", self.spec_lookup)):
                v = spec.get(key)
                if isinstance(v, (int, float)) and v > 0:
                    counter.inc(v)
            tau = spec.get("acceptance_length")
            if isinstance(tau, (int, float)):
                self.spec_tau.set(tau)
