"""Small helpers shared by the model.py files (which import pb_utils; these take what they need)."""

from __future__ import annotations

import json

import numpy as np

from backend.tokenizer import load_tokenizer
from build_engine.prepare_model import resolve_model_dir


def model_parameters(args: dict) -> dict[str, str]:
    """The config.pbtxt `parameters` of a model, as strings."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {key: value["string_value"] for key, value in params.items()}


def model_tokenizer(args: dict):
    """The tokenizer of the model named by the `model` parameter ("default" or a folder)."""
    return load_tokenizer(resolve_model_dir(model_parameters(args)["model"]))


def read_inputs(pb_utils, request, names: list[str]) -> dict[str, np.ndarray]:
    """The request's inputs among `names` that are present, as numpy arrays."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs
