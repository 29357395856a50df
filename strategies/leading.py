"""The leading examples: fixed schedules a campaign runs before it draws any (docs/contract.md,
"Pipelined pairs"), each the shortest way to a bug that drawn schedules reach only by luck: the
simplest pipelined pairs, a phase change, a partially filled bucket, a departure from the front of
a batch, a stale tail, a graph handed from request to request, stream sweeps, tokens past the
largest graph, a capture on long contexts, and returns after a preemption and after padded steps.
Each makes an empty list where the spec cannot hold it; `LEADING_EXAMPLES` is their order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pytest_graphmode.contract import TargetSpec
from pytest_graphmode.strategies.plans import Arrival, StepPlan, Stress
from pytest_graphmode.strategies.schedules import (
    DELAY_CYCLES,
    HELD_STREAMS,
    MAX_SPEC_K,
    PAIR_LATE,
    TEMPERATURES,
    adapter_ids,
    context_capacity,
)

MAX_LEADING_STEPS = 12  # a fixed leading example longer than this is left out
# A step whose asynchronous copies between host and device land, on cuda, before its host code
# goes on.
_HOST_LATE = Stress(delay_cycles=DELAY_CYCLES, late="host")


def first_pair(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule whose pipelined pairs run an eager step then a graph step, and two
    decode steps: a request is admitted with a two-token prompt (one token without the "prefill"
    feature) and prefilled, its first decode step submitted before the prefill is read; then two
    more decode steps the same way, twice. A campaign runs it as its first example: Hypothesis's
    own first example is its simplest draw, a single step, and a race between two steps (an event
    not waited for, a staging buffer rewritten while the step before still reads it) needs two
    steps that both run on the device, the one before mostly eager (a prefill: most runners graph
    decode steps only) or a graph replay.

    It is not what `schedules` draws first because shrinking moves towards the simplest draw: were
    a pair the simplest, every shrunk schedule would keep one, and a bug of one step would be
    reported with three.

    The pairs are delayed (on cuda, `stress.delay_cycles`; nothing changes on sim), so that on the
    GPU the first step is still in flight when the second is prepared, as the race needs: in the
    first two pairs its copies and event records land late (a replay that does not wait for its
    upload reads the inputs before they land, a host that rewrites pinned staging too early
    changes what is still to be copied: after an eager step too, where a runner orders the
    staging of its eager steps otherwise than its replays'), in the last its computation does,
    eager kernels and graph replays (an upload that does not wait for the work before it
    overwrites the inputs that work is still to read)."""
    single = StepPlan(kind="decode", rows=1)
    pairs = [
        dataclasses.replace(
            single, stress=Stress(pipelined=True, delay_cycles=DELAY_CYCLES, late=late)
        )
        for late in PAIR_LATE
    ]
    prompt = 2 if "prefill" in spec.features else 1
    opening = StepPlan(kind="prefill", rows=1, arrivals=(Arrival(prompt_len=prompt),))
    return [opening, pairs[0], single, pairs[0], single, pairs[1]]


def first_phase_change(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph replay is still in flight when an eager step
    starts, a graph captured before a weight update replays after it, and a graph captured on a
    short context replays on the longest. A campaign runs it as its second example, after
    `first_pair`, on the same twins.

    A request with a one-token prompt is admitted and decoded. The next step admits a second
    request, whose prompt leaves room for two tokens below the per-request block limit, and
    prefills it, pipelined with that decode (and delayed, as `first_pair` is): a runner that runs
    prefills on a stream of its own, or rewrites a buffer the replay still reads, races there.
    Where the step's token budget does not take the prompt whole, the steps after the pair
    prefill the rest beside the first request's decode (with the prompt shortened where that
    would take the schedule past `MAX_LEADING_STEPS`). Then the weights change (where the spec
    updates weights; delayed too, so that on cuda a loader racing its own pinned staging loads
    other weights into the graph twin) and the first request decodes alone, on the graph
    captured before the change; the two decode together; the long request decodes alone, on the
    graph the short one was captured with; and (where the spec has speculative decoding) the
    short one decodes a draft token, a step with the request count of one graph and the token
    count of another. A random schedule holds these rarely: half of them switch weight updates
    off, a quarter switch pipelined pairs off, most pairs join two steps of the same phase, and
    most prompts are short."""
    capacity = context_capacity(spec)
    whole = spec.max_num_tokens
    chunk = _prefill_chunk(spec)
    # Where the budget does not take the prompt whole, the rest is prefilled in the steps after
    # the pair, beside the first request's decode (a request absent from a step is a finished one
    # to some runners); at most as many steps as keep the schedule within MAX_LEADING_STEPS, the
    # prompt shortened to what they hold.
    beside = spec.max_num_reqs >= 2 and whole >= 2
    per_step = min(chunk, whole - 1) if beside else chunk
    most = MAX_LEADING_STEPS - 7  # the schedule's seven other steps, the speculative one included
    prompt = min(max(1, capacity - 2), chunk + most * per_step)
    rest = -(-(prompt - min(prompt, chunk)) // per_step)
    long_prompt = Arrival(
        prompt_len=prompt,
        seed=1 if "sampling" in spec.features else None,
        temperature=0.5,
    )
    # Delayed (on cuda): a weight loader whose copies out of pinned staging race its own host
    # writes then loads other weights into the graph twin than into the references.
    update = (
        Stress(weight_seed=1, delay_cycles=DELAY_CYCLES)
        if "weight_update" in spec.features
        else Stress()
    )
    pair = Stress(pipelined=True, delay_cycles=DELAY_CYCLES)
    # Two tokens of one request: as many requests as the last graph of one-token rows, as many
    # tokens as the two-request one, so a key without the query length replays one of them.
    speculative = (
        [StepPlan(kind="spec", rows=1, spec_k=1, accepted=1)]
        if "spec_decode" in spec.features
        else []
    )
    return [
        StepPlan(kind="decode", rows=1),
        StepPlan(kind="decode", rows=1),
        StepPlan(kind="prefill", rows=1, arrivals=(long_prompt,), chunk=chunk, stress=pair),
        *[StepPlan(kind="mixed" if beside else "prefill", rows=2, chunk=chunk)] * rest,
        StepPlan(kind="decode", rows=1, stress=update),
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="decode", rows=1, rotate=1),
        *speculative,
    ]


def _prefill_chunk(spec: TargetSpec) -> int:
    """The most prompt tokens one step of a leading example prefills: the step's token budget, or
    one without the "prefill" feature (the scheduler feeds such prompts a token a step)."""
    return spec.max_num_tokens if "prefill" in spec.features else 1


def first_partial_bucket(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph captured with a padding row replays a full batch,
    and then a batch with a padding row again. A campaign runs it as its third example, after
    `first_phase_change`, on the same twins.

    With n = min(4, the most requests a step may hold): n - 1 requests with one-token prompts are
    admitted and decode together (a graph of n rows captured for n - 1 of them, with captured sizes
    1, 2, 4, ...); the n-th request is admitted (sampled, where the spec samples) and the n decode
    together, on that graph; then n - 1 of them again, rows rotated, in two steps. A value the
    runner read on the host at capture (the rows a kernel appends to the cache, whether any row
    samples) replays for the full batch as it was for the partial one, and a padding row the
    runner does not reset keeps the full batch's last row. The second of the two steps continues
    the first (the same requests in the same rows, a token further): a runner that advances a
    continuing batch's inputs on the device instead of preparing them on the host (multi-step
    decoding, a step that overlaps the next one's preparation) advances the padding row too,
    from the full batch's stale row, only there. A random schedule seldom grows a batch within one
    captured size, with the batch it was captured for as its first, and seldom continues a batch
    that shrank within one.

    Where a step may hold more requests than the largest captured size, more one-token requests
    then join and all of them decode together, one request past that size: a batch that no
    captured graph fits, which a runner that clamps its lookup to the largest graph replays on
    it (rows past it neither computed nor written to the cache). A random schedule reaches it
    only once enough requests live at once, which drawn schedules seldom hold in a campaign's
    first hundred examples. Empty where a step holds one request."""
    n = min(4, spec.max_num_reqs)
    if n < 2:
        return []
    sampled = Arrival(prompt_len=1, seed=2 if "sampling" in spec.features else None)
    return [
        StepPlan(kind="prefill", rows=n - 1, arrivals=(Arrival(prompt_len=1),) * (n - 1)),
        StepPlan(kind="decode", rows=n - 1),
        StepPlan(kind="prefill", rows=1, arrivals=(sampled,)),
        StepPlan(kind="decode", rows=n),
        StepPlan(kind="decode", rows=n - 1, rotate=1),
        StepPlan(kind="decode", rows=n - 1, rotate=1),
        *_past_the_largest_graph(spec, live=n),
    ]


def first_front_departure(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a request leaves the batch's first row while the requests
    admitted after it stay, and one of those then starts a new block and samples. A campaign runs
    it as its fourth example, after `first_partial_bucket`, on the same twins.

    Three requests are admitted in turn: A, greedy, two blocks long (a prompt one token past the
    first block); B, greedy, one token; C, two slots short of one block (sampled at temperature 2
    where the spec samples, and with an adapter where the spec has them). The step that prefills
    B and C decodes A too (A absent from a step would be a finished request to a runner whose
    scheduler sends only what changed), and so does every step that has to go on with C's
    prefill within the token budget. Then all three decode; then A finishes and B and C decode,
    C in its first block's last slot; then B and C decode again, and C's token starts its second
    block. A runner that closes the hole A left by moving C into A's row (or by shifting B and C
    down) must move every per-row value with it: a block count left as A's puts C's new block in
    the wrong column of the block table (`kv_writes_land`); a greedy flag, seed or temperature
    left as A's samples C's token otherwise than the company twin, which runs C without A
    (`sampling_independent`: A is greedy so that it is not in that twin's batch, where the same
    move would leave C the same wrong values). A random schedule seldom holds this with blocks
    longer than a few slots: a request that survives a departure must then start a new block,
    which a decode step of 16-slot blocks does once in 16 steps. Empty where a step
    holds fewer than three requests, a request fewer than two blocks, or the cache fewer than the
    five blocks the schedule holds at once, and where the prompts would take more than
    `MAX_LEADING_STEPS` steps (long blocks without the "prefill" feature: one token a step)."""
    size, budget = spec.block_size, spec.max_num_tokens
    fits = (
        size >= 2
        and spec.max_num_reqs >= 3
        and min(spec.max_blocks_per_req, spec.num_blocks - 1) >= 2
        and spec.num_blocks - 1 >= 5
    )
    if not fits:
        return []
    first = Arrival(prompt_len=size + 1)
    # C's prompt ends two slots short of its block's end, so that its token starts the next block
    # in the second step after A left, not in the step A leaves (with 2-slot blocks, one short:
    # the three then decode together only in the mixed step).
    together = [StepPlan(kind="decode", rows=3)] if size >= 3 else []
    later = Arrival(
        prompt_len=size - 1 - len(together),
        seed=4 if "sampling" in spec.features else None,
        temperature=2.0,
        adapter=1 if "adapters" in spec.features else 0,
    )
    # A's prefill alone, then C's beside A's and B's one token each, in as many steps as the
    # budget takes (one token a step without the "prefill" feature).
    chunk = _prefill_chunk(spec)
    prefill_a = -(-first.prompt_len // chunk)
    prefill_c = -(-later.prompt_len // min(chunk, budget - 2))
    plans = [
        StepPlan(kind="prefill", rows=1, arrivals=(first,), chunk=chunk),
        *[StepPlan(kind="prefill", rows=1, chunk=chunk)] * (prefill_a - 1),
        StepPlan(kind="mixed", rows=3, arrivals=(Arrival(prompt_len=1), later), chunk=chunk),
        *[StepPlan(kind="mixed", rows=3, chunk=chunk)] * (prefill_c - 1),
        *together,
        StepPlan(kind="decode", rows=2, finish=(0,)),
        StepPlan(kind="decode", rows=2),
    ]
    return plans if len(plans) <= MAX_LEADING_STEPS else []


def first_stale_tail(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a batch shrinks within one captured graph while its queries
    grow: the padding rows of a speculative step follow a larger decode batch on the same graph.
    A campaign runs it as its fifth example, after `first_front_departure`, on the same twins.

    c one-token requests are admitted and decode together on the graph of c rows, c the smallest
    capture size whose bucket also serves c - 2 requests (two padding rows; one where no capture
    size leaves two). Then the last two finish and the other c - 2 run a speculative step, each
    with the most draft tokens (up to 3) that keep c rows of them within the token budget, padded
    to the same c rows (fewer drafts where the step's tokens would fill a capture size exactly,
    so that a graph keyed by token count is padded too: `_stale_tail_drafts`). Every per-row value staged for a padding row (where its queries start and
    end, its sequence length, its block-table row) is then whatever the decode step left there,
    unless the runner rewrites it: where queries start, for one, a decode step leaves one token
    a row apart, so a stale padding row's query range reaches back into the valid requests' tokens.
    A value the runner stages once and uploads whole (a pinned host buffer, say) cannot be
    poisoned by the harness, so only a schedule shows it; a random one holds a larger batch then a
    padded speculative one on the same graph seldom, since row counts change at most steps.
    Without speculative decoding the last step decodes one token a row.

    The speculative step accepts about half of its drafts (none of one), and the same rows then
    decode one token each: each row's position and slot move back from where the drafts reached
    to where the accepted ones end. A runner that carries positions from step to step (advancing
    them on the device where a batch seems to continue the last, or rolling back only when every
    draft is rejected) writes that token's KV at the wrong slot. A random schedule seldom
    follows a partly rejected speculative step with a decode of exactly its rows.

    The steps after the prefill make the host late on cuda (`Stress.late="host"`): every
    asynchronous copy between host and device has landed before the runner's host code goes on.
    A runner that writes its padding rows into pinned staging after queueing their upload then
    uploads what the step before left there, as a runner that never rewrites them does; undelayed,
    its host write mostly wins the race, and the bug shows by chance. Nothing changes on sim,
    whose race check sees such a write whichever order it lands in.
    Empty where no capture size leaves a padding row, or a step or the cache cannot hold the c
    requests."""
    rows = _shrunk_rows(spec)
    if rows is None:
        return []
    c, live = rows
    drafts = _stale_tail_drafts(spec, c, live) if "spec_decode" in spec.features else 0
    positions = 3 + drafts  # a one-token prompt, its first token, a decode step's, the drafts
    fits = (
        positions <= context_capacity(spec)
        and c * _blocks(spec, 2) <= spec.num_blocks - 1
        and live * _blocks(spec, positions) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    gone = (-1,) * (c - live)  # the last request, then the new last one
    if not drafts:
        return [
            StepPlan(kind="prefill", rows=c, arrivals=(Arrival(prompt_len=1),) * c),
            StepPlan(kind="decode", rows=c, stress=_HOST_LATE),
            StepPlan(kind="decode", rows=live, finish=gone, stress=_HOST_LATE),
        ]
    # Fewer positions than the drafts reached: a rejected draft's are taken again by the decode.
    return [
        StepPlan(kind="prefill", rows=c, arrivals=(Arrival(prompt_len=1),) * c),
        StepPlan(kind="decode", rows=c, stress=_HOST_LATE),
        StepPlan(
            kind="spec",
            rows=live,
            spec_k=drafts,
            accepted=drafts // 2,
            finish=gone,
            stress=_HOST_LATE,
        ),
        StepPlan(kind="decode", rows=live, stress=_HOST_LATE),
    ]


def first_handover(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which one graph serves requests with other per-request values in
    turn. A campaign runs it as its sixth example, after `first_stale_tail`, on the same twins.

    Three requests with one-token prompts take turns: each is admitted (the one before it
    finishing in the same step), then decodes alone. A samples at the lowest temperature drawn,
    on the first adapter; B samples at the highest, on the last adapter the spec declares; C is
    greedy, on the first adapter again (sampling and adapters where the spec has them). Their
    decode steps have one request each and, where the spec has adapters, each on one, so they
    run on one graph even where a runner keys its graphs by whether a batch uses adapters.
    Whatever the runner read from the batch on the host when it captured that graph (a
    temperature, a seed, whether a row samples, which adapter's weights to apply when the batch
    has only one) replays for B and C as it was. A random schedule seldom runs such a handover:
    per-request values are drawn per arrival, most decode steps hold several requests, and two
    requests alone on one graph in turn with different values need a departure and an admission
    between them.

    Then D, a one-token prompt, joins C listed before it: a batch of one-token rows whose new
    request comes first. A runner that orders its rows its own way (requests that continue a
    sequence first, as engines that reorder a batch for their kernels do) must give the results
    back in the batch's order; schedules list new requests last unless a step rotates its rows.

    Last (where the spec prefills), two prefill steps of the same padded token count c (the
    smallest even capture size of at least 4 a step may fill): c / 2 two-token prompts, then one
    prompt of c tokens. A graph captured for the first (its longest query 2, read on the host to size
    attention's query window, as varlen attention metadata's `max_query_len` is) replays the
    second as it was. Empty where the cache cannot hold one request's two positions."""
    if _blocks(spec, 2) > min(spec.max_blocks_per_req, spec.num_blocks - 1):
        return []
    seeds = (6, 7) if "sampling" in spec.features else (None, None)
    ids = adapter_ids(spec) if "adapters" in spec.features else (0,)
    first, last = ids[min(1, len(ids) - 1)], ids[-1]
    coldest, hottest = min(TEMPERATURES), max(TEMPERATURES)
    turns = (
        Arrival(prompt_len=1, seed=seeds[0], temperature=coldest, adapter=first),
        Arrival(prompt_len=1, seed=seeds[1], temperature=hottest, adapter=last),
        Arrival(prompt_len=1, temperature=coldest, adapter=first),
    )
    plans = []
    for turn, arrival in enumerate(turns):
        gone = (0,) if turn else ()  # the request before it, the only one live
        plans += [
            StepPlan(kind="prefill", rows=1, arrivals=(arrival,), finish=gone),
            StepPlan(kind="decode", rows=1),
        ]
    # C, then D admitted after it: rotated by one, D's row comes first.
    if spec.max_num_reqs >= 2:
        plans.append(StepPlan(kind="mixed", rows=2, arrivals=(Arrival(prompt_len=1),), rotate=1))
    return plans + _short_then_long_queries(spec, live=min(2, spec.max_num_reqs))


def first_stream_sweep(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which each of a step's first streams runs late alone. A campaign
    runs it as its seventh example, after `first_handover`, on the same twins.

    A request A (sampled where the spec samples, so its tokens differ from step to step) is
    admitted and prefilled; then, in each of three mixed steps, A decodes while a new request is
    admitted and prefilled (a two-token prompt; one token without the "prefill" feature), the
    newcomer of the step before finishing. A step that holds a decode row beside a prefill is
    where a runner that replays graphs for one-token rows and runs the rest eagerly uses the most
    streams: an upload stream, the compute stream, an output stream for the sampled tokens. The
    three mixed steps are delayed on cuda holding back only the step's stream 0, 1 and 2 in turn
    (`Stress.held_stream`; nothing changes on sim): a race between two streams, such as a
    download the host reads after waiting for another stream, shows only while the stream of its
    late side is held back alone. Random schedules draw the held stream per delayed step, and a
    mixed step delayed with the right one in about one in thirty. Empty where a step cannot hold
    two requests or the cache A's five positions beside a newcomer."""
    held = [k for k in HELD_STREAMS if k is not None]
    fits = (
        spec.max_num_reqs >= 2
        and spec.max_num_tokens >= 3
        and 2 + len(held) <= context_capacity(spec)
        and _blocks(spec, 2 + len(held)) + 2 * _blocks(spec, 2) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    first = Arrival(prompt_len=1, seed=8 if "sampling" in spec.features else None)
    prompt = 2 if "prefill" in spec.features else 1
    plans = [StepPlan(kind="prefill", rows=1, arrivals=(first,))]
    for turn, stream in enumerate(held):
        plans.append(
            StepPlan(
                kind="mixed",
                rows=2,
                arrivals=(Arrival(prompt_len=prompt),),
                finish=(1,) if turn else (),
                stress=_held_alone(stream),
            )
        )
    return plans


def first_graph_stream_sweep(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which each of a step's first streams runs late alone in decode
    steps on a graph: a request back from sitting out a step, then more requests than the largest
    graph. A campaign runs it as its tenth example, after `first_capture_on_long_contexts`, on the
    same twins.

    `first_stream_sweep` holds streams back in mixed steps, which most graph runners run eagerly
    or piecewise; a runner's decode replays have streams of their own around them. Two requests,
    A (sampled where the spec samples) and B, are admitted; then, three times, one of them decodes
    alone while the other sits the step out, and the two decode together on a graph, delayed on
    cuda with the step's stream 0, 1 and 2 held back alone in turn. The request back from sitting
    out is where a runner that reloads or restores what a request holds between its steps (KV
    blocks swapped out to host memory, a recurrent state, per-request buffers) does that work: a
    reload on a copy stream that the replay does not wait for lands late and overwrites what the
    replay wrote. Its contexts then (2, 3 and 5 positions with a two-token prompt) are not a
    multiple of 4, so its last block is partial and the step's token lands in a reloaded block.
    Then requests join until there is one more than the largest graph holds, and all of them
    decode three times, holding back stream 0, 1 and 2 in turn: a runner that replays one graph
    more than once per step (micro-batches) overlaps one replay's download or upload with the
    next replay there. A random schedule holds one given stream back alone in a step in about one
    step in sixteen, in the half of its examples whose swarm leaves delays on, and seldom holds a
    return step or a step past the largest graph so. The second half is left out where a step or
    the cache cannot hold that many requests; the whole is empty where a step cannot hold two
    requests or the cache their six positions each."""
    held = [k for k in HELD_STREAMS if k is not None]
    prompt = 2 if "prefill" in spec.features else 1
    positions = 2 * len(held)  # what A and B hold after their turns, at most
    returns_fit = (
        min(spec.max_num_reqs, spec.max_num_tokens) >= 2
        and spec.max_num_tokens >= 1 + prompt
        and positions <= context_capacity(spec)
        and 2 * _blocks(spec, positions) <= spec.num_blocks - 1
    )
    if not returns_fit:
        return []
    seed = 10 if "sampling" in spec.features else None
    plans = [StepPlan(kind="prefill", rows=2, arrivals=(Arrival(1, seed=seed), Arrival(prompt)))]
    for turn, stream in enumerate(held):
        # rotated by the turn, A and B take turns sitting out; the one who sat out comes back
        alone = StepPlan(kind="decode", rows=1, rotate=turn % 2)
        together = StepPlan(kind="decode", rows=2, stress=_held_alone(stream))
        plans += [alone, together]
    return plans + _past_the_largest_graph_held(spec, held, live_positions=positions)


def _held_alone(stream: int) -> Stress:
    """A step delayed on cuda with only its `stream`-th stream held back."""
    return Stress(delay_cycles=DELAY_CYCLES, held_stream=stream)


def _past_the_largest_graph_held(
    spec: TargetSpec, held: list[int], live_positions: int
) -> list[StepPlan]:
    """Two live requests of up to `live_positions` positions are joined by one-token prompts
    until there is one more than the largest captured size, and all decode once for each stream
    in `held`, holding it back alone; empty where a step, a request or the cache cannot hold
    them."""
    past = max(spec.capture_sizes, default=0) + 1
    longest = live_positions + len(held)
    joining = past - 2
    fits = (
        spec.capture_sizes
        and 2 < past <= min(spec.max_num_reqs, spec.max_num_tokens)
        and longest <= context_capacity(spec)
        and 2 * _blocks(spec, longest) + joining * _blocks(spec, 1 + len(held))
        <= spec.num_blocks - 1
    )
    if not fits:
        return []
    join = StepPlan(kind="prefill", rows=joining, arrivals=(Arrival(prompt_len=1),) * joining)
    return [join, *(StepPlan(kind="decode", rows=past, stress=_held_alone(k)) for k in held)]


def first_tokens_past_the_largest_graph(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule whose speculative step has the request count of a captured graph
    and more tokens than the largest one. A campaign runs it as its eighth example, after
    `first_stream_sweep`, on the same twins.

    R one-token requests are admitted and decode once, then run a speculative step with k draft
    tokens each, all accepted, and decode once more: k the fewest drafts (up to `MAX_SPEC_K`)
    for which R = largest capture size // (1 + k) + 1 requests fit a step, so that R * (1 + k)
    tokens are just past the largest capture size while R requests are as few as that allows. A
    runner that decides whether a batch fits a graph by its request count alone (and not by its
    tokens) replays the largest graph with the tokens past it cut off. A random schedule seldom
    holds it: the draft count is drawn apart from the row count, and most speculative steps hold a
    few rows.

    Then, where the cache holds k more positions a request, the same R requests run one more
    speculative step listed from the second admitted on, proposing k - 1 draft tokens down to
    none and then k again (`StepPlan.uneven`), none accepted: rows whose draft counts differ, in
    another order than the runner's rows may be. A runner that splits the step's flat logits into
    requests by counts taken in one order while its rows are laid out in another reads a
    neighbour's logits (vLLM PR 14645), which the twins share and only other company shows; a
    random schedule draws such a step seldom: half of its speculative steps are even, and most
    uneven ones hold one request or list their requests in the order the runner holds them.
    Empty without speculative decoding, where no such R and k fit a step's token budget and
    request limit, or where the cache cannot hold the R requests."""
    if "spec_decode" not in spec.features or not spec.capture_sizes:
        return []
    largest = spec.capture_sizes[-1]
    for drafts in range(1, MAX_SPEC_K + 1):
        rows = largest // (1 + drafts) + 1
        positions = 3 + drafts  # the prompt, the first decode, the drafts, the last decode
        fits = (
            rows <= spec.max_num_reqs
            and rows * (1 + drafts) <= spec.max_num_tokens
            and positions <= context_capacity(spec)
            and rows * _blocks(spec, positions) <= spec.num_blocks - 1
        )
        if fits:
            plans = [
                StepPlan(kind="prefill", rows=rows, arrivals=(Arrival(prompt_len=1),) * rows),
                StepPlan(kind="decode", rows=rows),
                StepPlan(kind="spec", rows=rows, spec_k=drafts, accepted=drafts),
                StepPlan(kind="decode", rows=rows),
            ]
            if (
                positions + drafts <= context_capacity(spec)
                and rows * _blocks(spec, positions + drafts) <= spec.num_blocks - 1
            ):
                # listed from the second admitted on; drafts - 1 down to none, then drafts again
                uneven = StepPlan(kind="spec", rows=rows, spec_k=drafts, rotate=1, uneven=True)
                plans.append(uneven)
            return plans
    return []


def first_capture_on_long_contexts(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph first captured for rows that are all long replays a
    batch with a short row. A campaign runs it as its ninth example, after
    `first_tokens_past_the_largest_graph` (its eighth where that one is left out), on fresh twins
    made for it wherever it falls (kept twins are also made again every `kept_twins.FRESH_EVERY`
    examples), so a runner that captures a graph the first time a batch needs it captures its
    graph of two rows here.

    Two requests with prompts four positions short of the per-request limit are admitted and
    prefilled together (half the step's token budget each, in as many steps as that takes), then
    decode together: the graph of two rows meets two long contexts first. Then the first one
    finishes and a one-token prompt is admitted beside the second one's decode, and the two decode
    together on that graph. A value the runner derived on the host from the capture batch as a
    lower bound (the first block a sliding window reads, the fewest blocks any row holds, a split
    of the context by its longest row that leaves the shortest one empty) replays for the short
    row as it was for the long ones. A random schedule holds this rarely: fresh twins' first graph
    steps mostly follow a crowd of short prompts, and `first_phase_change` captures on a short
    context before it replays the longest. Empty without the "prefill" feature (one token a step
    could not reach a long context within `MAX_LEADING_STEPS`), where a step holds fewer than two
    requests or tokens, or where the cache cannot hold the three requests.

    Where the spec samples, the two long requests sample (one at the lowest temperature, one at
    the highest) and the newcomer is greedy: the graph is captured on a batch with no greedy row,
    which a random schedule seldom captures on (half of its requests are greedy), and then
    replays a greedy one. A choice the runner made on the host from the capture batch's sampling
    (that every row samples, so the greedy branch can go, as an `all_random` flag says) replays
    for the greedy row as it was; `first_handover` shows the graph of one row the same.

    Where the spec has speculative decoding, the two long requests run one speculative step
    between their prompts and their first decode, proposing one draft each, none accepted: the
    first decode captures its graph on rows whose last step rejected a draft. A runner whose
    forward corrects its own inputs in place for the drafts the last step rejected (an overlap
    scheduler prepares a request as if every draft was accepted) and captures on the live batch
    after warm-up runs on the same inputs applies the correction once per run (TensorRT-LLM PR
    7373); a random schedule seldom captures right after a rejection (twins are fresh every
    eighth example, and most first captures follow a crowd of short prompts). The last decode
    then writes the per-request limit's last position."""
    room = 4  # positions after the prompt: the decodes (one short of the limit, or at it)
    budget = spec.max_num_tokens // 2
    if "prefill" not in spec.features or spec.max_num_reqs < 2 or budget < 1:
        return []
    # one draft a row, rejected: the first decode's capture follows a rejection
    rejected = [StepPlan(kind="spec", rows=2, spec_k=1)] if "spec_decode" in spec.features else []
    prefill_steps = MAX_LEADING_STEPS - 3 - len(rejected)
    prompt = min(context_capacity(spec) - room, prefill_steps * budget)
    if prompt < 2 or 2 * _blocks(spec, prompt + room) + 1 > spec.num_blocks - 1:
        return []
    # Sampled where the spec samples, at the two ends of the temperatures, and the newcomer
    # greedy: the graph of two rows is captured on rows that all sample, then replays a greedy one.
    sampled = "sampling" in spec.features
    long = [
        Arrival(prompt_len=prompt, seed=seed if sampled else None, temperature=temperature)
        for seed, temperature in ((8, min(TEMPERATURES)), (9, max(TEMPERATURES)))
    ]
    return [
        StepPlan(kind="prefill", rows=2, arrivals=tuple(long), chunk=budget),
        *[StepPlan(kind="prefill", rows=2, chunk=budget)] * (-(-prompt // budget) - 1),
        *rejected,
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="mixed", rows=2, finish=(0,), arrivals=(Arrival(prompt_len=1),)),
        StepPlan(kind="decode", rows=2),
    ]


def first_return_after_preemption(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a preempted request comes back and decodes on a graph. A
    campaign runs it as its eleventh example, after `first_graph_stream_sweep`, on the same
    twins.

    Two requests with one-token prompts, A (sampled where the spec samples) and B, are admitted
    and decode twice on a graph. Then A is preempted: B decodes beside C, a new one-token prompt
    that takes the blocks A freed. Then A comes back with `context_len` 0 and computes its four
    tokens again (one prefill chunk, or one token a step without the "prefill" feature) while B
    and C decode, and the three decode twice more on a graph. Whatever a runner keeps per request
    or per row and clears only when a request is new to it (counts of the tokens it produced for
    a repetition penalty, a speculative or recurrent state, a row's sampling values), or keeps
    from A's first life in a table or buffer (A's old block table row, now C's blocks), meets A's
    second life here. A random schedule preempts seldom, and more seldom still in a step
    followed by replays of the same requests. Empty where a step cannot hold three requests or
    the cache cannot hold them."""
    positions = 4  # A's prompt and the three tokens of its first life: what it computes again
    recompute = 1 if "prefill" in spec.features else positions
    longest = positions + recompute + 2  # B's positions by the last step, the longest
    fits = (
        min(spec.max_num_reqs, spec.max_num_tokens) >= 3
        and longest <= context_capacity(spec)
        and 3 * _blocks(spec, longest) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    seed = 9 if "sampling" in spec.features else None
    a_and_b = (Arrival(prompt_len=1, seed=seed), Arrival(prompt_len=1))
    plans = [
        StepPlan(kind="prefill", rows=2, arrivals=a_and_b),
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="decode", rows=2),
        # A preempted; rotated by one, B and the newcomer C run, A (first in the list) waits.
        StepPlan(kind="mixed", rows=2, preempt=(0,), arrivals=(Arrival(prompt_len=1),), rotate=1),
    ]
    plans += [StepPlan(kind="mixed", rows=3, chunk=positions)] * recompute
    return plans + [StepPlan(kind="decode", rows=3)] * 2


def first_return_after_padded_steps(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a request that sat out padded replays comes back and
    samples. A campaign runs it as its twelfth example, after `first_return_after_preemption`, on
    the same twins.

    With r the fewest requests a graph pads (the smallest count of two or more that is no capture
    size but below the largest): A (sampled where the spec samples, at the highest temperature,
    admitted first) and r others with one-token prompts are admitted and decode together; then
    the r others decode twice without A, padded, A first in the list and left out; then A comes
    back, continuing where it was, and all decode twice more. A padding row given an absent
    request's place (the lowest sequence slot the batch does not hold, the first row the step
    leaves free) moves what the runner keeps there for A: the offset of A's random stream, its
    produced-token counts, its state. A random schedule leaves the first request out of a padded
    decode step and brings it back seldom: requests admitted first finish first. Empty where no
    count is padded, or a step or the cache cannot hold the r + 1 requests."""
    largest = max(spec.capture_sizes, default=0)
    r = next((n for n in range(2, largest) if n not in spec.capture_sizes), None)
    longest = 6  # A's prompt and its decodes; the others' are one fewer
    fits = (
        r is not None
        and r + 1 <= min(spec.max_num_reqs, spec.max_num_tokens)
        and longest <= context_capacity(spec)
        and (r + 1) * _blocks(spec, longest) <= spec.num_blocks - 1
    )
    if r is None or not fits:
        return []
    seed = 11 if "sampling" in spec.features else None
    first = Arrival(prompt_len=1, seed=seed, temperature=max(TEMPERATURES))
    return [
        StepPlan(kind="prefill", rows=r + 1, arrivals=(first, *[Arrival(prompt_len=1)] * r)),
        StepPlan(kind="decode", rows=r + 1),
        # rotated by one, A (first in the list) is the one left out
        *[StepPlan(kind="decode", rows=r, rotate=1)] * 2,
        *[StepPlan(kind="decode", rows=r + 1)] * 2,
    ]


def _short_then_long_queries(spec: TargetSpec, live: int) -> list[StepPlan]:
    """Two prefill steps padded to one capture size c: c / 2 two-token prompts, then one prompt
    of c tokens (`first_handover`), beside `live` requests of three positions at most; empty
    where no such c fits a step, a request or the cache."""
    if "prefill" not in spec.features:
        return []
    most = min(spec.max_num_tokens, context_capacity(spec))
    c = next(
        (
            s
            for s in spec.capture_sizes
            if 4 <= s <= most and s % 2 == 0 and s // 2 <= spec.max_num_reqs
        ),
        None,
    )
    if c is None:
        return []
    held = live * _blocks(spec, 3) + c // 2 * _blocks(spec, 2) + _blocks(spec, c)
    if held > spec.num_blocks - 1:
        return []
    short = StepPlan(kind="prefill", rows=c // 2, arrivals=(Arrival(prompt_len=2),) * (c // 2))
    long = StepPlan(kind="prefill", rows=1, arrivals=(Arrival(prompt_len=c),), chunk=c)
    return [short, long]


def _stale_tail_drafts(spec: TargetSpec, c: int, live: int) -> int:
    """The draft tokens per request of `first_stale_tail`'s speculative step: the most (up to 3)
    that keep c rows of them within the token budget, but fewer where `live` requests of that
    many tokens fill a capture size exactly and fewer do not: a runner that keys its verify
    graphs by token count then pads the step too (6 requests of 4 tokens fill a graph of 24)."""
    most = max(0, min(3, spec.max_num_tokens // c - 1))
    for drafts in range(most, 0, -1):
        if live * (1 + drafts) not in spec.capture_sizes:
            return drafts
    return most


def _shrunk_rows(spec: TargetSpec) -> tuple[int, int] | None:
    """(c, n): the smallest capture size c a step may fill whose bucket also serves n = c - 2
    requests, else n = c - 1; None where no capture size a step may fill leaves a padding row."""
    most = min(spec.max_num_reqs, spec.max_num_tokens)
    sizes = spec.capture_sizes
    for padding in (2, 1):
        for below, c in zip((0, *sizes), sizes, strict=False):
            if c <= most and c - padding > below:
                return c, c - padding
    return None


def _blocks(spec: TargetSpec, positions: int) -> int:
    """The KV blocks a request needs to hold `positions` positions."""
    return -(-positions // spec.block_size)


def _past_the_largest_graph(spec: TargetSpec, live: int) -> list[StepPlan]:
    """`live` requests become one more than the largest captured size, which then decode
    together; empty where a step cannot hold them all or the cache cannot. The first requests
    hold five tokens by then (a one-token prompt and four decodes)."""
    past = max(spec.capture_sizes, default=0) + 1
    blocks_each = _blocks(spec, 5)
    fits = (
        live < past <= min(spec.max_num_reqs, spec.max_num_tokens)
        and blocks_each <= spec.max_blocks_per_req
        and past * blocks_each <= spec.num_blocks - 1  # the null block is padding's
    )
    if not spec.capture_sizes or not fits:
        return []
    joining = past - live
    return [
        StepPlan(kind="prefill", rows=joining, arrivals=(Arrival(prompt_len=1),) * joining),
        StepPlan(kind="decode", rows=past),
    ]


LEADING_EXAMPLES: tuple[Callable[[TargetSpec], list[StepPlan]], ...] = (
    first_pair,
    first_phase_change,
    first_partial_bucket,
    first_front_departure,
    first_stale_tail,
    first_handover,
    first_stream_sweep,
    first_tokens_past_the_largest_graph,
    first_capture_on_long_contexts,
    first_graph_stream_sweep,
    first_return_after_preemption,
    first_return_after_padded_steps,
)
# Starts on fresh twins wherever it falls (an empty schedule before it moves it forward): a runner
# that captures a graph the first time a batch needs it must capture one there, on long contexts.
ON_FRESH_TWINS = first_capture_on_long_contexts
