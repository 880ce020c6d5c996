"""OpenVINO GenAI worker for `specdec bench` peers; runs in the OpenVINO peer venv, imports nothing of specdec.

Protocol, JSON Lines on stdin / stdout, one reply per request:
  1st request  {"model_path", "mode": "plain" | "draft" | "lookup", "draft_path": str | null,
                "models_dir", "num_threads", "num_assistant_tokens", "max_ngram_size"}
               -> {"load_seconds", "version", "draft_folder": str | null}
  then         {"prompt_ids": [int], "max_tokens": int}
               -> {"token_ids": [int], "seconds": float, "ttft_seconds": float}
  any failure  -> {"error": "..."} (a failed load then exits). EOF on stdin ends the worker.
The pipeline gets the prompt as token ids (an ov.Tensor [1, n] of int64: LLMPipeline.generate's
EncodedInputs, never templated or tokenized again) and returns token ids. Decoding is greedy
(do_sample false, no penalties) and ignores EOS and stop tokens (GenerationConfig.ignore_eos) for
exactly max_new_tokens; `seconds` is the whole generate call, prefill included; a StreamerBase notes
when the first token arrives. "draft": speculative decoding with the draft GGUF exported once to an
OpenVINO model folder under models_dir (openvino_gguf.py), `num_assistant_tokens` drafts per step;
"lookup": its prompt lookup, n-grams up to `max_ngram_size`. Load time includes that export and a
2-token warm-up generate.
"""
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# OpenVINO compiles its CPU kernels on the first inference (seconds): a short generate at load puts
# that into load_seconds rather than into the first measured run's prefill
WARMUP_IDS = list(range(100, 116))


def _gguf_tools():
    """openvino_gguf.py from this folder, by path: -P keeps the folder off sys.path."""
    spec = importlib.util.spec_from_file_location("openvino_gguf", Path(__file__).with_name("openvino_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(req: dict) -> tuple[object, dict]:
    """The pipeline for the request's mode, and what the load reply reports besides its time."""
    import openvino_genai as ov_genai
    tools = _gguf_tools()
    props = {"INFERENCE_NUM_THREADS": req["num_threads"]}
    cache = Path(req["models_dir"])
    target = Path(req["model_path"])
    if tools.unreadable_tensors(target):  # a target OpenVINO cannot read as it is: its exported folder
        target = tools.model_folder(target, cache, props)
    extra, draft_folder = {}, None
    if req["mode"] == "draft":
        draft_folder = tools.model_folder(Path(req["draft_path"]), cache, props)
        extra["draft_model"] = ov_genai.draft_model(str(draft_folder), "CPU", **props)
    elif req["mode"] == "lookup":
        extra["prompt_lookup"] = True
    pipe = ov_genai.LLMPipeline(str(target), "CPU", **props, **extra)
    return pipe, {"version": ov_genai.__version__, "draft_folder": str(draft_folder) if draft_folder else None}


def generation_config(pipe, req: dict, max_tokens: int):
    cfg = pipe.get_generation_config()
    cfg.max_new_tokens = max_tokens
    cfg.ignore_eos = True  # also ignores stop_token_ids (sampler.cpp): exactly max_new_tokens
    cfg.stop_strings = set()
    cfg.do_sample = False
    cfg.num_beams = 1
    cfg.repetition_penalty = 1.0
    if req["mode"] in ("draft", "lookup"):
        cfg.num_assistant_tokens = req["num_assistant_tokens"]
    if req["mode"] == "lookup":
        cfg.max_ngram_size = req["max_ngram_size"]
    return cfg


def generate(pipe, load_req: dict, prompt_ids: list, max_tokens: int) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    class FirstToken(ov_genai.StreamerBase):
        """Notes when the first generated token (or the first accepted run of them) arrives."""

        def __init__(self) -> None:
            super().__init__()
            self.at = None

        def write(self, token) -> ov_genai.StreamingStatus:
            self.at = self.at or time.perf_counter()
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    ids = ov.Tensor(np.array([prompt_ids], dtype=np.int64))
    cfg = generation_config(pipe, load_req, max_tokens)
    first = FirstToken()
    t = time.perf_counter()
    out = pipe.generate(ids, cfg, first)
    end = time.perf_counter()
    tokens = [int(x) for x in out.tokens[0]]
    return {"token_ids": tokens, "seconds": end - t, "ttft_seconds": (first.at or end) - t}


def main() -> int:
    # OpenVINO's C++ code may print to fd 1: keep the protocol on a private copy, send fd 1 to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    pipe, load_req = None, None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if pipe is None:
                t0 = time.perf_counter()
                pipe, info = load(req)
                load_req = req
                generate(pipe, req, WARMUP_IDS, 2)
                reply = {"load_seconds": time.perf_counter() - t0, **info}
            else:
                reply = generate(pipe, load_req, req["prompt_ids"], req["max_tokens"])
        except Exception as e:  # noqa: BLE001 - report any failure, never hang the caller
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        if pipe is None:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
