"""config.pbtxt `parameters` -> EngineConfig: every setting, tenant quotas, and errors that name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.engine.config import EngineConfig, TenantQuota, setting_fields
from backend.serving.settings import engine_config_from_settings, parse_tenant_quotas

LLM_CONFIG = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt"


def test_parameters_reach_their_part_of_the_config(tiny_model_dir):
    config = engine_config_from_settings({
        "model": str(tiny_model_dir), "max_num_seqs": "8", "block_size": "32", "enable_prefix_caching": "false",
        "num_kv_blocks": "none", "kv_cache_memory_gb": "0.5", "tenant_quotas": "gold=running:4,blocks:100; *=running:2",
    })
    assert config.scheduler.max_num_seqs == 8 and config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False and config.cache.num_kv_blocks is None
    assert config.cache.kv_cache_memory_gb == 0.5
    assert config.scheduler.tenant_quotas == {"gold": TenantQuota(4, 100), "*": TenantQuota(max_running=2)}


@pytest.mark.parametrize("params, message", [
    ({"max_num_seq": "8"}, "max_num_seq: not an engine setting"),
    ({"max_num_seqs": "eight"}, "max_num_seqs: expected int"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching: expected bool"),
    ({"admission_policy": "fifo"}, "admission_policy: unknown policy 'fifo'"),
    ({"tenant_quotas": "gold=runing:4"}, "tenant_quotas: 'runing:4'"),
    ({"tenant_quotas": "gold"}, "tenant_quotas: 'gold'"),
])
def test_bad_parameters_name_the_key(tiny_model_dir, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_config_from_settings({"model": str(tiny_model_dir), **params})


def test_llm_config_pbtxt_sets_only_known_settings_with_the_code_defaults():
    """The shipped config.pbtxt and the code agree: no unknown key, and each value equals the code's default
    (one default per setting), except the model, which the front door resolves."""
    text = LLM_CONFIG.read_text()
    params = dict(re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))
    fields = setting_fields()
    assert set(params) <= set(fields), set(params) - set(fields)
    defaults = EngineConfig.create(model="default")
    for key, text_value in params.items():
        if key == "model":
            continue
        part = defaults.scheduler if hasattr(defaults.scheduler, key) else \
            defaults.cache if hasattr(defaults.cache, key) else defaults
        expected = getattr(part, key)
        shown = "none" if expected is None else str(expected).lower()
        assert text_value.lower() == shown, f"{key}: config.pbtxt says {text_value!r}, the code {expected!r}"


def test_quota_syntax_round_trip():
    assert parse_tenant_quotas("") == {}
    assert parse_tenant_quotas("a=blocks:8") == {"a": TenantQuota(max_blocks=8)}
