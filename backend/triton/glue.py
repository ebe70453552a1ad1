"""What the model.py files share: their parameters, the tokenizer, reading inputs, error responses.

The model.py files import pb_utils (it exists only inside the Triton stub) and pass it in."""

from __future__ import annotations

import faulthandler
import json
import re
import signal

import numpy as np

from backend.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from backend.serving.protocol import INPUTS
from backend.serving.request import input_error
from backend.serving.tokenizer import load_tokenizer
from backend.serving.model_store import resolve_model_dir

INPUT_NAMES = frozenset(t.name for t in INPUTS)

# A stub that dies of a fatal signal (the python backend's own crash family, Triton server issue 8882) first
# writes every thread's Python stack to its stderr, which is the server's log; so does a live one on SIGUSR1
# (`kill -USR1 <stub pid>`, and the launcher's supervisor before it kills a server whose engine is wedged).
faulthandler.enable(all_threads=True)
faulthandler.register(signal.SIGUSR1, all_threads=True)


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


def tensors_response(pb_utils, tensors: dict[str, np.ndarray], requested: frozenset[str]):
    """A response holding the tensors its request asked for, and no others.

    Triton 2.51's python backend drops a decoupled response's unrequested outputs itself, inside
    `sender.send` with the GIL released, and so frees their numpy arrays without the GIL (fixed upstream in
    python_backend #390, Triton 25.01): under load that corrupted the stub's heap while another thread ran
    Python (the stub crashes of the cancel storms). So nothing is left for it to drop."""
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items() if name in requested])


def requested_outputs(request) -> frozenset[str]:
    """The outputs a request asked for (all of the model's when its client named none)."""
    return frozenset(request.requested_output_names())


def error_response(pb_utils, err: Exception):
    """One final error response: INVALID_ARG for a bad input (named as the client sent it), UNAVAILABLE
    when overloaded or the engine is down, INTERNAL for anything else (logged)."""
    if isinstance(err, InvalidRequestError):
        err, code = input_error(err), pb_utils.TritonError.INVALID_ARG
    elif isinstance(err, (QueueFullError, EngineDeadError)):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
        pb_utils.Logger.log_error(f"request failed: {err!r}")
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), code))


def forwarded_error(pb_utils, error):
    """The error of a BLS call's response, to send on to the caller's client. Triton 2.51 hands a BLS caller
    every error as INTERNAL whatever its code; a bad input's error, which error_response writes as
    "<input>: what is allowed", is made INVALID_ARG again."""
    name = re.match(r"\w*", error.message()).group()
    if name in INPUT_NAMES:
        return pb_utils.TritonError(error.message(), pb_utils.TritonError.INVALID_ARG)
    return error
