"""Triton glue: text -> llm (BLS, streamed) -> text, forwarding client cancels to the llm as `stop`.

Tokenizes and detokenizes with backend/serving/tokenizer.py and backend/serving/detokenize.py (stateful here: one
thread follows the whole stream), so the text equals the ensemble's.
"""

import json
import threading
import time
import uuid
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.detokenize import IncrementalDetokenizer
from backend.serving.request import parse_text_prompt
from backend.serving.tokenizer import encode
from backend.triton.glue import (error_response, forwarded_error, model_parameters, model_tokenizer,
                                 read_inputs, requested_outputs, tensors_response)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TEXT_INPUTS = ("text_input", "apply_chat_template")
PASSTHROUGH = ("output_log_probs", "cum_log_probs", "output_top_logprobs", "output_top_logprob_ids",
               "output_prompt_logprobs", "output_prompt_top_logprobs", "output_prompt_top_logprob_ids",
               "num_input_tokens", "num_output_tokens", "finish_reason", "sequence_index")
RETIRE_S = 10.0  # how long a finished BLS stream stays referenced here (see _retire)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input_names = [i["name"] for i in config["input"]]
        self.tokenizer = model_tokenizer(args)
        self.llm = model_parameters(args).get("llm_model", "llm")
        self.active: dict[str, set[str]] = {}  # client request id -> its llm request ids
        self.lock = threading.Lock()
        self.stop_lock = threading.Lock()
        self.retired: deque[tuple[float, tuple]] = deque()  # (when, (BLS request, its responses)), oldest first

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request) -> None:
        sender, requested = request.get_response_sender(), requested_outputs(request)
        client_id = request.request_id()
        try:
            inputs = read_inputs(pb_utils, request, self.input_names)
            prompt = parse_text_prompt(inputs)
            if prompt.stop:
                with self.lock:
                    targets = list(self.active.get(client_id, ()))
                for llm_id in targets:
                    self._stop(llm_id)
                sender.send(_text_response("", {}, requested), flags=FINAL)
                return
            ids = np.asarray(encode(self.tokenizer, prompt.text, prompt.apply_chat_template), dtype=np.int32).reshape(1, -1)
            self._generate(client_id, ids, inputs, sender, requested)
        except Exception as err:  # noqa: BLE001 - this request's error; the model serves on
            sender.send(error_response(pb_utils, err), flags=FINAL)

    def _generate(self, client_id: str, ids: np.ndarray, inputs: dict, sender, requested: frozenset[str]) -> None:
        llm_id = f"bls-{uuid.uuid4().hex}"
        tensors = [pb_utils.Tensor("input_ids", ids)]
        tensors += [pb_utils.Tensor(n, v) for n, v in inputs.items() if n not in TEXT_INPUTS]
        request = pb_utils.InferenceRequest(model_name=self.llm, inputs=tensors, request_id=llm_id,
                                            requested_output_names=["output_ids", "is_final", *PASSTHROUGH])
        with self.lock:
            self.active.setdefault(client_id, set()).add(llm_id)
        samples = inputs.get("num_return_sequences")
        unfinished = 1 if samples is None else int(samples.reshape(-1)[0])  # the llm refuses a bad count
        detokenizers: dict[int, IncrementalDetokenizer] = {}  # one per sample
        cancelled = False
        responses = request.exec(decoupled=True)
        try:
            for response in responses:
                if response.has_error():
                    if not cancelled:
                        error = forwarded_error(pb_utils, response.error())
                        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                    return
                outs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if not outs:
                    continue
                if not cancelled and sender.is_cancelled():
                    cancelled = True  # the engine frees the sequence at its next step
                    self._stop(llm_id)
                final = bool(outs["is_final"].reshape(-1)[0])  # of its sample
                index = int(outs["sequence_index"].reshape(-1)[0]) if "sequence_index" in outs else 0
                if index not in detokenizers:
                    detokenizers[index] = IncrementalDetokenizer(self.tokenizer)
                text = detokenizers[index].push(outs["output_ids"].reshape(-1).tolist(), final=final)
                unfinished -= final
                if not cancelled:
                    sender.send(_text_response(text, outs, requested), flags=FINAL if unfinished <= 0 else 0)
                if unfinished <= 0:
                    return
        finally:
            self._retire(request, responses)
            with self.lock:
                self.active[client_id].discard(llm_id)
                if not self.active[client_id]:
                    del self.active[client_id]
            if cancelled:
                sender.send(flags=FINAL)

    def _stop(self, llm_id: str) -> None:
        """One stop at a time: a stop is a short-lived decoupled BLS stream, and the stub segfaulted inside
        `exec` with 8 of them in flight at once (its traceback, 2026-11-23; the python backend's stream map
        under concurrent decoupled BLS, Triton server issues 8882 and 8922). The llm answers a stop at once."""
        stop = pb_utils.InferenceRequest(
            model_name=self.llm, request_id=llm_id, requested_output_names=["is_final"],
            inputs=[pb_utils.Tensor("input_ids", np.zeros((1, 0), np.int32)),
                    pb_utils.Tensor("stop", np.array([[True]]))])
        with self.stop_lock:
            responses = stop.exec(decoupled=True)
            for _ in responses:
                pass
        self._retire(stop, responses)

    def _retire(self, request, responses) -> None:
        """Drop a finished BLS stream here, later. Triton 2.51's stub holds each stream too, until a thread of
        its own that runs without the GIL erases it; when that comes after Python's last reference, the stream's
        tensors are freed there, numpy arrays without the GIL, which corrupts the heap (python_backend #390,
        fixed in Triton 25.01; the likely cause of the llm_bls stub crashes in the cancel storms). Held RETIRE_S
        seconds, Python's reference is the last one, and Python frees them."""
        now = time.monotonic()
        with self.lock:
            self.retired.append((now, (request, responses)))
            while now - self.retired[0][0] > RETIRE_S:
                self.retired.popleft()


def _text_response(text: str, outs: dict, requested: frozenset[str]) -> "pb_utils.InferenceResponse":
    tensors = {"text_output": np.array([[text.encode("utf-8")]], dtype=np.object_)}
    tensors.update((n, outs[n]) for n in PASSTHROUGH if n in outs)
    return tensors_response(pb_utils, tensors, requested)
