"""One compiled shard; one InferRequest (and so one in-graph KV state) per key (a stream, or a
decode group whose streams are the rows of one state).

The runner checks every step against what it holds before OpenVINO sees it: the mask must be
exactly the cache's slots plus the new tokens, the rows must be the state's rows (or a Gather
of them), hidden states must have the model's width, token ids must be in the vocabulary. A
step that does not fit raises `StepRefused` and changes nothing: a peer's bad step fails that
step, never the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.model.manifest import StageEntry, StageLimits
from shardline.stage.block_ops import read_stage
from shardline.stage.cache import StepInputs
from shardline.stage.keyed import Key, Keyed, shown
from shardline.stage.resident import released_while
from shardline.stage.zero_points import round_zero_points, split_zero_points, uniform_group

_BEAMS = [np.arange(b, dtype=np.int32) for b in range(65)]  # identity Gathers, made once


@dataclass
class _Held:
    request: ov.InferRequest
    slots: int = 0  # physical KV entries of every row
    rows: int = 0  # rows of the state (0: fresh, no step run yet)


def _kv_precision(compiled: ov.CompiledModel, run: RunConfig) -> str:
    """The KV cache precision the device took (a device without the setting: its own default).
    One it did not take as asked is an error: sizing and exactness assume it."""
    try:
        took = compiled.get_property("KV_CACHE_PRECISION").get_type_name()
    except RuntimeError:
        took = "device default"
    if run.kv is not None and took != run.kv:
        raise ShardlineError(f"{run.device} keeps its KV cache as {took}, not the {run.kv} asked "
                             f"(--kv-precision is one of f32, f16, u8, as far as the device supports each)")
    return str(took)


class StageRunner(Keyed[_Held]):
    def __init__(self, folder: Path, entry: StageEntry, run: RunConfig, core: ov.Core | None = None,
                 vocab: int | None = None, context: int | None = None) -> None:
        """`context`: steps with a position at or past it are refused (None: no bound here)."""
        if len(run.devices) != 1:
            raise ShardlineError(f"{entry.name} runs on one device, not {run.device} (RunConfig.for_stage)")
        super().__init__()
        self.entry, self.name = entry, entry.name
        self.context = context
        core = core or ov.Core()
        try:
            model, self._weights_file = read_stage(core, folder / entry.xml, run)
            self.compiled = core.compile_model(model, run.device, precision_properties(model, run))
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kv = f" with a {run.kv} KV cache" if run.kv_precision else ""
            hint = "" if run.device.upper().startswith(("CPU", "GPU")) else (
                f"; {entry.name} is stateful (dynamic shapes, its KV cache in the graph), which {run.device} may not "
                f"run: an NPU runs a static export (shardline export --static)")
            raise ShardlineError(f"cannot load {entry.name} from {folder} on {run.device}{kv}: {first}{hint}") from None
        self.kv_precision = _kv_precision(self.compiled, run)  # as the device took it
        self._input = "input_ids" if entry.has_embedding else "hidden_states"
        width = self.compiled.input(self._input).partial_shape
        self.hidden = None if entry.has_embedding else int(width[2].get_length())
        self.vocab = vocab
        self._out = self.compiled.output(0)
        self._layout: dict[str, tuple[np.dtype, int, int]] | None = None
        with released_while(self._weights_file):  # resident.py: why
            self._warm_up()

    def limits(self) -> StageLimits:
        return self.entry.limits()

    def _warm_up(self) -> None:
        """One token through a scratch request: the plugin makes its copy of the weights here
        (seconds for an 8B-class stage), not in a client's first step."""
        x = (np.zeros((1, 1), np.int64) if self.hidden is None else np.zeros((1, 1, self.hidden), np.float32))
        feed = {self._input: x, "attention_mask": np.ones((1, 1), np.int64), "position_ids": np.zeros((1, 1), np.int64),
                "beam_idx": _BEAMS[1]}
        if self.entry.has_head:
            feed["logits_index"] = np.zeros((1, 1), np.int64)
        self.compiled.create_infer_request().infer(feed, share_inputs=False)

    def fresh(self) -> _Held:
        return _Held(self.compiled.create_infer_request())

    def reset(self, key: Key) -> None:
        held = self.held(key)
        held.request.reset_state()
        held.slots = held.rows = 0

    def kv(self, key: Key, start: int = 0) -> dict[str, np.ndarray]:
        """A copy of the key's KV state from slot `start` on: variable name -> [B, kv_heads,
        slots - start, head_dim] (a chunk-level transfer copies only what it has not sent).
        StepRefused for a start past the key's slots."""
        held = self.held(key)
        if not 0 <= start <= held.slots:
            raise StepRefused(f"KV from slot {start} of key {shown(key)}, which holds {held.slots}")
        return {s.name: s.state.data[:, :, start:].copy() for s in held.request.query_state()}

    def set_kv(self, key: Key, kv: dict[str, np.ndarray]) -> None:
        """Replace the key's whole KV state (OpenVINO sets a variable as a whole)."""
        held = self.held(key)
        for state in held.request.query_state():
            state.state = ov.Tensor(kv[state.name])
        shape = next(iter(kv.values())).shape
        held.rows, held.slots = int(shape[0]), int(shape[2])

    def compact(self, key: Key, index: np.ndarray, slots: int) -> None:
        """Keep in each row of the key's state only the slots `index` names ([B, W], made by
        cache.compaction from a mask over `slots` slots): the masked ones are dropped. A copy of
        the whole state (OpenVINO sets a variable as a whole). StepRefused, changing nothing,
        when the index was made for another state."""
        held = self.held(key)
        fits = index.ndim == 2 and index.shape[0] == held.rows > 0 and slots == held.slots
        if not fits or (index.size and (int(index.min()) < 0 or int(index.max()) >= held.slots)):
            raise StepRefused(f"cannot compact {shown(key)}: {held.rows} rows of {held.slots} slots, "
                              f"a mask of {slots} slots")
        for state in held.request.query_state():  # gathered from the state's own buffer, row by row
            old = state.state.data
            new = np.empty((old.shape[0], old.shape[1], index.shape[1], old.shape[3]), old.dtype)
            for r in range(old.shape[0]):
                np.take(old[r], index[r], axis=1, out=new[r])
            state.state = ov.Tensor(new)  # copied in: the plugin must not keep our buffer
        held.slots = int(index.shape[1])

    def run(self, key: Key, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray:
        """Run one step; returns hidden states [B, T, H] or, on the last stage, logits [B, N, V]
        for the positions of `inputs.logits_index`. The result is a view of the request's output
        buffer: valid until the key's next step."""
        held = self.held(key)
        x = inputs.input_ids if hidden is None else hidden
        feed = {self._input: self._checked(held, inputs, x), "attention_mask": inputs.attention_mask,
                "position_ids": inputs.position_ids, "beam_idx": self._beam(inputs)}
        if self.entry.has_head:
            feed["logits_index"] = self._logits_index(inputs)
        # Inputs are copied (share_inputs=False): a request keeps its last input tensors set, and
        # with shared memory it would point into numpy buffers freed after this call. Seen here:
        # heap corruption when such a request was later destroyed. The copy is a few KB per step.
        # start_async + wait rather than infer(): the step then runs on the plugin's own pinned
        # executor thread instead of the calling Python thread; measured 0.5-1 ms per token
        # faster on this 2-core VM (BENCHMARKS.md, parity), and it matches openvino_genai.
        held.request.start_async(feed, share_inputs=False)
        held.request.wait()
        held.rows, held.slots = inputs.rows, int(inputs.attention_mask.shape[1])
        return held.request.get_tensor(self._out).data

    def kv_layout(self) -> dict[str, tuple[np.dtype, int, int]]:
        """Each KV variable the stage holds: (dtype, kv_heads, head_dim), as an import must fit."""
        if self._layout is None:
            self._layout = states_of(self.compiled)
        return self._layout

    def _checked(self, held: _Held, inputs: StepInputs, x: np.ndarray) -> np.ndarray:
        return checked(inputs, x, held.slots, held.rows, self.hidden, self.vocab, self.context)

    def _logits_index(self, inputs: StepInputs) -> np.ndarray:
        return checked_logits_index(inputs)

    @staticmethod
    def _beam(inputs: StepInputs) -> np.ndarray:
        if inputs.beam_idx is not None:
            return inputs.beam_idx.astype(np.int32, copy=False)
        b = inputs.rows
        return _BEAMS[b] if b < len(_BEAMS) else np.arange(b, dtype=np.int32)


def checked(inputs: StepInputs, x: np.ndarray, slots: int, rows: int, hidden: int | None, vocab: int | None,
            context: int | None) -> np.ndarray:
    """`x` (ids, or hidden states of width `hidden`) once the step is known to fit a state of
    `rows` rows of `slots` slots; else StepRefused. Every runner kind checks a step so."""
    b, t, width = inputs.rows, inputs.new_tokens, int(inputs.attention_mask.shape[1])
    if inputs.position_ids.shape[0] != b or t < 1:
        raise StepRefused(f"positions of shape {inputs.position_ids.shape} for a mask of {b} rows")
    if context is not None and inputs.position_ids.size and int(inputs.position_ids.max()) >= context:
        raise StepRefused(f"position {int(inputs.position_ids.max())} is past the context of {context} tokens")
    if width != slots + t:
        raise StepRefused(f"a mask of {width} slots for a cache of {slots} plus {t} new tokens")
    beam = inputs.beam_idx
    if beam is not None and (beam.shape != (b,) or int(beam.min()) < 0 or int(beam.max()) >= rows):
        raise StepRefused(f"rows {beam.tolist()} of a state of {rows}")
    if beam is None and rows not in (0, b):
        raise StepRefused(f"{b} rows for a state of {rows}")
    if hidden is None:
        if x.shape != (b, t) or (x.size and (int(x.min()) < 0 or (vocab and int(x.max()) >= vocab))):
            raise StepRefused(f"token ids of shape {x.shape} outside the vocabulary")
    elif x.shape != (b, t, hidden) or x.dtype.kind != "f":
        raise StepRefused(f"hidden states of shape {x.shape} ({x.dtype}); expected {(b, t, hidden)}")
    return x


def checked_logits_index(inputs: StepInputs) -> np.ndarray:
    """The step's logits positions ([B, N] among its T new tokens; None: the last), or StepRefused."""
    b, t = inputs.rows, inputs.new_tokens
    index = inputs.logits_index
    if index is None:
        return np.full((b, 1), t - 1, np.int64)
    if index.ndim != 2 or index.shape[0] != b or (index.size and (int(index.min()) < 0 or int(index.max()) >= t)):
        raise StepRefused(f"logits positions of shape {index.shape} for {b} rows of {t} tokens")
    return index.astype(np.int64, copy=False)


def states_of(compiled: ov.CompiledModel) -> dict[str, tuple[np.dtype, int, int]]:
    """A stateful graph's KV variables as an empty request reports them: (dtype, kv_heads, head_dim)."""
    return {s.name: (s.state.data.dtype, int(s.state.shape[1]), int(s.state.shape[3]))
            for s in compiled.create_infer_request().query_state()}


def precision_properties(model: ov.Model, run: RunConfig) -> dict[str, str]:
    """The compile properties of `run`'s precision for `model`, which `fast` and `rounded`
    rewrite on a CPU: fractional zero points apart (or rounded) so that activations may be
    int8, quantized in groups of the weights' own when they all share one (zero_points.py)."""
    props = run.ov_properties()
    if run.device.upper().startswith("CPU") and run.precision in ("fast", "rounded"):
        (split_zero_points if run.precision == "fast" else round_zero_points)(model)
        if (group := uniform_group(model)) is not None:
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(group)
    return props
