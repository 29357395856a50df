"""What makes a batch legal for a `TargetSpec`: the harness only ever sends legal batches, and
`replay` refuses illegal ones before any target is touched."""

from __future__ import annotations

from pytest_graphmode.contract import Batch, TargetSpec


def batch_problems(batch: Batch, spec: TargetSpec) -> list[str]:
    """Every reason `batch` is not a legal step for `spec`; empty when it is legal."""
    problems = []
    if not 1 <= batch.num_reqs <= spec.max_num_reqs:
        problems.append(f"{batch.num_reqs} requests; allowed 1..{spec.max_num_reqs}")
    if batch.num_tokens > spec.max_num_tokens:
        problems.append(f"{batch.num_tokens} tokens > max_num_tokens {spec.max_num_tokens}")
    owners: dict[int, int] = {}
    seen_ids: set[int] = set()
    for r in batch.requests:
        name = f"req {r.req_id}"
        if r.req_id in seen_ids:
            problems.append(f"{name} appears twice")
        seen_ids.add(r.req_id)
        if not r.tokens:
            problems.append(f"{name} has no query tokens")
        if any(not 0 <= t < spec.vocab_size for t in r.tokens):
            problems.append(f"{name} has tokens outside [0, {spec.vocab_size})")
        if r.context_len < 0:
            problems.append(f"{name} has context_len {r.context_len} < 0")
        needed = -(-r.seq_len // spec.block_size)
        if len(r.block_ids) != needed:
            problems.append(
                f"{name} has {len(r.block_ids)} blocks for {r.seq_len} positions; "
                f"needs exactly {needed}"
            )
        if len(r.block_ids) > spec.max_blocks_per_req:
            problems.append(f"{name} has more than max_blocks_per_req={spec.max_blocks_per_req}")
        if len(set(r.block_ids)) != len(r.block_ids):
            problems.append(f"{name} lists a block twice")
        if r.temperature <= 0:
            problems.append(f"{name} has temperature {r.temperature} <= 0")
        if r.seed is not None and "sampling" not in spec.features:
            problems.append(f"{name} is sampled but the target lacks the 'sampling' feature")
        if r.adapter and "adapters" not in spec.features:
            problems.append(f"{name} uses an adapter but the target lacks the 'adapters' feature")
        for block in r.block_ids:
            if block == spec.null_block or not 0 <= block < spec.num_blocks:
                problems.append(f"{name} uses block {block} (null block or out of range)")
            elif owners.setdefault(block, r.req_id) != r.req_id:
                problems.append(f"block {block} belongs to req {owners[block]} and {name}")
    return problems
