"""KV export / import between two engines (disaggregated prefill and decode, in one process): the decode
engine that imports a prefill engine's blocks generates exactly what one engine generates alone."""

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.errors import InvalidRequestError
from backend.engine.kv_events import BlockStored
from backend.engine.kv_transfer import ExportedKV
from tests.reference import hf_greedy

PROMPT = list(range(300, 357))  # 57 tokens: 3 full blocks of 16 and a partial one


def _engine(model_dir, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(model_dir), **settings))


def test_decode_after_imported_prefill_equals_hf(tiny_model_dir):
    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir, enable_kv_events=True)
    prefill.generate([PROMPT], SamplingParams(max_tokens=1))
    kv = prefill.export_kv(PROMPT)
    assert (kv.num_tokens, kv.num_blocks) == (48, 3) and kv.data.shape[2] == 3

    assert decode.import_kv(PROMPT, kv) == 48
    stored = [e for e in decode.kv.take_events() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [tuple(PROMPT[i:i + 16]) for i in (0, 16, 32)]  # the router learns them
    assert decode.kv.num_used_blocks == 0  # cached, not held: the request takes them as prefix hits
    [out] = decode.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out == hf_greedy(tiny_model_dir, [PROMPT], [12])[0]
    assert decode.kv.stats.hit_tokens == 48 and decode.kv.num_used_blocks == 0


def test_import_keeps_cached_blocks_and_stops_where_the_pool_ends(tiny_model_dir):
    prefill = _engine(tiny_model_dir)
    prefill.generate([PROMPT], SamplingParams(max_tokens=1))
    kv = prefill.export_kv(PROMPT)
    small = _engine(tiny_model_dir, num_kv_blocks=2)
    assert small.import_kv(PROMPT, kv) == 32  # two blocks fit; the third would need a third
    assert small.import_kv(PROMPT, kv) == 32  # again: the cached two stay, nothing leaks
    assert small.kv.num_used_blocks == 0


def test_blocks_of_another_shape_are_refused_by_name(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    wrong = ExportedKV(16, 16, torch.zeros(1, 2, 1, 16, 1, 8))
    with pytest.raises(InvalidRequestError, match="kv: blocks of shape"):
        engine.import_kv(PROMPT, wrong)
