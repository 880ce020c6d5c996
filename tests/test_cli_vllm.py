"""The CLI as vLLM and llama.cpp users type it: `serve MODEL`, vLLM's flags, one-line errors before any
model loads, stdin prompts, readable logprobs and a --compare-plain whose figures can be trusted."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from specdec.cli import build_parser, main
from specdec.commands import spec_json
from specdec.commands.serve import configure_logging, serve_configs

SMOLLM = "smollm2-135m-instruct"


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str, *needles: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and "error:" in lines[0] and all(n in lines[0] for n in needles) and "Traceback" not in err


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model would load: these mistakes must be caught before."""
    import specdec.llm

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(specdec.llm, "LLM", refuse)


# ---- the parser ---------------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("specdec ") and out.split()[1]


@pytest.mark.parametrize("args,cmd,needle", [
    (["generate", "--max-tokens", "x", "hi"], "specdec generate", "--max-tokens"),
    (["nope"], "specdec", "invalid choice"),
    (["serve", "--log-level", "loud"], "specdec serve", "--log-level"),
    (["models", "pull", "--prepare", "int3"], "specdec models pull", "--prepare"),
    ([], "specdec", "required"),
])
def test_argparse_errors_are_one_line(capsys, args, cmd, needle):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" not in err
    assert one_line_error(err, f"{cmd}: error:", needle, f"(see {cmd} --help)")


def test_models_alone_lists(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and SMOLLM in out
    assert run(capsys, "models", "list")[1] == out


# ---- serve: vLLM's form and flags ---------------------------------------------------------------

def test_serve_positional_model_and_vllm_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    a = build_parser().parse_args(["serve", SMOLLM, "--served-model-name", "my-model", "--max-num-seqs", "5",
                                   "--max-num-batched-tokens", "256", "--chat-template", str(template),
                                   "--seed", "11", "--log-level", "debug"])
    cfg, server, _ = serve_configs(a)
    assert cfg.model.model == SMOLLM and server.served_model_name == "my-model"
    assert (cfg.scheduler.max_batch_size, cfg.scheduler.max_num_batched_tokens) == (5, 256)
    assert cfg.model.chat_template == str(template) and cfg.model.seed == 11 and server.log_level == "debug"
    a = build_parser().parse_args(["serve", "--model", SMOLLM, "--max-batch-size", "7"])  # the old spelling
    cfg, server, _ = serve_configs(a)
    assert cfg.model.model == SMOLLM and cfg.scheduler.max_batch_size == 7 and server.log_level == "info"
    assert serve_configs(build_parser().parse_args(["serve", SMOLLM, "--model", SMOLLM]))[0].model.model == SMOLLM


def test_serve_flags_override_the_yaml(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("execution_config:\n  target_model: smollm2-135m-instruct\n  seed: 1\n"
                    "  max_num_batched_tokens: 64\nserver:\n  log_level: warning\n")
    cfg, server, _ = serve_configs(build_parser().parse_args(["serve", "--config", str(yaml)]))
    assert (cfg.model.seed, cfg.scheduler.max_num_batched_tokens, server.log_level) == (1, 64, "warning")
    a = build_parser().parse_args(["serve", "--config", str(yaml), "--seed", "2", "--max-num-batched-tokens", "128",
                                   "--log-level", "error"])
    cfg, server, _ = serve_configs(a)
    assert (cfg.model.seed, cfg.scheduler.max_num_batched_tokens, server.log_level) == (2, 128, "error")


def test_log_level_sets_the_root_logger():
    root = logging.getLogger()
    before = root.level
    try:
        configure_logging("debug")
        assert root.level == logging.DEBUG
        configure_logging("error")
        assert root.level == logging.ERROR and not logging.getLogger("specdec.access").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(before)


@pytest.mark.parametrize("args,needles", [
    (["serve", "a-model", "--model", "b-model"], ["a-model", "b-model", "--model"]),
    (["serve", "--config", "nope.yaml"], ["--config: cannot read nope.yaml: No such file or directory"]),
    (["serve", SMOLLM, "--chat-template", "{% if %}"], ["--chat-template", "does not parse"]),
    (["serve", SMOLLM, "--chat-template", "missing.jinja"], ["--chat-template: cannot read missing.jinja"]),
    (["serve", SMOLLM, "--speculative-config", '{"method": "medusa"}'], ["--speculative-config", "medusa"]),
    (["serve", SMOLLM, "--max-num-seqs", "0"], ["max_batch_size"]),
])
def test_serve_mistakes_are_one_line(capsys, args, needles):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and one_line_error(err, *needles)


def test_bad_yaml_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("execution_config: [unclosed\n  precision: x\n")
    code, _, err = run(capsys, "serve", "--config", bad)
    assert code == 2 and one_line_error(err, "not valid YAML")


def test_cuda_without_cuda_fails_before_loading(capsys, monkeypatch, no_load):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["generate", "--model", SMOLLM, "--device", "cuda", "hi"], ["serve", SMOLLM, "--device", "cuda:0"]):
        code, out, err = run(capsys, *args)
        assert code == 2 and out == "" and one_line_error(err, "--device cuda", "CUDA is not available")


# ---- --speculative-config ----------------------------------------------------------------------

def test_speculative_config_maps_vllms_keys():
    spec = spec_json.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, '
                           '"prompt_lookup_min": 2, "draft_tensor_parallel_size": 1}', SMOLLM)
    assert (spec.method, spec.num_speculative_tokens, spec.ngram.max_n, spec.ngram.min_n) == ("ngram", 5, 6, 2)
    assert spec.draft_model is None
    assert spec_json.parse('{"method": "ngram", "prompt_lookup_min": 7}', SMOLLM).ngram.max_n == 7
    spec = spec_json.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 24, '
                           '"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2}', SMOLLM)
    suffix = spec.suffix
    assert (spec.method, suffix.max_depth, suffix.spec_factor, suffix.min_prob) == ("suffix", 24, 2.0, 0.2)
    spec = spec_json.parse('{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3}',
                           "qwen2.5-coder-1.5b-instruct")  # vLLM infers draft_model from a model alone
    assert (spec.method, spec.draft_model) == ("draft_model", "qwen2.5-coder-0.5b-instruct")
    assert spec.num_speculative_tokens == 3
    spec = spec_json.parse('{"method": "draft_model"}', "qwen2.5-coder-1.5b-instruct")
    assert spec.draft_model == "qwen2.5-coder-0.5b-instruct"  # the registry's default draft
    assert spec_json.parse('{"method": "hybrid", "model": "x.gguf"}', SMOLLM).method == "hybrid"


@pytest.mark.parametrize("text,needles", [
    ('{"method": "eagle3", "model": "x"}', ["eagle3", "does not support"]),
    ('{"method": "lookahead"}', ["unknown method 'lookahead'"]),
    ('{"method": "ngram", "disable_by_batch_size": 4, "quantization": "fp8"}',
     ["keys disable_by_batch_size, quantization"]),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', ["draft_tensor_parallel_size must be 1"]),
    ('{"method": "ngram", "model": "x"}', ["uses no model"]),
    ('{"method": "ngram", "num_speculative_tokens": 99}', ["num_speculative_tokens"]),
    ('{"num_speculative_tokens": 3}', ['"method"']),
    ('["ngram"]', ["JSON object"]),
    ("{method: ngram}", ["not JSON"]),
])
def test_speculative_config_refuses_what_it_cannot_honour(text, needles):
    with pytest.raises(ValueError) as e:
        spec_json.parse(text, SMOLLM)
    message = str(e.value)
    assert message.startswith("--speculative-config: ") and "\n" not in message
    assert all(n in message for n in needles)


@pytest.mark.parametrize("flag", [["--spec", "ngram"], ["--draft", "x.gguf"], ["--no-spec"], ["-k", "2"]])
def test_speculative_config_conflicts_with_the_other_flags(capsys, no_load, flag):
    code, _, err = run(capsys, "generate", "--model", SMOLLM, "--speculative-config", '{"method": "ngram"}', *flag,
                       "hi")
    assert code == 2 and one_line_error(err, "--speculative-config", flag[0])


def test_speculative_config_runs(capsys, tiny_qwen):
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--json", "--max-tokens", 3,
                         "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}',
                         "--spec-policy", "fixed", "a b a b")
    assert code == 0 and "k=3, policy=fixed" in err and json.loads(out)["stats"]["method"] == "suffix"


# ---- inputs checked before any model loads ------------------------------------------------------

@pytest.mark.parametrize("args,needles", [
    (["--prompts-file", "missing.jsonl"], ["--prompts-file: cannot read missing.jsonl: No such file or directory"]),
    (["x", ""], ["prompt 2 is empty"]),
    (["--regex", "a(b", "x"], ["--regex", "invalid regular expression", "unclosed group"]),
    (["--grammar", "GRAMMAR", "x"], ["--grammar", "invalid grammar"]),
    (["--json-schema", "SCHEMA", "x"], ["--json-schema", "invalid JSON schema"]),
    (["--json-schema", "NOTJSON", "x"], ["--json-schema", "not valid JSON"]),
    (["--chat-template", "{{ unclosed", "x"], ["--chat-template", "does not parse"]),
    (["--choice", "", "x"], ["--choice"]),
    (["--compare-plain", "--compare-repeats", "0", "x"], ["--compare-repeats"]),
    (["-", "-"], ["once"]),
])
def test_bad_inputs_fail_fast_in_one_line(capsys, tmp_path, no_load, args, needles):
    files = {"GRAMMAR": "start: ???\n", "SCHEMA": '{"type": "strin"}', "NOTJSON": "{"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / x) if x in files else x for x in args]
    code, out, err = run(capsys, "generate", "--model", SMOLLM, *args)
    assert code == 2 and out == "" and one_line_error(err, *needles)


def test_empty_prompt_in_a_file_names_the_line(capsys, tmp_path, no_load):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "x"}\n{"prompt": ""}\n')
    code, _, err = run(capsys, "generate", "--model", SMOLLM, "--prompts-file", pf)
    assert code == 2 and one_line_error(err, "p.jsonl:2", "empty")


def test_structured_check_needs_no_tokenizer():
    from specdec.sample.structured import check_structured
    from specdec.sampling_params import StructuredOutput
    for ok in (StructuredOutput("regex", "[a-z]+"), StructuredOutput("json_schema", {"type": "object"}),
               StructuredOutput("grammar", 'start: "yes" | "no"'), StructuredOutput("choice", ["a", "b"])):
        check_structured(ok)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        check_structured(StructuredOutput("json_schema", {"$ref": "#/nowhere"}))


# ---- prompts and what comes out ------------------------------------------------------------------

def test_prompt_from_stdin(tiny_qwen):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tiny_qwen), "--json",
                        "--max-tokens", "2", "-"], input="a prompt\nover two lines\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt"] == "a prompt\nover two lines"
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tiny_qwen), "-"],
                       input="", capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and one_line_error(r.stderr, "prompt 1 (stdin) is empty")


def test_several_prompts_are_told_apart(capsys, tiny_qwen):
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--max-tokens", 2, "--ignore-eos",
                         "one", "two", "three")
    assert code == 0 and [line for line in err.splitlines() if line.startswith("===")] == [
        "=== prompt 1/3 ===", "=== prompt 2/3 ===", "=== prompt 3/3 ==="]
    assert "===" not in out
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--max-tokens", 2, "one")
    assert code == 0 and "===" not in err + out


def test_logprobs_carry_token_text(capsys, tiny_qwen):
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--json", "--max-tokens", 3, "--ignore-eos",
                         "--logprobs", 2, "hello")
    row = json.loads(out)
    assert code == 0 and len(row["logprobs"]) == 3
    for token_id, lp in zip(row["token_ids"], row["logprobs"]):
        assert lp["token_id"] == token_id and isinstance(lp["token"], str) and lp["logprob"] <= 0
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["logprob"] >= lp["top_logprobs"][1]["logprob"]
        assert set(lp["top_logprobs"][0]) == {"token", "token_id", "logprob"}
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--max-tokens", 3, "--ignore-eos", "--logprobs", 2,
                         "hello")
    assert code == 0 and "logprobs:" in err and "top:" in err and "logprob" not in out


def test_seed_reproduces_a_sampled_run(capsys, tiny_qwen):
    def sampled(seed: int, *extra) -> list[list[int]]:
        code, out, _ = run(capsys, "generate", "--model", tiny_qwen, "--json", "--temperature", "1.0", "--seed", seed,
                           "--max-tokens", 8, "--ignore-eos", "--no-spec", *extra, "the same", "the same")
        assert code == 0
        return [json.loads(line)["token_ids"] for line in out.splitlines()]

    first = sampled(7)
    assert sampled(7) == first and sampled(7, "--batch") == first
    assert first[0] != first[1]  # each prompt draws its own stream from the engine's seed
    assert sampled(8) != first


def test_chat_template_override(capsys, tiny_qwen, tmp_path):
    from specdec.llm import LLM
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    llm = LLM(model=str(tiny_qwen), precision="float32", chat_template=template, progress=False)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    assert llm.engine.loaded.tokenizer.chat_template != template  # the shared tokenizer keeps its own
    path = tmp_path / "t.jinja"
    path.write_text(template)
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--chat", "--chat-template", path, "--json",
                         "--max-tokens", 1, "hi")
    assert code == 0 and json.loads(out)["stats"]["prompt_tokens"] == len(llm.tokenizer.encode("<<hi>>", False))


# ---- --compare-plain ----------------------------------------------------------------------------

def test_compare_plain_reports_medians_of_alternating_rounds(capsys):
    code, out, err = run(capsys, "generate", "--model", SMOLLM, "--spec", "ngram", "--spec-policy", "fixed", "--chat",
                         "--max-tokens", 12, "--ignore-eos", "--compare-plain",
                         "Repeat exactly: the cat sat on the mat, the cat sat on the mat")
    assert code == 0 and out.strip()
    lines = err.splitlines()
    plain = next(x for x in lines if x.startswith("plain decoding:"))
    spec = next(x for x in lines if x.startswith("speculative decoding:"))
    speedup = next(x for x in lines if x.startswith("speedup "))
    assert "median of 3 rounds" in plain and "median of 3 rounds" in spec and "acceptance" in spec
    assert "median of 3 paired rounds, min" in speedup and "output identical to plain" in speedup
    assert lines.index(speedup) > lines.index(next(x for x in lines if x.startswith("[")))  # after the output


def test_compare_plain_gives_no_speedup_when_nothing_is_drafted(capsys, monkeypatch):
    from specdec.commands import compare_plain

    class Busy:  # every timed run had company
        cores, noisy, load_average = 1.5, True, 3.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(compare_plain, "Contention", Busy)
    code, out, err = run(capsys, "generate", "--model", SMOLLM, "--spec", "ngram", "-k", 0, "--max-tokens", 4,
                         "--compare-plain", "--compare-repeats", 2, "hello")
    assert code == 0
    assert "no speedup figure: nothing was drafted (k = 0); output identical to plain" in err
    assert "median of 2 rounds" in err and "speedup " not in err.replace("no speedup figure", "")
    assert "warning: other processes took up to 1.5 cores in 4 of 4 timed runs" in err


def test_busy_warning():
    from specdec.contention import Contention, busy_warning
    quiet, busy = Contention(), Contention()
    quiet.cores, busy.cores = 0.1, 0.9
    assert busy_warning([quiet, quiet]) is None
    assert "0.9 cores in 1 of 2 timed runs" in busy_warning([quiet, busy])
