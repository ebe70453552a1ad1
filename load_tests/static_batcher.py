"""The static-batching baseline of bench_online: HF transformers `generate` over batches formed from a queue.

One background thread loops: take the oldest waiting request, add whatever else has already arrived (up to
`max_batch`, no waiting for more), left-pad the prompts, and run one greedy `generate` for the batch's
longest max_tokens with EOS suppressed (min_new_tokens). Tokens stream out per step; a request ends as soon
as it has its own max_tokens, but the batch runs on to its longest member, and requests that arrive
meanwhile wait for the next batch. That waiting is what in-flight batching removes.

Served by the Triton python model load_tests/static_hf (so clients use the same path as for our server).
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

MAX_BATCH = 8


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[list[int], bool], None]  # (new token ids, final)
    fail: Callable[[BaseException], None]
    sent: int = field(default=0, init=False)


class _BatchStreamer(BaseStreamer):
    """Hands each generated column to its jobs; a job's final tokens go out when it reaches max_tokens."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first puts the (padded) prompts
            self.prompt_seen = True
            return
        for job, token in zip(self.jobs, value.reshape(-1).tolist()):
            if job.sent < job.max_tokens:
                job.sent += 1
                job.emit([token], job.sent == job.max_tokens)

    def end(self) -> None:
        pass


class StaticBatcher:
    def __init__(self, model, pad_id: int, max_batch: int = MAX_BATCH):
        self.model, self.pad_id, self.max_batch = model, pad_id, max_batch
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="static-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _next_batch(self) -> list[Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        while len(batch) < self.max_batch:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # closing: finish this batch first
                self._queue.put(None)
                break
            batch.append(job)
        return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._generate(batch)
            except BaseException as err:  # noqa: BLE001 - answer the batch's requests; the loop serves on
                traceback.print_exc()
                for job in batch:
                    if job.sent < job.max_tokens:
                        job.fail(err)

    def _generate(self, batch: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
        new = max(j.max_tokens for j in batch)
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=self.pad_id, streamer=_BatchStreamer(batch))
