"""Runners written from the public docs alone (`tests/runners/from_docs/`): correct, each passes
the harness; with its bug, each is caught by the check that names it, within the campaign's
leading examples or, for a bug none of them is built for, the examples `LATER` allows."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import pytest
import torch

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.isolation import run_isolated
from pytest_graphmode.fuzz.ranks import run_rank_campaign
from pytest_graphmode.strategies.leading import LEADING_EXAMPLES
from tests.runners.caught import assert_caught, failure_of

# runner -> the check that catches its bug on sim
CAUGHT_BY: dict[str, str | tuple[str, ...]] = {
    "max_context_baked": "replay_matches_eager",  # a capture batch's longest context baked in
    "dirty_rows": "kv_writes_land",  # a condensed row never re-uploaded to the device table
    "event_before_copy": "no_stream_races",  # the upload's event recorded before its copies
    "row_params_not_reset": "replay_matches_eager",  # a reused row keeps its sampling seed
    "staging_guard_on_resize": "no_stream_races",  # pinned staging rewritten under its upload
    "derived_weights_cached": "replay_matches_eager",  # a fused weight left out of the update
    "fallback_shares_buffers": "no_stream_races",  # the next upload under a replay still reading
    "adapter_path_baked": "replay_matches_eager",  # the LoRA path left out of a capture
    "adapter_id_baked": "replay_matches_eager",  # one adapter's weights baked into a capture
    "reorder_not_undone": "replay_matches_eager",  # rows left in the runner's own order
    "piecewise_query_len_baked": "replay_matches_eager",  # a capture's longest query baked in
    "weights_loaded_unsynced": "no_stream_races",  # weights still loading when a step reads them
    "capture_size_lookup_off_by_one": "kv_writes_land",  # the graph one size too small
    "logits_index_padded": "replay_matches_eager",  # a row's logits at the next row's first token
    "replay_stream_not_awaited": "no_stream_races",  # results read before the replay wrote them
    "moe_padding_capacity": "replay_matches_eager",  # padding rows use up experts' capacity
    "rope_table_one_short": "replay_matches_eager",  # the longest context past the rotary table
    "request_state_not_evicted": "sampling_independent",  # a reused id keeps the last one's flags
    "spec_len_baked": "replay_matches_eager",  # the capture's query length per row baked in
    # metadata re-planned only for a new shape: a stale slot written in the first example's pair
    "metadata_planned_by_shape": "kv_writes_confined",
    # two attention wrappers planned in forward, which a replay skips: the warm-up plan replays
    "multi_wrapper_plan_deferred": "replay_matches_eager",
    # positions advanced on the device where the ids repeat, past a rejected draft's
    "positions_advanced_on_device": "kv_writes_confined",
    "state_slot_padding": "states_match",  # padding rows given a live request's recurrent state
    "tokens_downloaded_unawaited": "no_stream_races",  # pinned tokens read before the copy landed
    "adapter_slots_rebuilt": "replay_matches_eager",  # adapter slots rebuilt, not loaded in place
    "side_stream_escapes_capture": "replay_matches_eager",  # a sampler stream never forked
    "int32_view_made_once": "replay_matches_eager",  # int32 index copies made once, at capture
    "rope_cache_grown": "replay_matches_eager",  # the rotary cache rebound when it grows
    "ping_pong_not_flipped": "no_stream_races",  # a buffer set reused after an eager step
    "dynamic_scale_over_padding": "replay_matches_eager",  # padding rows in a quantization scale
    "penalty_counts_not_cleared": "replay_matches_eager",  # a reused slot keeps its penalty counts
    "query_start_padding_stale": "replay_matches_eager",  # padding rows' query starts left stale
    "one_event_two_purposes": "no_stream_races",  # a download's event re-recorded by an upload
    "empty_row_nan_scale": "replay_matches_eager",  # NaN of empty padding rows in a batch scale
    "spec_tokens_past_graph": "kv_writes_land",  # a graph chosen by request count, not tokens
    "split_step_shared_pool": "replay_matches_eager",  # one graph's output read after another's
    "cached_index_evicted": "replay_matches_eager",  # a memoized index freed under its graph
    "workspace_resized": "replay_matches_eager",  # a scratch buffer rebound when it grows
    "recurrent_state_not_reset": "replay_matches_eager",  # a recycled state slot not cleared
    "kv_cache_reallocated": "kv_writes_land",  # a reload moves the KV cache from under the graphs
    "generator_not_registered": "replay_matches_eager",  # a private generator drawn in a capture
    "greedy_graph_for_sampled": "replay_matches_eager",  # the all-greedy branch baked in a graph
    "pad_slot_wraps_to_last": "states_match",  # padding slot -1 indexes the cache's last slot
    "piecewise_attention_out_fresh": "replay_matches_eager",  # a piece reads a freed output
    "max_seq_len_read_racing": "no_stream_races",  # seq_lens read back before their upload
    # a forward thread's stream never waits for the scheduling stream's uploads
    "forward_thread_skips_upload_wait": "no_stream_races",
    # pinned staging refilled while the forward thread's upload of the last step may be queued
    "forward_thread_staging_refilled": "no_stream_races",
    # fresh upload tensors of a copy stream freed without record_stream (steps in inference mode)
    "upload_freed_without_record_stream": "no_stream_races",
    # a micro-batch's replay overwrites the outputs the previous one's download still reads
    "async_download_overwritten": "no_stream_races",
    # the graph's own upload reads a pinned staging buffer the runner replaced when it grew
    "pinned_upload_in_capture": "replay_matches_eager",
    # the batch's window start read on the host, baked in by a capture on long contexts
    "window_start_baked": "replay_matches_eager",
    # condensing the persistent batch leaves a moved request's sampling values behind
    "condense_leaves_sampling_rows": "sampling_independent",
    # the batch's sum of sequence lengths, read on the host, sizes the attention indices
    "seq_lens_sum_baked": "replay_matches_eager",
    # an fp8 KV cache's scales calibrated on the first forward: the capture's dummy rows. The
    # logits move by 6% of a row's scale on seed 0, within half a float8 unit; the next step's
    # keys, quantized by the wrong scale, clip to the largest code
    "fp8_scale_from_warmup": ("replay_matches_eager", "states_match"),
    # a custom attention op's host int (the blocks to scan) baked in at capture
    "custom_op_scan_baked": "replay_matches_eager",
    # the short or long rotary table chosen on the host from the batch's longest sequence
    "long_rope_switch": "replay_matches_eager",
    # a split-KV combine trusts stale splits a longer request left in the graph's workspace
    "split_kv_workspace": "replay_matches_eager",
    "grammar_bitmask_rows": "replay_matches_eager",  # plain rows keep a grammar request's mask
    # seeded rows draw from one generator the batch shares, not from their own
    "seeded_sampling_generators": "sampling_independent",
    "moe_host_sized_groups": "replay_matches_eager",  # the capture batch's expert groups baked in
    # a partial prefill's discarded draw rewound after the graph's generator took the state
    "generator_offset_rewind": "replay_matches_eager",
    "top_k_from_batch_max": "replay_matches_eager",  # the capture batch's largest top-k baked in
    "kv_swap_in_race": "no_stream_races",  # the replay waits on an event recorded before a reload
    # a host "every row continues" flag baked in: a new request starts from a freed slot's state
    "ssm_initial_state_flag": "replay_matches_eager",
    # the capture batch's count of logit-bias entries baked in, not the device count
    "logit_bias_sparse_lists": "replay_matches_eager",
    # a moved row keeps the M-RoPE position delta of the request that held the row before
    "mrope_delta_stale": "replay_matches_eager",
    # the capture batch's decode/prefill split, a host int, baked into a full graph
    "decode_prefill_split_baked": "replay_matches_eager",
    # padding rows keep a stale slot: a poisoned one (-1, huge) indexes past the interleaved
    # cache (seeds 0 and 1), a departed request's is written over (seed 2)
    "flashinfer_kv_layout": ("replay_matches_eager", "kv_writes_confined"),
    # the capture's dummy rows give cross-attention its encoder length, a host int baked in
    "cross_attention_lengths": "replay_matches_eager",
    # the draft graph reads the target graph's own output, not the buffer every path writes
    "draft_reads_hidden_states": "states_match",
    # a future map resolved on the copy stream, not after the forward stream that writes it
    "overlap_future_tokens": "no_stream_races",
    # a split-KV plan from the capture batch's longest sequence, baked in (bfloat16, fused QKV)
    "bf16_fused_graph_path": "replay_matches_eager",
    # the next step's upload overwrites device staging the previous step has not read yet
    "block_table_upload_war": "no_stream_races",
    # a rebalance rebinds the expert map while it permutes the experts' weights in place
    "eplb_expert_map_rebound": "replay_matches_eager",
    # two micro-batches split where the capture batch's rows split, a host int baked in
    "microbatch_split_baked": "replay_matches_eager",
    # a multimodal row's mask never cleared: a later text row reads a stale image embedding
    "inputs_embeds_stale": "replay_matches_eager",
    # the sampler's top-k width taken from the capture batch's largest k, baked in
    "topk_logprobs_baked": "replay_matches_eager",
    # a float8 cache's scale store lets padding slot -1 wrap to the last slot; the graph path
    # quantizes by other arithmetic than the eager one (the tolerances over float8 state)
    "fp8_kv_quant_paths": "states_match",
    # padding rows given free state-pool slots, parked requests' among them; the graph steps
    # the recurrence fused, the eager path scans it in chunks (bfloat16 logits' tolerance)
    "hybrid_ssm_scan_paths": "states_match",
    # the split-KV grid sized from the capture batch's longest context, baked in (bfloat16)
    "bf16_split_kv_decode": "replay_matches_eager",
    # a fused add-norm's persistent residual zeroed once, not in the graph (float16)
    "fp16_fused_norm_residual": "replay_matches_eager",
    # a compiled forward captured with the dummy batch's block count, a specialized int
    "compiled_model_graphs": "replay_matches_eager",
    # an int8 cache's unguarded store lets padding slot -1 wrap to the last slot (at the
    # capture's warm-up); the correct runner's codes one unit apart between its paths
    "int8_kv_cache": "states_match",
    # a piecewise runner's attention metadata built once at capture, its host max_seq_len stale
    "compiled_piecewise": "replay_matches_eager",
    # learned attention sinks copied to float32 before capture, the copy not refreshed by a
    # weight update (bfloat16; sliding-window and full layers on other paths per mode)
    "sinks_swa_decode": "replay_matches_eager",
    # MLA's absorbed projections derived from kv_b_proj once, not again after a weight update
    # (bfloat16; the graphs' absorbed path beside the eager twin's naive one)
    "mla_absorbed_decode": "replay_matches_eager",
    # int4 weights dequantized to float16 at capture, the copy stale after a weight update
    # (the graphs dequantize before the matmul, the eager path scales after it)
    "int4_weight_only": "replay_matches_eager",
    # chunked local attention's chunk start frozen at capture: wrong past the first chunk
    "chunked_local_attention": "replay_matches_eager",
    # `make_graphed_callables`' outputs handed out uncloned: the next call overwrites them
    "graphed_callables_decode": "results_stay_valid",
    # penalties sampled in the graph: padding rows count their dummy token into row 0's counts
    "penalties_in_graph": "replay_matches_eager",
    # landing tensors of an upload stream dropped without `record_stream` on the decode stream
    "facade_stream_breadth": "no_stream_races",
    # a graph captured lazily mid-serving, its warm-up's zeroed dummy rows writing slot 0
    "lazy_capture_serving": "kv_writes_confined",
    # memory profiled vLLM-style with a forward smaller than the largest eager step: the scratch
    # every graph writes is freed, emptied from the cache and reallocated by a later prefill
    "memory_profiled_capture": "replay_matches_eager",
    # a background thread rewrites the pinned staging before the last upload from it has read it
    # (sync debug mode around the replay, thread-local captures)
    "sync_debug_threads": "no_stream_races",
    # padding rows written into the pinned numpy views after their upload was queued
    "numpy_pinned_buffers": "no_stream_races",
    # warm-up and capture in one autocast block with its cast cache on: the graph reads the
    # warm-up's bfloat16 copy of a weight, freed when the block ends
    "sdpa_autocast_decode": "replay_matches_eager",
    # copy-on-write block forks in the graph: the padded tail of the (src, dst) pairs keeps an
    # earlier step's pairs, so a stale snapshot is copied over a block again
    "forked_blocks_decode": "kv_writes_land",
    # SDPA kernels chosen per path; the graph path's additive mask cached in per-step metadata
    # that the graph keeps, so every replay uses the warm-up's all-padding mask
    "sdpa_kernels_decode": "replay_matches_eager",
    # ALiBi's key window sized from the capture batch's longest context, a Python int the graph
    # keeps: a replay with longer contexts never sees the newest keys
    "alibi_bias_decode": "replay_matches_eager",
    # sliding-window layers' metadata filled in by the forward, not by `prepare`: a replay never
    # runs that Python, so the window layers read stale (poisoned) block indices
    "alternating_window_layers": "replay_matches_eager",
    # the verify graphs' KV writes from host slot numbers: the capture's dummy slots, frozen in
    "tree_spec_verify": "kv_writes_land",
    # float8 linears with a dynamic per-tensor activation scale: on the graph path its amax also
    # covers the padding rows, so a padded replay quantizes with another scale than eager
    "fp8_scaled_linear": ("replay_matches_eager", "states_match"),
    # sleep mode around a weight update (weights and cache in a MemPool, freed with
    # `resize_(0)`, graphs re-captured on wake): two init-once index tables put in the region
    # that is discarded, not backed up, so the re-captured graphs read zeros
    "sleep_wake_pool": "replay_matches_eager",
    # a ring of block-table columns read by the linear arm (valid before the ring wraps), the
    # arm chosen on the host and so baked in from the capture's empty rings
    "cyclic_block_table": "replay_matches_eager",
    # a float8 MoE layer reloaded layer by layer rebuilds its expert kernel: the graphs keep the
    # old kernel's freed descriptors and workspace
    "layerwise_reload_moe": "replay_matches_eager",
    # a persistent batch's decode-first reorder swaps two rows' stop masks as views: both rows
    # hold one mask (a greedy request on the greedy company twin shows it)
    "decode_first_stop_masks": "company_independent",
    # device-side substitution of last step's samples: the graph's spare index entries -1, so a
    # full graph writes the batch's token back over its last token's substitution
    "placeholder_substitution": "replay_matches_eager",
    # cascade attention's suffix launched without the split bound its graph plan used: a split
    # written past the workspace
    "shared_prefix_cascade": "replay_matches_eager",
    # two pipeline stages, each a graph: the second reads the cached intermediate buffers, never
    # filled with the first stage's outputs
    "pp_stage_graphs": "replay_matches_eager",
    # a DRY penalty over a persistent batch's token history, its scan width frozen with the
    # batch's sampling metadata: new tokens fall past it until the batch changes
    "dry_persistent_history": "sampling_independent",
    # a hybrid model's recurrent-state track-save reads the whole track buffer of the graphs, not
    # its rewritten front: a smaller graph takes a stale (poisoned) tail's destinations
    "mamba_extra_buffer": ("replay_matches_eager", "states_match"),
    # a greedy-only persistent batch: condensing counts a moved row's draft tokens after moving
    # them, so none are copied and the moved request decodes over the previous occupant's drafts
    # (every twin that keeps the batch's rows does it alike: the greedy company twin shows it)
    "condense_drops_spec_tokens": "company_independent",
    # a running batch filtered by truncating its per-row device tensors, not by picking the kept
    # rows: after a departure every later request takes the previous row's pool index and length
    "eagle_filter_truncates_rows": "kv_writes_confined",
    # the draft-extend graph's query offsets rebuilt packed (a cumsum of the query lengths) on
    # replay, where its token buffers keep the capture's constant width per request
    "draft_extend_qo_stride": "replay_matches_eager",
    # a capture-only "sample everything" override cleared on the live metadata but not on the
    # shallow copies the sampling graphs keep: every replay resamples with the capture's values
    "capture_sampling_override_leak": "replay_matches_eager",
    # the shared expert on a side stream reads the MoE input that the routed experts overwrite in
    # place on the main stream, nothing ordering the two (found in the capture's eager warm-up)
    "shared_expert_stream_inplace": "no_stream_races",
    # the shared expert writes its output into the MoE input in place while the routed experts on
    # a side stream read it; the two streams meet only inside the captured graphs, whose branches
    # the sim judges at capture (found when the twins are made)
    "dual_stream_capture_only": "no_stream_races",
    # the routed experts' input clone, read on a side stream, freed on the current one without
    # record_stream before the join: inside the capture the shared expert's next allocation takes
    # its block (found when the twins are made)
    "routed_clone_not_recorded": "no_stream_races",
    # the guard that keeps long contexts off the graphs reads the batch's longest prefill (0 in a
    # decode batch): a long context is sent to a graph whose block table is too narrow
    "long_context_graph_guard": "replay_matches_eager",
    # a graph's reuse check compares its inputs' shapes and strides, not their addresses: after a
    # long prefill reallocates the buffer they view, a replay reads the freed one
    "src_addresses_unchecked": "replay_matches_eager",
    # the verify step's flat custom mask built for the real requests only, its offsets covering
    # the graph's padding rows: a padded replay reads past the mask (an exception on sim)
    "verify_tree_mask_unpadded": "replay_matches_eager",
    # a graph's padding rows (and forking parents) gather sequence slot 0's sibling table, not the
    # dummy slot's: they write their keys into a live parent's shared prompt block
    "sibling_slot_gather": "replay_matches_eager",
    # a logits processor's per-request parameters consumed once per request over every token row
    # of a verify step: a request's last row takes another request's banned ids, or none
    "spec_verify_processor_params": "company_independent",
    # multi-step decoding advances every row of the graph on the device, padding rows too: from a
    # window's second step a padding row writes a block of whoever last held its row
    "multi_step_padded_advance": "kv_writes_confined",
    # the padding branch zeroes the full pool's write slots but not the sliding-window pool's: a
    # padded replay's padding rows write the window layer's keys into the slots the buffer last
    # held (a request of a larger batch before), or wherever the poisoned buffer points
    "swa_loc_padding_stale": ("kv_writes_confined", "replay_matches_eager"),
    # a speculative step's flat logits split into requests by draft counts taken in the batch's
    # order while the rows are laid out in the persistent batch's: with uneven draft counts a row
    # reads a neighbour's logits, on every twin alike, so only other company shows it
    "spec_split_scheduler_order": ("company_independent", "sampling_independent"),
    # the attention's cumulative key lengths built before the capture, from the warm-up's lengths,
    # and dropped after it: every replay reads the freed (on sim, reported) or stale sums
    "seqlen_built_outside_capture": "replay_matches_eager",
    # padding dummies add their own tokens to the host part of the token staging, shifting the
    # device-side (overlap) tokens by the padding: continuing rows on a padded graph read another
    # row's token
    "overlap_dummy_token_shift": "replay_matches_eager",
    # graph updates patch the destination of one copy kernel's nodes only: with a quantized key
    # cache beside a half-precision value cache, a reused graph writes the values into the slot
    # of the token it was captured for
    "cpy_dest_single_kernel": "kv_writes_confined",
    # a batch called uniform decode by its shape alone: a fresh prompt of the uniform query length
    # replays the full graph, whose recurrent-state metadata the builder left as it was for a
    # batch with a prefill
    "prefill_aliases_uniform_decode": "replay_matches_eager",
    # the eager attention between piecewise graphs reads the request count padded to the
    # captured size: a padded uniform decode batch fails the indexer's shape check
    "padded_reqs_at_graph_break": "replay_matches_eager",
    # the LoRA kernels' segment count frozen at capture: a replayed batch with more adapter
    # segments than the capture loses the last ones' change
    "lora_segment_count_baked": "replay_matches_eager",
    # a split-K scratch made inside a capture from the shared graph pool: its arrival counter
    # is dirty for the small graphs until the graph that zeroes it replays
    "split_k_scratch_in_graph_pool": "replay_matches_eager",
    # the speculator's draft loop captured in one graph keeps the first draft step's page count:
    # a later draft step's key lands on a page the attention never reads
    "draft_loop_stale_page_plan": "replay_matches_eager",
    # the capture's warm-ups run the forward's in-place correction of its inputs for rejected
    # drafts again and again on the live batch: the second warm-up stores over the request's
    # own context
    "capture_warmup_kv_lens_drift": "kv_writes_confined",
    # the graphs' expert dispatch never switches the shared communication buffer back to
    # low-latency mode after an eager prefill: the first replay adds its token counts onto the
    # prefill's staged rows, and experts process the wrong number of tokens
    "deepep_mode_flip_skipped": "replay_matches_eager",
    # the second recurrent group's graph reads its own block-column buffers, which only the
    # first group's metadata refreshes: it reads and writes the state at stale block columns
    "mamba_group_metadata_reused": "replay_matches_eager",
    # the split-KV planner's chunk-size search counts a padding row as no tile, the split as one:
    # a padded batch whose rows fill the fixed grid plans more tiles than it holds, and raises
    "split_kv_chunk_search_empty_rows": "replay_matches_eager",
    # the layer-wise connector's save hook runs inside the forward, so a full graph recorded it
    # once and no replay saves: a request that comes back is reloaded with what was never saved
    "layerwise_kv_save_in_full_graph": "kv_writes_confined",
    # a one-token prompt's first step replays the decode graph, which takes no encoder outputs:
    # the request's cross-attention memory is never stored
    "whisper_first_step_graphed": "replay_matches_eager",
    # the recurrent kernel's host-side sort of the state indices is cached by the buffer's address
    # and batch size: the capture after a warm-up records no sort, and every replay reads the
    # warm-up's permutation, freed since (a use-after-free on sim)
    "gdn_sorted_state_indices_cached": "replay_matches_eager",
    # the compile config's early return leaves attention inside the piecewise graphs, captured on
    # dummy batches of one-token requests and keyed by token count: a short prefill replays the
    # decode path
    "empty_splitting_ops_piecewise": "replay_matches_eager",
    # the attention kernel's scheduling metadata is planned for the batch's requests and read as
    # planned for the graph's padded count: nine to twelve requests on the graph of sixteen
    "fa3_schedule_planned_unpadded": "replay_matches_eager",
    # a padding row takes the lowest sequence slot the batch does not hold, which may be a request
    # sitting the step out: its random stream moves on, and it samples otherwise when it returns
    "padding_advances_absent_rng": "replay_matches_eager",
    # a verify graph captured right after an eager prefill records the prefill's ragged kernel,
    # which reads the plan that prefill left, at every replay
    "verify_capture_takes_prefill_fallback": "replay_matches_eager",
    # a graph's output freed after capture: the next graph's offsets, written once, land on it and
    # every replay of the first graph overwrites them
    "graph_output_weak_ref": "replay_matches_eager",
    # the graphs' block tables as wide as the warm-up prompt: a longer context does not fit
    "warmup_block_table_width": "replay_matches_eager",
    # the step that captures a graph replays it after the warm-up: the live batch's recurrent
    # state advances twice
    "capture_step_state_advanced_twice": "replay_matches_eager",
    # penalty history uploaded in batch order and read by slot: a hole in the slot grid gives a
    # request another one's history
    "penalty_history_packed_not_scattered": "replay_matches_eager",
    # the padding request of a padded speculative step has no row in the hidden-state pool: the
    # host's lookup of its row raises
    "mtp_padding_dummy_unregistered": "replay_matches_eager",
    # one pinned mask rewritten for the next step before the last step's upload of it ran
    "mm_embed_mask_single_pinned": "no_stream_races",
    # the sampler's per-step tensors taken for static inputs by their names: every replay samples
    # with the recording batch's seeds and temperatures
    "static_inputs_by_name": "replay_matches_eager",
    # the tile plan made once, by the warm-up before the capture: every replay reads its rows'
    # context only as far as the warm-up's dummy lengths planned
    "flashmla_lazy_plan_warmup": "replay_matches_eager",
    # the indexer's short-context shortcut taken at capture on dummy lengths: every verify replay
    # attends to the first k positions
    "nsa_indexer_skip_baked": "replay_matches_eager",
}
# Caught while the twins are made, before step 0: the capture at start-up is refused (the side
# stream's work outside the capture allocates; a draw from a generator the graph did not
# register), on sim as on CUDA; a warm-up of padding rows writes the cache's last slot (its
# keys, or a float8 cache's scales); two streams race in a warm-up or in a captured graph's
# branches (sim's race checker only).
AT_START_UP = {
    "shared_expert_stream_inplace",
    "dual_stream_capture_only",
    "routed_clone_not_recorded",
    "side_stream_escapes_capture",
    "generator_not_registered",
    "pad_slot_wraps_to_last",
    "fp8_kv_quant_paths",
    "int8_kv_cache",
}
# Data-parallel runners, run on two ranks (gloo on sim): the check that catches the bug, and the
# examples a campaign may take (seed 0 took 4 and 5).
RANK_RUNNERS: dict[str, str | tuple[str, ...]] = {
    "dp_local_bucket": "ranks_arrive",  # each rank pads to its own bucket
    # each rank decides graph or eager from its own batch: the ranks take different paths, or
    # their exchanges differ in size and one rank dies in it (seed 0)
    "dp_graph_mode_disagrees": ("ranks_arrive", "ranks_agree"),
}
RANK_BUDGET = 12
# The bugs no leading example is built for, and the examples a campaign may take to find each on
# sim. The figures are seeds 0-5, each campaign in a fresh process (2026-12-07, midday: draws that
# follow from the seed alone, `fuzz.hypothesis_scope`).
LATER = {
    # the padding token's activation must be the batch's largest, which the drawn token values
    # decide: 10, 10, 8, 11, 7, 10
    "dynamic_scale_over_padding": 60,
    # a padded decode batch whose valid rows' pages fill the planner's grid within fewer tiles
    # than the batch has padding rows: 14, 14, 57, 14, 23, 19
    "split_kv_chunk_search_empty_rows": 60,
    # a cascade batch whose suffix plans more splits than the heuristic's workspace: 50, 45, 81,
    # 53, 16, 22
    "shared_prefix_cascade": 150,
    # the swapped stop masks show on a greedy request of the greedy company twin within its
    # min-token window: 60, 14, 30, 16, 27, 17
    "decode_first_stop_masks": 100,
}
# On a GPU the value bugs are caught by the same check, whatever the timing. A race shows as
# whatever the late work broke there, which the timing of the moment decides: an index read
# before its upload landed faults the device, an overwritten input lands a write in the wrong
# slot or changes a value, results read before the replay wrote them differ from the unpoisoned
# twin's. So the races run in a child process (a fault ends the child, not the session) and may
# be caught by any check that judges values.
RACE_ON_CUDA = (
    "no_stream_races",
    "no_device_fault",
    "kv_writes_land",
    "kv_writes_confined",
    "replay_matches_eager",
    "padding_inert",
    "states_match",
    "sampling_independent",
    "company_independent",
    "results_stay_valid",
)


def _on_cuda(check: str | tuple[str, ...]) -> tuple[str, ...]:
    if check == "no_stream_races":
        return RACE_ON_CUDA
    return (check,) if isinstance(check, str) else check


ON_CUDA = {runner: _on_cuda(check) for runner, check in CAUGHT_BY.items()}
# An index past a table is an exception on sim and a device-side assert on a GPU.
ON_CUDA["rope_table_one_short"] = ("replay_matches_eager", "no_device_fault")
# Index copies made once hold the capture's values, which on a GPU may index past a table.
ON_CUDA["int32_view_made_once"] = ("replay_matches_eager", "no_device_fault")
# A capture CUDA refuses raises a CUDA error, which the harness takes for a device fault.
ON_CUDA["side_stream_escapes_capture"] = ("replay_matches_eager", "no_device_fault")
# A graph that reads memory freed under it reads whatever the allocator put there since: on a
# GPU an index past a table (seeds 0-2 of the evicted index faulted the device) or values that
# change what the step returns (seeds 0-2 of the rebound workspace: a sampled token).
ON_CUDA["cached_index_evicted"] = RACE_ON_CUDA
ON_CUDA["workspace_resized"] = RACE_ON_CUDA
ON_CUDA["piecewise_attention_out_fresh"] = RACE_ON_CUDA
ON_CUDA["seqlen_built_outside_capture"] = RACE_ON_CUDA
# The replaced staging goes back to the pinned allocator, which may hand it out again: the graph
# reads what was there when it was replaced, or what the allocator's next user wrote.
ON_CUDA["pinned_upload_in_capture"] = RACE_ON_CUDA
# The padding row's update of a live request's state shows in the state after the step, or
# (seed 2 on the H200) first in the padding rows' effect on what the step returns.
ON_CUDA["state_slot_padding"] = ("states_match", "padding_inert")
# A poisoned entry index past the logits is an exception on sim and a device-side assert on the
# H200 (2026-12-05, seed 0).
ON_CUDA["logit_bias_sparse_lists"] = ("replay_matches_eager", "no_device_fault")
# A split written past the workspace, and a poisoned track destination, are exceptions on sim
# and device-side asserts on a GPU.
ON_CUDA["shared_prefix_cascade"] = ("replay_matches_eager", "no_device_fault")
ON_CUDA["mamba_extra_buffer"] = ("replay_matches_eager", "states_match", "no_device_fault")
# A replay through the freed expert workspace read indices past a table there: a device-side
# assert at the second example on seeds 0-2 (the H100, 2026-12-06).
ON_CUDA["layerwise_reload_moe"] = ("replay_matches_eager", "no_device_fault")
# A padding row's stale query start covers valid tokens; the twin whose staging the harness poisoned
# reads other stale starts than the clean one, so the valid rows may differ between the twins
# first: at step 2 of the leading example whose padding rows follow a larger batch's, the host late
# (seed 0, the H100, 2026-12-06, night).
ON_CUDA["query_start_padding_stale"] = ("replay_matches_eager", "padding_inert")
# Bugs a GPU does not show within the leading examples; on cuda only their correct runners run.
# CUDA does not say which of two writes to one index lands: on the H100 (2026-12-06) the
# substitution's write won on seeds 0-2 (20 examples each), so the batch's token never replaced
# it; the sim lets the later write land, and catches it at the eighth example. (The races of
# `kv_swap_in_race` and `async_download_overwritten` were here until the leading examples held
# each stream back alone in decode steps on a graph, `first_graph_stream_sweep`; so was
# `shared_expert_stream_inplace`'s until the cuda delays held back a stream the step enters; and
# `mm_embed_mask_single_pinned`'s, one pinned mask rewritten for the next step while the step before
# still uploads it, which changes a value only where the two steps' tokens at one position fall on
# different sides of the vision range (seeds 0, 3, 4, 5 passed 12 examples on the H100, seed 0
# also 60), until the delayed pair's host write into the mask in flight became a race whatever
# the values: `no_stream_races`, cuda_races.py, at step 1 of the second leading example on seeds
# 0-5, the H100, 2026-12-07, evening.)
NOT_SHOWN_ON_CUDA = {"placeholder_substitution"}
# Races the sim reports when the twins are made, from its race checker; on a GPU only a value
# can show them, in a step (the routed experts reading the shared expert's output through the
# clone's block: `replay_matches_eager` at step 1 of the first example, seeds 0-2, on the H100).
RACES_AT_START_UP = {
    "shared_expert_stream_inplace",
    "dual_stream_capture_only",
    "routed_clone_not_recorded",
}
# The graph reads the freed input buffer, or a mask past its end: device-side asserts on the H100
# at the second and third example of seeds 0-2 (2026-12-06, late).
ON_CUDA["src_addresses_unchecked"] = ("replay_matches_eager", "no_device_fault")
ON_CUDA["verify_tree_mask_unpadded"] = ("replay_matches_eager", "no_device_fault")
# A stale padding slot past the cache is an exception on sim and a device-side assert on a GPU.
ON_CUDA["flashinfer_kv_layout"] = ("replay_matches_eager", "kv_writes_confined", "no_device_fault")
# The scratch freed under the graphs holds whatever the allocator put there since: on the H200 a
# replay's `index_copy_` read indices from it and tripped a device-side assert (2026-12-05, late).
ON_CUDA["memory_profiled_capture"] = ("replay_matches_eager", "no_device_fault")
# A poisoned window index is an exception on sim and a device-side assert on a GPU.
ON_CUDA["alternating_window_layers"] = ("replay_matches_eager", "no_device_fault")
# A poisoned window write slot past the pool is an exception on sim and a device-side assert on a
# GPU.
ON_CUDA["swa_loc_padding_stale"] = ("kv_writes_confined", "replay_matches_eager", "no_device_fault")
# The prefill batch read through the uniform decode graph's buffers: its wrong rows, or an index
# past a buffer (a device-side assert), at step 0 of the first example, seeds 0-2 (the H100,
# 2026-12-06, night).
ON_CUDA["prefill_aliases_uniform_decode"] = ("replay_matches_eager", "no_device_fault")
# The padding rows' keys in slot 0's shared block change a valid row: against the eager twin, or
# first against the twin whose padding the harness did not poison (step 0 of the second example,
# seed 0, the H100, 2026-12-07).
# The poisoned column buffer of the second group indexes past the state: an exception on sim and
# a device-side assert on a GPU.
ON_CUDA["mamba_group_metadata_reused"] = ("replay_matches_eager", "no_device_fault")
# The cached permutation freed under the graph holds whatever the allocator put there since, or
# still the warm-up's slots, which leave a request's state unwritten.
ON_CUDA["gdn_sorted_state_indices_cached"] = RACE_ON_CUDA
ON_CUDA["sibling_slot_gather"] = ("replay_matches_eager", "padding_inert")
# The overwritten offsets are indices: an exception on sim, a device-side assert on a GPU.
ON_CUDA["graph_output_weak_ref"] = ("replay_matches_eager", "no_device_fault")
LEADING = len(LEADING_EXAMPLES)  # the campaign's fixed leading examples
# vLLM's start-up profiling asserts that the GPU's free memory did not rise while it profiled,
# which another process freeing memory on the same GPU breaks: on a GPU shared by eight pytest
# workers, the correct runner failed so (2026-12-05, late); alone, on the same H200, it passed.
NEEDS_THE_GPU_ALONE = {"memory_profiled_capture"}


def _on_a_gpu(runners: Iterable[str]) -> list[object]:
    """`runners` sorted, those that need the GPU to itself marked so (`make test` runs them alone)."""
    alone = pytest.mark.graphmode_gpu_alone
    return [
        pytest.param(runner, marks=alone if runner in NEEDS_THE_GPU_ALONE else ())
        for runner in sorted(runners)
    ]


def _factory(runner: str, name: str) -> TargetFactory:
    module = importlib.import_module(f"tests.runners.from_docs.{runner}")
    return getattr(module, name)  # type: ignore[no-any-return]


def _budget(runner: str) -> int:
    """The examples a campaign may take to find `runner`'s bug."""
    return LATER.get(runner, LEADING)


def _passes(runner: str, backend: str) -> None:
    factory = _factory(runner, "make_target")
    stats = run_campaign(factory, backend=backend, max_examples=2 * LEADING, max_steps=8, seed=0)
    assert stats.failures == []
    # it replays graphs, whole or in pieces: the campaign tested graph mode
    assert stats.paths["full"] + stats.paths["piecewise"] > 0


@pytest.mark.parametrize("runner", sorted(CAUGHT_BY))
def test_the_correct_runner_passes_the_harness_on_sim(runner: str) -> None:
    _passes(runner, "sim")


@pytest.mark.parametrize("runner", sorted(CAUGHT_BY))
def test_the_bug_is_caught_on_sim_within_the_leading_examples_or_its_budget(runner: str) -> None:
    failure = failure_of(_factory(runner, "make_buggy_target"), "sim", examples=_budget(runner))
    assert_caught(failure, CAUGHT_BY[runner], at_start_up=runner in AT_START_UP)


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("runner", _on_a_gpu(ON_CUDA))
def test_the_correct_runner_passes_the_harness_on_a_gpu(runner: str) -> None:
    _need_a_gpu(runner)
    _passes(runner, "cuda")


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("runner", _on_a_gpu(set(ON_CUDA) - NOT_SHOWN_ON_CUDA))
def test_the_bug_is_caught_on_a_gpu_within_the_leading_examples_or_its_budget(runner: str) -> None:
    _need_a_gpu(runner)
    factory = _factory(runner, "make_buggy_target")
    with pytest.raises(GraphmodeFailure) as caught:
        run_isolated(
            factory,
            backend="cuda",
            max_examples=_budget(runner),
            max_steps=8,
            seed=0,
            shrink_seconds=0,
        )
    at_start_up = runner in AT_START_UP - RACES_AT_START_UP
    assert_caught(caught.value.failure, ON_CUDA[runner], at_start_up=at_start_up)


def _need_a_gpu(runner: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("runner", sorted(RANK_RUNNERS))
def test_the_correct_rank_runner_passes_two_ranks_on_sim(runner: str) -> None:
    stats = run_rank_campaign(
        _factory(runner, "make_target"), ranks=2, max_examples=LEADING, max_steps=8, seed=0
    )
    assert stats.failures == []
    assert stats.checks_run["ranks_agree"] == stats.steps > 0
    assert stats.paths["piecewise"] > 0  # it replays graphs on every rank


@pytest.mark.parametrize("runner", sorted(RANK_RUNNERS))
def test_the_rank_bug_is_caught_on_sim_within_its_budget(runner: str) -> None:
    with pytest.raises(GraphmodeFailure) as caught:
        run_rank_campaign(
            _factory(runner, "make_buggy_target"),
            ranks=2,
            max_examples=RANK_BUDGET,
            max_steps=8,
            seed=0,
            shrink_seconds=0,
        )
    assert_caught(caught.value.failure, RANK_RUNNERS[runner], at_start_up=False)
