"""The server on tiny random models, as a real process on a loopback port: auth, every bad input of
the HTTP edge (and the next good request still succeeding), a full queue, aborts that free blocks,
preemption under a tiny KV cache that leaves outputs unchanged, and the YAML config."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import engine_config, expected_auto_precision
from openai import AuthenticationError, BadRequestError
from server_process import ServerProcess, http_json, in_process_server, slow_server

from specdec.config import load_yaml_config
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

KEY = "sekret-key"


def post(server: ServerProcess, path: str, body: bytes | dict | list | Iterator[bytes], key: str | None = KEY,
         headers: dict | None = None) -> tuple[int, dict]:
    return http_json(server, path, body, key, headers)


@pytest.fixture(scope="module")
def strict_server(tiny_qwen, tmp_path_factory):
    """One running request at a time and two waiting (room for the n = 2 test's choices, which may
    both be queued before the first is admitted): easy to fill the queue."""
    d = tmp_path_factory.mktemp("strict")
    cfg = d / "config.yaml"
    cfg.write_text(f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: ngram
  speculation_length: 3
  max_batch_size: 1
  max_queued_requests: 2
server:
  max_n: 2
""")
    s = ServerProcess(["--config", str(cfg), "--threads", "1"], d / "server.log", api_key=KEY)
    yield s
    s.stop()


def test_health_models_and_auth(strict_server):
    with urllib.request.urlopen(strict_server.url + "/health") as r:
        assert r.status == 200
    with pytest.raises(AuthenticationError):
        strict_server.client(api_key="wrong").completions.create(model=strict_server.model, prompt="hi", max_tokens=2)
    status, body = post(strict_server, "/v1/completions", {"prompt": "hi"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    models = strict_server.client().models.list().data
    assert len(models) == 1 and models[0].id == "tiny-qwen2.gguf"


BAD = [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "presence_penalty": -9}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": "x", "max_tokens": 100000}, "context"),
    ({"prompt": [1, 2, 10 ** 9]}, "vocabulary"),
    ({"prompt": [-1]}, "vocabulary"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "n": 3}, "n must be"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "speculative": {"method": "draft_model"}}, "not loaded"),
    ({"prompt": "x", "speculative": {"max_k": -1}}, "max_k"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ([1, 2], "body"),
]


def test_bad_inputs_get_400_and_the_server_keeps_serving(strict_server):
    for body, needle in BAD:
        status, err = post(strict_server, "/v1/completions", body)
        assert status == 400, (body, status, err)
        msg = err["error"]["message"]
        assert needle in msg and "Traceback" not in msg and "/" not in msg.replace("0..", ""), (body, msg)
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": True},
                 {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6}):
        status, _ = post(strict_server, "/v1/chat/completions", body)
        assert status == 400, body
    status, err = post(strict_server, "/v1/completions", b'{"prompt": "' + b"a" * (1 << 23) + b'"}')
    assert status == 413 and "larger than" in err["error"]["message"]
    chunked = iter([b'{"prompt": "', *[b"a" * (1 << 16)] * 64, b'"}'])  # 4 MiB, no Content-Length
    status, err = post(strict_server, "/v1/completions", chunked)
    assert status == 413 and "larger than" in err["error"]["message"]
    out = strict_server.client().completions.create(model=strict_server.model, prompt="hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    m = strict_server.metrics()
    assert m['specdec_requests_total{status="rejected_400"}'] >= len(BAD)
    assert m['specdec_requests_total{status="rejected_413"}'] == 2


def _stream_some(server: ServerProcess, started: threading.Event, chunks: int | None, max_tokens: int = 400):
    stream = server.client().completions.create(model=server.model, prompt="count", max_tokens=max_tokens,
                                                temperature=0, stream=True)
    started.set()
    for i, _ in enumerate(stream):
        if chunks is not None and i + 1 >= chunks:
            break
    stream.close()


def test_queue_full_gets_429_and_abort_frees_blocks(strict_server):
    # one request running (max_batch_size 1), room for two waiting (max_queued_requests 2): of four more
    # sent at once, some are refused. (Sent one after another they raced the tiny model, which
    # finishes the running request's 400 tokens in a fraction of a second.)
    first = threading.Event()
    t1 = threading.Thread(target=_stream_some, args=(strict_server, first, None))
    t1.start()
    first.wait(30)
    deadline = time.time() + 30
    while strict_server.metrics()["specdec_num_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    results: list[tuple[int, dict]] = []
    go = threading.Barrier(4)

    def send():
        go.wait(30)
        results.append(post(strict_server, "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    burst = [threading.Thread(target=send) for _ in range(4)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(120)
    refused = [err for status, err in results if status == 429]
    assert refused and all(err["error"]["type"] == "rate_limit_error" for err in refused)
    assert all(status in (200, 429) for status, _ in results)
    t1.join(120)
    # a client that leaves mid-stream aborts its request: nothing left running, every block free
    started = threading.Event()
    _stream_some(strict_server, started, chunks=3)
    m = strict_server.wait_idle()
    assert m['specdec_kv_blocks_used{pool="target"}'] == 0
    assert m['specdec_requests_total{status="rejected_429"}'] >= 1
    assert strict_server.client().completions.create(model=strict_server.model, prompt="ok", max_tokens=2,
                                                extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_n_logprobs_echo_and_usage(strict_server):
    c = strict_server.client()
    out = c.completions.create(model=strict_server.model, prompt="hello there", max_tokens=5, n=2, temperature=0.8, seed=3,
                               logprobs=2, echo=True, extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1]
    assert all(ch.text.startswith("hello there") for ch in out.choices)
    assert len(out.choices[0].logprobs.tokens) == 5 and all(lp <= 0 for lp in out.choices[0].logprobs.token_logprobs)
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens > 0  # the prompt counts once
    chat = c.chat.completions.create(model=strict_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                     logprobs=True, top_logprobs=2, temperature=0)
    assert len(chat.choices[0].logprobs.content) == 3


@pytest.fixture(scope="module")
def preempting_server(tiny_qwen, tiny_llama, tmp_path_factory):
    """A draft model and KV pools far too small for the load: forces preemption in both pools."""
    d = tmp_path_factory.mktemp("preempt")
    cfg = d / "config.yaml"
    cfg.write_text(f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: {tiny_llama}
  speculation_length: 3
  max_batch_size: 8
  cache_config:
    target_cache_blocks: 10
    draft_cache_blocks: 10
speculative:
  policy: fixed
""")
    s = ServerProcess(["--config", str(cfg), "--threads", "1"], d / "server.log")
    yield s
    s.stop()


def _concurrently(run, n: int) -> None:
    """run(i) for i < n, each on its own thread, all at once."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)


def test_preemption_leaves_outputs_unchanged(preempting_server, tiny_qwen):
    prompts = [f"request {i}: " + "the cat sat on the mat " * (1 + i % 3) for i in range(8)]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        out = preempting_server.client().completions.create(model=preempting_server.model, prompt=prompts[i], max_tokens=60,
                                                             temperature=0, extra_body={"ignore_eos": True})
        results[i] = out.choices[0].text

    _concurrently(run, len(prompts))
    offline = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    ref = offline.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    assert [results[i] for i in range(len(prompts))] == [o.text for o in ref]
    m = preempting_server.wait_idle()
    assert m["specdec_preemptions_total"] > 0
    assert m['specdec_kv_blocks_used{pool="target"}'] == 0 and m['specdec_kv_blocks_used{pool="draft:tiny-llama.gguf"}'] == 0
    assert sum(v for k, v in m.items() if k.startswith("specdec_spec_drafted_tokens_total")) > 0, m


def test_seeded_choices_survive_load_and_preemption(preempting_server, tiny_qwen):
    """Concurrent seeded n = 2 requests, speculative and preempted, answer what one plain offline engine
    answers for (seed, choice); an unseeded request answers the seed that replays it."""
    prompts = [f"request {i}: " + "the cat sat on the mat " * (1 + i % 3) for i in range(6)]
    results: dict[int, list[str]] = {}

    def run(i: int) -> None:
        out = preempting_server.client().completions.create(
            model=preempting_server.model, prompt=prompts[i], max_tokens=40, temperature=0.8, top_p=0.95, n=2,
            seed=100 + i, extra_body={"ignore_eos": True})
        results[i] = [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]

    _concurrently(run, len(prompts))
    offline = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=100 + i, choice=j)
              for i in range(len(prompts)) for j in (0, 1)]
    ref = [o.text for o in offline.generate([p for p in prompts for _ in (0, 1)], params)]
    assert [t for i in range(len(prompts)) for t in results[i]] == ref
    free = preempting_server.client().completions.create(model=preempting_server.model, prompt=prompts[0],
                                                         max_tokens=20, temperature=1.0)
    seed = free.model_extra["speculative"]["seed"]
    again = preempting_server.client().completions.create(model=preempting_server.model, prompt=prompts[0],
                                                          max_tokens=20, temperature=1.0, seed=seed)
    assert again.choices[0].text == free.choices[0].text


def test_yaml_config(tmp_path):
    cfg, server, serving = load_yaml_config("configs/default.yaml")
    assert serving.replicas == 1 and not serving.on_ray
    assert cfg.speculative.draft_model == "qwen2.5-coder-0.5b-instruct" and cfg.speculative.num_speculative_tokens == 8
    assert cfg.scheduler.max_batch_size == 8 and cfg.cache.draft_cache_blocks == 1024 and server.host == "127.0.0.1"
    bad = tmp_path / "bad.yaml"
    for text, needle in (("execution_config:\n  speculation_lenght: 3\n", "execution_config.speculation_lenght"),
                         ("execution_config:\n  cache_config:\n    blocks: 3\n", "cache_config.blocks"),
                         ("server:\n  hots: 0.0.0.0\n", "server.hots"),
                         ("speculative:\n  method: ngram\n", "speculative.method"),
                         ("extra: 1\n", "top level.extra"),
                         ("execution_config:\n  max_batch_size: 0\n", "max_batch_size")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            load_yaml_config(bad)
    bad.write_text("execution_config:\n  draft_model: null\n")
    assert load_yaml_config(bad)[0].speculative is None
    bad.write_text("execution_config:\n  precision: float32\n  draft_precision: int4-a8\n")
    cfg = load_yaml_config(bad)[0]
    assert cfg.model.precision == "float32" and cfg.speculative.draft.precision == "int4-a8"
    assert cfg.sampling.coupling == "gumbel"
    bad.write_text("sampling:\n  coupling: rejection\n")
    assert load_yaml_config(bad)[0].sampling.coupling == "rejection"
    bad.write_text("sampling:\n  coupling: gumbell\n")
    with pytest.raises(ValueError, match=r"sampling\.coupling"):
        load_yaml_config(bad)
    bad.write_text("execution_config:\n  draft_precision: int3\n")
    with pytest.raises(ValueError, match=r"draft\.precision"):
        load_yaml_config(bad)


def test_cli_flags_override_the_config(tmp_path):
    from specdec.cli import build_parser
    from specdec.commands.serve import serve_configs
    a = build_parser().parse_args(["serve", "--config", "configs/default.yaml", "-k", "2", "--port", "9001",
                                   "--max-batch-size", "3"])
    cfg, server, _ = serve_configs(a)
    assert cfg.speculative.num_speculative_tokens == 2 and server.port == 9001 and cfg.scheduler.max_batch_size == 3
    a = build_parser().parse_args(["serve", "--config", "configs/default.yaml", "--draft-precision", "int4-a8"])
    assert serve_configs(a)[0].speculative.draft.precision == "int4-a8"
    a = build_parser().parse_args(["serve", "--config", "configs/default.yaml", "--spec", "ngram"])
    assert serve_configs(a)[0].speculative.method == "ngram"
    a = build_parser().parse_args(["serve", "--config", "configs/default.yaml", "--no-spec"])
    assert serve_configs(a)[0].speculative is None


def test_serve_without_flags_takes_the_cli_default_precision():
    """`specdec serve` with no config and no --precision runs the CLI's default mode on this CPU (it
    once fell back to float32 because serve's --device defaults to unset)."""
    from specdec.cli import build_parser
    from specdec.commands.serve import serve_configs
    from specdec.precision import resolve_precision
    from specdec.quant import kernel
    cfg, _ = resolve_precision(serve_configs(build_parser().parse_args(["serve"]))[0])  # what the engine runs
    assert cfg.model.precision == expected_auto_precision(cfg.model.model)
    assert cfg.speculative.draft.precision == ("int4-a8" if kernel.available() else None)


def test_bad_request_fails_before_the_engine_is_touched(strict_server):
    with pytest.raises(BadRequestError):
        strict_server.client().chat.completions.create(model=strict_server.model, messages=[{"role": "user", "content": "x"}],
                                                       n=5)


def test_bench_serve_writes_json_and_plot(tiny_qwen, tmp_path):
    from specdec.cli import main
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(["bench", "serve", "--model", str(tiny_qwen), "--arms", "plain,ngram", "--rates", "50,200",
                 "--num-requests", "3", "--max-tokens", "4", "--threads", "1", "--out", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    for arm in ("plain", "ngram"):
        for rate in ("50.0", "200.0"):
            r = report["results"][arm][rate]
            assert r["requests"] == 3 and r["output_tokens"] == 12 and r["ttft_p50"] <= r["ttft_p99"]
            assert r["throughput_tokens_per_second"] > 0
    assert png.stat().st_size > 1000


def test_health_is_503_until_the_models_are_loaded(tiny_qwen):
    from specdec.engine import LLMEngine

    gate = threading.Event()

    def build():
        gate.wait(60)
        return LLMEngine(engine_config(str(tiny_qwen)), progress=False)

    with in_process_server(build) as (engine, local):
        try:
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(local.url + "/health")
            assert e.value.code == 503
            assert post(local, "/v1/completions", {"prompt": "hi"})[0] == 503
            gate.set()
            deadline = time.time() + 60
            while not engine.ready and time.time() < deadline:
                time.sleep(0.05)
            with urllib.request.urlopen(local.url + "/health") as r:
                assert r.status == 200
            # ignore_eos: the default temperature samples, and the tiny model may sample EOS early
            status, body = post(local, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 3
        finally:
            gate.set()


def test_client_leaving_a_non_streaming_request_aborts_it(tiny_qwen):
    """In process, with every engine step slowed down: the client leaves while the request runs, and
    the request must end as an abort (whatever the machine's speed) with its blocks freed."""
    import socket

    with slow_server(str(tiny_qwen)) as (engine, local, metrics):
        deadline = time.time() + 60
        before = metrics()
        body = json.dumps({"prompt": "count", "max_tokens": 400, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", local.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while metrics().get("specdec_num_requests_running", 0) < 1 and time.time() < deadline:
                time.sleep(0.05)
        while metrics().get("specdec_num_requests_running", 0) > 0 and time.time() < deadline:
            time.sleep(0.05)
        m = metrics()
        assert m['specdec_kv_blocks_used{pool="target"}'] == 0
        count = lambda sample, status: sample.get(f'specdec_requests_total{{status="{status}"}}', 0)  # noqa: E731
        assert count(m, "abort") == count(before, "abort") + 1
        assert count(m, "length") == count(before, "length")


def test_streams_match_the_non_streamed_responses(strict_server):
    c = strict_server.client()
    full = c.completions.create(model=strict_server.model, prompt="hello there", max_tokens=6, temperature=0, echo=True)
    parts = list(c.completions.create(model=strict_server.model, prompt="hello there", max_tokens=6, temperature=0, echo=True,
                                      stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].usage.completion_tokens == 6 and parts[-1].model_extra["speculative"]["proposer"]
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model=strict_server.model, messages=messages, max_tokens=5, temperature=0)
    chunks = list(c.chat.completions.create(model=strict_server.model, messages=messages, max_tokens=5, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_suffix_per_request_and_its_cache_on_metrics(strict_server):
    """extra_body picks suffix decoding per request; the shared cache of finished outputs and the
    lookup drafts show on /metrics, and the output is the plain one."""
    c = strict_server.client()
    ask = dict(model=strict_server.model, prompt="red green blue red green blue red", max_tokens=8, temperature=0)
    plain = c.completions.create(**ask, extra_body={"speculative": {"enabled": False}})
    outs = [c.completions.create(**ask, extra_body={"speculative": {"method": "suffix"}}) for _ in range(2)]
    assert all(o.choices[0].text == plain.choices[0].text for o in outs)
    assert outs[1].model_extra["speculative"]["method"] == "suffix"
    m = strict_server.wait_idle()
    assert m['specdec_draft_cache_tokens{cache="suffix"}'] >= 3 * 8      # every finished output joins it
    assert m['specdec_draft_cache_max_tokens{cache="suffix"}'] == 100_000
    assert m['specdec_draft_cache_bytes{cache="suffix"}'] > 0
    drafted = sum(o.model_extra["speculative"]["drafted_tokens"] for o in outs)
    assert m.get('specdec_spec_free_drafted_tokens_total{proposer="suffix"}', 0) == drafted
