"""DraftSet: the proposers an engine may draft with, by id, and their lifecycle.

Ids: a model-free kind's id is the kind ("ngram": no weights, always loaded); a draft model's is the model's name
(its registry name, or the file/folder name of a path). The configured draft is loaded with the
engine and stays; `draft.extra_models`, and drafts added at run time (`POST /admin/drafts`), load on
first use on a background thread, so no step waits for a load and no request fails because of one:
until a draft is ready (or when it fails to load: reported, then skipped) its requests draft with
what is loaded or decode plainly. A lazily loaded draft that no request used for
`draft.idle_seconds` is unloaded, and unloading one under load moves its requests to another
proposer (the router's next choice) or to plain decoding, mid-stream. With `router.enabled`, the
DraftRouter picks each new request's proposer and takes over requests whose acceptance collapses.
Everything here runs on the engine thread except the load itself.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from specdec.config import EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.models import registry as model_registry
from specdec.models.loader import LoadedModel, check_exists
from specdec.metrics import DraftStatus
from specdec.request import Request
from specdec.quant.layers import row_align
from specdec.speculation import registry
from specdec.speculation.controller import SpecController
from specdec.speculation.costs import CostTable
from specdec.speculation.proposers.base import BuildContext, Proposer, SharedCache
from specdec.speculation.router import DraftRouter

log = logging.getLogger("specdec.speculation")


def draft_id(model: str) -> str:
    """The id a draft model reference gets (what the loader names it)."""
    return model if model in model_registry.REGISTRY else Path(model).expanduser().name


class DraftSet:
    def __init__(self, config: EngineConfig, target: LoadedModel, max_model_len: int,
                 draft_loaded: LoadedModel | None = None, progress: bool = True) -> None:
        spec = config.speculative
        assert spec is not None
        self.config, self.target, self.max_model_len = config, target, max_model_len
        self.router = DraftRouter(spec.router.exploration) if spec.router.enabled else None
        self.proposers: dict[str, Proposer] = {}
        self.controllers: dict[str, SpecController] = {}
        self.kinds: dict[str, str] = {}         # proposer id -> registry kind, for every known proposer
        self.models: dict[str, str] = {}        # draft id -> model reference, for every known draft
        self.errors: dict[str, str] = {}
        self.pools: dict[str, KVCacheManager] = {}   # the scheduler reads this dict: kept in place
        self.pinned: set[str] = set(registry.model_free_kinds())
        self.last_used: dict[str, float] = {}
        self.num_loads = self.num_unloads = self.num_load_failures = 0
        self._loading: dict[str, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        # the target's forward seconds by row count: one table for every controller and proposer
        self.verify_costs = CostTable(row_align=row_align(config.model.precision, config.model.device))
        # caches shared by all requests (the suffix cache of finished outputs): they outlive proposers
        self.shared: dict[str, SharedCache] = {}
        self.default_id = spec.method
        if registry.get(spec.method).needs_model:
            proposer = registry.get(spec.method).build(self._context(config, draft_loaded, progress))
            self.default_id = proposer.name
            self.models[proposer.name] = spec.draft_model or model_registry.default_draft(target.name) or proposer.name
            self.pinned.add(proposer.name)
            self._install(proposer.name, spec.method, proposer)
        for kind in registry.model_free_kinds():  # no weights: always loaded
            self._install(kind, kind, registry.get(kind).build(self._context(config)))
        for model in spec.draft.extra_models:
            self.kinds.setdefault(draft_id(model), registry.model_kinds()[0])
            self.models.setdefault(draft_id(model), model)
        self._sync_pools()

    def _context(self, config: EngineConfig, draft_loaded: LoadedModel | None = None,
                 progress: bool = False) -> BuildContext:
        return BuildContext(config, self.target, self.max_model_len, draft_loaded, progress, self.verify_costs,
                            self.shared)

    # ---- queries ------------------------------------------------------------------------------
    def resolve(self, method: str) -> str:
        """A request's `method` (a registry kind or a draft id) -> a known proposer id."""
        if method in self.kinds:
            return method
        if method in registry.kinds() and registry.get(method).needs_model:
            if self.kinds.get(self.default_id) == method:
                return self.default_id
            # not the configured kind: a loaded draft of it first, else any known one (it loads on first use)
            drafts = [i for i in self.proposers if self.kinds[i] == method]
            drafts += [i for i in self.models if self.kinds[i] == method]
            if not drafts:
                raise ValueError(f"method {method!r} is not loaded: no draft model is configured "
                                 f"(use {', '.join(registry.model_free_kinds())}, or load a draft)")
            return drafts[0]
        known = ", ".join(dict.fromkeys([*registry.kinds(), *self.kinds]))
        raise ValueError(f"unknown speculative method or draft {method!r} (known: {known})")

    def kind_of(self, proposer_id: str) -> str:
        return self.kinds[proposer_id]

    def candidates(self) -> list[str]:
        """Proposers a router may pick: loaded ones and known drafts that did not fail to load."""
        ids = list(self.proposers) + [i for i in self.models if i not in self.proposers]
        return [i for i in ids if i not in self.errors]

    def status(self) -> list[DraftStatus]:
        now = time.monotonic()
        rows = []
        for i in dict.fromkeys([*self.proposers, *self.models]):
            state = ("loaded" if i in self.proposers else "loading" if i in self._loading
                     else "failed" if i in self.errors else "unloaded")
            idle = now - self.last_used[i] if i in self.last_used and i in self.proposers else None
            rows.append(DraftStatus(i, self.models.get(i), state, i in self.pinned, self.errors.get(i), idle))
        return rows

    # ---- lifecycle (engine thread) ------------------------------------------------------------
    def touch(self, proposer_id: str) -> None:
        self.last_used[proposer_id] = time.monotonic()

    def add(self, model: str) -> str:
        """Make a draft model known (by name or path) and start loading it. Returns its id."""
        i = draft_id(model)
        if i in registry.kinds():
            raise ValueError(f"{i!r} names a proposer kind, not a draft model")
        if i not in self.models:
            check_exists(model)  # a name that cannot load is refused here, not in the background
        self.kinds.setdefault(i, registry.model_kinds()[0])
        self.models.setdefault(i, model)
        self.errors.pop(i, None)
        self.load(i)
        return i

    def load(self, proposer_id: str) -> None:
        """Start loading a known draft in the background (no-op if loaded or loading)."""
        if proposer_id in self.proposers or proposer_id in self._loading or proposer_id in self.errors:
            return  # a failed draft is retried only when added again
        if proposer_id not in self.models:
            raise ValueError(f"unknown draft {proposer_id!r}")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-draft-load")
        config, model, kind = self.config, self.models[proposer_id], self.kinds[proposer_id]
        spec = config.speculative
        assert spec is not None
        lazy = EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler,
                            speculative=replace(spec, method=kind, draft_model=model,
                                                draft=replace(spec.draft, extra_models=[])))
        log.info("loading draft %s from %s", proposer_id, model)
        self._loading[proposer_id] = self._executor.submit(registry.get(kind).build, self._context(lazy))

    def poll(self) -> tuple[list[str], list[str]]:
        """Install finished loads and report failed ones. Returns (ids installed, ids failed)."""
        installed, failed = [], []
        for i, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[i]
            try:
                proposer = future.result()
            except Exception as e:  # noqa: BLE001 - a bad draft is reported and skipped, never fatal
                self.errors[i] = str(e) or type(e).__name__
                self.num_load_failures += 1
                log.error("draft %s failed to load: %s; requests will not use it", i, self.errors[i])
                failed.append(i)
                continue
            if proposer.name != i:  # the file names itself differently: keep the id it was asked by
                proposer.name = i
            self._install(i, self.kinds[i], proposer)
            self.num_loads += 1
            log.info("draft %s loaded", i)
            installed.append(i)
        return installed, failed

    def idle(self, in_use: set[str]) -> list[str]:
        """Loaded, unpinned drafts unused for draft.idle_seconds (and by no unfinished request)."""
        limit = self.config.speculative.draft.idle_seconds if self.config.speculative else None
        if limit is None:
            return []
        now = time.monotonic()
        return [i for i in self.proposers if i not in self.pinned and i not in in_use
                and now - self.last_used.get(i, now) > limit]

    def remove(self, proposer_id: str) -> None:
        """Drop a loaded draft (the engine has already moved its requests elsewhere)."""
        self._check_unloadable(proposer_id, proposer_id)
        del self.proposers[proposer_id]
        del self.controllers[proposer_id]
        self.pinned.discard(proposer_id)
        self.num_unloads += 1
        log.info("draft %s unloaded", proposer_id)

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until pending loads finish (offline use and tests; the server never waits)."""
        for future in list(self._loading.values()):
            try:
                future.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - recorded by poll()
                pass

    def _install(self, proposer_id: str, kind: str, proposer: Proposer) -> None:
        entry = registry.get(kind)
        self.kinds[proposer_id] = kind
        self.proposers[proposer_id] = proposer
        align = row_align(self.config.model.precision, self.config.model.device)
        # a draft model's own forward (maybe in another precision) pads its rows its own way
        draft_align = proposer.row_align if entry.has_kv_pool else None
        self.controllers[proposer_id] = SpecController(self.config.speculative, draft_cost_ratio=entry.cost_hint,
                                                       row_align=align, draft_row_align=draft_align,
                                                       verify_costs=self.verify_costs)
        self.last_used[proposer_id] = time.monotonic()

    def _check_unloadable(self, proposer_id: str, reference: str) -> None:
        entry = registry.get(self.kinds.get(proposer_id, registry.model_kinds()[0]))
        if not entry.needs_model:
            raise ValueError(f"{proposer_id!r} is {entry.description}: it has no weights to unload")
        if proposer_id not in self.proposers:
            raise ValueError(f"draft {reference!r} is not loaded")

    # ---- requests across drafts (engine thread) -------------------------------------------------
    def update(self, requests: list[Request]) -> None:
        """Install finished loads, move requests off drafts that failed to load, unload idle drafts."""
        installed, failed = self.poll()
        if installed or failed:
            self._sync_pools()
        for req in requests:
            if req.spec_method in failed:
                self.move(req, "its draft failed to load", allow_plain=True)
        for proposer_id in self.idle({r.spec_method for r in requests}):
            self.unload(proposer_id, requests)

    def unload(self, model: str, requests: list[Request]) -> str:
        """Unload a loaded draft now; its requests move elsewhere and keep going. Returns its id."""
        proposer_id = model if model in self.proposers else draft_id(model)
        self._check_unloadable(proposer_id, model)
        for req in requests:
            if req.spec_method == proposer_id:
                self.move(req, "its draft is being unloaded", allow_plain=True)
        self.remove(proposer_id)
        if self.router is not None:
            self.router.forget(proposer_id)
        self._sync_pools()
        return proposer_id

    def move(self, req: Request, reason: str, allow_plain: bool = False) -> None:
        """Hand a running request to another proposer (the router's next choice). Without one it
        keeps its proposer (which re-probes), or with `allow_plain` decodes plainly."""
        old = req.spec_method
        new = None
        if self.router is not None:
            new = self.router.switch(req.spec_domain or "prose", old, set(req.spec_history), self.candidates())
        if new is None and not allow_plain:
            return
        self.observe_gain(req)
        if old in self.proposers:
            self.proposers[old].free(req.request_id)
            self.controllers[old].free(req.request_id)
        req.spec_method = new
        if new is not None:
            req.spec_history.append(new)
            self.touch(new)
            self.load(new)
        log.info("request %s: %s under %s; now %s", req.request_id, reason, old, new or "plain decoding")

    def observe_gain(self, req: Request) -> None:
        """Tell the router what the request's current proposer achieved on it."""
        if self.router is not None and req.spec_domain and req.spec_method in self.controllers:
            tokens, cost = self.controllers[req.spec_method].gain(req.request_id)
            self.router.observe(req.spec_domain, req.spec_method, tokens, cost)

    def _sync_pools(self) -> None:
        self.pools.clear()
        self.pools.update({i: p.kv for i, p in self.proposers.items() if registry.get(self.kinds[i]).has_kv_pool})
