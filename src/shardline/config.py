"""Frozen, validated configuration. Built in one place: the CLI (tests build them directly)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardline.errors import ShardlineError

WEIGHTS = ("fp32", "fp16", "int8", "int4", "gguf")
# Prompt tokens per prefill step: the knee of prefill speed against chunk size, measured in
# BENCHMARKS.md, issue 9 (default model, 2 stages, 2 threads, exact).
# 128 is the smallest chunk within 5% of the best prefill tok/s at 1024-4096-token prompts
# (0.98 / 0.97 / 1.00 of the best; 0.90 at 512), and it halves the stall of running streams
# while a 2048-token prompt arrives: longest gap 0.54-0.60 s (1.10 s at 256, 5.6-5.8 s whole),
# for a time to first token 1.10-1.21x the whole prompt's in one step (two runs). 64 stalls
# less (0.31-0.35 s) but costs up to 10% of prefill speed at 1024-4096 tokens, 15-17% at 128-512.
DEFAULT_PREFILL_CHUNK = 128


STATIC_CONTEXT = 1024  # a static export's ring when --context is not given


@dataclass(frozen=True)
class ExportConfig:
    out: Path
    model: Path | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    stages: int | None = None
    layers: str | None = None  # explicit split "0-9,10-19,20-29"
    balance: bool = False  # with `stages`: equal work per stage (the head counted), not equal layers
    # With `balance`: each stage's node memory in GiB (one for all, or one per stage). Each stage
    # then fits its node first, and the work per token is evened within that (export/plan.py).
    memory: tuple[float, ...] = ()
    # None: the model's own weights (`gguf`) for a GGUF file, `int8` for a Hugging Face folder.
    weights: str | None = None
    group_size: int = 64  # int4 only; must divide the hidden size
    isolate: bool = True  # export each stage in its own process (memory per stage, measured)
    progress: bool = True
    # Keep only the first N decoder layers, then the final norm and head: a self-speculation
    # draft. The upper bound (the model's layer count) is checked by the exporter.
    truncate: int | None = None
    context: int | None = None  # the longest sequence the export serves (default: the model's own)
    # Under gguf: matmul weights re-quantized into groups of this size (export/reblock.py: faster
    # int8 kernels, changed weights; an opt-in). None: the file's own blocks.
    reblock: int | None = None
    # The stages exported static and stateless (export/static.py: NPUs take no dynamic shape or
    # state): batch 1, the KV on the host in a ring of `context` slots (STATIC_CONTEXT when not
    # given); with `prefill_chunk` a second graph per static stage takes that many prompt tokens
    # at once. The others stay stateful: one pipeline may mix both.
    static: frozenset[int] = frozenset()
    prefill_chunk: int | None = None
    # Past the ring, the first `sinks` slots stay (attention sinks) and the rest slide; None: a
    # static export serves no more than its ring. Every stage must then be static.
    sinks: int | None = None
    # Every stage paged (export/paged.py): attention as OpenVINO's PagedAttention over KV block
    # pools, one ragged batch of every stream's tokens a step (issue 41). Not with --static.
    paged: bool = False

    @property
    def ring(self) -> int:
        """A static export's ring: the KV slots every static stage holds."""
        return self.context or STATIC_CONTEXT

    def __post_init__(self) -> None:
        if self.weights is None:
            object.__setattr__(self, "weights", default_weights(self.model))
        if (self.stages is None) == (self.layers is None):
            raise ShardlineError("give exactly one of --stages N or --layers A-B,C-D,...")
        if self.balance and self.layers is not None:
            raise ShardlineError("--balance splits --stages N; --layers gives the split itself")
        if self.memory:
            self._check_memory()
        if self.weights not in WEIGHTS:
            raise ShardlineError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.group_size < 1:
            raise ShardlineError("--group-size must be positive")
        if self.truncate is not None and self.truncate < 1:
            raise ShardlineError(f"--truncate must be at least 1 (layers kept), got {self.truncate}")
        if self.context is not None and self.context < 1:
            raise ShardlineError(f"--context must be at least 1 token, got {self.context}")
        n = self.stages if self.stages is not None else len((self.layers or "").split(","))
        if any(not 0 <= k < n for k in self.static):
            raise ShardlineError(f"--static names stages {sorted(self.static)}; the export has stages 0-{n - 1}")
        if self.sinks is not None and (self.static != frozenset(range(n)) or not 1 <= self.sinks < self.ring):
            raise ShardlineError(f"--sinks needs every stage static (--static) and 1 <= sinks < {self.ring} "
                                 f"(the ring), got {self.sinks}")
        if self.prefill_chunk is not None and not self.static:
            raise ShardlineError("--prefill-chunk sizes a static export's prefill graph: it needs --static")
        if self.static and self.prefill_chunk is not None and not 2 <= self.prefill_chunk <= self.ring:
            raise ShardlineError(f"--prefill-chunk must be in 2-{self.ring} (the ring) tokens, "
                                 f"got {self.prefill_chunk}")
        if self.paged and self.static == frozenset(range(n)):
            raise ShardlineError("--paged with --static: the static stages run beside paged ones, so at least one "
                                 "stage must be paged (a static stage's ring does not slide there: no --sinks)")
        if self.reblock is not None:
            if self.weights != "gguf":
                raise ShardlineError(f"--reblock re-quantizes a GGUF's own blocks: it needs --weights gguf, "
                                     f"not {self.weights}")
            if not 16 <= self.reblock <= 1 << 16 or self.reblock % 16:
                raise ShardlineError(f"--reblock takes a group size that is a multiple of 16 (e.g. 128), "
                                     f"got {self.reblock}")

    def _check_memory(self) -> None:
        if not self.balance:
            raise ShardlineError("--memory sizes the split --balance makes: give --balance too")
        if len(self.memory) not in (1, self.stages):
            raise ShardlineError(f"--memory takes one size for every stage or one per stage ({self.stages}), "
                                 f"got {len(self.memory)}")
        if not all(0 < gib < 1 << 20 for gib in self.memory):  # NaN fails too
            raise ShardlineError(f"--memory sizes must be positive GiB, got {list(self.memory)}")

    @property
    def precision(self) -> str:
        assert self.weights is not None  # resolved on construction
        return self.weights


def default_weights(model: Path | None) -> str:
    """A GGUF file (or the embedded default, one) keeps its own weights; a Hugging Face folder
    (f32 or bf16 safetensors) is compressed to int8."""
    return "gguf" if model is None or model.suffix == ".gguf" else "int8"


PRECISIONS = ("exact", "fast", "rounded", "plugin")
KV_PRECISIONS = ("f32", "f16", "u8")  # the KV cache as the device keeps it (model/context.py: bytes per token)
MAX_CONTEXT = 1 << 24  # tokens; no model here has more (a bound for hostile flags)


# A device that spans others names them after a colon ("HETERO:GPU,CPU"): one device, not a list.
_VIRTUAL_DEVICES = ("HETERO:", "AUTO:", "MULTI:", "BATCH:")


def _devices(device: str) -> tuple[str, ...]:
    if device.upper().startswith(_VIRTUAL_DEVICES):
        return (device,)
    return tuple(d.strip() for d in device.split(","))


@dataclass(frozen=True)
class RunConfig:
    # The OpenVINO device of every stage run here, or one per stage ("CPU,GPU": stage 0 on the
    # CPU, stage 1 on the GPU); `for_stage` gives each stage's own config.
    device: str = "CPU"
    # How a stage computes (weights are fixed at export):
    # - "exact" (default): f32 compute, f32 KV cache, no dynamic int8 quantization of
    #   activations. Agrees with a reference on the same weights to ~1e-4, so the tokens do not
    #   depend on the split, the thread count or the batch. With GGUF blocks it costs ~10%.
    # - "fast": f32 compute with the plugin's int8 activation quantization for compressed
    #   weights and an f16 KV cache: much faster with int8 weights, but near-ties can flip.
    #   f16, not the plugin's u8: on a trained 1.5B u8 cost 1.8% perplexity, f16 nothing
    #   (BENCHMARKS.md, issue 39), and llama.cpp keeps f16 by default too.
    # - "rounded": "fast", and GGUF Q4_1 zero points rounded to whole codes, as openvino_genai
    #   reads a GGUF: the fastest here, but it changes the weights themselves (its agreement
    #   with the exact model is in BENCHMARKS.md, issue 12). Only Q4_1 weights change.
    # - "plugin": the device plugin's own defaults (bf16 compute on CPUs that have it, which
    #   costs this small model ~8% perplexity; see BENCHMARKS.md).
    precision: str = "exact"
    threads: int | None = None
    # False where several pipelines share this process (disaggregated instances): OpenVINO pins
    # each compiled model's threads from the first core on, so two one-thread instances ran on
    # one core (60 tokens each at once: 2.05 s pinned, 1.12 s unpinned, 1.07 s alone).
    pinned: bool = True
    # The longest sequence served (None: the model's, capped to fit a 16 GiB PC: model/context.py).
    # Every node of a chain must serve the same (the handshake checks it).
    context: int | None = None
    # The KV cache's precision (None: f32 under `exact`, f16 under `fast` and `rounded` on a
    # CPU, the device's own under `plugin`; u8 halves f16's memory at a cost in quality).
    # Stages may differ: each node keeps its own cache.
    kv_precision: str | None = None

    def __post_init__(self) -> None:
        if any(not d or len(d) > 64 or any(c.isspace() for c in d) for d in self.devices):
            raise ShardlineError(f"--device takes one OpenVINO device name, or one per stage separated by "
                                 f"commas (CPU, GPU.0, NPU, CPU,GPU), got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ShardlineError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.threads is not None and self.threads < 1:
            raise ShardlineError("--threads must be positive")
        if self.context is not None and not 1 <= self.context <= MAX_CONTEXT:
            raise ShardlineError(f"--context must be in 1-{MAX_CONTEXT} tokens, got {self.context}")
        if self.kv_precision is not None and self.kv_precision not in KV_PRECISIONS:
            raise ShardlineError(f"--kv-precision must be one of {', '.join(KV_PRECISIONS)}, got {self.kv_precision!r}")

    @property
    def devices(self) -> tuple[str, ...]:
        return _devices(self.device)

    def for_stage(self, k: int, n: int) -> RunConfig:
        """Stage k's config of the n stages run here: its own device (one device: every stage's)."""
        devices = self.devices
        if len(devices) == 1:
            return self
        if len(devices) != n:
            raise ShardlineError(f"--device names {len(devices)} devices ({self.device}) for {n} stages here: "
                                 f"give one device, or one per stage")
        return replace(self, device=devices[k])

    @property
    def _cpu(self) -> bool:
        return all(d.upper().startswith("CPU") for d in self.devices)

    @property
    def kv(self) -> str | None:
        """The KV cache precision asked of the device (None: the device's default)."""
        if self.kv_precision is not None:
            return self.kv_precision
        if self.precision == "exact":
            return "f32"
        # explicit on a CPU (whose plugin would pick u8) so that it is reported and sized truly
        return "f16" if self.precision in ("fast", "rounded") and self._cpu else None

    def ov_properties(self) -> dict[str, str]:
        props: dict[str, str] = {}
        if self.precision == "exact":
            props |= {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
        elif self.precision in ("fast", "rounded") and self._cpu:
            props["INFERENCE_PRECISION_HINT"] = "f32"
        if self.kv is not None:
            props["KV_CACHE_PRECISION"] = self.kv
        if self.threads:
            props["INFERENCE_NUM_THREADS"] = str(self.threads)
        if not self.pinned and self._cpu:
            props["ENABLE_CPU_PINNING"] = "NO"
        return props


MAX_KV_CACHE_MB = 1 << 22  # 4 TiB: a bound for hostile flags, past any machine here
# A worker's KV pools, every session's together, take at most this share of the memory available
# when it starts (unless --kv-cache-mb): the other half is for its stages' weights and compiled
# graphs, the OS and whatever else the machine runs, as serve's --memory-fraction leaves it.
WORKER_KV_FRACTION = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    """What a `shardline worker` gives its coordinators beyond running its stages."""

    # MiB that the KV pools of a paged export's sessions may take together on this worker
    # (node/paged.py pools_for); None: WORKER_KV_FRACTION of the memory available at start.
    kv_cache_mb: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_mb is not None and not 1 <= self.kv_cache_mb <= MAX_KV_CACHE_MB:
            raise ShardlineError(f"--kv-cache-mb must be in 1-{MAX_KV_CACHE_MB}, got {self.kv_cache_mb}")

    def kv_limit(self, available: int) -> int:
        """Bytes of KV pools this worker gives, given the bytes `available` at its start."""
        return self.kv_cache_mb << 20 if self.kv_cache_mb is not None else int(available * WORKER_KV_FRACTION)


ACTIVATIONS = ("f16", "f32")


def default_activations(precision: str) -> str:
    """Hidden states on the wire: f32 under `exact` (f16 would round them at every hop, and the
    answer would depend on the split), else f16 (half the bytes per hop)."""
    return "f32" if precision == "exact" else "f16"


# Sampling bounds, shared by the API, the CLI and the wire (every peer checks them again).
# Below MIN_TEMPERATURE, logits / temperature overflows float64 for ordinary logits (1e-308
# turned the distribution into NaN): such a temperature is refused, 0 means greedy.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_TOP_K = 1 << 20


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None, top_logprobs: int) -> None:
    """Raise ShardlineError (one line) for any setting out of range; NaN and infinities included."""
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ShardlineError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {temperature!r}")
    if not 0 <= top_k <= MAX_TOP_K:
        raise ShardlineError(f"top-k must be in 0-{MAX_TOP_K} (0: off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ShardlineError(f"top-p must be in (0, 1], got {top_p!r}")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ShardlineError(f"seed must be in 0-{MAX_SEED}, got {seed}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ShardlineError(f"top logprobs must be in 0-{MAX_TOP_LOGPROBS}, got {top_logprobs}")


@dataclass(frozen=True)
class SamplingConfig:
    """A request's sampling. Randomness depends only on (seed, position in the stream): the same
    request gives the same tokens whatever the batching, the split or a replay. A request
    without a seed gets a random one when it starts (fixed for its whole life)."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    # The most likely alternatives wanted per token, with their log-probabilities (computed at
    # the last stage: a few ids and floats travel, not the logits).
    logprobs: int = 0
    # The whole logits row of every sampled position travels back (~200 KB per token instead of
    # ~100 B): for tests and tools only.
    want_logits: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ShardlineError("max tokens must be at least 1")
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed, self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def params(self, seed: int) -> SamplingParams:
        """What the end of the chain needs, with the stream's seed (this one's, or `seed`)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed if self.seed is None else self.seed,
                              self.logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How one row's tokens are chosen at the end of the chain (travels in every step)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed, self.top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


@dataclass(frozen=True)
class RecoveryConfig:
    """What the coordinator does when a worker dies or hangs (issue 11). A step in flight is
    lost once it waits longer than max(`step_floor_s`, `step_multiple` x the recent average of
    its phase); a broken chain is reopened for up to `reconnect_s`; a lost stream is replayed
    (prompt and tokens so far prefilled again) at most `max_replays` times in its life, each
    within `replay_within_s` of the break, else its request ends with an error. A worker that
    sends nothing for `heartbeat_s`, pings unanswered, is taken as hung with no traffic (0: no
    pings; a hung idle worker is then seen only by a step's deadline)."""

    step_floor_s: float = 10.0
    step_multiple: float = 20.0
    reconnect_s: float = 10.0
    max_replays: int = 4
    replay_within_s: float = 30.0
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.heartbeat_s == 0 or 1 <= self.heartbeat_s <= 3600):
            raise ShardlineError(f"--heartbeat must be 0 (off) or in 1-3600 seconds, got {self.heartbeat_s}")
        if not 0 < self.step_floor_s <= 3600:
            raise ShardlineError(f"--step-deadline must be in (0, 3600] seconds, got {self.step_floor_s}")
        if not 1 <= self.step_multiple <= 1000:
            raise ShardlineError(f"--step-deadline-multiple must be in 1-1000, got {self.step_multiple}")
        if not 0 < self.reconnect_s <= 3600:
            raise ShardlineError(f"--reconnect-window must be in (0, 3600] seconds, got {self.reconnect_s}")
        if not 0 <= self.max_replays <= 100:
            raise ShardlineError(f"--max-replays must be in 0-100, got {self.max_replays}")
        if not 0 < self.replay_within_s <= 3600:
            raise ShardlineError(f"--replay-within must be in (0, 3600] seconds, got {self.replay_within_s}")


@dataclass(frozen=True)
class PacingConfig:
    """Prefill while streams decode (serving/pacing.py): one chunk takes at most `budget` of their
    step times, and prefill at most `share` of the pipeline's time. A prompt of at most `short`
    tokens is not paced: it goes in full chunks at once (an ordinary chat message must never
    wait behind the pacing; issue 35)."""

    # 2 steps: a short prompt (tens of tokens) goes in one or two chunks, not a token at a time.
    # share 0.3 of the graph time: running streams keep >= 50% of their steady rate (measured,
    # BENCHMARKS.md issue 23: a chunk beside a decode step slows both on shared cores, so 0.5 of
    # the graph time left them ~37%)
    budget: float = 2.0
    share: float = 0.3
    # 256 tokens: a chat turn (GuideLLM's 128-token prompts are ~160 with the template) costs
    # about one 128-token chunk more than a paced one would, a gap of ~5-8 decode steps, once
    short: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.short <= 1 << 20:
            raise ShardlineError(f"--short-prompt must be in 0-{1 << 20} tokens, got {self.short}")
        if not 0 < self.budget <= 100:
            raise ShardlineError(f"--prefill-budget must be in (0, 100] decode steps, got {self.budget}")
        if not 0 < self.share < 1:
            raise ShardlineError(f"--prefill-share must be in (0, 1), got {self.share}")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_streams: int | None = None  # None: as many as the memory budget allows (capped)
    max_queue: int = 64
    # A request without max_tokens: at most this many new tokens, and never more than what is
    # left of the context after its prompt; None: what is left (as vLLM and llama-server do).
    default_max_tokens: int | None = None
    memory_fraction: float = 0.5  # of available memory that stream KV may take
    model_id: str | None = None  # None: the source model's file or folder name
    # Decode groups whose streams share each infer call (pipeline/groups.py); 0: no batching,
    # one call per stream per step. None: measured best (BENCHMARKS.md): 1 when every stage is
    # in this process (they share its cores), else one per stage, so that each stage (each
    # machine) works on one group while the others work on theirs.
    decode_groups: int | None = None
    # Prompt tokens per prefill step: chunks interleave with the running streams' decode steps
    # (the default is the knee measured in BENCHMARKS.md, issue 9).
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_prefills: int = 2  # prompts prefilling at once, oldest first
    # While streams decode, chunks sized to a time budget and prefill's share of the time
    # (serving/pacing.py); None: every chunk `prefill_chunk` tokens (the old policy, for benchmarks).
    pacing: PacingConfig | None = field(default_factory=PacingConfig)
    max_body_bytes: int = 2 << 20  # larger request bodies get 413
    # A chat template's text in place of the model's (`--chat-template`: a built-in's or a file's); None: the model's.
    chat_template: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # /v1 requests must bear one (api/auth.py)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)  # after a worker dies or hangs
    # Browser origins allowed to call the API from their pages (CORS); none unless given.
    cors_origins: tuple[str, ...] = ()
    # Disaggregated serving (disagg/): (prefill instances, decode instances), each a pipeline of
    # every stage in this process; None: one coupled instance. Its decode admission policy and
    # its prefill instances' local policy.
    disaggregate: tuple[int, int] | None = None
    admission: str = "reserve-dynamic"
    prefill_policy: str = "fcfs"
    flip: bool = False  # idle instances change role when the other role's queues are under pressure
    # How prefill instances predict a request's decode length: "auto" (the bundled trained model
    # when it fits the export, else "max-tokens"), "max-tokens" (the request's own cap), or the
    # path of a model made by tools/shardline_tools/lengths/length_train.py.
    length_predictor: str = "auto"
    # KV from prefill to decode instance: "request" (the whole cache once the first token is
    # out) or "chunk" (each prompt chunk's slots as soon as it has run, overlapping the prefill).
    kv_transfer: str = "request"
    # Prefix reuse (serving/prefix.py): MiB of ended streams' KV kept for later prompts that
    # start alike, per process; None: a tenth of the memory available at start, at most 2 GiB;
    # 0: off.
    prefix_cache_mb: int | None = None
    # A paged export's KV block pool (export --paged), reserved at start, in MiB; None: what
    # PAGED_STREAMS streams at the full context hold, within `memory_fraction` of available memory.
    kv_cache_mb: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_mb is not None and not 1 <= self.kv_cache_mb <= MAX_KV_CACHE_MB:
            raise ShardlineError(f"--kv-cache-mb must be in 1-{MAX_KV_CACHE_MB}, got {self.kv_cache_mb}")
        if self.prefix_cache_mb is not None and not 0 <= self.prefix_cache_mb <= 1 << 20:
            raise ShardlineError(f"--prefix-cache-mb must be in 0-{1 << 20}, got {self.prefix_cache_mb}")
        if self.decode_groups is not None and self.decode_groups < 0:
            raise ShardlineError("--decode-groups must be >= 0")
        if not 1 <= self.prefill_chunk <= 1 << 16:
            raise ShardlineError(f"--prefill-chunk must be in 1-65536, got {self.prefill_chunk}")
        if self.max_prefills < 1:
            raise ShardlineError("--max-prefills must be >= 1")
        if self.max_body_bytes < 1024:
            raise ShardlineError("--max-body-bytes must be >= 1024")
        if not 0 <= self.port < 65536:
            raise ShardlineError(f"--port must be in 0-65535, got {self.port}")
        if self.max_streams is not None and self.max_streams < 1:
            raise ShardlineError("--max-streams must be >= 1")
        if self.max_queue < 0:
            raise ShardlineError("--max-queue must be >= 0")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ShardlineError("--max-tokens must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ShardlineError("--memory-fraction must be in (0, 1]")
        if self.disaggregate is not None and not (
                len(self.disaggregate) == 2 and all(1 <= n <= 16 for n in self.disaggregate)):
            raise ShardlineError(f"--disaggregate P:D needs 1-16 prefill and 1-16 decode instances, "
                                 f"got {self.disaggregate}")
        if self.admission not in ADMISSIONS:
            raise ShardlineError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ShardlineError(f"--prefill-policy must be one of {', '.join(PREFILL_POLICIES)}, "
                                 f"got {self.prefill_policy!r}")
        if not 1 <= len(self.length_predictor) <= 4096 or "\0" in self.length_predictor:
            raise ShardlineError("--length-predictor must be auto, max-tokens or a model file's path")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ShardlineError(f"--kv-transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}")
        if len(self.cors_origins) > 32:
            raise ShardlineError(f"at most 32 --cors-origin, got {len(self.cors_origins)}")
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ShardlineError(f"--cors-origin must be '*' or SCHEME://HOST[:PORT] with no path, got {origin!r}")


ADMISSIONS = ("vanilla", "reserve-static", "reserve-dynamic")  # disagg/instance.py Admission
PREFILL_POLICIES = ("fcfs", "sjf", "ljf")  # disagg/policies.py PrefillPolicy
KV_TRANSFERS = ("request", "chunk")  # disagg/prefill.py PrefillOnly(chunked_kv=...)


def disaggregation(text: str) -> tuple[int, int]:
    """`--disaggregate P:D` as (P, D); the range is checked by ServeConfig."""
    p, sep, d = text.partition(":")
    if not sep or not p.strip().isdigit() or not d.strip().isdigit():
        raise ShardlineError(f"--disaggregate must be P:D (prefill and decode instances), got {text!r}")
    return int(p), int(d)


DRAFT_K_MAX = 8  # drafts per verify step at most (auto K stays within it)
COMPACT_AT = 128  # masked slots a stream's cache may hold before a step compacts it (BENCHMARKS.md, issue 10)
# At most: a worker refuses a row of more than its context + 512 slots (node/bounds.py), which
# must leave room for these masked slots and a step's drafts.
MAX_COMPACT_AT = 256


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding: where drafts come from and how many a verify step carries.

    `draft`: "" (off), "ngram" (prompt lookup: n-gram matches in the text so far, no model),
    "layers:L" (self-speculation: the target's first L layers with its norm and head, exported
    once as a shard of its own), or the path of a draft model's export folder (sharing the
    target's tokenizer). `k`: drafts per step, or None for auto: per stream, from its measured
    acceptance and the measured time of a step (serving/speculation.py)."""

    draft: str = ""
    k: int | None = None
    k_max: int = DRAFT_K_MAX
    compact_at: int = COMPACT_AT

    def __post_init__(self) -> None:
        if not 1 <= self.k_max <= 32:
            raise ShardlineError(f"the most drafts per step must be in 1-32, got {self.k_max}")
        if self.k is not None and not 1 <= self.k <= self.k_max:
            raise ShardlineError(f"--draft-k must be 'auto' or in 1-{self.k_max}, got {self.k}")
        if not 1 <= self.compact_at <= MAX_COMPACT_AT:
            raise ShardlineError(f"the compaction threshold must be 1-{MAX_COMPACT_AT} masked slots, "
                                 f"got {self.compact_at}")
        if self.kind == "layers" and not (self.draft[7:].isdigit() and int(self.draft[7:]) >= 1):
            raise ShardlineError(f"--draft layers:L needs a layer count L >= 1, got {self.draft!r}")

    @property
    def kind(self) -> str:
        """"off", "ngram", "layers" or "model"."""
        if not self.draft:
            return "off"
        if self.draft == "ngram":
            return "ngram"
        return "layers" if self.draft.startswith("layers:") else "model"

    @property
    def layers(self) -> int:
        return int(self.draft[7:]) if self.kind == "layers" else 0

