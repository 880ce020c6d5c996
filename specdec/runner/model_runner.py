"""ModelRunner: SchedulerOutput -> flat tensors -> one forward -> logits at the requested rows.

Owns the model, its paged KV cache (one (k, v) pair per layer, each [num_kv_heads, num_blocks *
block_size, row], rows in one of quant/kv_format.py's formats) and its thread count
(runner/threads.py: set around each forward, restored after). Knows nothing about sampling or requests
beyond their block tables.
"""
from __future__ import annotations

import time

import torch

from specdec.core.outputs import ChainOutput, DraftChain, ModelRunnerOutput, SchedulerOutput
from specdec.models.llama import LlamaModel
from specdec.quant import kv_format
from specdec.quant.layers import pad_rows
from specdec.runner.batch import build_batch
from specdec.runner.threads import ThreadTuner, using_threads


def kv_cache_dtype(choice: str) -> torch.dtype | None:
    """The K/V caches' dtype for a `cache_config.kv_cache_dtype` choice (config.KV_CACHE_DTYPES); None: the
    model's own (`auto` left unresolved: precision.resolve_kv_cache picks a measured format)."""
    return {"auto": None, "float32": torch.float32, "float16": torch.float16, "int8": torch.int8}[choice]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 never_sample_ids: list[int] | None = None, vocab_limit: int | None = None,
                 tuner: ThreadTuner | None = None, kv_dtype: torch.dtype | None = None) -> None:
        """`tuner`: the thread count of each forward, picked by measurement or fixed (`ThreadTuner.fixed`),
        set around the forward only (None: torch's count, untouched). `kv_dtype`: the K/V caches' dtype
        (None: the model's)."""
        cfg = model.cfg
        self.tuner = tuner
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_dtype = kv_dtype or model.dtype
        # head-major (one stream per KV head), rows in quant/kv_format.py's formats
        shape = (cfg.num_kv_heads, num_blocks * block_size, kv_format.row_width(self.kv_dtype, cfg.head_dim))
        # zeros: pages are only touched (and counted) as slots are used
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=device)) for _ in range(cfg.num_layers)]
        mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        if never_sample_ids:
            mask[torch.tensor(never_sample_ids, dtype=torch.long)] = True
        if vocab_limit is not None and vocab_limit < cfg.vocab_size:
            mask[vocab_limit:] = True  # embedding rows past the tokenizer's vocabulary
        # their ids: a few hundred, so filling them costs microseconds where a vocabulary-wide mask costs 0.1 ms a row
        self.never_sample = mask.nonzero()[:, 0].to(device)
        # the same ids as columns of a sub-vocabulary's logits (`execute(sub_vocab=True)`)
        ids = model.vocab_ids
        self.never_sub = None if ids is None else mask.to(ids.device)[ids].nonzero()[:, 0]
        self._never_columns: torch.Tensor | None = None  # uint8 over the output columns (draft_chain)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, sub_vocab: bool = False) -> ModelRunnerOutput:
        """One forward over the scheduled chunks, on this runner's own thread count (restored after).
        `sub_vocab`: a model restricted to a sub-vocabulary returns only its columns (`vocab_ids` says
        which), never-sample ids at -inf: no vocabulary-wide row to fill and search."""
        sub_vocab = sub_vocab and self.never_sub is not None
        t0 = time.perf_counter()
        for src, dst in sched.block_copies:
            self._copy_block(src, dst)
        batch = build_batch(sched.chunks, self.block_size, self.model.row_align, self.device)
        num_rows = batch.meta.num_rows
        threads = self.tuner.choose(num_rows) if self.tuner else None
        best = self.tuner.best(num_rows) if self.tuner else None
        with using_threads(threads):
            t1 = time.perf_counter()
            hidden = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
            logits, hidden = self.compute_logits(hidden, batch.logit_rows, sub_vocab)
            if self.device.type == "cuda":  # kernels run asynchronously: the cost model needs their real time
                torch.cuda.synchronize(self.device)
            t2 = time.perf_counter()
        if self.tuner:
            self.tuner.record(num_rows, threads, t2 - t1)
        return ModelRunnerOutput(logits=logits, cu_num_logits=batch.cu_num_logits, forward_seconds=t2 - t0,
                                 exploring=best is not None and threads != best, hidden=hidden,
                                 vocab_ids=self.model.vocab_ids if sub_vocab else None)

    def chain_ready(self, own_heads: list[object]) -> bool:
        """Whether `draft_chain` runs on this runner's model (LlamaModel.chain_ready)."""
        return self.model.chain_ready(own_heads)

    @torch.inference_mode()
    def draft_chain(self, chains: list[DraftChain], block_copies: list[tuple[int, int]], vocab: int) -> ChainOutput:
        """Drafts (their slots allocated) in one C++ call, each forward on the tuner's thread count for
        its rows; a sampled chain's distributions `vocab` wide."""
        for src, dst in block_copies:
            self._copy_block(src, dst)
        rows = [sum(len(c.feed) for c in chains)]
        rows += [sum(c.steps > s for c in chains) for s in range(1, max(c.steps for c in chains))]
        threads = [self.tuner.choose(n) if self.tuner else torch.get_num_threads() for n in rows]
        best = [self.tuner.best(n) if self.tuner else None for n in rows]
        if self._never_columns is None:
            width = len(self.model.vocab_ids) if self.never_sub is not None else self.model.cfg.vocab_size
            self._never_columns = torch.zeros(width, dtype=torch.uint8)
            self._never_columns[self.never_sub if self.never_sub is not None else self.never_sample] = 1
        tokens, probs, seconds = self.model.draft_chain(chains, self._never_columns, vocab, self.kv_caches, threads)
        costs = []
        for n, used, fastest, s in zip(rows, threads, best, seconds):
            if self.tuner:
                self.tuner.record(n, used, s)
            costs.append((n, None if fastest is not None and used != fastest else s))
        return ChainOutput(tokens, probs, costs)

    def compute_logits(self, hidden: torch.Tensor, rows: list[int],
                       sub_vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for the given rows of the hidden states, never-sample ids at -inf ([len(rows), vocab],
        or a sub-vocabulary's columns), and those rows' hidden states (padded to `row_align` rows)."""
        if not rows:
            width = len(self.model.vocab_ids) if sub_vocab else self.model.cfg.vocab_size
            return torch.empty(0, width, device=self.device), hidden[:0]
        idx = rows + [rows[-1]] * (pad_rows(len(rows), self.model.row_align) - len(rows))
        if idx == list(range(idx[0], idx[0] + len(idx))):
            selected = hidden[idx[0]:idx[0] + len(idx)]   # one run of rows (decoding): a view, no gather
        else:
            selected = hidden[torch.tensor(idx, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(selected, scatter=not sub_vocab)[: len(rows)]
        return logits.index_fill_(-1, self.never_sub if sub_vocab else self.never_sample, float("-inf")), selected

    def _copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for k, v in self.kv_caches:
            k[:, dst * bs:(dst + 1) * bs] = k[:, src * bs:(src + 1) * bs]
            v[:, dst * bs:(dst + 1) * bs] = v[:, src * bs:(src + 1) * bs]
