"""llama.cpp worker for `specdec bench` peers; runs in the llama.cpp peer venv, imports nothing of specdec.

Protocol, JSON Lines on stdin / stdout, one reply per request:
  1st request  {"model_path", "n_ctx", "n_threads", "lookup": bool, "num_pred_tokens", "logits_all": bool}
               -> {"load_seconds", "version"}
  then         {"prompt_ids": [int], "max_tokens": int}
               -> {"token_ids": [int], "seconds": float, "ttft_seconds": float}
  or           {"score_ids": [int], "logits_path": str}  (a worker loaded with logits_all)
               -> {"seconds": float, "n_vocab": int}; the logits of every position, [len, n_vocab]
                  float32 in numpy's .npy format, written to logits_path
  or           {"step_ids": [int], "context": int}  (a worker loaded with logits_all)
               -> {"seconds": float}: one forward of step_ids[context:] after step_ids[:context] (kept
                  from the previous request when it is the same), logits at every new row
  any failure  -> {"error": "..."} (a failed load then exits). EOF on stdin ends the worker.
Decoding is greedy (temp 0) with no penalties, and ignores EOS: `Llama.generate` yields tokens
until the caller stops; `seconds` is the whole generate call, prefill included.
"""
import json
import os
import sys
import time


def load(req: dict):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    draft = LlamaPromptLookupDecoding(num_pred_tokens=req["num_pred_tokens"]) if req["lookup"] else None
    return Llama(model_path=req["model_path"], n_ctx=req["n_ctx"], n_threads=req["n_threads"],
                 n_threads_batch=req["n_threads"], draft_model=draft, seed=0, verbose=False,
                 **({"logits_all": True} if req.get("logits_all") else {}))


def score(llm, ids: list, path: str) -> dict:
    import numpy as np
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - t
    np.save(path, np.ascontiguousarray(llm.scores[: len(ids)], dtype=np.float32))
    return {"seconds": seconds, "n_vocab": llm.n_vocab()}


def generate(llm, prompt_ids: list, max_tokens: int) -> dict:
    ids = []
    llm.reset()  # forget the previous request's KV: every run prefills its prompt, as ours do in the bench
    t = time.perf_counter()
    first = None
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                              repeat_penalty=1.0):
        ids.append(int(token))
        first = first or time.perf_counter()
        if len(ids) >= max_tokens:
            break
    end = time.perf_counter()
    return {"token_ids": ids, "seconds": end - t, "ttft_seconds": (first or end) - t}


def step(llm, ids: list, context: int) -> dict:
    if llm.n_tokens < context or list(llm.input_ids[:context]) != ids[:context]:
        llm.reset()
        llm.eval(ids[:context])
    llm.n_tokens = context  # eval drops the cache past n_tokens first
    t = time.perf_counter()
    llm.eval(ids[context:])
    return {"seconds": time.perf_counter() - t}


def main() -> int:
    # llama.cpp's C code may print to fd 1: keep the protocol on a private copy, send fd 1 to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if llm is None:
                import llama_cpp
                t0 = time.perf_counter()
                llm = load(req)
                reply = {"load_seconds": time.perf_counter() - t0, "version": llama_cpp.__version__}
            elif "step_ids" in req:
                reply = step(llm, req["step_ids"], req["context"])
            elif "score_ids" in req:
                reply = score(llm, req["score_ids"], req["logits_path"])
            else:
                reply = generate(llm, req["prompt_ids"], req["max_tokens"])
        except Exception as e:  # noqa: BLE001 - report any failure, never hang the caller
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        if llm is None:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
