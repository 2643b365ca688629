"""`shardline inspect`: the manifest as a table, every checksum verified."""

from __future__ import annotations

from pathlib import Path

from shardline.model.manifest import Manifest, load_manifest, verify


def inspect(folder: Path) -> str:
    m = load_manifest(folder)
    verify(folder, m)
    a = m.arch
    lines = [
        f"source      {m.source['path']} ({m.source['format']}, sha256 {m.source['sha256'][:16]}...)",
        f"model       {a.family}: {a.n_layers} layers, hidden {a.hidden}, heads {a.n_heads}/{a.n_kv_heads} "
        f"(kv), vocab {a.vocab}, rope theta {a.rope_theta:g}, tied {a.tied_embeddings}",
        f"weights     {m.weights}" + (f" (group {m.group_size})" if m.group_size else "") + _kept(m),
        "versions    " + ", ".join(f"{k} {v}" for k, v in m.versions.items()),
        "",
        f"{'stage':<7}{'layers':<9}{'owns':<16}{'inputs':<56}{'outputs':<24}{'state':>6}{'peak MB':>9}",
    ]
    for s in m.stages:
        owns = "+".join(x for x, has in (("embed", s.has_embedding), ("norm+head", s.has_head)) if has) or "-"
        ins = ", ".join(p.name for p in s.inputs)
        outs = ", ".join(f"{p.name}:{p.dtype}" for p in s.outputs)
        rss = f"{s.export_peak_rss_mb:.0f}" if s.export_peak_rss_mb else "-"
        lines.append(f"{s.index:<7}{f'{s.first_layer}-{s.last_layer}':<9}{owns:<16}{ins:<56}{outs:<24}"
                     f"{len(s.state):>6}{rss:>9}")
    lines += ["", f"{len(m.files)} files, all checksums verified"]
    return "\n".join(lines)


def _kept(m: Manifest) -> str:
    """Under gguf: what the stages kept, by the file's type (nothing is widened unseen)."""
    total: dict[str, int] = {}
    for s in m.stages:
        for kind, n in s.weights_kept.items():
            total[kind] = total.get(kind, 0) + n
    if not total:
        return ""
    return ": kept " + ", ".join(f"{k} x{n}{_HOW.get(k, '')}" for k, n in sorted(total.items()))


# Types the plugin cannot take as the file stores them, and what they become (exactly).
_HOW = {"MXFP4": " (as int8 codes times its e8m0 scales: exact, twice its bytes; the CPU plugin has no f4e2m1 "
                 "expert kernel)"}
