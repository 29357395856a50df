"""The reference decoder's shape: sizes, KV cache geometry, adapters and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """A Llama-like decoder over a paged KV cache of `num_blocks` blocks of `block_size` slots.

    Adapter ids run from 0 (the base model, no delta) to `num_adapters` inclusive.
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    block_size: int
    num_blocks: int
    max_blocks_per_req: int
    num_adapters: int = 0
    adapter_rank: int = 4
    dtype: str = "float32"
    rope_theta: float = 10000.0
    null_block: int = 0

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("invalid DecoderConfig: " + "; ".join(problems))

    @classmethod
    def tiny(cls) -> DecoderConfig:
        """Small enough that a step takes milliseconds on one CPU core, with GQA (2 query heads per
        KV head), several blocks per request and two adapters, so every code path is exercised."""
        return cls(
            vocab_size=256,
            hidden=64,
            layers=2,
            heads=4,
            kv_heads=2,
            head_dim=16,
            mlp=128,
            block_size=4,
            num_blocks=64,
            max_blocks_per_req=8,
            num_adapters=2,
        )

    @classmethod
    def gpu_bench(cls) -> DecoderConfig:
        """Launch-bound on an H200: a decode step issues about 700 small ATen ops (some 87 per
        layer over 8 layers) while each GEMM (at most 512 x 4096 per token) takes a few
        microseconds, so host launch overhead dominates device time. That gap is what graph
        replay removes, so the benchmark measures the runtime rather than the GPU's arithmetic."""
        return cls(
            vocab_size=4096,
            hidden=512,
            layers=8,
            heads=8,
            kv_heads=4,
            head_dim=64,
            mlp=1536,
            block_size=16,
            num_blocks=1024,
            max_blocks_per_req=16,
            num_adapters=2,
            adapter_rank=8,
            dtype="bfloat16",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_seq_len(self) -> int:
        """Longest sequence one block table can address."""
        return self.max_blocks_per_req * self.block_size

    @property
    def qkv_size(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def _problems(config: DecoderConfig) -> list[str]:
    problems = []
    positive = (
        "vocab_size",
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "head_dim",
        "mlp",
        "block_size",
        "max_blocks_per_req",
        "adapter_rank",
    )
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an int >= 1")
    if config.num_blocks < 2:
        problems.append(
            f"num_blocks={config.num_blocks} must be >= 2 (the null block plus at least one block)"
        )
    if config.num_adapters < 0:
        problems.append(f"num_adapters={config.num_adapters} must be >= 0 (0 disables adapters)")
    if config.kv_heads >= 1 and config.heads % config.kv_heads != 0:
        problems.append(
            f"heads={config.heads} must be a multiple of kv_heads={config.kv_heads} "
            "(grouped-query attention shares each KV head among heads // kv_heads query heads)"
        )
    if config.head_dim % 2 != 0:
        problems.append(f"head_dim={config.head_dim} must be even (RoPE rotates pairs)")
    if config.dtype not in DTYPES:
        problems.append(f"dtype={config.dtype!r} must be one of {sorted(DTYPES)}")
    if not config.rope_theta > 0:
        problems.append(f"rope_theta={config.rope_theta} must be > 0")
    if not 0 <= config.null_block < max(config.num_blocks, 1):
        problems.append(
            f"null_block={config.null_block} outside [0, num_blocks={config.num_blocks})"
        )
    if config.max_blocks_per_req > config.num_blocks - 1:
        problems.append(
            f"max_blocks_per_req={config.max_blocks_per_req} exceeds the {config.num_blocks - 1} "
            "blocks a request can own (num_blocks minus the null block)"
        )
    return problems
