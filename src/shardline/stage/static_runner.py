"""A static stage (export/static.py): fixed shapes, no state in the graph, the KV on the host.

Each key holds a ring of `ring` slots per KV variable, [1, kv_heads, ring, head_dim], as
OpenVINO tensors the graphs read in place (no copy of the context per token). The plan's
physical slots are the ring's slots: slot s of the key's cache is ring slot s, and a step's
mask over [0, slots) is the ring's mask for that step (slots past them masked), so every stage
keeps the same positions and slots as the plan gives them; a masked draft stays masked, and a
compaction gathers the ring as it gathers a stateful stage's cache.

A step runs on the prefill graph (`prefill_width` tokens at once, right-padded with masked
tokens) when it feeds more than one token and wants at most one position's logits; otherwise
token by token on the decode graph (one token, one logit). Only the new tokens' KV comes out
of the graph; it is written into the ring after the step.

Past the ring: a stage exported without sinks refuses the step (its export serves no more
than the ring). With `sinks` S (export --sinks), the ring's first S slots keep the plan's first
S slots for good (attention sinks: the first tokens draw much of every query's attention) and
the plan's later slots take turns in the other ring slots, each overwriting the oldest: the
stream goes on, attending to its first S and its latest ring - S tokens (positions go on
growing, so RoPE still sees the true distances). A slid cache is no longer whole: it cannot be
exported or compacted (StepRefused).

One row at a time: a static graph has batch 1, so a state of more rows (a decode group's
merge) is refused. The same checks as a stateful stage's refuse a step that does not fit
(runner.py `checked`): a bad step fails that step, never the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.model.manifest import StageEntry, StageLimits
from shardline.model.shapes import dynamic
from shardline.stage.block_ops import read_stage
from shardline.stage.cache import StepInputs
from shardline.stage.keyed import Key, Keyed, shown
from shardline.stage.runner import checked, checked_logits_index


@dataclass
class _Ring:
    past: dict[str, ov.Tensor]  # variable -> [1, kv_heads, ring, head_dim] f32, read in place by the graphs
    slots: int = 0  # the plan slots written so far (within the ring: its first `slots`; past it, slid)
    rows: int = 0  # 0: fresh, no step run yet

    def view(self, name: str) -> np.ndarray:
        return self.past[name].data


class StaticRunner(Keyed[_Ring]):
    def __init__(self, folder: Path, entry: StageEntry, run: RunConfig, core: ov.Core | None = None,
                 vocab: int | None = None, context: int | None = None) -> None:
        if len(run.devices) != 1:
            raise ShardlineError(f"{entry.name} runs on one device, not {run.device} (RunConfig.for_stage)")
        if entry.ring is None:
            raise ShardlineError(f"{entry.name} of {folder} is static but its manifest names no ring")
        super().__init__()
        self.entry, self.name = entry, entry.name
        self.ring, self.width, self.sinks = entry.ring, entry.prefill_width, entry.sinks
        # Without sinks a stream ends at the ring; with them it goes on, the ring sliding.
        bound = entry.ring if entry.sinks is None else None
        self.context = bound if context is None else min(context, bound or context)
        self.vocab, self.kv_precision = vocab, "f32"  # the ring is kept on the host, in f32
        core = core or ov.Core()
        self.compiled = self._compile(core, folder, entry.xml, run)
        self.prefill = self._compile(core, folder, entry.prefill_xml, run) if entry.prefill_xml else None
        self._requests = [self.compiled.create_infer_request()]
        if self.prefill is not None:
            self._requests.append(self.prefill.create_infer_request())
        self._input = "input_ids" if entry.has_embedding else "hidden_states"
        shape = self.compiled.input(self._input).partial_shape
        self.hidden = None if entry.has_embedding else int(shape[2].get_length())
        self._past = {p.get_any_name(): tuple(int(d) for d in p.shape) for p in self.compiled.inputs
                      if p.get_any_name().startswith("past.")}

    def limits(self) -> StageLimits:
        return self.entry.limits()

    def _compile(self, core: ov.Core, folder: Path, xml: str, run: RunConfig) -> ov.CompiledModel:
        try:
            model, _ = read_stage(core, folder / xml, run)
        except RuntimeError as e:
            raise ShardlineError(f"cannot read {xml} of {folder}: {_first(e)}") from None
        if left := dynamic(model):
            raise ShardlineError(f"{folder / xml}: the manifest says static, but {len(left)} shapes are dynamic "
                                 f"({', '.join(left[:3])})")
        try:
            return core.compile_model(model, run.device, run.ov_properties())
        except RuntimeError as e:
            raise ShardlineError(f"cannot load {xml} from {folder} on {run.device}: {_first(e)}") from None

    def fresh(self) -> _Ring:
        return _Ring({n: ov.Tensor(np.zeros(shape, np.float32)) for n, shape in self._past.items()})

    def reset(self, key: Key) -> None:
        held = self.held(key)
        held.slots = held.rows = 0

    def kv_layout(self) -> dict[str, tuple[np.dtype, int, int]]:
        return {n: (np.dtype(np.float32), s[1], s[3]) for n, s in self._past.items()}

    def kv(self, key: Key, start: int = 0) -> dict[str, np.ndarray]:
        held = self.held(key)
        if not 0 <= start <= held.slots:
            raise StepRefused(f"KV from slot {start} of key {shown(key)}, which holds {held.slots}")
        self._whole(key, held, "export the KV of")
        return {n: held.view(n)[:, :, start:held.slots].copy() for n in self._past}

    def set_kv(self, key: Key, kv: dict[str, np.ndarray]) -> None:
        """Replace the key's KV: one row of at most `ring` slots per variable."""
        held = self.held(key)
        shape = next(iter(kv.values())).shape
        if shape[0] != 1 or shape[2] > self.ring or set(kv) != set(self._past):
            raise StepRefused(f"a static stage holds one row of at most {self.ring} slots, not {shape[0]} rows of "
                              f"{shape[2]} (a decode group's merge, or a longer cache)")
        for n, a in kv.items():
            held.view(n)[:, :, : shape[2]] = a
        held.rows, held.slots = 1, int(shape[2])

    def compact(self, key: Key, index: np.ndarray, slots: int) -> None:
        held = self.held(key)
        self._whole(key, held, "compact")
        fits = index.shape == (1, index.shape[-1]) and held.rows == 1 and slots == held.slots
        if not fits or (index.size and (int(index.min()) < 0 or int(index.max()) >= held.slots)):
            raise StepRefused(f"cannot compact {shown(key)}: {held.rows} rows of {held.slots} slots, "
                              f"a mask of {slots} slots")
        for n in self._past:
            ring = held.view(n)
            ring[:, :, : index.shape[1]] = ring[:, :, index[0]]  # a gather: a copy before the write
        held.slots = int(index.shape[1])

    # --- steps ---------------------------------------------------------------------------------

    def run(self, key: Key, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray:
        """As StageRunner.run; the result is a copy (the graphs' requests are shared by every key)."""
        held = self.held(key)
        x = checked(inputs, inputs.input_ids if hidden is None else hidden, held.slots, held.rows, self.hidden,
                    self.vocab, self.context)
        index = checked_logits_index(inputs)
        t = inputs.new_tokens
        if inputs.rows != 1:
            raise StepRefused(f"a static stage runs one row at a time, not {inputs.rows}")
        if held.slots + t > self.ring and self.sinks is None:
            raise StepRefused(f"{held.slots} slots plus {t} new tokens are past the ring of {self.ring} of a static "
                              f"stage without attention sinks (export with a larger --context, or --sinks)")
        if self.prefill is not None and t > 1 and index.shape[1] <= 1:
            assert self.width is not None  # a prefill graph has its width
            if t > self.width:
                raise StepRefused(f"a prompt chunk of {t} tokens is wider than the prefill graph's {self.width}")
            out = self._chunk(held, x, inputs, index)
        else:
            out = self._tokens(held, x, inputs, index)
        held.rows, held.slots = 1, held.slots + t
        return out

    def _chunk(self, held: _Ring, x: np.ndarray, inputs: StepInputs, index: np.ndarray) -> np.ndarray:
        """Every new token at once on the prefill graph, right-padded to its width."""
        t, c = inputs.new_tokens, self.width or 0
        pad = np.zeros((1, c, *x.shape[2:]), x.dtype)
        pad[:, :t] = x
        mask = np.zeros((1, c), np.int64)
        mask[:, :t] = inputs.attention_mask[:, held.slots:]
        positions = np.zeros((1, c), np.int64)
        positions[:, :t] = inputs.position_ids
        at = index[:, :1] if index.shape[1] else np.zeros((1, 1), np.int64)
        out = self._infer(self._requests[1], held, pad, inputs.attention_mask[0], held.slots, mask, positions, at, t)
        return out[:, : index.shape[1]] if self.entry.has_head else out[:, :t]

    def _tokens(self, held: _Ring, x: np.ndarray, inputs: StepInputs, index: np.ndarray) -> np.ndarray:
        """The new tokens one at a time on the decode graph, each one's KV in the ring before the
        next: hidden states of every token, or the logits of the positions `index` names."""
        s, mask, outs = held.slots, inputs.attention_mask, {}
        for j in range(inputs.new_tokens):
            outs[j] = self._infer(self._requests[0], held, x[:, j : j + 1], mask[0], s + j, mask[:, s + j : s + j + 1],
                                  inputs.position_ids[:, j : j + 1], np.zeros((1, 1), np.int64), 1)
        picked = range(inputs.new_tokens) if not self.entry.has_head else index[0].tolist()
        if not picked:
            return outs[0][:, :0]
        return np.concatenate([outs[j] for j in picked], axis=1)

    def _infer(self, request: ov.InferRequest, held: _Ring, x: np.ndarray, plan_mask: np.ndarray, written: int,
               new_mask: np.ndarray, positions: np.ndarray, at: np.ndarray, keep: int) -> np.ndarray:
        """One call of a static graph over the key's ring, which holds the plan's slots [0, written)
        (or, slid, its sinks and latest slots), masked as `plan_mask` ([slots + new] of the step)
        masks them; the first `keep` new tokens' KV is then written in at plan slots `written`...
        Returns a copy of the graph's output."""
        holds = ring_holds(written, self.ring, self.sinks)
        ring_mask = np.where(holds >= 0, plan_mask[np.maximum(holds, 0)], 0)[None, :]
        feed = {self._input: x, "attention_mask": np.concatenate([ring_mask, new_mask], axis=1),
                "position_ids": positions}
        if self.entry.has_head:
            feed["logits_index"] = at
        for name, tensor in held.past.items():
            request.set_tensor(name, tensor)  # the ring itself: read in place, never copied
        request.start_async(feed, share_inputs=False)
        request.wait()
        to = ring_slot(np.arange(written, written + keep), self.ring, self.sinks)
        for name in self._past:
            held.view(name)[:, :, to] = request.get_tensor("present" + name[len("past"):]).data[:, :, :keep]
        return request.get_tensor(self.compiled.output(0).get_any_name()).data.copy()

    def _whole(self, key: Key, held: _Ring, what: str) -> None:
        """StepRefused once the key's cache has slid past the ring: some of its slots are gone."""
        if held.slots > self.ring:
            raise StepRefused(f"cannot {what} {shown(key)}: its {held.slots} slots slid past the ring of {self.ring}")

def ring_slot(plan_slots: np.ndarray, ring: int, sinks: int | None) -> np.ndarray:
    """The ring slot of each plan slot: itself within the ring; past it (with sinks) the first
    `sinks` stay and the others take turns in the rest of the ring."""
    if sinks is None:
        return plan_slots
    return np.where(plan_slots < sinks, plan_slots, sinks + (plan_slots - sinks) % (ring - sinks))


def ring_holds(written: int, ring: int, sinks: int | None) -> np.ndarray:
    """The plan slot each ring slot holds once plan slots [0, written) are in (-1: none yet)."""
    r = np.arange(ring)
    if written <= ring or sinks is None:
        return np.where(r < written, r, -1)
    tail, q = ring - sinks, r - sinks
    return np.where(r < sinks, r, sinks + q + tail * ((written - 1 - sinks - q) // tail))


def _first(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
