"""An encoder behind the engine's Executor interface: the scheduler plans encoder inputs as prompt-only requests
(SamplingParams.pool), each admitted whole (chunked prefill off: attention runs both ways, so an input cannot
be split over steps), and this runner computes a step's inputs in one packed forward and returns each one's
pooled vector, or a cross-encoder's logits for a "classify" request.

An encoder keeps no KV cache. The scheduler still counts blocks per sequence, so the runner declares a pool
with room for `max_num_seqs` inputs of the longest length: bookkeeping only, no memory behind it.
"""

from __future__ import annotations

import torch

from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.encoder.config import Pooling
from tokenmill.encoder.inputs import EncoderInput
from tokenmill.encoder.model import EncoderModel


class EncoderRunner:
    kv_block_bytes = 0  # no KV: nothing for the KV tiers to move

    def __init__(self, model: EncoderModel, pooling: Pooling, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> None:
        self.model = model
        self.pooling = pooling
        self.num_kv_blocks = max_num_seqs * -(-max_model_len // block_size)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = [s for s in plan.scheduled if not s.padding]
        if not scheduled:
            return ModelRunnerOutput({})
        for s in scheduled:
            if s.start_position != 0 or not s.sample or not s.sampling_params.pool:
                raise ValueError(f"request {s.request_id!r}: an encoder runs whole embedding inputs only")
        inputs = [EncoderInput(s.token_ids, s.token_type_ids) for s in scheduled]
        hidden = self.model(inputs)
        vectors = self.model.pool(hidden, [len(i.token_ids) for i in inputs], self.pooling)
        rows = vectors.tolist()
        classify = [s.sampling_params.pooling_task == "classify" for s in scheduled]
        if any(classify):  # the head runs on the rows that asked for it; theirs replace their embeddings
            logits = iter(self.model.classify(vectors[torch.tensor(classify)]).tolist())
            rows = [next(logits) if wanted else row for wanted, row in zip(classify, rows, strict=True)]
        return ModelRunnerOutput({}, pooled={s.request_id: row for s, row in zip(scheduled, rows, strict=True)})
