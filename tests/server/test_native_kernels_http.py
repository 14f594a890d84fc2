"""`serve --kernels native|aten`: /props says which kernels run; answers are the same
streamed or not; a kernel cache that cannot be written means one warning and the aten path,
never a failed start."""
import httpx

from dflash_server import kernels

from .serverproc import ServerProc

ARGS = ("--dtype", "bf16", "--quantize", "int4", "--max-ctx", "512", "--threads", "1", "--model-name", "tiny",
        "--kernels", "native")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 12,
        "temperature": 0}


def _answers(url):
    plain = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120).json()["choices"][0]["message"]["content"]
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                parts.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return plain, "".join(parts)


def test_native_kernels_serve(tiny_dir):
    with ServerProc("--model", str(tiny_dir("llama")), *ARGS) as srv:  # the user's kernel cache (built once)
        runtime = httpx.get(srv.url + "/props").json()["runtime"]
        k = runtime["kernels"]
        assert k["enabled"] and k["native"] and k["isa"] in kernels.ISAS
        assert runtime["kv_dtype"] == ["float16"] and runtime["kv_bytes"] > 0   # --kv-dtype auto, bf16, native
        plain, streamed = _answers(srv.url)
        assert plain and plain == streamed


def test_unusable_kernel_cache_falls_back(tiny_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with ServerProc("--model", str(tiny_dir("llama")), *ARGS,
                    env={"DFLASH_KERNELS_CACHE": str(blocker / "under-a-file")}) as srv:
        runtime = httpx.get(srv.url + "/props").json()["runtime"]
        k = runtime["kernels"]
        assert k["enabled"] and not k["native"] and "build failed" in k["reason"]
        assert runtime["kv_dtype"] == ["float32"]   # aten's attention reads the cache: auto keeps fp32
        plain, streamed = _answers(srv.url)
        assert plain and plain == streamed
        out = srv.output()
    assert out.count("native kernels unavailable") == 1


def test_kernels_aten_opts_out(tiny_dir):
    args = tuple(a for a in ARGS if a not in ("--kernels", "native")) + ("--kernels", "aten")
    with ServerProc("--model", str(tiny_dir("llama")), *args) as srv:
        runtime = httpx.get(srv.url + "/props").json()["runtime"]
        k = runtime["kernels"]
        assert not k["enabled"] and not k["native"] and runtime["kv_dtype"] == ["float32"]
        plain, streamed = _answers(srv.url)
        assert plain and plain == streamed
