"""The decoupled models send only the outputs a request asked for.

Triton 2.51's python backend drops unrequested outputs inside `sender.send` with the GIL released, freeing
their numpy arrays without it (python_backend #390, fixed in Triton 25.01). That corrupted the llm stub's
heap within two minutes of a cancel storm on the text front door (2026-11-23). Whether a stub survives is
timing; what is checked here is the project's side: nothing is left for the backend to drop.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from backend.triton import glue

MODEL_REPO = Path(__file__).resolve().parents[1] / "model_repository"
DECOUPLED = ("llm", "llm_bls")


class FakeTensor:
    def __init__(self, name: str, value: np.ndarray):
        self.name, self.value = name, value


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor]):
        self.output_tensors = output_tensors


class FakePbUtils:
    """pb_utils's interface, as glue.tensors_response uses it."""

    Tensor = FakeTensor
    InferenceResponse = FakeResponse


def test_a_response_holds_only_the_requested_outputs():
    tensors = {"output_ids": np.zeros((1, 2), np.int32), "is_final": np.ones((1, 1), np.bool_),
               "text_output": np.array([[b"hi"]], dtype=np.object_)}
    response = glue.tensors_response(FakePbUtils, tensors, frozenset({"text_output", "finish_reason"}))
    assert [t.name for t in response.output_tensors] == ["text_output"]
    assert glue.tensors_response(FakePbUtils, tensors, frozenset()).output_tensors == []


def test_the_decoupled_models_build_every_response_with_tensors_through_it():
    for model in DECOUPLED:
        source = (MODEL_REPO / model / "1" / "model.py").read_text()
        assert "tensors_response(" in source, model
        assert not re.search(r"InferenceResponse\(\s*output_tensors", source), model
