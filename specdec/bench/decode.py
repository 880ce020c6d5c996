"""`specdec bench`: plain greedy decoding at batch 1 on a prompt set.

Reports tokens/s, time to first token, peak memory and load time as JSON. With --peer transformers,
transformers' float32 runs the same prompts in the same process, interleaved per prompt, so the
ratio is measured under the same machine conditions (the peer itself: peers.py).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from specdec.fileio import atomic_write_text
from specdec.prompts import read_prompts_file
from specdec.sampling_params import SamplingParams


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_decode_bench(a) -> dict:
    from tqdm import tqdm

    from specdec.llm import LLM

    prompts = read_prompts_file(a.prompts_file)[: a.num_prompts]
    t0 = time.perf_counter()
    llm = LLM(model=a.model, precision=a.precision, device=a.device, max_model_len=a.max_model_len,
              num_threads=a.threads)
    load_seconds = time.perf_counter() - t0
    tok = llm.tokenizer
    inputs = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
              for p in prompts]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    peer = None
    if a.peer == "transformers":
        from specdec.bench.peers import TransformersPeer, check_peers
        check_peers(["transformers"], install=False)
        peer = TransformersPeer("transformers", llm.engine.loaded.path, a.threads or os.cpu_count() or 1)
    rows = []
    bar = tqdm(total=len(inputs) * a.repeats, desc="bench", file=sys.stderr)
    for rep in range(a.repeats):
        for i, ids in enumerate(inputs):
            out = llm.generate([ids], params)[0]
            row = {"prompt": i, "repeat": rep, "specdec": {
                "generated_tokens": out.stats.generated_tokens, "seconds": out.stats.seconds,
                "ttft_seconds": out.stats.ttft_seconds, "tokens_per_second": out.stats.tokens_per_second,
                "decode_tokens_per_second": out.stats.decode_tokens_per_second}}
            if peer is not None:
                row["transformers"] = peer.generate(ids, a.max_tokens).stats()
            rows.append(row)
            bar.update(1)
    bar.close()

    def median(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rows)

    summary = {"specdec_tokens_per_second": median("specdec", "tokens_per_second"),
               "specdec_ttft_seconds": median("specdec", "ttft_seconds")}
    if peer is not None:
        summary["transformers_tokens_per_second"] = median("transformers", "tokens_per_second")
        summary["speedup_vs_transformers"] = (summary["specdec_tokens_per_second"]
                                              / summary["transformers_tokens_per_second"])
        summary["transformers_load_seconds"] = peer.load_seconds
    report = {
        "model": llm.engine.loaded.name, "precision": llm.engine.precision, "device": a.device,
        "prompts_file": a.prompts_file, "num_prompts": len(prompts), "max_tokens": a.max_tokens,
        "repeats": a.repeats, "threads": __import__("torch").get_num_threads(),
        "load_seconds": load_seconds, "weight_cache_hit": llm.engine.loaded.cache_hit,
        "load_average": os.getloadavg(), "peak_rss_gib": peak_rss_gib(), "summary": summary, "runs": rows,
    }
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)
    return report
