"""Pure placement: which layers (and which stages of an export) each participant hosts.

Participants are the coordinator, which always runs stage 0, followed by one stage worker per
cluster node. No Ray here: the fleet turns its nodes into plain `Participant`s first, so every
rule below is testable with numbers alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cache

from shardline.errors import ShardlineError
from shardline.export.plan import parse_layers

Range = tuple[int, int]  # first, last (inclusive)
GIB = 1 << 30
GIVEN = "as given by --plan"


@dataclass(frozen=True)
class Participant:
    name: str  # "coordinator", or the node's name as the cluster reports it
    memory: int  # bytes available
    node_id: str = ""  # empty for the coordinator

    @property
    def label(self) -> str:
        return "coordinator" if not self.node_id else f"node {self.name} ({self.node_id[:8]})"


@dataclass(frozen=True)
class Assignment:
    participant: Participant
    layers: Range
    stages: Range  # the run of export stages this participant hosts
    devices: tuple[str, ...] = ("CPU",)  # the OpenVINO device of each of those stages

    @property
    def device(self) -> str:
        """As `--device` takes it for the stages run there: one device, or one per stage."""
        return self.devices[0] if len(set(self.devices)) == 1 else ",".join(self.devices)


@dataclass(frozen=True)
class Plan:
    assignments: tuple[Assignment, ...]
    how: str  # how the layers were chosen, for the printed plan

    @property
    def spec(self) -> str:
        """The plan as a `--plan` (and `--layers`) value."""
        return ",".join(f"{a}-{b}" for a, b in (x.layers for x in self.assignments))

    @property
    def workers(self) -> tuple[Assignment, ...]:
        return self.assignments[1:]

    def describe(self) -> str:
        n_layers = self.assignments[-1].layers[1] + 1
        hint = "" if self.how == GIVEN else f" (override with --plan {self.spec})"
        lines = [f"plan: {n_layers} layers on the coordinator and {len(self.workers)} Ray nodes, {self.how}{hint}"]
        width = max(len(a.participant.label) for a in self.assignments)
        for a in self.assignments:
            (first, last), (k, m) = a.layers, a.stages
            stages = f"stage {k}" if k == m else f"stages {k}-{m}"
            layers = f"{first}-{last}"
            lines.append(f"  {a.participant.label:<{width}}  layers {layers:<7} ({last - first + 1:>2})  {stages:<11}"
                         f"{a.participant.memory / GIB:6.1f} GiB available  on {a.device}")
        return "\n".join(lines)

    def on_devices(self, devices: tuple[str, ...]) -> Plan:
        """The plan with each stage's device: one device for every stage, or one per stage of
        the export (`--device CPU,CPU,NPU,NPU` under Ray), each participant getting its own."""
        n_stages = self.assignments[-1].stages[1] + 1
        if len(devices) not in (1, n_stages):
            raise ShardlineError(f"--device names {len(devices)} devices ({','.join(devices)}) for the {n_stages} "
                                 f"stages of this plan: give one device, or one per stage")
        def of(a: Assignment) -> tuple[str, ...]:
            k, m = a.stages
            return devices[k:m + 1] if len(devices) > 1 else devices * (m - k + 1)
        return replace(self, assignments=tuple(replace(a, devices=of(a)) for a in self.assignments))


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` units in proportion to `weights`, at least one each, by largest remainder.

    Exact integer arithmetic, ties to the earlier participant: the same inputs always give the
    same plan on every machine."""
    if len(weights) > total:
        raise ShardlineError(f"cannot place {total} layers on {len(weights)} participants "
                             f"(the coordinator and {len(weights) - 1} Ray nodes): each needs at least one layer")
    if min(weights) <= 0:
        raise ShardlineError(f"every participant needs memory to hold layers, got {weights}")
    weight = sum(weights)
    sizes = [max(1, total * w // weight) for w in weights]

    def excess(i: int) -> int:  # (size - quota) scaled by `weight`, so it stays an integer
        return sizes[i] * weight - total * weights[i]

    while sum(sizes) < total:
        sizes[min(range(len(sizes)), key=excess)] += 1
    while sum(sizes) > total:  # only when the one-layer minimum lifted someone above their quota
        sizes[max((i for i in range(len(sizes)) if sizes[i] > 1), key=excess)] -= 1
    return sizes


def split_by_memory(n_layers: int, memories: list[int]) -> list[Range]:
    """Contiguous layer ranges, one per participant in order, sized in proportion to memory."""
    return _ranges(apportion(n_layers, memories))


def group_stages(stage_layers: list[Range], memories: list[int]) -> list[Range]:
    """Map an export's stages onto participants: stage 0 to the coordinator (memories[0]), then
    consecutive runs of the other stages to the workers, as close to their memory shares as the
    stage boundaries allow (least total deviation in layers)."""
    sizes = [last - first + 1 for first, last in stage_layers[1:]]
    n_workers = len(memories) - 1
    if len(sizes) < n_workers:
        raise ShardlineError(f"the export has {len(stage_layers)} stages: stage 0 stays on the coordinator, "
                             f"which leaves {len(sizes)} for {n_workers} Ray nodes: export at least "
                             f"{n_workers + 1} stages, or leave out --shards")
    targets = [Fraction(sum(sizes) * m, sum(memories[1:])) for m in memories[1:]]

    @cache
    def best(i: int, j: int) -> tuple[Fraction, tuple[int, ...]]:
        """Least deviation placing stages sizes[i:] on workers j.., and where each group ends."""
        if j == n_workers:
            return Fraction(0), ()
        last_end = len(sizes) - (n_workers - j - 1)  # leave one stage per later worker
        first_end = last_end if j == n_workers - 1 else i + 1
        options = []
        for end in range(first_end, last_end + 1):
            cost, ends = best(end, j + 1)
            options.append((abs(sum(sizes[i:end]) - targets[j]) + cost, (end, *ends)))
        return min(options)

    ends = best(0, 0)[1]
    starts = (0, *ends[:-1])
    return [(0, 0)] + [(s + 1, e) for s, e in zip(starts, ends, strict=True)]


def parse_plan(spec: str, n_layers: int, n_participants: int) -> list[Range]:
    """A `--plan` override: contiguous, complete ranges, one per participant."""
    ranges = [(p.first, p.last) for p in parse_layers(spec, n_layers, flag="--plan")]
    if len(ranges) != n_participants:
        raise ShardlineError(f"--plan {spec!r} has {len(ranges)} ranges but there are {n_participants} participants "
                             f"(the coordinator and {n_participants - 1} Ray nodes)")
    return ranges


def align_to_stages(ranges: list[Range], stage_layers: list[Range]) -> list[Range]:
    """The stage runs that cover the given layer ranges exactly, on an existing export."""
    ends = {last: i for i, (_, last) in enumerate(stage_layers)}
    runs, start = [], 0
    for first, last in ranges:
        if last not in ends:
            bounds = ", ".join(str(b) for _, b in stage_layers)
            raise ShardlineError(f"--plan range {first}-{last} does not end on a stage boundary of the export "
                                 f"(its stages end at layers {bounds})")
        runs.append((start, ends[last]))
        start = ends[last] + 1
    if runs[0] != (0, 0):
        a, b = stage_layers[0]
        raise ShardlineError(f"--plan gives the coordinator layers {ranges[0][0]}-{ranges[0][1]}, but it runs only "
                             f"stage 0 of the export (layers {a}-{b})")
    return runs


def place(participants: list[Participant], n_layers: int, stage_layers: list[Range] | None = None,
          override: str | None = None) -> Plan:
    """The whole plan: by memory unless overridden; on an existing export's stage boundaries when
    given one (else one new stage per participant)."""
    if len(participants) < 2:
        raise ShardlineError("no Ray node to place stage workers on (the cluster has no alive node with a CPU)")
    for p in participants:
        if p.memory <= 0:
            raise ShardlineError(f"{p.label} reports no available memory")
    memories = [p.memory for p in participants]
    if override is not None:
        layers = parse_plan(override, n_layers, len(participants))
        stages = _one_each(len(layers)) if stage_layers is None else align_to_stages(layers, stage_layers)
        how = GIVEN
    elif stage_layers is not None:
        stages = group_stages(stage_layers, memories)
        layers = [(stage_layers[k][0], stage_layers[m][1]) for k, m in stages]
        how = "by available memory, on the export's stage boundaries"
    else:
        layers = split_by_memory(n_layers, memories)
        stages = _one_each(len(layers))
        how = "by available memory"
    return Plan(tuple(Assignment(*x) for x in zip(participants, layers, stages, strict=True)), how)


def _ranges(sizes: list[int]) -> list[Range]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size - 1))
        start += size
    return out


def _one_each(n: int) -> list[Range]:
    return [(i, i) for i in range(n)]
