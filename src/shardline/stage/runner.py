"""One compiled shard; one InferRequest (and so one in-graph KV state) per stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.manifest import StageEntry
from shardline.stage.cache import StepInputs

_BEAMS = [np.arange(b, dtype=np.int32) for b in range(65)]  # identity Gathers, made once


class StageRunner:
    def __init__(self, folder: Path, entry: StageEntry, run: RunConfig, core: ov.Core | None = None) -> None:
        self.entry = entry
        core = core or ov.Core()
        try:
            model = core.read_model(folder / entry.xml)
            self.compiled = core.compile_model(model, run.device, run.ov_properties())
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShardlineError(f"cannot load {entry.name} from {folder} on {run.device}: {first}") from None
        self._input = "input_ids" if entry.has_embedding else "hidden_states"
        self._out = self.compiled.output(0)
        self._streams: dict[int, ov.InferRequest] = {}

    def open(self, stream: int) -> None:
        if stream in self._streams:
            raise ShardlineError(f"stream {stream} is already open on {self.entry.name}")
        self._streams[stream] = self.compiled.create_infer_request()

    def has(self, stream: int) -> bool:
        return stream in self._streams

    def close(self, stream: int) -> None:
        """Drop the stream's request and with it its KV state."""
        self._streams.pop(stream, None)

    def reset(self, stream: int) -> None:
        self._streams[stream].reset_state()

    def move(self, stream: int, to: int) -> None:
        """The request of `stream` (and its KV) is known as `to` from now on."""
        if to in self._streams:
            raise ShardlineError(f"stream {to} is already open on {self.entry.name}")
        self._streams[to] = self._streams.pop(stream)

    def kv(self, stream: int) -> dict[str, np.ndarray]:
        """A copy of the stream's KV state: variable name -> [B, kv_heads, slots, head_dim]."""
        return {s.name: s.state.data.copy() for s in self._streams[stream].query_state()}

    def set_kv(self, stream: int, kv: dict[str, np.ndarray]) -> None:
        """Replace the stream's whole KV state (OpenVINO sets a variable as a whole)."""
        for state in self._streams[stream].query_state():
            state.state = ov.Tensor(kv[state.name])

    def run(self, stream: int, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray:
        """Run one step; returns hidden states [1, T, H] or, on the last stage, logits [1, T, V]."""
        request = self._streams[stream]
        x = inputs.input_ids if hidden is None else hidden
        # Inputs are copied (share_inputs=False): a request keeps its last input tensors set, and
        # with shared memory it would point into numpy buffers freed after this call. Seen here:
        # heap corruption when such a request was later destroyed. The copy is a few KB per step.
        # start_async + wait rather than infer(): the step then runs on the plugin's own pinned
        # executor thread instead of the calling Python thread; measured 0.5-1 ms per token
        # faster on this 2-core VM (BENCHMARKS.md, parity), and it matches openvino_genai.
        request.start_async(
            {self._input: x, "attention_mask": inputs.attention_mask,
             "position_ids": inputs.position_ids, "beam_idx": self._beam(inputs)},
            share_inputs=False,
        )
        request.wait()
        out = request.get_tensor(self._out)
        if self.entry.has_head and out.shape[1] > 1:
            # A request keeps its output buffer for the stream's life: after a prefill that is
            # [1, T, vocab] f32 (196 KB per prompt token; 48 of a stream's 61 MB at 256 tokens,
            # measured). Hand back a copy and give the request a one-row buffer for the decode
            # steps that follow (a later multi-token step grows it again, then shrinks it here).
            logits = out.data.copy()
            request.set_output_tensor(0, ov.Tensor(np.zeros((1, 1, out.shape[2]), np.float32)))
            return logits
        return out.data

    @staticmethod
    def _beam(inputs: StepInputs) -> np.ndarray:
        if inputs.beam_idx is not None:
            return inputs.beam_idx.astype(np.int32, copy=False)
        b = inputs.attention_mask.shape[0]
        return _BEAMS[b] if b < len(_BEAMS) else np.arange(b, dtype=np.int32)
