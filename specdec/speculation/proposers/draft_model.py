"""DraftModelProposer: a smaller model of the same vocabulary, with its own paged KV cache.

For each request it first catches its cache up with the committed tokens it has not seen (the
whole prompt the first time, then the accepted and bonus tokens of the last round), then drafts k
tokens autoregressively from the *processed* draft distribution: the request's own penalties,
temperature, top-k/top-p/min-p, applied with the drafts before position j counted as output; a
Gumbel-coupled request's draft is the argmax of that distribution plus the target's own noise at
the position (sample/noise.py), so it is kept exactly when the target would have chosen it.
All speculating requests share each draft forward. After verification the rejected drafts' K/V
are rolled back and the full blocks of committed tokens are hashed, so the draft pool has a prefix
cache like the target's: a prompt seen before (a shared system prompt, the next turn of a chat, a
repeated request) costs the draft no prefill.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import ExitStack

import torch

from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import DraftChain, ScheduledChunk, SchedulerOutput
from specdec.models.llama import LlamaModel
from specdec.models.registry import default_draft
from specdec.models.loader import LoadedModel, load_model
from specdec.request import Request
from specdec.runner.batch import context_slots
from specdec.runner.model_runner import ModelRunner, kv_cache_dtype
from specdec.runner.threads import ThreadTuner, thread_tuner
from specdec.sample.logits_processors import process_logits
from specdec.sample.noise import coupled_argmax
from specdec.sample.sampler import first_argmax, make_generator
from specdec.grammar import Lookahead
from specdec.speculation.proposers.base import BuildContext, DraftProposal, Drafts
from specdec.speculation.proposers.self_draft import format_skip, is_self_draft, parse_skip, resolve_auto
from specdec.speculation.proposers.subvocab import RequestVocab, auto_vocab_size, build_subvocab


def _max_key(m: tuple[float, int]) -> tuple[bool, float, int]:
    """Orders (logit, id) so that max() picks what first_argmax over a row does: NaN as the largest,
    then the larger logit, then the smaller id."""
    nan = math.isnan(m[0])
    return nan, 0.0 if nan else m[0], -m[1]


def _tail(req: Request, drafts: list[int], start: int) -> list[int]:
    """(prompt + output + drafts)[start:], without building the whole list (a long prompt, every step)."""
    prompt, output = req.prompt_token_ids, req.output_token_ids
    if start >= len(prompt) + len(output):
        return drafts[start - len(prompt) - len(output):]
    if start >= len(prompt):
        return output[start - len(prompt):] + drafts
    return prompt[start:] + output + drafts


def build(ctx: BuildContext) -> DraftModelProposer:
    """The draft model named by ctx.config.speculative.draft_model (else the target's default
    draft), or the target itself with layers skipped for a `self:...` reference."""
    config, target, spec = ctx.config, ctx.target, ctx.config.speculative
    assert spec is not None
    name = spec.draft_model or default_draft(target.name)
    if name is None and ctx.draft_loaded is None:
        raise ValueError(f"no draft model given and {target.name!r} has no default draft; "
                         "pass draft_model=... or use method='ngram'")
    skip = None
    if is_self_draft(name):  # self-speculation: the target's own weights, some layers skipped
        if spec.draft.precision not in (None, config.model.precision):
            raise ValueError("self-speculation runs the target's own weights: draft_precision must be the "
                             f"target's ({config.model.precision}) or unset")
        skip = parse_skip(name, target.config.num_layers)
        if skip is None:
            skip = resolve_auto(target, ctx.progress)
        name, draft = format_skip(skip), target
    else:
        precision = spec.draft.precision or config.model.precision
        draft = ctx.draft_loaded or load_model(name, precision, config.model.device, ctx.progress,
                                               requant=spec.draft.requantize, huge_pages=config.model.huge_pages)
    if ctx.progress:
        print(f"draft model {draft.name} loaded in {draft.load_seconds:.1f}s", file=sys.stderr)
    shared = check_same_vocabulary(target.tokenizer.token_strings, draft.tokenizer.token_strings,
                                   target.name, draft.name)
    return DraftModelProposer(draft, config.cache.draft_cache_blocks, config.cache.block_size,
                              torch.device(config.model.device), shared, ctx.max_model_len, spec.draft.vocab_size,
                              skip_layers=skip, name=name if skip is not None else None,
                              tuner=thread_tuner(config.model), prefix_caching=config.cache.enable_prefix_caching,
                              kv_dtype=kv_cache_dtype(config.cache.kv_cache_dtype))


def check_same_vocabulary(target_tokens: list[str], draft_tokens: list[str], target_name: str,
                          draft_name: str) -> int:
    """The real tokens must agree; only padding rows may differ. Returns the shared vocabulary size."""
    shared = min(len(target_tokens), len(draft_tokens))
    for i in range(shared):
        if target_tokens[i] != draft_tokens[i]:
            raise ValueError(f"draft {draft_name} and target {target_name} have different vocabularies "
                             f"(token {i}: {draft_tokens[i]!r} vs {target_tokens[i]!r})")
    return shared


class DraftModelProposer:
    kind = "draft_model"

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, device: torch.device,
                 vocab_size: int, max_model_len: int, draft_vocab_size: int | str | None = None,
                 skip_layers: frozenset[int] | None = None, name: str | None = None,
                 tuner: ThreadTuner | None = None, prefix_caching: bool = True,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`skip_layers`: self-speculation (`loaded` is the target; see speculation/proposers/self_draft.py). `tuner`: the
        draft forwards' own thread-count tuner (runner/threads.py). `prefix_caching`: the engine's
        setting, so that turning it off turns off both pools' caches."""
        self.name = name or loaded.name
        self.loaded = loaded
        self.max_model_len = min(max_model_len, loaded.config.max_position)
        model = LlamaModel(loaded.config, loaded.weights, self.max_model_len, device, skip_layers or frozenset())
        full_head = model.lm_head
        size = auto_vocab_size(model, vocab_size) if draft_vocab_size == "auto" else draft_vocab_size
        if size is not None and size < vocab_size:
            model.restrict_vocab(build_subvocab(loaded.tokenizer, vocab_size, size))
        self.vocab_size = vocab_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=prefix_caching)
        self.runner = ModelRunner(model, num_blocks, block_size, device, loaded.tokenizer.never_sample_ids,
                                  vocab_limit=vocab_size, tuner=tuner, kv_dtype=kv_dtype)
        # a sub-vocabulary also scores each request's own tokens
        self.request_vocab = None if model.vocab_ids is None else RequestVocab(
            full_head, model.vocab_ids, vocab_size, self.runner.never_sample, model.row_align, model.options)
        self._generators: dict[str, torch.Generator] = {}

    @property
    def row_align(self) -> int:
        return self.runner.model.row_align

    def propose(self, requests: list[Request], num_tokens: list[int], model_k: list[int]) -> Drafts:
        t0 = time.perf_counter()
        forward_costs: list[tuple[int, float | None]] = []
        active: list[tuple[int, Request, int]] = []
        for i, (req, k) in enumerate(zip(requests, num_tokens)):
            k = min(k, self.max_model_len - req.num_tokens)
            if k <= 0:
                continue
            rid = req.request_id
            seen, cached = self._seen(req)
            if not self.kv.can_allocate(rid, req.num_tokens - seen + k - 1, cached):
                continue  # draft pool full: this request decodes plainly this step
            if rid not in self.kv.block_tables:
                self.kv.allocate(rid, 0, cached)
            if self.request_vocab is not None:
                self.request_vocab.take_in(rid, req.prompt_token_ids, req.output_token_ids)
            active.append((i, req, k))
        drafts: dict[int, list[int]] = {i: [] for i, _, _ in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        with ExitStack() as scopes:   # grammar lookaheads over this call's drafts, rolled back on exit
            ahead = {i: scopes.enter_context(req.grammar.lookahead()) for i, req, _ in active
                     if req.grammar is not None}
            self._draft(active, drafts, probs, ahead, forward_costs)
        result = [DraftProposal([]) for _ in requests]
        for i in drafts:  # [k, vocab]: one piece from the chain, else a row a position
            q = None if not probs[i] else probs[i][0] if len(probs[i]) == 1 else torch.cat(probs[i])
            result[i] = DraftProposal(drafts[i], q)
        return Drafts(result, time.perf_counter() - t0, forward_costs)

    def _draft(self, active: list[tuple[int, Request, int]], drafts: dict[int, list[int]],
               probs: dict[int, list[torch.Tensor]], ahead: dict[int, Lookahead],
               forward_costs: list[tuple[int, float | None]]) -> None:
        """Autoregressive draft steps, all active requests in one forward each."""
        if self._chainable(active, ahead) and self._chain(active, drafts, probs, forward_costs):
            return
        step = 0
        while active:
            chunks = []
            for i, req, k in active:
                rid = req.request_id
                seen = self.kv.num_slots.get(rid, 0)
                tokens = _tail(req, drafts[i], seen)
                self.kv.allocate(rid, len(tokens))
                chunks.append(ScheduledChunk(rid, tokens, seen, list(self.kv.block_tables[rid]), 1))
            rows = sum(len(c.token_ids) for c in chunks)
            lean = self._lean(active, ahead)
            out = self.runner.execute(SchedulerOutput(chunks, rows, self.kv.take_pending_copies()), sub_vocab=lean)
            forward_costs.append((rows, None if out.exploring else out.forward_seconds))
            ended = set()
            for row, (i, req, _) in enumerate(active):
                if lean:
                    drafts[i].append(self._greedy(req, out.logits[row], out.hidden[row], out.vocab_ids))
                    continue
                if self.request_vocab is not None:
                    self.request_vocab.score(req.request_id, out.logits[row], out.hidden[row])
                token, q = self._sample(req, out.logits[row, : self.vocab_size], drafts[i], ahead.get(i))
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q[None])
                if i in ahead and not ahead[i].advance([token]):  # the next draft's mask follows this one
                    ended.add(i)
            step += 1
            # the last draft is never fed: its K/V would be computed by the next catch-up anyway
            active = [(i, req, k) for i, req, k in active if k > step and i not in ended]

    def _chainable(self, active: list[tuple[int, Request, int]], ahead: dict[int, Lookahead]) -> bool:
        """Whether every draft of this call can be picked on the C++ side: no grammar, bias or penalties
        (greedy, Gumbel-coupled, or drawn from the processed distribution)."""
        return all(not req.params.logit_bias and not req.params.needs_penalties and i not in ahead
                   for i, req, _ in active)

    def _chain(self, active: list[tuple[int, Request, int]], drafts: dict[int, list[int]],
               probs: dict[int, list[torch.Tensor]], forward_costs: list[tuple[int, float | None]]) -> bool:
        """The drafts without returning here between them: one C++ call runs each position's forward,
        output layer and pick (ModelRunner.draft_chain). False, having done nothing, where it cannot
        run (a request scoring the whole vocabulary, a layout it lacks)."""
        vocab = self.request_vocab
        if vocab is not None and any(vocab.whole(req.request_id) for _, req, _ in active):
            return False
        owns = [vocab.own_head(req.request_id) if vocab is not None else (None, None) for _, req, _ in active]
        positions = [self.kv.num_slots.get(req.request_id, 0) for _, req, _ in active]
        feeds = [_tail(req, [], seen) for (_, req, _), seen in zip(active, positions)]
        if not all(feeds) or not self.runner.chain_ready([head for head, _ in owns if head is not None]):
            return False
        chains = []
        for (i, req, k), (head, ids), position, feed in zip(active, owns, positions, feeds):
            rid = req.request_id
            self.kv.allocate(rid, len(feed) + k - 1)
            slots = context_slots(self.kv.block_tables[rid], self.kv.block_size, position + len(feed) + k - 1)
            chains.append(self._sampling(req, DraftChain(feed, k, position, torch.from_numpy(slots), head, ids)))
        out = self.runner.draft_chain(chains, self.kv.take_pending_copies(), self.vocab_size)
        for (i, _, _), tokens, q in zip(active, out.tokens, out.probs):
            drafts[i].extend(tokens)
            if q is not None:
                probs[i].append(q)
        forward_costs.extend(out.forward_costs)
        return True

    def _sampling(self, req: Request, chain: DraftChain) -> DraftChain:
        """The chain's picks as `_sample` makes them: greedy, Gumbel-coupled with the request's noise,
        or drawn from the processed distribution by uniform draws of the draft's generator for it."""
        p = req.params
        if p.greedy:
            return chain
        chain.temperature, chain.top_k, chain.top_p, chain.min_p = p.temperature, p.top_k, p.top_p, p.min_p
        if req.noise_key is not None:
            chain.noise_key, chain.noise_at = req.noise_key, len(req.output_token_ids)
            return chain
        chain.uniform = torch.rand(chain.steps, dtype=torch.float64, generator=self._generator(req))
        return chain

    def _lean(self, active: list[tuple[int, Request, int]], ahead: dict[int, Lookahead]) -> bool:
        """Whether this forward's drafts are all plain greedy picks from a sub-vocabulary (no grammar,
        bias or penalties): then its logits stay the sub-vocabulary's columns (`_greedy`)."""
        if self.request_vocab is None:
            return False
        return all(req.params.greedy and not req.params.logit_bias and not req.params.needs_penalties
                   and i not in ahead for i, req, _ in active)

    def _greedy(self, req: Request, logits: torch.Tensor, hidden: torch.Tensor, vocab_ids: torch.Tensor) -> int:
        """The greedy draft from a sub-vocabulary's logits and the request's own tokens' (RequestVocab):
        the token `_sample` picks from the whole row those make, the first maximum in id order."""
        own = self.request_vocab.own_scores(req.request_id, hidden)
        if own is not None and own[0] is None:  # the request scores the whole vocabulary
            return int(first_argmax(own[1][: self.vocab_size]))
        i = int(first_argmax(logits))
        best = (float(logits[i]), int(vocab_ids[i]))
        if own is not None:
            j = int(first_argmax(own[1]))
            best = max(best, (float(own[1][j]), int(own[0][j])), key=_max_key)
        return best[1]

    def _sample(self, req: Request, logits: torch.Tensor, drafts: list[int], ahead: Lookahead | None
                ) -> tuple[int, torch.Tensor | None]:
        p = req.params
        if ahead is not None:  # the target's rows get the same mask (sample/structured.py)
            masked = ahead.mask(logits)
            # nothing the grammar allows is in a reduced draft vocabulary: an unconstrained guess, trimmed
            # before verification (the drafts stop there)
            logits = masked if bool(torch.isfinite(masked).any()) else logits
        processed = process_logits(logits, p, req.prompt_token_ids, req.output_token_ids + drafts)
        if p.greedy:
            return int(first_argmax(processed)), None
        if req.noise_key is not None:  # coupled: the target's noise at this position, no distribution needed
            return coupled_argmax(processed, req.noise_key, len(req.output_token_ids) + len(drafts)), None
        q = torch.softmax(processed.cpu(), dim=-1)  # on the CPU, as the engine's sampler: one stream per seed
        noise = torch.empty_like(q).exponential_(generator=self._generator(req))
        return int(first_argmax(q / noise)), q

    def _generator(self, req: Request) -> torch.Generator:
        """The request's draft stream: its own, so that a seed fixes the drafts too."""
        g = self._generators.get(req.request_id)
        if g is None:
            p = req.params
            g = self._generators[req.request_id] = make_generator(None if p.seed is None else p.seed + 1)
        return g

    def _seen(self, req: Request) -> tuple[int, list[int]]:
        """Tokens of the request the draft has K/V for, and (for a request it has no table for yet)
        the prefix-cache blocks that hold them."""
        if req.request_id in self.kv.block_tables:
            return self.kv.num_slots[req.request_id], []
        cached = self.kv.find_cached_prefix(req.all_token_ids, req.params.cache_scope)
        return len(cached) * self.kv.block_size, cached

    def catch_up_tokens(self, request: Request) -> int:
        """Committed tokens the draft would have to process before its first draft for this request."""
        return request.num_tokens - self._seen(request)[0]

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        rid = request.request_id
        if num_drafted and rid in self.kv.num_slots:
            self.kv.rollback(rid, num_drafted - 1 - min(num_accepted, num_drafted - 1))
        if rid in self.kv.num_slots and not request.finished:
            # every slot left holds a committed token
            self.kv.commit(rid, request.all_token_ids, request.params.cache_scope)

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self._generators.pop(request_id, None)
        if self.request_vocab is not None:
            self.request_vocab.free(request_id)
