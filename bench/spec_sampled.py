"""Speculative decoding (issue 10) with sampled drafts: acceptance, K and speedup when streams
sample, and the bytes of q's support a verify step carries.

Sampled drafts (temperature `--temperature`, in process, the model sources, K fixed at
`--sampled-k`: in process a draft model costs what the target does and auto K offers almost
no drafts, which would leave nothing to measure): acceptance, K and speedup, and the bytes
of q's support a verify step carries (per drafted position SUPPORT = 16 ids as i64 + 16
probabilities as f32 = 192 B; as the step builds it, every sampled position of a row, K + 1,
carries a token i64 + the padded support: 200 B each).

    python bench/spec_sampled.py --quick
    python bench/spec_sampled.py --sources int8,int4 --k 4

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spec_kit import (  # bench/ is on sys.path when this script runs
    LoadWatch,
    common_flags,
    engines,
    f,
    git_state,
    measure_spec,
    provenance,
    rounded,
    setup,
    show,
    summarize_spec,
)

from shardline.config import SpeculationConfig
from shardline.decoding.drafts import SUPPORT

Q_SUPPORT_BYTES = SUPPORT * (8 + 4)  # per drafted position: ids i64 + probabilities f32
Q_ENTRY_BYTES = 8 + Q_SUPPORT_BYTES  # per sampled position of a verify step: + the draft token (i64)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 types, 16 tokens, 1 round")
    common_flags(p, "int8,int4,layers:24")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--k", default="4", help="drafts per verify step, a number or auto (in process a draft model "
                   "costs about what the target does, so auto K offers almost none)")
    args = p.parse_args()
    n, rounds = (16, 1) if args.quick else (args.tokens, args.rounds)
    if n < 3:
        p.error("--tokens must be at least 3")
    if "ngram" in args.sources.split(","):
        p.error("sampled drafts come from a model: ngram drafts are certain")
    s = setup(p, args, args.quick)
    watch, git = LoadWatch(), git_state()
    sources = list(s.drafts)
    with engines() as eng:
        eng.open("plain", s.f2, None, SpeculationConfig())
        for src in sources:
            eng.open(src, s.f2, None, s.spec_cfg(src, None if args.k == "auto" else int(args.k)))
        runs = measure_spec(eng, ["plain", *sources], s.prompts, n, rounds, s.stops, f"sampled T={args.temperature:g}",
                            s.deadline, {"temperature": args.temperature})
    sampled = summarize_spec(runs, sources, exact=False)
    for src in sources:
        x = sampled["sources"][src]
        x["q_support_bytes_per_step"] = x["k_mean"] * Q_SUPPORT_BYTES  # mean over every verify step
        # per step that drafts, as the step builds it: (its drafts + 1) entries of Q_ENTRY_BYTES
        x["drafted_entry_bytes_per_drafting_step_at_k"] = {k_: (k_ + 1) * Q_ENTRY_BYTES for k_ in (1, 4, 8)}

    ran = provenance(s, watch, git)
    headers = ["source", "mean x", "acceptance", "K", "q support B/step"]
    rows = [[src, f(x["mean_speedup"]), f(x["acceptance"]), f(x["k_mean"], ".1f"),
             f(x["q_support_bytes_per_step"], ".0f")] for src, x in sampled["sources"].items()]
    show(f"sampled drafts (T={args.temperature:g}), in process, K {args.k}, up to {n} tokens; per row, a verify "
         f"step offering K drafts carries K x {Q_SUPPORT_BYTES} B of q's support (SUPPORT {SUPPORT} x (i64 id + f32 "
         f"probability)); as the step builds it, (K + 1) x {Q_ENTRY_BYTES} B (+ the draft token, and a padded entry "
         f"at the last position): {', '.join(f'K={k_}: {(k_ + 1) * Q_ENTRY_BYTES} B' for k_ in (1, 4, 8))}"
         "; 'q support B/step' is the mean over every verify step (K from the table)", headers, rows)
    figures: dict[str, Any] = {f"ratio_mean_speedup_{src}": round(x["mean_speedup"], 3)
                               for src, x in sampled["sources"].items()}
    figures |= {"tokens": n, "rounds": rounds, "temperature": args.temperature, "k": args.k} | ran
    figures["sampled"] = rounded(sampled)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
