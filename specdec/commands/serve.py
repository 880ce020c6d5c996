"""`specdec serve`: the OpenAI-compatible HTTP server. A YAML file (--config) gives the engine and
server settings; each flag given overrides its value, a flag not given leaves the file's."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from specdec.commands.args import (
    add_engine_args,
    add_huge_pages_arg,
    add_model_args,
    add_spec_args,
    cache_overrides,
    check_chat_template,
    check_device,
    check_pulled,
    config_models,
    describe_speculation,
    sampling_config,
    scheduler_overrides,
    speculative_config,
)
from specdec.config import (
    CACHE_SCOPES,
    LOG_LEVELS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    ServingConfig,
    SpeculativeConfig,
    load_yaml_config,
)


def register(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model (as vLLM's `vllm serve MODEL`; "
                                                                  "or --model)")
    sv.add_argument("--config", help="YAML config (execution_config, speculative, server); flags override it")
    add_model_args(sv, defaults=False)
    add_huge_pages_arg(sv)
    add_engine_args(sv)
    sv.add_argument("--seed", type=int, default=None,
                    help="seeds requests that carry no seed, in arrival order (a run reproduces)")
    add_spec_args(sv, defaults=False)
    sv.add_argument("--served-model-name", default=None,
                    help="the model name /v1/models reports (default: the target's)")
    sv.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                    help="default info: one access-log line per request")
    sv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=None)
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or set SPECDEC_API_KEY)")
    sv.add_argument("--api-keys-file", default=None,
                    help="more API keys (tenants), one per line; only --api-key opens /admin")
    sv.add_argument("--cache-scope", choices=CACHE_SCOPES, default=None,
                    help="api_key: each key's requests share prefix and suffix caches only among themselves "
                         "(default shared; cache_salt separates requests either way)")
    sv.add_argument("--suffix-cache-path", default=None,
                    help="save the suffix cache to this file on shutdown and load it at start")
    sv.add_argument("--router", action="store_true",
                    help="choose a proposer per request (domain guess + measured gain)")
    sv.add_argument("--extra-draft", action="append", default=[],
                    help="another draft model the router may use, loaded on first use (repeatable)")
    sv.add_argument("--shadow-fraction", type=float, default=None,
                    help="shadow A/B: share of speculative requests also decoded plainly in the background")
    sv.add_argument("--replicas", type=int, default=None,
                    help="engine replicas on Ray Serve behind one endpoint (default 1: this process, no Ray)")
    sv.add_argument("--ray-address", default=None,
                    help="join a running Ray cluster (auto | HOST:PORT); default: start a local one with the server")
    sv.add_argument("--routing", choices=("affinity", "random", "least_loaded"), default=None,
                    help="how requests pick a replica (default affinity: the replica holding the prompt's prefix)")
    sv.set_defaults(func=cmd_serve)


def serve_configs(a: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, ServingConfig]:
    """The engine, server and serving configs from --config (if any), then the flags given on top.
    Precision `auto` (the default without a file) is resolved by the engine when it is built."""
    _merge_model_arg(a)
    engine_cfg, server_cfg, serving = (_read_config(a.config) if a.config
                                       else (EngineConfig(), ServerConfig(), ServingConfig()))
    model = _model_config(a, engine_cfg.model)
    sched = {**dataclasses.asdict(engine_cfg.scheduler), **scheduler_overrides(a)}
    cache = {**dataclasses.asdict(engine_cfg.cache), **cache_overrides(a)}
    engine_cfg = EngineConfig(model=model, cache=CacheConfig(**cache),
                              scheduler=SchedulerConfig(**sched), structured=engine_cfg.structured,
                              sampling=sampling_config(a, engine_cfg.sampling),
                              speculative=_speculative(a, engine_cfg.speculative, model.model))
    return engine_cfg, _server_config(a, server_cfg), _serving_config(a, serving)


def _merge_model_arg(a: argparse.Namespace) -> None:
    """`serve MODEL` (vLLM's form) and `--model MODEL` are one setting: given twice, they must agree."""
    if a.model_arg is not None:
        if a.model is not None and a.model != a.model_arg:
            raise ValueError(f"MODEL {a.model_arg} and --model {a.model} differ: give the model once")
        a.model = a.model_arg


def _read_config(path: str) -> tuple[EngineConfig, ServerConfig, ServingConfig]:
    try:
        return load_yaml_config(path)
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None


def check_before_loading(engine_cfg: EngineConfig, a: argparse.Namespace) -> None:
    """What fails without a model, failed before one loads: a CUDA device without CUDA, a chat
    template that cannot be read or does not parse (named by the flag, or the YAML key)."""
    check_device(engine_cfg.model.device, "--device" if a.device is not None else "execution_config.device")
    check_chat_template(engine_cfg.model.chat_template,
                        "--chat-template" if a.chat_template is not None else "execution_config.chat_template")


def check_server(engine_cfg: EngineConfig, server: ServerConfig, serving: ServingConfig) -> None:
    """The server settings that read files, checked before a model loads: the keys file, and where the
    suffix cache is saved (one process with speculation, in a folder that exists)."""
    server.all_keys()
    path = server.suffix_cache_path
    if path is None:
        return
    if serving.on_ray:
        raise ValueError("server.suffix_cache_path works with one process: replicas would overwrite each "
                         "other's file")
    if engine_cfg.speculative is None:
        raise ValueError("server.suffix_cache_path needs speculation (the suffix cache): drop --no-spec")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"server.suffix_cache_path: {folder} is not a folder this process can write")


def _model_config(a: argparse.Namespace, base: ModelConfig) -> ModelConfig:
    model = dataclasses.asdict(base)
    for flag, name in (("model", "model"), ("precision", "precision"), ("device", "device"),
                       ("max_model_len", "max_model_len"), ("threads", "num_threads"),
                       ("chat_template", "chat_template"), ("seed", "seed"), ("huge_pages", "huge_pages")):
        if getattr(a, flag) is not None:
            model[name] = getattr(a, flag)
    return ModelConfig(**model)


def _speculative(a: argparse.Namespace, base: SpeculativeConfig | None, model: str) -> SpeculativeConfig | None:
    """The flags' speculation without a file, or when they name a method (--draft, --spec,
    --no-spec, --speculative-config); otherwise the file's, with -k, --spec-policy and --draft-precision on top."""
    spec = base
    if a.config is None or a.no_spec or a.draft or a.spec or a.speculative_config:
        spec = speculative_config(a, model)
    elif spec is not None:
        given = {"num_speculative_tokens": a.num_speculative_tokens, "policy": a.spec_policy}
        spec = dataclasses.replace(spec, **{k: v for k, v in given.items() if v is not None})
        if a.draft_precision is not None:
            spec = dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, precision=a.draft_precision))
    if a.router or a.extra_draft:
        if spec is None:
            raise ValueError("--router / --extra-draft need speculation (drop --no-spec)")
        spec = dataclasses.replace(
            spec, router=dataclasses.replace(spec.router, enabled=spec.router.enabled or a.router),
            draft=dataclasses.replace(spec.draft, extra_models=spec.draft.extra_models + a.extra_draft))
    return spec


def _server_config(a: argparse.Namespace, base: ServerConfig) -> ServerConfig:
    server = dataclasses.asdict(base)
    for name in ("host", "port", "api_key", "shadow_fraction", "served_model_name", "log_level", "api_keys_file",
                 "cache_scope", "suffix_cache_path"):
        if getattr(a, name) is not None:
            server[name] = getattr(a, name)
    if server["api_key"] is None and os.environ.get("SPECDEC_API_KEY"):
        server["api_key"] = os.environ["SPECDEC_API_KEY"]
    return ServerConfig(**server)


def _serving_config(a: argparse.Namespace, base: ServingConfig) -> ServingConfig:
    given = {"replicas": a.replicas, "ray_address": a.ray_address, "routing": a.routing}
    serving = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    if a.replicas is not None and serving.autoscaling is not None:
        raise ValueError("--replicas and serving.autoscaling both set the number of replicas: keep one")
    if a.routing is not None and not serving.on_ray:
        raise ValueError("--routing picks among replicas: give --replicas N (or --ray-address)")
    return serving


def configure_logging(level: str) -> None:
    """Log lines on stderr from `level` (critical ... debug) on; at info, one access line per request.
    The level is set even where a handler already exists (basicConfig then does nothing)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level.upper())


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from specdec.engine import LLMEngine
    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine
    from specdec.server.lifecycle import DrainingServer, JSONErrorsH11
    from specdec.server.lifecycle import restore_suffix_cache
    engine_cfg, server_cfg, serving = serve_configs(a)
    check_before_loading(engine_cfg, a)
    check_server(engine_cfg, server_cfg, serving)
    check_pulled(config_models(engine_cfg))  # a server installs nothing: say which pull is missing, exit 2
    configure_logging(server_cfg.log_level)
    if serving.on_ray:
        from specdec.serve_ray.launch import run
        return run(engine_cfg, server_cfg, serving, engine_cfg.model.model.rsplit("/", 1)[-1])

    def build() -> LLMEngine:  # on the engine thread: /health answers 503 meanwhile
        engine = LLMEngine(engine_cfg, progress=True)
        print(f"model {engine.loaded.name} ({engine.precision}, {engine_cfg.model.device}) loaded; "
              + describe_speculation(engine.config.speculative), file=sys.stderr)
        if server_cfg.suffix_cache_path is not None:
            restore_suffix_cache(engine, server_cfg.suffix_cache_path)
        return engine

    engine = AsyncEngine(build, queue_timeout=server_cfg.queue_timeout)
    app = build_app(engine, server_cfg, engine_cfg.model.model.rsplit("/", 1)[-1])
    engine.start()
    auth = "API key required" if server_cfg.has_keys else "no API key"
    print(f"serving {engine_cfg.model.model} on http://{server_cfg.host}:{server_cfg.port} ({auth}); "
          "/health answers 503 until the models are loaded", file=sys.stderr)
    # uvicorn's own lines (startup, its access log) only from warning on: ours say the same
    uvicorn_level = server_cfg.log_level if server_cfg.log_level in ("error", "critical") else "warning"
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=uvicorn_level,
                            timeout_graceful_shutdown=5, http=JSONErrorsH11)
    try:
        DrainingServer(config, app.state.specdec).run()
    finally:
        engine.shutdown()
    return 0
