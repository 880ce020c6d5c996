"""Render the documentation's results tables from `docs/results/*.json`.

`python tools/docs_report.py` (or `make docs`) rewrites, in place, every block between

    <!-- generated:VIEW:STEM -->   ...   <!-- end generated -->

in README.md and the docs/ files named in DOCS: VIEW says how to draw the table
(`spec`, `spec-wide`, `precision`, `serve`, `soak`, `structured`, `replicas`, `affinity`, `steps`,
`row-invariance`, `kld`, `matmul`, `peers`, `tool-speed`, `coupling`, `overhead`, `attention`;
`history` and `index` take no STEM), STEM names the results file (`docs/results/STEM.json`). Each
table opens with a caption giving the run's date and machine (from SOURCES below) and the command
that reproduces the run, rebuilt from the configuration its JSON records. Files are written
atomically (a temporary file in the same folder, then os.replace) and only when their text changes,
so a second run changes nothing.
`--check` writes nothing and exits 1 when any file is out of date.

A developer tool, not part of the installed package: it rewrites the checkout it sits in (the
folder above tools/, or --root). Standard library only (no specdec imports), so it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this checkout: the tool lives in its tools/ folder
DOCS = ("README.md", "docs/performance.md", "docs/results/README.md", "docs/architecture.md",
        "docs/scale-out.md", "docs/cpu-kernels.md", "docs/models.md")
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"  # `specdec bench --model`'s default
START, END = "<!-- generated:", "<!-- end generated -->"

# machine key -> (short name, description)
MACHINES = {
    "zen4": ("Zen 4", "Zen 4 VM (AMD EPYC family 25, 2 vCPU, AVX-512)"),
    "zen1": ("Zen 1", "Zen 1 VM (AMD EPYC family 23, 2 vCPU, AVX2 only)"),
    "zen3": ("Zen 3", "Zen 3 VM (AMD EPYC family 25 model 1, 2 vCPU, AVX2 only: no AVX-512, no VNNI)"),
    "h200": ("H200", "NVIDIA H200 GPU (torch 2.11, CUDA 13)"),
    "xeon": ("Xeon", "Intel Xeon (Sapphire Rapids: AVX-512, VNNI; AMX not exposed), 2 vCPU"),
    "xeon-amx": ("Xeon", "Intel Xeon (Sapphire Rapids: AVX-512, VNNI; AMX exposed, unused by specdec), 2 vCPU"),
    "xeon-emr": ("Xeon EMR", "Intel Xeon (Emerald Rapids, family 6 model 207: AVX-512, VNNI; AMX not exposed), 2 vCPU"),
}
# Per results file, in the order the runs were made: (date, machine, what it shows). The command
# that reproduces a run is rebuilt from the configuration its JSON records (`command`).
SOURCES: dict[str, tuple[str, str, str]] = {
    "kld-olmo2-random-zen3": ("2026-12-08", "zen3", "a random olmo2 GGUF (norms on attention's and the MLP's "
                              "outputs, q/k norms over the projection): int4-a8 and llama.cpp against our float32"),
    "kld-smollm3-random-zen3": ("2026-12-08", "zen3", "a random smollm3 GGUF (8 layers, every 4th without rotary "
                                "embeddings): int4-a8 and llama.cpp against our float32"),
    "kld-qwen3-random-zen3": ("2026-12-08", "zen3", "a random qwen3 GGUF (per-head q/k norms, head_dim 128): "
                              "int4-a8 and llama.cpp against our float32"),
    "kld-qwen2-random-zen3": ("2026-12-08", "zen3", "a random qwen2 GGUF of the same size: int4-a8 and llama.cpp "
                              "against our float32"),
    "kld-llama-random-zen3": ("2026-12-08", "zen3", "a random llama GGUF of the same size: int4-a8 and llama.cpp "
                              "against our float32"),
    "kld-llama3-rope-ignored-zen3": ("2026-12-08", "zen3", "a random llama GGUF with Llama 3.1's rope factors, "
                                     "the factors ignored (specdec before they were read)"),
    "kld-llama3-stretched-ignored-zen3": ("2026-12-08", "zen3", "a random llama GGUF with rope factors over a "
                                          "64-token original context, the factors ignored"),
    "kld-llama3-rope-zen3": ("2026-12-08", "zen3", "a random llama GGUF with Llama 3.1's rope factors, read"),
    "kld-llama3-stretched-zen3": ("2026-12-08", "zen3", "a random llama GGUF with rope factors over a 64-token "
                                  "original context, read"),
    "bench-code-edit-prefetch-kept-zen4": ("2026-12-07", "zen4", "code edits of 256 tokens on a Zen 4 EPYC: "
                                           "suffix beside llama.cpp and OpenVINO GenAI's prompt lookup"),
    "draft-ranks-zen4": ("2026-12-07", "zen4", "where the target's greedy tokens rank among the 0.5B draft's "
                         "choices on code, chat and prose: the most a draft chain or tree could accept"),
    "bench-steps-8k-attention-l2-zen4": ("2026-12-07", "zen4", "one row and five after 8,192 tokens on a Zen 4 "
                                         "EPYC with K/V rows asked for into L2 further ahead, beside llama.cpp"),
    "bench-steps-4k-attention-l2-zen4": ("2026-12-07", "zen4", "one row, five and nine verified rows after 4,096 "
                                         "tokens on a Zen 4 EPYC with K/V rows asked for into L2 further ahead, "
                                         "beside llama.cpp"),
    "bench-attention-l2-zen4": ("2026-12-07", "zen4", "the attention kernel alone on a Zen 4 EPYC, K/V rows asked "
                                "for into L2 further ahead: each K/V format at 2-16k tokens against the read "
                                "bandwidth"),
    "bench-step-overhead-prefetch-kept-zen4": ("2026-12-07", "zen4", "the step outside the forwards on a Zen 4 "
                                               "EPYC, plain and with the draft model"),
    "bench-prefetch-kept-zen4": ("2026-12-07", "zen4", "the speculation bench on a Zen 4 EPYC with the tiles' "
                                 "prefetches restored: plain, the draft model under the cost model, the hybrid, "
                                 "llama.cpp and OpenVINO GenAI's speculation on code, chat and prose"),
    "bench-steps-prefetch-kept-zen4": ("2026-12-07", "zen4", "the three prices on a Zen 4 EPYC with the tiles' "
                                       "prefetches restored, the draft as it drafts, beside llama.cpp, 1 to 512 rows"),
    "bench-spread-prefetch-zen4": ("2026-12-07", "zen4", "the speculation bench on a Zen 4 EPYC with the tiles' "
                                   "prefetches spread over each super-block: plain, the draft model under the cost "
                                   "model, the hybrid, llama.cpp and OpenVINO GenAI's speculation on code, chat and "
                                   "prose"),
    "bench-steps-spread-prefetch-zen4": ("2026-12-07", "zen4", "the three prices on a Zen 4 EPYC with the tiles' "
                                         "prefetches spread over each super-block, the draft as it drafts, beside "
                                         "llama.cpp, 1 to 256 rows"),
    "bench-steps-4k-spread-prefetch-zen4": ("2026-12-07", "zen4", "one row, five and nine verified rows after 4,096 "
                                            "tokens on a Zen 4 EPYC with the tiles' prefetches spread over each "
                                            "super-block, beside llama.cpp"),
    "bench-genoa-zen4": ("2026-12-07", "zen4", "the speculation bench on a Zen 4 EPYC: plain, the draft model "
                         "under the cost model, the hybrid, llama.cpp and OpenVINO GenAI's speculation on code, "
                         "chat and prose"),
    "bench-steps-int8-peak-zen4": ("2026-12-07", "zen4", "the three prices on a Zen 4 EPYC against the int8 peak "
                                   "measured by twelve real chains, the draft as it drafts, beside llama.cpp, 1 to "
                                   "256 rows"),
    "bench-f16-draft-xeon-emr": ("2026-12-07", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with "
                                 "the draft's scales and offsets in float16: plain, the draft model under the cost "
                                 "model, the hybrid, llama.cpp and OpenVINO GenAI's speculation on code, chat and "
                                 "prose"),
    "bench-steps-f16-draft-xeon-emr": ("2026-12-07", "xeon-emr", "the three prices on an Emerald Rapids Xeon with "
                                       "the draft's scales and offsets in float16, the draft as it drafts, beside "
                                       "llama.cpp, 1 to 256 rows"),
    "bench-q6-offsets-xeon-emr": ("2026-12-07", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with "
                                  "Q6_K's group scales in one vpdpwssd and register tiles of 12 rows: plain, the "
                                  "draft model under the cost model, the hybrid, llama.cpp and OpenVINO GenAI's "
                                  "speculation on code, chat and prose"),
    "bench-steps-q6-offsets-xeon-emr": ("2026-12-07", "xeon-emr", "the three prices on an Emerald Rapids Xeon with "
                                        "Q6_K's group scales in one vpdpwssd and register tiles of 12 rows, the "
                                        "draft as it drafts, beside llama.cpp, 1 to 256 rows"),
    "bench-steps-8k-q6-offsets-xeon-emr": ("2026-12-07", "xeon-emr", "one row and five verified rows after "
                                           "8,192 tokens on an Emerald Rapids Xeon, beside llama.cpp"),
    "bench-steps-4k-q6-offsets-xeon-emr": ("2026-12-07", "xeon-emr", "one row, five and nine verified rows after "
                                           "4,096 tokens on an Emerald Rapids Xeon with Q6_K's group scales in one "
                                           "vpdpwssd and register tiles of 12 rows, beside llama.cpp"),
    "bench-pair-sums-xeon-emr": ("2026-12-06", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with "
                                 "a head pair's scores summed in 16-float vectors: plain, the draft model under "
                                 "the cost model, the hybrid, llama.cpp and OpenVINO GenAI's speculation on "
                                 "code, chat and prose"),
    "bench-steps-pair-sums-xeon-emr": ("2026-12-06", "xeon-emr", "the three prices on an Emerald Rapids Xeon with "
                                       "a head pair's scores summed in 16-float vectors, the draft as it drafts, "
                                       "beside llama.cpp, 1 to 256 rows"),
    "bench-steps-4k-pair-sums-xeon-emr": ("2026-12-06", "xeon-emr", "one row, five and nine verified rows after "
                                          "4,096 tokens on an Emerald Rapids Xeon with a head pair's scores "
                                          "summed in 16-float vectors, beside llama.cpp"),
    "bench-attention-pair-sums-xeon-emr": ("2026-12-06", "xeon-emr", "the attention kernel alone over 28 layers' "
                                           "caches on an Emerald Rapids Xeon with a head pair's scores summed in "
                                           "16-float vectors: float16 and int8 K/V, 1, 5 and 9 rows, against "
                                           "the read bandwidth"),
    "bench-steps-many-xeon-emr": ("2026-12-06", "xeon-emr", "the three prices on an Emerald Rapids Xeon with "
                                  "past 8 rows every row through a tile column in one pass, the draft as it "
                                  "drafts, beside llama.cpp, 1 to 256 rows"),
    "bench-attention-rows-xeon-emr": ("2026-12-06", "xeon-emr", "the attention kernel alone over 28 layers' "
                                      "caches on an Emerald Rapids Xeon with a verification's head pairs scored "
                                      "across its rows: float16 and int8 K/V, 1, 5 and 9 rows, against the "
                                      "read bandwidth"),
    "bench-steps-4k-many-xeon-emr": ("2026-12-06", "xeon-emr", "one row, five and nine verified rows after "
                                     "4,096 tokens on an Emerald Rapids Xeon, beside llama.cpp"),
    "bench-picks-xeon-emr": ("2026-12-06", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with "
                             "coupled rows picked natively: plain, the draft model under the cost model, the "
                             "hybrid, llama.cpp and OpenVINO GenAI's speculation on code, chat and prose"),
    "bench-step-overhead-picks-xeon-emr": ("2026-12-06", "xeon-emr", "the step outside the forwards on an Emerald "
                                           "Rapids Xeon with coupled rows picked natively: plain and the draft "
                                           "model, greedy and sampled"),
    "bench-steps-picks-xeon-emr": ("2026-12-06", "xeon-emr", "the three prices on an Emerald Rapids Xeon, 1 to 17 "
                                   "rows, the draft as it drafts (4-bit per 64 values, a 32k-row output layer) "
                                   "beside llama.cpp"),
    "bench-code-edit-xeon-emr": ("2026-12-06", "xeon-emr", "code edits of 256 tokens on an Emerald Rapids Xeon: "
                                 "suffix beside llama.cpp and OpenVINO GenAI's prompt lookup"),
    "bench-chain-xeon-emr": ("2026-12-06", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with a "
                             "draft's positions in one C++ call (the draft chain): plain, the draft model under "
                             "the cost model, the hybrid, llama.cpp and OpenVINO GenAI's speculation on code, "
                             "chat and prose"),
    "bench-step-overhead-chain-xeon-emr": ("2026-12-06", "xeon-emr", "the step outside the forwards on an Emerald "
                                           "Rapids Xeon: plain, and the draft model greedy and sampled, with the "
                                           "draft chain and without it (one round trip a position)"),
    "bench-steps-prefetch-xeon-emr": ("2026-12-06", "xeon-emr", "the three prices on an Emerald Rapids Xeon "
                                      "with the tiles' streams asked for ahead (L1 and L2) and the read peak "
                                      "measured as the kernels stream, beside llama.cpp, 1 to 256 rows"),
    "bench-prefetch-xeon-emr": ("2026-12-06", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon with "
                                "the tiles' streams asked for ahead and greedy drafts in their sub-vocabulary: "
                                "plain, the draft model under the cost model, the hybrid, llama.cpp and OpenVINO "
                                "GenAI's speculation on code, chat and prose"),
    "bench-steps-4k-attention-xeon-emr": ("2026-12-06", "xeon-emr", "a decode row and a five-row verification "
                                          "after 4,096 tokens on an Emerald Rapids Xeon, attention in AVX-512, "
                                          "beside llama.cpp"),
    "bench-steps-8k-attention-xeon-emr": ("2026-12-06", "xeon-emr", "one row and five verified rows after 8,192 "
                                          "tokens (Emerald Rapids Xeon) beside llama.cpp"),
    "bench-attention-avx512-xeon-emr": ("2026-12-06", "xeon-emr", "the attention kernel alone over 28 layers' "
                                        "caches in AVX-512 on an Emerald Rapids Xeon, each K/V format against "
                                        "the read bandwidth"),
    "bench-step-overhead-prefetch-xeon-emr": ("2026-12-06", "xeon-emr", "the step outside the forwards on an "
                                              "Emerald Rapids Xeon with greedy drafts in their sub-vocabulary"),
    "bench-steps-draft-tiles-xeon-emr": ("2026-12-06", "xeon-emr", "the three prices on an Emerald Rapids Xeon "
                                         "with the draft's matrices as row-interleaved tiles of one group of 64 "
                                         "(4 and 3 bits), the target's K-quant tiles, beside llama.cpp, 1 to 256 "
                                         "rows"),
    "bench-step-overhead-draft-tiles-xeon-emr": ("2026-12-06", "xeon-emr", "the step outside the forwards on an "
                                                 "Emerald Rapids Xeon, plain and with the draft model at k = 4, "
                                                 "the draft's matrices as row-interleaved tiles"),
    "bench-draft-tiles64-xeon-emr": ("2026-12-06", "xeon-emr", "the speculation bench on an Emerald Rapids Xeon "
                                     "with the draft's row-interleaved tiles: plain, the draft model at 4 and 3 "
                                     "bits per 64 values under the cost model, the hybrid, llama.cpp and "
                                     "OpenVINO GenAI's speculation"),
    "bench-steps-tiles16-xeon-amx": ("2026-12-06", "xeon-amx", "the three prices on a Xeon with the target's "
                                     "K-quants read as row-interleaved tiles of 16 features, the draft at 4 and "
                                     "3 bits per 64 values, beside llama.cpp, 1 to 256 rows"),
    "kld-tiles16-xeon-amx": ("2026-12-06", "xeon-amx", "int4-a8 on row-interleaved tiles (one float "
                             "operation per super-block and feature) against float32, llama.cpp the anchor"),
    "bench-draft-tiles16-xeon-amx": ("2026-12-06", "xeon-amx", "the speculation bench on a Xeon with the "
                                     "row-interleaved tiles: plain, the draft model at 4 and 3 bits per 64 "
                                     "values under the cost model, the hybrid, llama.cpp and OpenVINO GenAI's "
                                     "speculation"),
    "profile-drafts-q64-xeon-amx": ("2026-12-06", "xeon-amx", "the draft packed four ways on every shipped set: "
                                    "acceptance and measured decode speedup at k = 3, and c as the engine sees it"),
    "bench-steps-prices-q64-xeon-amx": ("2026-12-06", "xeon-amx", "the three prices on a Xeon with the draft "
                                        "requantized per 64 values (4 and 3 bits) beside its 4-bit per-32 form, "
                                        "the target and llama.cpp"),
    "bench-draft-q64-xeon-amx": ("2026-12-06", "xeon-amx", "the speculation bench on a Xeon: the draft requantized "
                                 "to 4 bits per 64 values (the new default), per 32, and to 3 bits per 64, under "
                                 "the cost model, the hybrid, llama.cpp and OpenVINO GenAI's speculation"),
    "bench-steps-prices-pairs-xeon-amx": ("2026-12-05", "xeon-amx", "the three prices on a Xeon after the per-32 "
                                          "tiles that take two features a vector: the draft as the file holds it "
                                          "and as it runs by default, the target, beside llama.cpp"),
    "bench-step-overhead-xeon-amx": ("2026-12-05", "xeon-amx", "the step outside the forwards on a Xeon, plain "
                                     "and with the draft model at k = 4, after the cheaper draft step"),
    "bench-draft-pairs-xeon-amx": ("2026-12-05", "xeon-amx", "the speculation bench on a Xeon after the cheaper draft "
                                   "step and the cost model's fixes: plain, the draft model under the cost model "
                                   "and at k = 4, the hybrid, llama.cpp and OpenVINO GenAI's speculation"),
    "bench-draft-huge-xeon-amx": ("2026-12-05", "xeon-amx", "the speculation bench on a Xeon with the weights in huge "
                                  "pages: plain, the draft model, the hybrid, llama.cpp and OpenVINO GenAI's speculation"),
    "bench-steps-prices-xeon-amx": ("2026-12-05", "xeon-amx", "the three prices on a Xeon: the draft as the file "
                                    "holds it and as it runs by default, the target, beside llama.cpp, 1 to 256 rows"),
    "bench-steps-draft-variants-zen3": ("2026-12-05", "zen3", "the draft's one-row and five-row steps as the file "
                                        "holds it, requantized to 4 bits, with a 32k-token output layer, and both"),
    "bench-draft-variants-zen3": ("2026-12-05", "zen3", "the draft model at k = 4 on every shipped set: the new "
                                  "default, the file's draft, 4 bits only, the sub-vocabulary only"),
    "bench-draft-cheap-zen3": ("2026-12-05", "zen3", "the speculation bench with the cheaper default draft beside the "
                               "file's draft, the hybrid, llama.cpp and OpenVINO GenAI's speculation, 192 tokens"),
    "bench-peers-zen3": ("2026-12-05", "zen3", "int4-a8 (auto) beside llama.cpp and OpenVINO GenAI, their "
                         "speculation included, on three sets"),
    "bench-code-edit-zen3": ("2026-12-05", "zen3", "code edits of 256 tokens: suffix and n-gram beside llama.cpp's and "
                             "OpenVINO GenAI's prompt lookup"),
    "bench-draft-192-zen3": ("2026-12-05", "zen3", "the speculation bench: plain, the draft model under the cost "
                             "model and the hybrid beside llama.cpp and OpenVINO GenAI's speculation, 192 tokens"),
    "bench-steps-rows-zen3": ("2026-12-05", "zen3", "after the row-block, Q6_K and minimums changes: the "
                              "draft's and the target's forwards by new rows beside llama.cpp's, against the "
                              "int8 peak measured in assembly"),
    "bench-steps-prompt-tiles-zen3": ("2026-12-05", "zen3", "prompt tiles: the draft's and the target's forwards "
                                      "by new rows beside llama.cpp's, against the int8 peak measured in assembly"),
    "bench-decode-zen3": ("2026-12-05", "zen3", "plain decoding, the draft model and suffix beside llama.cpp on "
                          "three sets"),
    "bench-steps-ctx2k-zen3": ("2026-12-05", "zen3", "one row and five after 2,048 tokens of context beside llama.cpp"),
    "bench-steps-ctx16k-zen3": ("2026-12-05", "zen3", "one row and five after 16,384 tokens of context beside "
                                "llama.cpp"),
    "bench-spec-float32": ("2026-11-29", "zen1", "float32 target: the arms on the five prompt sets"),
    "bench-serve-float32": ("2026-11-29", "zen1", "Poisson arrivals through the server's engine, plain and draft"),
    "bench-spec-bfloat16": ("2026-11-29", "zen1", "bfloat16 target: verification is dear, the cost model stays plain"),
    "bench-precision": ("2026-11-30", "zen1", "precision modes against the float32 oracle"),
    "bench-spec-int4-peers": ("2026-11-30", "zen1", "int4 target and draft beside llama.cpp, first cost model"),
    "bench-spec-int4-cost-model": ("2026-11-30", "zen1", "int4, cost tables on medians and whole-step calibration"),
    "bench-spec-int4-layer-kernels": ("2026-11-30", "zen1", "int4, the C++ layer kernels (norm, RoPE, attention)"),
    "bench-spec-int4-thread-tuner": ("2026-11-30", "zen1", "int4, thread-tuner warm-up, wall-time check"),
    "bench-steps-h200": ("2026-11-30", "h200", "forward cost by new rows, random weights of the real shapes"),
    "cuda-linear-row-invariance-h200": ("2026-11-30", "h200", "row counts at which F.linear changes a row's bits, "
                                        "against 64-row blocks (a one-off measurement, no CLI command)"),
    "bench-spec-int4-fused-zen4": ("2026-11-30", "zen4", "int4 with the fused C++ layer loop"),
    "bench-spec-int4-a8-draft-zen4": ("2026-11-30", "zen4", "int4 target, int4-a8 draft, fixed-k arm added"),
    "bench-spec-int4-sliced-zen4": ("2026-11-30", "zen4", "int4: row-block prefill, k-sliced tiles, faster attention"),
    "bench-ngram-code-edit-48-zen4": ("2026-11-30", "zen4", "prompt lookup on code edits, int4"),
    "bench-plain-llamacpp-zen4": ("2026-11-30", "zen4", "plain int4 decoding beside llama.cpp"),
    "bench-precision-a16-zen4": ("2026-11-30", "zen4", "precision modes against the float32 oracle"),
    "bench-spec-a16-before-controller-zen4": ("2026-11-30", "zen4", "int4-a16, before per-domain acceptance priors"),
    "bench-spec-a16-zen4": ("2026-11-30", "zen4", "the default mode (int4-a16, int4-a8 draft) beside llama.cpp"),
    "bench-ngram-code-edit-48-a16-zen4": ("2026-11-30", "zen4", "prompt lookup on code edits, int4-a16"),
    "bench-ngram-code-edit-256-zen4": ("2026-11-30", "zen4", "prompt lookup on code edits, 256-token answers, int4"),
    "bench-draft-code-gen-192-zen4": ("2026-11-30", "zen4", "the draft model on 192-token answers, int4"),
    "bench-draft-code-gen-192-a16-zen4": ("2026-12-01", "zen4", "the draft model on 192-token answers, int4-a16, "
                                          "with a sub-vocabulary arm"),
    "bench-spec-a16-xeon": ("2026-12-01", "xeon", "the default mode on a Xeon, three sets, 2 prompts each"),
    "bench-ngram-code-edit-48-a16-xeon": ("2026-12-01", "xeon", "prompt lookup on code edits, int4-a16, on a Xeon"),
    "bench-suffix-xeon": ("2026-12-01", "xeon", "suffix decoding and the hybrid beside the draft model, four sets"),
    "bench-suffix-codegen-xeon": ("2026-12-01", "xeon", "suffix, hybrid and draft model on 192-token code answers"),
    "bench-agentic-xeon": ("2026-12-01", "xeon", "an agentic session in order (rewrites, tests, JSON, tool calls), "
                           "requests ending at EOS"),
    "bench-serve-agentic-xeon": ("2026-12-01", "xeon", "the agentic session under Poisson arrivals, plain and "
                                 "suffix"),
    "bench-soak-xeon": ("2026-12-01", "xeon", "a server process under 8 misbehaving clients for 10 minutes"),
    "bench-soak-single-smollm-xeon": ("2026-12-02", "xeon", "one server process, SmolLM2-135M, 8 misbehaving "
                                      "clients for 3 minutes"),
    "bench-soak-ray2-kill-smollm-xeon": ("2026-12-02", "xeon", "two engine replicas on Ray Serve, one killed 60 s "
                                         "in, SmolLM2-135M, 8 misbehaving clients for 3 minutes"),
    "bench-structured-xeon": ("2026-12-01", "xeon", "constrained decoding on the structured set: plain, "
                              "grammar-forced drafts, suffix"),
    "bench-replicas-xeon": ("2026-12-01", "xeon", "one server process against two engine replicas on Ray "
                            "Serve, SmolLM2-135M, 8 clients"),
    "bench-affinity-xeon": ("2026-12-01", "xeon", "multi-turn chats on four replicas: prefix-affinity against "
                            "random routing"),
    "bench-affinity-2-xeon": ("2026-12-01", "xeon", "multi-turn chats on two replicas: prefix-affinity against "
                              "random routing"),
    "kld-xeon": ("2026-12-02", "xeon", "each mode's next-token distributions against float32, llama.cpp the anchor"),
    "bench-steps-int4-xeon": ("2026-12-02", "xeon", "forward cost by new rows, the real files: our integer modes "
                              "(AVX-512 VNNI) and llama.cpp"),
    "bench-steps-int4-avx2-xeon": ("2026-12-02", "xeon", "the same with SPECDEC_KERNEL_ISA=avx2"),
    "bench-spec-llamacpp-xeon": ("2026-12-02", "xeon", "the default mode beside llama.cpp (AVX-512, no AMX) on "
                                 "the five sets"),
    "bench-draft-code-gen-192-llamacpp-xeon": ("2026-12-02", "xeon", "the draft model and suffix on 192-token code "
                                               "answers beside llama.cpp"),
    "bench-ngram-code-edit-256-llamacpp-xeon": ("2026-12-02", "xeon", "prompt lookup on code edits, 256-token "
                                                "answers, beside llama.cpp"),
    "bench-threads-xeon": ("2026-12-02", "xeon", "thread counts of each kernel, quiet and beside a busy process "
                           "(AVX-512 VNNI)"),
    "kld-exact-xeon": ("2026-12-02", "xeon", "each mode against float32 with int4-a8's offsets on the rounded "
                       "activations; the second half of each chunk scored, as llama.cpp does"),
    "bench-peers-xeon": ("2026-12-02", "xeon", "int4-a8 (auto) beside llama.cpp and OpenVINO GenAI, their "
                         "speculation included, on three sets"),
    "bench-peers-code-gen-192-xeon": ("2026-12-02", "xeon", "192-token code answers: the draft model and suffix "
                                      "beside llama.cpp, its lookup and OpenVINO's draft-model speculation"),
    "bench-peers-code-edit-256-xeon": ("2026-12-02", "xeon", "256-token code edits: suffix and n-gram beside "
                                       "llama.cpp, its lookup and OpenVINO's prompt lookup"),
    "bench-steps-a8-xeon": ("2026-12-02", "xeon", "forward cost by new rows, the real file: int4-a8 with exact "
                            "offsets, int4-a16 and llama.cpp"),
    "bench-matmul-xeon": ("2026-12-02", "xeon", "each matrix product's error under int8 activations, offsets on "
                          "the unrounded against the rounded activations"),
    "bench-step-overhead-xeon": ("2026-12-02", "xeon", "a sampled batch of 8 with suffix drafts: the share of a step "
                                 "outside the target forward and its peak memory, before and after the flat verifier"),
    "bench-step-values-xeon": ("2026-12-02", "xeon", "greedy token ids and speed of the shipped prompts before and "
                               "after the step as values, every precision (a one-off script)"),
    "bench-steps-a8-zen4": ("2026-12-02", "zen4", "forward cost by new rows, the real file, timed interleaved: "
                            "llama.cpp, int4-a8 with Q6_K at 6 bits and integer minimums, int4-a16"),
    "bench-steps-roofline-zen3": ("2026-12-04", "zen3", "forward cost by new rows against this machine's bound, "
                                  "the draft and the target, int4-a8"),
    "bench-steps-4k-zen3": ("2026-12-04", "zen3", "one row and a five-row verification after 4,096 tokens of "
                            "context, against this machine's bound (keys and values included)"),
    "bench-draft-q4-zen3": ("2026-12-04", "zen3", "the draft model from the file's blocks, requantized to 4 bits, "
                            "and each with a 32k sub-vocabulary, k = 4 fixed"),
    "bench-tool-speed-xeon": ("2026-12-03", "xeon-amx", "a named tool call under its grammar against as many free "
                              "tokens, the default pair with draft-model speculation"),
    "bench-coupling-xeon": ("2026-12-03", "xeon-amx", "acceptance of the 0.5B draft under Gumbel coupling and under "
                            "rejection sampling, by set and temperature, and seeded exactness on hold-out prompts"),
    "bench-soak-checked-xeon": ("2026-12-03", "xeon-amx", "one server process, the default pair, 4 clients for 10 "
                                "minutes, every completed answer checked against its plain reference"),
    "bench-soak-checked-ray2-kill-xeon": ("2026-12-03", "xeon-amx", "two replicas of the default pair on Ray "
                                          "Serve, one killed mid-run, every completed answer checked"),
    "bench-coupling-zen3": ("2026-12-04", "zen3", "acceptance of the 0.5B draft under Gumbel coupling and under "
                            "rejection sampling, by set and temperature, and seeded exactness on hold-out prompts"),
    "bench-soak-checked-zen3": ("2026-12-04", "zen3", "one server process, the default pair drafting k = 4 every "
                                "step, 4 clients for 10 minutes, every completed answer checked against its plain "
                                "reference"),
    "bench-soak-checked-ray2-kill-zen3": ("2026-12-04", "zen3", "two replicas of the default pair on Ray Serve "
                                          "drafting k = 4 every step, one killed mid-run, every completed answer "
                                          "checked"),
    "bench-step-overhead-zen3": ("2026-12-05", "zen3", "one greedy request, plain and with the draft model at "
                                 "k = 4: each part of a step by its self time, the forwards apart"),
    "kld-kv-zen3": ("2026-12-05", "zen3", "int4-a8 with float32 and float16 K/V caches against float32, "
                    "head-major caches (llama.cpp's figures: kld-zen4, the same tokens)"),
    "kld-kv8-zen3": ("2026-12-05", "zen3", "int4-a8 with an int8 K/V cache (a scale per 32 values) against "
                     "float32"),
    "bench-attention-zen3": ("2026-12-05", "zen3", "the attention kernel over every layer's cache of the 1.5B, "
                             "by context and K/V format, against the read bandwidth"),
    "bench-steps-kv3-4k-zen3": ("2026-12-05", "zen3", "one row and five after 4,096 tokens of context in each K/V "
                                "format, beside llama.cpp (float16 K/V)"),
    "bench-steps-kv3-8k-zen3": ("2026-12-05", "zen3", "one row and five after 8,192 tokens of context in each K/V "
                                "format, beside llama.cpp (float16 K/V)"),
    "bench-steps-prompt-zen3": ("2026-12-05", "zen3", "prompts of 256 and 512 rows beside llama.cpp, against the "
                                "int8 multiply-add peak"),
    "kld-kv16-zen3": ("2026-12-05", "zen3", "int4-a8 with a float32 and a float16 K/V cache against float32 "
                      "(llama.cpp's figures: kld-zen4, the same tokens)"),
    "bench-steps-prices-zen3": ("2026-12-05", "zen3", "the three prices: the draft's and the target's forwards by "
                                "new rows beside llama.cpp's, against this machine's bound"),
    "bench-steps-kv-4k-zen3": ("2026-12-05", "zen3", "one row and five after 4,096 tokens of context: float16 and "
                               "float32 K/V caches beside llama.cpp (float16 K/V)"),
    "bench-steps-kv-8k-zen3": ("2026-12-05", "zen3", "one row and five after 8,192 tokens of context: float16 and "
                               "float32 K/V caches beside llama.cpp (float16 K/V)"),
    "kld-zen4": ("2026-12-02", "zen4", "each mode against float32 with Q6_K at 6 bits and Q4_K's integer "
                 "minimums; the second half of each chunk scored"),
    "bench-peers-zen4": ("2026-12-02", "zen4", "int4-a8 (auto) beside llama.cpp and OpenVINO GenAI, their "
                         "speculation included, on three sets"),
    "bench-peers-code-gen-192-zen4": ("2026-12-02", "zen4", "192-token code answers: the draft model and suffix "
                                      "beside llama.cpp, its lookup and OpenVINO's draft-model speculation"),
    "bench-peers-code-edit-256-zen4": ("2026-12-02", "zen4", "256-token code edits: suffix and n-gram beside "
                                       "llama.cpp, its lookup and OpenVINO's prompt lookup"),
}
ARM_LABELS = {
    "plain": "plain", "draft_fixed": "draft, fixed k", "draft_cost_model": "draft, cost model",
    "ngram": "n-gram, cost model", "ngram_fixed": "n-gram, fixed k",
    "draft_file_fixed": "draft as the file holds it, all tokens, fixed k",
    "draft_file_cost_model": "draft as the file holds it, all tokens, cost model",
    "draft_subvocab_fixed": "draft (32k sub-vocabulary), fixed k",
    "draft_subvocab_cost_model": "draft (32k sub-vocabulary), cost model",
    "draft_q4_fixed": "draft requantized to 4 bits, fixed k",
    "draft_q4_cost_model": "draft requantized to 4 bits, cost model",
    "draft_q4_subvocab_fixed": "draft requantized to 4 bits, 32k sub-vocabulary, fixed k",
    "draft_q4_1_cost_model": "draft as q4_1 (4 bits per 32), cost model",
    "draft_q4_64_cost_model": "draft as q4_64 (4 bits per 64), cost model",
    "draft_q3_64_cost_model": "draft as q3_64 (3 bits per 64), cost model",
    "suffix": "suffix", "hybrid": "hybrid (suffix or draft)",
}


# ---- formatting ---------------------------------------------------------------------------------

def num(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def ratio(spread: dict | None) -> str:
    """A ratio's median with its min–max, e.g. `1.03× [0.98–1.05]`."""
    if not spread:
        return "—"
    return f"{spread['median']:.2f}× [{spread['min']:.2f}–{spread['max']:.2f}]"


def table(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def label(arm: str, k: int | None) -> str:
    text = ARM_LABELS.get(arm, arm)
    return text.replace("fixed k", f"fixed k = {k}") if k is not None else text


# ---- inputs -------------------------------------------------------------------------------------

def load(root: Path, stem: str) -> dict:
    path = root / "docs" / "results" / f"{stem}.json"
    if not path.exists():
        raise SystemExit(f"error: {path} not found (named by a generated block)")
    return json.loads(path.read_text())


def source_link(root: Path, doc: Path, stem: str) -> str:
    target = root / "docs" / "results" / f"{stem}.json"
    return f"[{stem}.json]({os.path.relpath(target, doc.parent)})"


def config_note(data: dict) -> str:
    """What the JSON records about the run's conditions (its configuration is in the command)."""
    parts = []
    if data.get("mode") in ("replicas", "affinity"):  # whole server processes: each arm started afresh
        repeats = len(next(iter(data["runs"].values())))
        parts.append(f"{repeats} repeats, arms alternating, each on a fresh deployment")
    elif "runs" in data:
        parts.append(f"{data.get('noisy_runs', 0)} of {len(data['runs'])} runs noisy")
    if data.get("bandwidth_gb_s"):
        parts.append(f"read bandwidth {data['bandwidth_gb_s']:.1f} GB/s, "
                     f"ceiling {data['ceiling_tokens_per_second']:.1f} tokens/s")
    return "; ".join(parts)


def caption(root: Path, doc: Path, stem: str, data: dict) -> str:
    date, machine, _ = SOURCES.get(stem, ("undated", "", ""))
    note = config_note(data)
    return (f"*{date}, {MACHINES.get(machine, ('', 'unknown machine'))[1]}; {source_link(root, doc, stem)}"
            f"{'; ' + note if note else ''}.*  \n*Command:* `{command(data)}`")


# ---- the command that reproduces a run, from what its JSON records --------------------------------

def spec_command(data: dict) -> str:
    peers, summary = list(data.get("peers") or {}), data["summary"]
    arms = [a for a in next(iter(summary.values())) if a not in peers]
    parts = ["specdec bench"] + ([] if data["model"] == DEFAULT_MODEL else [f"--model {data['model']}"])
    parts.append(f"--precision {data['precision']}")
    if data.get("draft_precision") not in (None, data["precision"]):
        parts.append(f"--draft-precision {data['draft_precision']}")
    parts += [f"--sets {','.join(summary)}", f"--num-prompts {data['num_prompts_per_set']}",
              f"--repeats {data['repeats']}", f"--max-tokens {data['max_tokens']}", f"--arms {','.join(arms)}",
              f"-k {data['k']}"] + ([f"--peers {','.join(peers)}"] if peers else [])
    return " ".join(parts + (["--until-eos"] if data.get("until_eos") else []))


def precision_command(data: dict) -> str:
    sets = data["sets"].split(",")
    modes = [m for m in data["summary"] if m != "float32"]
    return (f"specdec bench precision --max-tokens {data['max_tokens']} "
            f"--num-prompts {len(data['prompts']) // len(sets)} --precisions {','.join(modes)} --sets {data['sets']}")


def serve_command(data: dict) -> str:
    return (f"specdec bench serve --precision {data['precision']} --arms {','.join(data['results'])} "
            f"--rates {','.join(map(str, data['rates']))} --num-requests {data['num_requests_per_rate']} "
            f"--max-tokens {data['max_tokens']} -k {data['k']} --max-batch-size {data['max_batch_size']} "
            f"--policy {data['policy']}" + (f" --sets {data['sets']}" if "sets" in data else "")
            + (" --in-order" if data.get("in_order") else "") + (" --until-eos" if data.get("until_eos") else ""))


def soak_command(data: dict) -> str:
    return (f"specdec bench soak --model {data['model']} --precision {data['precision']} "
            f"--clients {data['clients']} --minutes {data['minutes']:g} --warmup-minutes {data['warmup_minutes']:g} "
            f"--max-tokens {data['max_tokens']} --max-batch-size {data['max_batch_size']} --sets {data['sets']} "
            f"--num-prompts {data['num_prompts']} --seed {data['seed']}"
            + (f" --max-requests {data['max_requests']}" if data.get("max_requests") else "")
            + (f" --replicas {data['replicas']}" if (data.get("replicas") or 1) > 1 else "")
            + (f" --kill-replica-at {data['kill_replica_at']:g}" if data.get("kill_replica_at") else "")
            + (f" --draft {data['draft']}" if data.get("draft") else "")
            + (f" --policy {data['policy']} -k {data['k']}" if data.get("policy", "cost_model") != "cost_model" else "")
            + (f" --check-outputs --bodies-per-kind {_bodies_per_kind(data)}" if data.get("check_outputs") else ""))


def _bodies_per_kind(data: dict) -> int:
    """Recorded since the option came in; earlier checked runs have it as the pool's size by kind."""
    return data.get("bodies_per_kind") or max(len(keys) for keys in data["pool"].values())


def structured_command(data: dict) -> str:
    return (f"specdec bench structured --model {data['model']} --precision {data['precision']} "
            f"--arms {','.join(data['summary'])} --repeats {data['repeats']} --max-tokens {data['max_tokens']} "
            f"-k {data['k']}" + (f" --draft {data['draft']}" if data.get("draft") else ""))


def scale_out_command(data: dict) -> str:
    """`bench replicas` and `bench affinity`: both start `specdec serve` processes under HTTP load."""
    common = (f"--model {data['model']} --precision {data['precision']} --clients {data['clients']} "
              f"--max-tokens {data['max_tokens']} --repeats {len(next(iter(data['runs'].values())))} "
              f"--cpus-per-replica {data['cpus_per_replica']:g}")
    if data["mode"] == "replicas":
        return (f"specdec bench replicas {common} --arms {','.join(data['runs'])} "
                f"--num-requests {data['num_requests']} --routing {data['routing']}")
    return (f"specdec bench affinity {common} --replicas {data['replicas']} "
            f"--conversations {data['conversations']} --turns {data['turns']}")


def steps_command(data: dict) -> str:
    rows = sorted({r["rows"] for r in data["results"]})
    dtypes = list(dict.fromkeys(r["precision"] for r in data["results"]))
    return (f"specdec bench steps --device {data['device']} --context {data['context']} "
            f"--rows {','.join(map(str, rows))} --precisions {','.join(dtypes)}")


def kld_command(data: dict) -> str:
    extra = f" --max-tokens {data['max_tokens']}" if data.get("max_tokens") else ""
    first = f" --first {data['first']}" if "first" in data else ""
    return (f"specdec kld --model {data['model']} --modes {','.join(data['modes_scored'])} --ctx {data['ctx']}"
            f"{first}{extra} --decode-tokens {data['decode_tokens']} --repeats {data['repeats']}"
            + ("" if "llama.cpp" in data["modes"] else " --no-llama-cpp"))


def matmul_command(data: dict) -> str:
    return (f"specdec bench matmul --model {data['model']} --kind {data['kind']} "
            f"--context {data['rows'] + data['first'] + 1} --first {data['first']}")


def attention_command(data: dict) -> str:
    return (f"python -m specdec.bench.attention --shape {data['shape']} --contexts "
            f"{','.join(map(str, data['contexts']))} --kv {','.join(data['kv'])} --rows "
            f"{','.join(map(str, data['rows']))} --repeats {data['repeats']}")


def draft_ranks_command(data: dict) -> str:
    parts = ["python -m specdec.bench.draft_ranks"]
    if data["target"] != DEFAULT_MODEL:
        parts.append(f"--model {data['target']} --draft {data['draft']}")
    if data["precision"] != "int4-a8":
        parts.append(f"--precision {data['precision']}")
    if data["draft_requantize"] != "auto":
        parts.append(f"--draft-requantize {data['draft_requantize']}")
    parts.append(f"--sets {','.join(s['name'] for s in data['sets'])} --num-prompts {data['num_prompts']} "
                 f"--max-tokens {data['max_tokens']}")
    return " ".join(parts)


def command(data: dict) -> str:
    """The command line that reproduces the run, rebuilt from the configuration its JSON records."""
    if data.get("mode") == "attention":
        return attention_command(data)
    if data.get("mode") == "draft_ranks":
        return draft_ranks_command(data)
    if data.get("mode") == "kld":
        return kld_command(data)
    if data.get("mode") == "matmul":
        return matmul_command(data)
    if "best_threads" in data:
        return (f"specdec bench threads --shape {data['shape'][0]}x{data['shape'][1]} -k {data['rows'][-1] - 1} "
                f"--repeats {data['repeats']} --calls {data['calls']}")
    if data.get("mode") == "structured":
        return structured_command(data)
    if data.get("mode") in ("replicas", "affinity"):
        return scale_out_command(data)
    if "runs" in data and "summary" in data:
        return spec_command(data)
    if "prompts" in data and "summary" in data:
        return precision_command(data)
    if "rates" in data:
        return serve_command(data)
    if "clients" in data and "by_outcome" in data:
        return soak_command(data)
    if isinstance(data.get("results"), list):
        return steps_command(data)
    if isinstance(data.get("command"), str):
        return data["command"]
    return "(no CLI command)"


# ---- views --------------------------------------------------------------------------------------

def spec_rows(data: dict) -> list[list[str]]:
    peers, k = set(data.get("peers") or {}), data.get("k")
    rows = []
    for s, arms in data["summary"].items():
        for arm, e in arms.items():
            own = arm not in peers
            if "tokens_per_second" not in e:  # a peer that failed to install, load or run
                rows.append([s, label(arm, k) + " (peer)", "failed", "—", "—", "—", "—", "—", "—"])
                continue
            same = e.get("identical_to_plain")
            rows.append([s, label(arm, k) + ("" if own else " (peer)"), num(e["tokens_per_second"]["median"]),
                         "—" if arm == "plain" else ratio(e.get("speedup")),
                         num((e.get("decode_tokens_per_second") or {}).get("median")),
                         "—" if arm == "plain" else ratio(e.get("decode_speedup")),
                         num(e.get("acceptance_rate")), num(e.get("mean_accepted_length")),
                         ("yes" if same else "no") if own and same is not None else "—"])
    return rows


def view_spec(data: dict) -> str:
    """Every set and arm: tokens/s (whole request, decode only) and ratios to plain with min–max."""
    header = ["set", "arm", "tok/s", "vs plain [min–max]", "decode tok/s", "decode vs plain [min–max]",
              "acceptance", "tokens / forward", "output == plain"]
    return table(header, spec_rows(data), right_from=2)


def wide_cell(e: dict, arm: str, own: bool) -> str:
    if "tokens_per_second" not in e:  # a peer that failed to install, load or run
        return "failed"
    decode = e.get("decode_tokens_per_second")
    if arm == "plain" or not own:
        rate = num(e["tokens_per_second"]["median"])
        return rate + (f" ({num(decode['median'])})" if decode else "")
    cell = f"{e['speedup']['median']:.2f}×"
    return cell + (f" ({e['decode_speedup']['median']:.2f}×)" if e.get("decode_speedup") else "")


def view_spec_wide(data: dict) -> str:
    """One row per set: plain tokens/s, each arm's ratio to plain, each peer's tokens/s and the ratio
    of our plain decoding to it; decode-only figures in brackets."""
    peers, k = list(data.get("peers") or {}), data.get("k")
    arms = list(next(iter(data["summary"].values())))
    header = ["set"] + [label(a, k) + (" tok/s" if a == "plain" or a in peers else "") for a in arms]
    header += [f"plain / {p}" for p in peers]
    rows = []
    for s, entries in data["summary"].items():
        row = [s] + [wide_cell(entries[a], a, a not in peers) for a in arms]
        for p in peers:
            ours, theirs = entries["plain"], entries[p]
            if "tokens_per_second" not in theirs:
                row.append("—")
                continue
            dec = (ours.get("decode_tokens_per_second") or {}).get("median")
            peer_dec = (theirs.get("decode_tokens_per_second") or {}).get("median")
            whole = ours["tokens_per_second"]["median"] / theirs["tokens_per_second"]["median"]
            row.append(f"{whole:.2f}" + (f" ({dec / peer_dec:.2f})" if dec and peer_dec else ""))
        rows.append(row)
    return table(header, rows)


PLAIN_PEERS = ("llama.cpp", "openvino", "transformers")  # the peers that decode without speculation


def paired(data: dict, s: str, ours: str, theirs: str, rate: str = "tokens_per_second") -> dict | None:
    """{median, min, max} of ours / theirs over the runs of set s, paired by prompt and repeat."""
    runs = {(r["arm"], r["prompt"], r["repeat"]): r.get(rate) for r in data["runs"] if r["set"] == s}
    ratios = sorted(v / runs[(theirs, p, rep)] for (arm, p, rep), v in runs.items()
                    if arm == ours and v and runs.get((theirs, p, rep)))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]} if ratios else None


def view_peers(data: dict) -> str:
    """Per set: our plain decoding against the fastest peer's, and our best arm against the best peer
    arm (their speculation included); ratios paired per run, median [min–max]."""
    peers, k = list(data.get("peers") or {}), data.get("k")
    rows = []
    for s, entries in data["summary"].items():
        med = lambda a: entries[a]["tokens_per_second"]["median"]  # noqa: E731
        ok = [p for p in peers if "tokens_per_second" in entries[p]]
        own = max((a for a in entries if a not in peers), key=med)
        plain_peer = max((p for p in ok if p in PLAIN_PEERS), key=med, default=None)
        best_peer = max(ok, key=med, default=None)
        if plain_peer is None or best_peer is None:
            rows.append([s, num(med("plain")), f"{label(own, k)}: {num(med(own))}", "—", "—", "—", "—", "—"])
            continue
        rows.append([s, num(med("plain")), f"{label(own, k)}: {num(med(own))}",
                     f"{plain_peer}: {num(med(plain_peer))}", f"{best_peer}: {num(med(best_peer))}",
                     ratio(paired(data, s, "plain", plain_peer)),
                     ratio(paired(data, s, "plain", plain_peer, "decode_tokens_per_second")),
                     ratio(paired(data, s, own, best_peer))])
    failed = [f"{p} ({data['peers'][p]['failed']})" for p in peers if (data["peers"][p] or {}).get("failed")]
    note = f"\n\nFailed: {'; '.join(failed)}." if failed else ""
    return table(["set", "plain tok/s", "best arm tok/s", "fastest plain peer", "best peer arm",
                  "plain / that peer", "decode only", "best arm / best peer arm"], rows, right_from=1) + note


def view_precision(data: dict) -> str:
    """Each mode against float32: decode speed, greedy agreement, logit error, top-1 agreement."""
    header = ["mode", "decode tok/s [min–max]", "vs float32", "greedy == float32", "max / mean logit error",
              "top-1 agreement"]
    prompts, rows = data["prompts"], []
    for mode, s in data["summary"].items():
        speed = f"{s['tok_s_median']:.2f} [{s['tok_s_min']:.2f}–{s['tok_s_max']:.2f}]"
        if mode == "float32":
            rows.append([mode, speed, "1.00×", "—", "—", "—"])
            continue
        runs = [p["modes"][mode] for p in prompts if mode in p["modes"]]
        diffs = sorted({r["first_diff"] for r in runs if not r["matches"] and r["first_diff"] is not None})
        agree = f"{sum(r['matches'] for r in runs)} of {len(runs)} prompts"
        if diffs:
            agree += f" (first differences at {', '.join(map(str, diffs))})"
        rows.append([mode, speed, f"{s['speedup_vs_float32']:.2f}×", agree,
                     f"{s['max_logit_err']:.2g} / {s['mean_logit_err']:.2g}", f"{s['top1_agree']:.3f}"])
    return table(header, rows)


def view_serve(data: dict) -> str:
    """Each arrival rate and arm: throughput, latency percentiles, acceptance."""
    header = ["rate (req/s)", "arm", "tok/s", "TTFT p50 / p99 (s)", "TPOT p50 (s)", "e2e p50 / p99 (s)",
              "acceptance"]
    rows = []
    for rate in (str(r) for r in data["rates"]):
        for arm, by_rate in data["results"].items():
            r = by_rate[rate]
            rows.append([rate, arm, num(r["throughput_tokens_per_second"]),
                         f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f}", num(r["tpot_p50"]),
                         f"{r['e2e_p50']:.1f} / {r['e2e_p99']:.1f}", num(r.get("acceptance_rate"))])
    return table(header, rows, right_from=2)


def view_soak(data: dict) -> str:
    """Requests by kind and outcome, latency, and what the server kept after the run."""
    checked = bool(data.get("check_outputs"))
    rows = [[kind, str(k["requests"]), str(k["expected"]), str(k["failed"])]
            + ([str(k.get("wrong", 0))] if checked else []) + [num(k["p50"]), num(k["p99"])]
            for kind, k in data["by_kind"].items()]
    text = table(["kind", "requests", "as expected", "failed"] + (["wrong"] if checked else [])
                 + ["latency p50 (s)", "p99 (s)"], rows, right_from=1)
    by, after = data["by_outcome"], data["kv_blocks_used_after"]
    # with replicas the page also carries their sum (replica="all"): count each block once
    kv = sum(v for k, v in after.items() if 'replica="all"' in k) if any('replica="all"' in k for k in after) \
        else sum(after.values())
    served = data.get("served") or {}
    kill = "" if not data.get("kill_replica_at") else (
        f" One of {data['replicas']} replicas was killed {data['kill_replica_at']:g} s in: {by.get('killed', 0)} "
        f"request(s) in flight on it cut, {int(data.get('ingress', {}).get('specdec_ingress_retries_total', 0))} "
        f"re-sent by the ingress; {data.get('ray_serve_error_log_lines', 0)} ERROR lines in the replicas' Serve logs.")
    return text + (f"\n\nServed at {served.get('precision', data['precision'])}. {data['requests']} requests in "
                   f"{data['wall_seconds'] / 60:.1f} min from {data['clients']} "
                   f"clients: {by['ok']} answered whole, {by['rejected']} invalid ones refused with a 4xx, "
                   f"{by['dropped']} dropped by their client, **{by['failed']} failed**. After the run: "
                   f"{kv:g} KV blocks in use (all pools), resident memory {data['rss_mb_before']:.0f} → "
                   f"{data['rss_mb_after']:.0f} MB ({100 * data['rss_growth']:+.1f} %), "
                   f"{data['error_log_lines']} ERROR lines in the server's log, exit code {data['server_exit_code']}."
                   + kill + (_checked_note(data) if checked else ""))


def _checked_note(data: dict) -> str:
    spec = {k: v for k, v in (data.get("spec_tokens") or {}).items() if 'replica="all"' not in k}
    drafted = sum(v for k, v in spec.items() if "drafted" in k)
    accepted = sum(v for k, v in spec.items() if "accepted" in k)
    return (f" Every completed answer was compared with the same request decoded alone without speculation "
            f"({data['references']} references): **{data['by_outcome'].get('wrong', 0)} wrong** "
            f"({data.get('warmup_wrong', 0)} in the warm-up); {accepted:g} of {drafted:g} drafted tokens accepted "
            f"during the run.")


def view_coupling(data: dict) -> str:
    """Acceptance of Gumbel coupling and of rejection sampling by set and temperature, and exactness."""
    rows = [[r["set"], f"{r['temperature']:g}", num(r["gumbel"]["acceptance"], 3), num(r["rejection"]["acceptance"], 3),
             num(r["gumbel_over_rejection"], 2), num(r["gumbel"]["tokens_per_forward"], 2),
             num(r["rejection"]["tokens_per_forward"], 2)] for r in data["acceptance"]]
    text = table(["set", "T", "accepted, gumbel", "accepted, rejection", "gumbel / rejection",
                  "tokens a forward, gumbel", "rejection"], rows, right_from=1)
    e = data["exactness"]
    exact = "; ".join(f"{m}: {v['equal']} of {v['of']}" for m, v in e["by_method"].items())
    return (text + f"\n\n{data['draft']} drafting for {data['target']} at `{data['precision']}`, k = {data['k']} "
            f"fixed, {data['max_tokens']} tokens a request. Hold-out prompts, seeded, T = {e['temperature']:g}: "
            f"speculative text equal to plain text token for token under coupling, {exact}.")


def view_structured(data: dict) -> str:
    """Per arm: whole-request speedup over plain constrained decoding, validity, forced share, mask cost."""
    rows = []
    for arm, s in data["summary"].items():
        speed = "1" if arm == "plain" else f"{num(s['speedup_median'])}× ({num(s['speedup_min'])}–{num(s['speedup_max'])})"
        rows.append([arm, speed, f"{num(s['speedup_total'])}×", num(s["tokens_per_second_median"]),
                     f"{100 * s['valid_fraction']:.0f} %", f"{100 * s['same_as_plain_fraction']:.0f} %",
                     f"{100 * s['forced_share']:.0f} %", num(s["acceptance"]), num(s["mask_ms_mean"], 3)])
    return table(["arm", "speedup, median (min–max)", "whole set", "tok/s", "valid", "same as plain",
                  "forced tokens", "acceptance", "mask ms"], rows, right_from=1)


def spread(s: dict, digits: int = 2, suffix: str = "") -> str:
    """A {median, min, max} as 'median (min–max)'."""
    if not s:
        return "—"
    return f"{num(s['median'], digits)}{suffix} ({num(s['min'], digits)}–{num(s['max'], digits)})"


def view_kld(data: dict) -> str:
    """Every mode and llama.cpp against float32 on the same tokens (llama.cpp's KL-divergence statistics):
    the scored rows (from `first` on), and every row's mean KLD and same-top-1 beside them."""
    rows = []
    for m, d in data["modes"].items():
        s, e, tps = d["all"], d.get("all_positions"), d.get("decode_tok_s")
        rows.append([m, f"{s['mean_kld']:.5f}", f"{s['p99_kld']:.4f}", f"{100 * s['same_top1']:.2f} %",
                     f"{100 * s['rms_dp']:.2f} %", f"{s['ppl_ratio']:.4f}",
                     f"{e['mean_kld']:.5f}" if e else "—", f"{100 * e['same_top1']:.2f} %" if e else "—",
                     num(tps), num(d.get("prompt_tok_s"), 1)])
    crit = data.get("criterion")
    first = data.get("first", 0)
    note = (f"\n\nScored: rows {first} to {data['ctx'] - 2} of each {data['ctx']}-token chunk, {data['tokens']} "
            f"tokens ({', '.join(f'{k} {n}' for k, n in data['kinds'].items())})"
            + (f"; every row: {data['tokens_all_positions']} tokens" if "tokens_all_positions" in data else "")
            + f". float32 decodes at {num(data['float32']['decode_tok_s'])} tok/s."
            + (f" Within the margins of llama.cpp: {', '.join(crit['meets'])}; `auto` picks **{crit['auto']}**."
               if crit else ""))
    return table(["mode", "mean KLD", "p99 KLD", "same top-1", "RMS Δp", "PPL ratio", "mean KLD, every row",
                  "same top-1, every row", "decode tok/s", "scoring tok/s"], rows) + note


def view_matmul(data: dict) -> str:
    """Per tensor and block type: each matrix product's relative error against float64 W x under int8
    activations, with the offsets on the unrounded and on the rounded activations (medians over layers)."""
    rows = [[s["part"], s["qtype"], str(s["layers"]), f"{s['unrounded']:.2e}", f"{s['exact']:.2e}",
             f"{s['ratio_median']:.2f}× ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})"] for s in data["summary"]]
    worst = max(s["kernel_vs_exact_max"] for s in data["summary"])
    return (table(["tensor", "block type", "layers", "offsets on unrounded x", "exact: w · x_rounded",
                   "ratio, median (min–max)"], rows, right_from=2)
            + f"\n\n{data['rows']} rows of a `{data['kind']}` chunk from row {data['first']} on; the kernel's "
              f"own output is within {worst:.1e} (relative) of the exact form's float64 value.")


def view_tool_speed(data: dict) -> str:
    """A forced tool call against as many unconstrained tokens on one engine: tokens/s and the ratio."""
    c, f, r = data["constrained_tok_s"], data["free_tok_s"], data["ratio"]
    rounds = data["rounds"]
    rows = [["named call, under its grammar", spread(c, 1)], ["as many free tokens", spread(f, 1)],
            ["ratio (per round)", spread(r, 2, "×")]]
    return (table(["", "tokens/s, median (min–max)"], rows)
            + f"\n\n{rounds[0]['tokens']} tokens a call, {rounds[0]['forced_accepted']} of them grammar-forced "
              f"drafts; {len(rounds)} rounds, `{data['precision']}`." + _ceiling_note(data.get("ceiling")))


def _ceiling_note(roof: dict | None) -> str:
    if not roof:
        return ""
    return (f" One token a target step could reach at most {roof['ceiling_tokens_per_second']:.1f} tokens/s here "
            f"({roof['bandwidth_gb_s']:.1f} GB/s read, {roof['weight_bytes_per_token'] / 1e6:.0f} MB a step).")


def view_replicas(data: dict) -> str:
    """Per arm (one process, N Ray replicas): throughput and latency under the same closed-loop load."""
    rows = [[arm, spread(s["tokens_per_second"], 1), spread(s["throughput_ratio"], 2, "×"),
             spread(s["ttft_p50"]), spread(s["e2e_p50"]), spread(s["e2e_p99"]), str(s["failed"])]
            for arm, s in data["summary"].items()]
    return table(["arm", "output tok/s", "vs single", "TTFT p50 (s)", "latency p50 (s)", "p99 (s)", "failed"],
                 rows, right_from=1)


def view_affinity(data: dict) -> str:
    """Prefix-cache hit rate and later turns' TTFT, prefix-affinity against random routing."""
    s = data["summary"]
    rows = [[arm, spread({k: 100 * v for k, v in s[arm]["hit_rate"].items()}, 0, " %"),
             spread({k: 100 * v for k, v in s[arm]["later_hit_rate"].items()}, 0, " %"),
             spread({k: 100 * v for k, v in s[arm]["same_replica"].items()}, 0, " %"),
             spread(s[arm]["later_ttft_p50"], 3), spread(s[arm]["later_ttft_p99"], 3)]
            for arm in ("affinity", "random")]
    text = table(["routing", "hit rate", "turns 2+", "same replica as last turn", "TTFT p50, turns 2+ (s)",
                  "p99 (s)"], rows, right_from=1)
    return text + (f"\n\nAffinity / random: hit rate {spread(s['hit_rate_ratio'], 2, '×')}, "
                   f"time to first token of turns 2+ {spread(s['later_ttft_p50_ratio'], 2, '×')} shorter.")


def view_steps(data: dict) -> str:
    """ms per forward (median) by new rows, per model and dtype, and in an interleaved run each one's
    ratio to the first dtype listed (median, min-max over rounds); the draft's cost ratio c."""
    counts = sorted({r["rows"] for r in data["results"]})
    first = data["results"][0]["precision"]
    cells: dict[tuple[str, str], dict[int, str]] = {}
    for r in data["results"]:
        v = r.get("vs_first_precision")
        ratio = f" ({v['median']:.2f}× [{v['min']:.2f}–{v['max']:.2f}])" if v and r["precision"] != first else ""
        bound = f" ({100 / r['x_bound']:.0f} % of bound)" if r.get("x_bound") else ""
        cells.setdefault((r["model"], r["precision"]), {})[r["rows"]] = num(r["ms"], 1) + ratio + bound
    rows = [[f"{m}, {p}"] + [by.get(n, "—") for n in counts] for (m, p), by in cells.items()]
    text = table(["model, dtype"] + [f"{n} row{'s' if n > 1 else ''}" for n in counts], rows)
    if data.get("interleaved") and len({p for _, p in cells}) > 1:
        text += (f"\n\nms per forward, median of {data['repeats']} interleaved rounds; in brackets the per-round "
                 f"ratio to {first}.")
    elif data.get("interleaved"):
        text += f"\n\nms per forward, median of {data['repeats']} interleaved rounds."
    ratios = ", ".join(f"{p} {v['c']:.2f}" for p, v in data.get("draft_cost_ratio", {}).items())
    text += f"\n\nDraft cost ratio c (0.5B / 1.5B at one row): {ratios}." if ratios else ""
    prices = {}
    for r in data["results"]:
        if r.get("r") is not None:
            prices.setdefault(f"{r['model']}, {r['precision']}", []).append(f"{r['r']:.2f} ({r['rows']})")
    if prices:
        text += ("\n\nr, each row past the first in one-row steps (rows): "
                 + "; ".join(f"{k}: {', '.join(v)}" for k, v in prices.items()) + ".")
    peaks = data.get("peaks")
    if peaks:
        rates = ", ".join(f"{v / 1e9:.0f} G on {t} thread{'s' * (int(t) > 1)}"
                          for t, v in peaks["int8_macs_per_s_by_threads"].items())
        text += (f"\n\nThis machine's peaks, measured in the run: read {peaks['read_gb_s']:.1f} GB/s; int8 "
                 f"multiply-adds ({peaks['isa']}) {rates} a second. A forward's bound is the larger of its bytes' read "
                 "time (the weights, and the context's keys and values where `work_per_step` counts them) and "
                 "its rows' multiply-adds at the int8 peak; the percentage is bound / time.")
    return text


def view_overhead(data: dict) -> str:
    """Per arm: the share of a step outside the forwards, then each part's self time a step."""
    arms = data["arms"]
    head = table(["arm", "ms a step (median)", "outside the forwards, median [min–max] over steps", "whole run"],
                 [[a["arm"], num(a["step_ms_median"], 1),
                   f"{100 * a['overhead_share_median']:.1f} % [{100 * a['overhead_share_min']:.1f}–"
                   f"{100 * a['overhead_share_max']:.1f}]", f"{100 * a['overhead_share_whole']:.1f} %"] for a in arms])
    names = sorted({n for a in arms for n in a["parts_ms_per_step"]},
                   key=lambda n: -max(a["parts_ms_per_step"].get(n, 0.0) for a in arms))
    parts = table(["part (self time)"] + [f"{a['arm']}: ms a step (share)" for a in arms],
                  [[n] + [f"{a['parts_ms_per_step'][n]:.2f} ({100 * a['parts_share'][n]:.1f} %)"
                          if n in a["parts_ms_per_step"] else "—" for a in arms] for n in names])
    return head + "\n\n" + parts


def view_profile(data: dict) -> str:
    """`specdec profile-drafts`: each proposer's draft step and c, its acceptance and measured speedup per set."""
    sets = list(data["recommendation"])
    rows = [[r["proposer"], f"{r['ms_per_draft_token']:.1f}", f"{r['cost_ratio']:.3f}",
             *(f"{r['domains'][s]['acceptance']:.2f} / {r['domains'][s]['measured_speedup']:.2f}×" for s in sets)]
            for r in data["proposers"]]
    note = (f"\n\nAcceptance / decode speedup over plain per set, k = {data['k']} fixed, greedy, "
            f"{data['max_tokens']} tokens a prompt; the target's plain step {data['target_ms_per_token']:.1f} ms. "
            "c is a draft step over a one-row target step, both measured inside the run.")
    return table(["proposer", "ms a draft step", "c", *sets], rows) + note


def view_attention(data: dict) -> str:
    """Per context, K/V format and rows: the kernel's time over every layer's cache against the bytes'
    read time at the measured bandwidth."""
    rows = [[f"{r['context']:,}", r["kv"], str(r["rows"]),
             f"{num(r['ms'], 2)} [{num(r['ms_min'], 2)}–{num(r['ms_max'], 2)}]", num(r["bound_ms"], 2),
             num(r["gb_s"], 1), f"{100 * r['of_read_bandwidth']:.0f} %",
             "—" if r["rows"] == data["rows"][0] else f"{r['vs_one_row']:.2f}×"] for r in data["results"]]
    note = (f"\n\nRead bandwidth {data['read_gb_s']['used']:.1f} GB/s (measured in the run), {data['threads']} "
            "threads; the bound is the context's keys and values read once.")
    return table(["context", "K/V", "rows", "ms, median [min–max]", "bytes' read time, ms", "GB/s",
                  "of read bandwidth", "vs one row"], rows, right_from=3) + note


def view_ranks(data: dict) -> str:
    """Per set: the share of the target's greedy tokens within the draft's n best choices."""
    ranks = list(data["sets"][0]["within"])
    rows = [[s["name"], str(s["tokens"]), *(f"{s['within'][n]:.3f}" for n in ranks)] for s in data["sets"]]
    note = (f"\n\nThe draft {data['draft']} packed as `{data['draft_requantize']}`, teacher-forced over the "
            f"target's greedy answers ({data['num_prompts']} prompts a set, up to {data['max_tokens']} tokens each).")
    return table(["set", "tokens", *(f"top {n}" for n in ranks)], rows, right_from=1) + note


def view_row_invariance(data: dict) -> str:
    """Per layer: the row counts at which F.linear changed row 0's bits, against specdec's linear."""
    header = ["dtype, layer (out × in)", "F.linear: rows differing from 512", "specdec linear",
              "ms at 1 / 64 / 256 rows"]
    rows = []
    for layer, r in data.items():
        differ = r["raw_F.linear_rows_differing_from_512"]
        ms = r["ms_by_rows"]
        rows.append([layer, ", ".join(map(str, differ)) or "none",
                     ", ".join(map(str, r["specdec_linear_rows_differing"])) or "none",
                     " / ".join(f"{ms[n]:.3f}" for n in ("1", "64", "256") if n in ms)])
    return table(header, rows, right_from=3)


def span(values: list[float], digits: int = 2, suffix: str = "") -> str:
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}{suffix}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" \
        else f"{lo:.{digits}f}–{hi:.{digits}f}{suffix}"


def history_row(root: Path, doc: Path, stem: str, data: dict) -> list[str]:
    date, machine, what = SOURCES[stem]
    summary, peers = data["summary"], list(data.get("peers") or {})
    decode = all("decode_tokens_per_second" in a["plain"] for a in summary.values())
    rate, sp = ("decode_tokens_per_second", "decode_speedup") if decode else ("tokens_per_second", "speedup")

    def med(arm: str, key: str) -> list[float]:
        return [a[arm][key]["median"] for a in summary.values() if arm in a and key in a[arm]]
    ours, theirs = med("plain", rate), med(peers[0], rate) if peers else []
    prec = data.get("precision", "") + (f" / {data['draft_precision']}" if data.get("draft_precision") else "")
    sets = "all five" if len(summary) == 5 else ", ".join(summary)
    return [date, MACHINES[machine][0], source_link(root, doc, stem), what, prec, sets,
            span(ours) + ("" if decode else " *"), span(theirs),
            span([o / t for o, t in zip(ours, theirs)]) if theirs else "—",
            span(med("draft_cost_model", sp), suffix="×"), span(med("ngram", sp), suffix="×"),
            span(med("suffix", sp), suffix="×")]


def view_history(root: Path, doc: Path) -> str:
    """Every arm sweep, oldest first: the ranges over sets of each median."""
    header = ["date", "machine", "results", "what changed", "target / draft", "sets", "plain tok/s",
              "llama.cpp tok/s", "plain / llama.cpp", "draft, cost model", "n-gram, cost model", "suffix"]
    rows = []
    for stem in SOURCES:
        path = root / "docs" / "results" / f"{stem}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        sweep = data.get("mode") not in ("structured", "replicas", "affinity")  # an arm sweep (`specdec bench`)
        if "runs" in data and "summary" in data and sweep:
            rows.append(history_row(root, doc, stem, data))
    note = ("Decode-only tokens/s and ratios to our plain decoding: each set's median, then the range over "
            "the sets. * marks a run that predates the decode-only figures: its rates and ratios cover the "
            "whole request. Machines: " + "; ".join(f"{short}: {desc}" for short, desc in MACHINES.values()) + ".")
    return table(header, rows, right_from=6) + "\n\n" + note


def view_index(root: Path, doc: Path) -> str:
    """Every results file: what it shows, date, machine, command."""
    rows = []
    for path in sorted((root / "docs" / "results").glob("*.json")):
        stem = path.stem
        date, machine, what = SOURCES.get(stem, ("—", "", "not described in tools/docs_report.py"))
        name = f"`{stem}.json`" + (" + `.png`" if path.with_suffix(".png").exists() else "")
        rows.append([name, what, date, MACHINES.get(machine, ("", "—"))[1],
                     f"`{command(json.loads(path.read_text()))}`"])
    return table(["file", "what", "date", "machine", "command"], rows, right_from=5)


def view_lines(root: Path, doc: Path) -> str:
    """Python files and lines per package folder (the tree's size, kept current)."""
    rows = []
    for folder in [root / "specdec", *sorted(d for d in (root / "specdec").rglob("*") if d.is_dir()
                                            and any(d.glob("*.py"))), root / "tests"]:
        files = sorted(folder.glob("*.py"))
        lines = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)
        rows.append([f"`{folder.relative_to(root).as_posix()}/*.py`", str(len(files)), str(lines)])
    return table(["files", "count", "lines"], rows)


TABLE_VIEWS = {"spec": view_spec, "spec-wide": view_spec_wide, "precision": view_precision,
               "serve": view_serve, "soak": view_soak, "structured": view_structured, "steps": view_steps,
               "replicas": view_replicas, "affinity": view_affinity, "row-invariance": view_row_invariance,
               "kld": view_kld, "matmul": view_matmul, "peers": view_peers,
               "tool-speed": view_tool_speed, "coupling": view_coupling, "overhead": view_overhead,
               "attention": view_attention, "profile": view_profile, "ranks": view_ranks}
DOC_VIEWS = {"history": view_history, "index": view_index, "lines": view_lines}


# ---- blocks -------------------------------------------------------------------------------------

def render(root: Path, doc: Path, name: str) -> str:
    """The text of one generated block, from its marker's NAME (VIEW:STEM, or history / index)."""
    view, _, stem = name.partition(":")
    if view in DOC_VIEWS and not stem:
        return DOC_VIEWS[view](root, doc)
    if view not in TABLE_VIEWS or not stem:
        raise SystemExit(f"error: {doc}: unknown generated block {name!r} "
                         f"(views: {', '.join([*TABLE_VIEWS, *DOC_VIEWS])})")
    data = load(root, stem)
    return caption(root, doc, stem, data) + "\n\n" + TABLE_VIEWS[view](data) + plot(root, doc, stem)


def plot(root: Path, doc: Path, stem: str) -> str:
    """The run's PNG under its table, when the bench drew one (a reader looks at it before the numbers)."""
    png = root / "docs" / "results" / f"{stem}.png"
    if not png.exists():
        return ""
    what = SOURCES.get(stem, ("", "", stem))[2]
    return f"\n\n![{what}]({os.path.relpath(png, doc.parent)})"


def rewrite(root: Path, doc: Path, text: str) -> str:
    """text with every generated block's body rendered anew; the markers stay where they are."""
    out, pos = [], 0
    while (start := text.find(START, pos)) != -1:
        head_end = text.find("-->", start)
        end = text.find(END, head_end)
        if head_end == -1 or end == -1:
            raise SystemExit(f"error: {doc}: a generated block at offset {start} has no {END!r}")
        name = text[start + len(START):head_end].strip()
        out.append(text[pos:head_end + 3] + "\n" + render(root, doc, name) + "\n")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/docs_report.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    stale = []
    for rel in DOCS:
        doc = args.root / rel
        if not doc.exists():
            continue
        old = doc.read_text()
        new = rewrite(args.root, doc, old)
        if new != old:
            stale.append(rel)
            if not args.check:
                write_atomic(doc, new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "generated tables up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
