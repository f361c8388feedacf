"""SpeculativeConfig (E20): vLLM's --speculative-config JSON, validated when built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig


def test_ngram_defaults_and_vllm_rule_for_one_bound():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5).prompt_lookup_min == 5
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=3).prompt_lookup_max == 3
    assert SpeculativeConfig.parse(c.to_json()) == c


def test_engine_config_takes_dict_json_or_config():
    as_dict = {"method": "draft_model", "self_draft_layers": 4, "num_speculative_tokens": 2}
    a = EngineConfig.from_options(speculative_config=as_dict).speculative_config
    b = EngineConfig.from_options(speculative_config=SpeculativeConfig(**as_dict)).speculative_config
    c = EngineConfig.from_options(speculative_config=json.dumps(as_dict)).speculative_config
    assert a == b == c and a.self_draft_layers == 4
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(("value", "match"), [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "unknown method 'medusa'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    (f'{{"method": "ngram", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS + 1}}}', "at most"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown keys \\['lookahead'\\]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min \\(4\\) must not exceed prompt_lookup_max \\(2\\)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}', "takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "exactly one of model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/x", "self_draft_layers": 2}',
     "exactly one of model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "self_draft_layers": 0}', "self_draft_layers must be"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/x", "prompt_lookup_max": 2}',
     "apply to method 'ngram' only"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}', "adaptive must be true or false"),
    ('{"method": "eagle", "num_speculative_tokens": 2, "model": ""}', "takes model: the draft head's directory"),
    ('{"method": "eagle", "num_speculative_tokens": 2, "model": "/h", "self_draft_layers": 2}',
     "takes only model"),
    ("[1, 2", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_configs_are_refused_naming_the_value(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_options(speculative_config=value)


def test_cli_refuses_a_bad_config_before_loading_anything():
    r = subprocess.run([sys.executable, "-m", "pdserve.tools.cli", "generate", "--speculative-config",
                        '{"method": "nope", "num_speculative_tokens": 2}', "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "unknown method 'nope'" in r.stderr
