"""The engine's asynchronous scheduling: step N+1 is dispatched before step N's tokens are read, and
outputs stay exactly `generate`'s; host time per step is measured and exported.

Models are the tiny torch-free builds of tests/helpers.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from gemma4_nnx import Engine, generate
from gemma4_nnx.decode.text import FinishReason
from tests import hf_fixtures as fx
from tests.helpers import random_model


class _CharTokenizer:
    """Token i is chr(i + 33) (printable); id 0 is a 'special' spelled <s>; stops: id 1."""

    stop_ids = (1,)

    def decode(self, ids, skip_special=False):
        return "".join("<s>" if i == 0 else chr(i + 33) for i in ids)

    def stream_decoder(self):
        from gemma4_nnx.tokenizer import StreamDecoder

        return StreamDecoder(self)

    def _check_id(self, i):
        pass


@pytest.fixture(scope="module")
def model():
    return random_model("e2b", seed=4)


#: the precompiled engine of every test that needs one (and the shape of the unprecompiled ones' but
#: for the precompile): the same programs, compiled once for the module and found in jax's cache after
PRECOMPILED = dict(max_batch=2, max_length=96, precompile=(16,))


def _cases(model):
    """Requests of several prompt lengths and lengths, greedy and seeded sampled; stop tokens and
    stop strings taken from each prompt's own free-running output, so they do end rows early. Prompts
    and lengths within one bucket (16): `generate` compiles one prefill and one loop per sampler, the
    engine one prefill width (the rows joining and leaving are what is checked, not the buckets)."""
    tok = _CharTokenizer()
    out = []
    for i, (n, max_tokens, temperature) in enumerate(
        [(3, 16, 0.0), (10, 7, 0.8), (14, 14, 0.0), (6, 11, 0.9), (15, 5, 0.0), (12, 15, 0.7), (4, 9, 0.0)]
    ):
        prompt = fx.sample_ids(1, n, seed=40 + i)[0].tolist()
        kw = dict(temperature=temperature, seed=100 + i, stop_tokens=[])
        free = generate(model, [prompt], max_tokens, **kw).tokens[0]
        if i % 3 == 1:  # a stop string of two characters from the middle of its output
            kw["stop_strings"] = [tok.decode(free[max_tokens // 2 : max_tokens // 2 + 2])]
        elif i % 3 == 2:  # a stop token from its output
            kw["stop_tokens"] = [free[max_tokens // 2]]
        out.append((prompt, max_tokens, kw))
    return tok, out


@pytest.mark.parametrize("row_factor", [2, 4])
def test_async_engine_outputs_equal_generate_with_rows_joining_and_leaving(model, row_factor):
    """Seven requests (prompts of 3 to 15 tokens, 5 to 16 tokens each, greedy and seeded sampled,
    stop tokens, stop strings, max_tokens) through an engine of 4 rows: they join while others run
    (staggered submits, more requests than rows) and leave at different times. Each one's tokens,
    text and finish reason equal `generate` of it alone; the engine dispatched steps before reading
    the previous one's tokens (async), and measured its host time. Row programs of 1, 2, 4 rows
    (`row_factor` 2, a CPU's default) or 1 and 4 (4, an accelerator's): the same outputs."""
    tok, cases = _cases(model)
    engine = Engine(model, tok, max_batch=4, max_length=64, row_factor=row_factor)
    assert [m for m, _, _ in engine.decoder.draw_shapes(joining=False)] == ([1, 2, 4] if row_factor == 2 else [1, 4])
    try:
        reqs = []
        for i, (prompt, max_tokens, kw) in enumerate(cases):
            reqs.append(engine.submit(prompt, max_tokens, **kw))
            if i in (0, 3):  # the next ones join rows that are already decoding
                while len(reqs[-1].tokens) < 3 and reqs[-1].finish_reason is None:
                    time.sleep(0.002)
        got = [r.result() for r in reqs]
    finally:
        engine.close()
    for (prompt, max_tokens, kw), (tokens, text, reason, _) in zip(cases, got, strict=True):
        ref = generate(model, [prompt], max_tokens, tokenizer=tok, **kw)
        assert tokens == ref.tokens[0], (kw, tokens, ref.tokens[0])
        assert reason == ref.finish_reasons[0], (kw, reason, ref.finish_reasons[0])
        want = ref.texts[0]
        if reason == FinishReason.STOP:  # the engine does not show the stop token; generate's text keeps it
            want = tok.decode(ref.tokens[0][:-1])
        assert text == want, (kw, text, want)
    reasons = {r[2] for r in got}
    assert {FinishReason.STOP, FinishReason.STOP_STRING, FinishReason.LENGTH} <= reasons, reasons
    st = engine.stats
    assert st.async_steps > 0 and st.async_steps <= st.decode_steps, (st.async_steps, st.decode_steps)
    assert st.host_seconds > 0


def test_host_time_per_step_is_exported_at_metrics(model):
    """/metrics carries the engine's host seconds and its decode steps (host time per step is their
    ratio), read from the engine's counters."""
    pytest.importorskip("prometheus_client")
    from gemma4_nnx.serve.metrics import ServerMetrics

    engine = Engine(model, max_batch=1, max_length=64)  # the next test's programs
    try:
        engine.submit(fx.sample_ids(1, 5, seed=1)[0].tolist(), 6, stop_tokens=[]).result()
        text = ServerMetrics(engine).exposition().decode()
    finally:
        engine.close()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["gemma4_engine_host_seconds_total"] == pytest.approx(engine.stats.host_seconds)
    assert values["gemma4_decode_steps_total"] == engine.stats.decode_steps > 0
    per_step = values["gemma4_engine_host_seconds_per_step"]
    assert per_step == pytest.approx(engine.stats.host_seconds / engine.stats.decode_steps)
    assert values["gemma4_engine_host_cpu_seconds_total"] == pytest.approx(engine.stats.host_cpu_seconds)


def test_host_cpu_time_leaves_out_waits_for_the_gil(model):
    """`host_cpu_seconds` is the part of `host_seconds` the engine thread ran: alone it is most of it;
    beside a thread of pure Python that holds the GIL (as a server's event loop streaming many tokens
    does), the engine thread waits for the lock at each return from XLA, and its CPU time falls well
    below its busy time."""
    engine = Engine(model, max_batch=1, max_length=64)
    prompt = fx.sample_ids(1, 5, seed=2)[0].tolist()

    def run():
        before = engine.stats.host_seconds, engine.stats.host_cpu_seconds
        engine.submit(prompt, 40, stop_tokens=[]).result()
        return engine.stats.host_seconds - before[0], engine.stats.host_cpu_seconds - before[1]

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    try:
        run()  # compiles
        wall, cpu = run()
        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            wall_busy, cpu_busy = run()
        finally:
            stop.set()
            spinner.join()
    finally:
        engine.close()
    assert 0 < cpu <= wall * 1.05 + 0.005, (wall, cpu)
    assert cpu_busy < 0.7 * wall_busy, (wall_busy, cpu_busy)


def test_a_new_prompt_bucket_compiles_off_the_serving_thread(model):
    """After a precompile of 16-token prompts, a 40-token prompt (a new bucket) arrives while a
    stream decodes: its prefill programs compile on the helper thread while it waits alone, so the
    serving thread compiles nothing (its counter of compiles, `Decoder.compiles` without the
    background kinds, stays as after start-up; before, the prefill compiled there between two of the
    stream's tokens), and `compiles_pending` counts it while the prompt waits; both outputs equal
    `generate`."""
    engine = Engine(model, **PRECOMPILED)
    stream, late_prompt = fx.sample_ids(1, 9, seed=61)[0].tolist(), fx.sample_ids(1, 40, seed=62)[0].tolist()

    def serving(compiles):
        return {k: v for k, v in compiles.items() if "background" not in k}

    try:
        before = serving(engine.decoder.compiles)
        running = engine.submit(stream, 30, stop_tokens=[])
        while len(running.tokens) < 3:
            time.sleep(0.002)
        late = engine.submit(late_prompt, 6, stop_tokens=[], temperature=0.7, seed=5)
        pending = 0  # what /metrics reports as gemma4_compiles_pending while the late prompt waits
        while not late.tokens and late.finish_reason is None:
            pending = max(pending, engine.decoder.compiles_pending)
            time.sleep(0.001)
        got_late = late.result()[0]
        got_stream = running.result()[0]
        after = dict(engine.decoder.compiles)
    finally:
        engine.close()
    assert serving(after) == before, (before, after)
    assert after.get("prefill (background)", 0) > 0 and pending >= 1, (after, pending)
    assert got_stream == generate(model, [stream], 30, stop_tokens=[], max_length=96).tokens[0]
    ref = generate(model, [late_prompt], 6, stop_tokens=[], temperature=0.7, seed=5, max_length=96)
    assert got_late == ref.tokens[0]


def test_helper_queue_runs_urgent_jobs_first():
    """The helper thread's queue: jobs a request waits for (urgent) run first, then those the running
    rows want soon (their fused step programs), then those queued for later, each kind in the order
    queued; a later job made urgent (`promote`) moves up; a shutdown cancels what has not started,
    and the job running finishes."""
    from gemma4_nnx.decode.compiles import HelperQueue

    q, order, gate = HelperQueue(), [], threading.Event()
    held = q.submit("held", lambda: gate.wait(30) and order.append("held"))
    while not held.running():
        time.sleep(0.001)
    jobs = [("later1", False, False), ("soon1", False, True), ("urgent1", True, False), ("later2", False, False)]
    jobs += [("later3", False, False), ("soon2", False, True), ("urgent2", True, False)]
    futures = {name: q.submit(name, lambda n=name: order.append(n), urgent, soon) for name, urgent, soon in jobs}
    q.promote("later3")
    gate.set()
    for f in futures.values():
        f.result(30)
    assert order == ["held", "urgent1", "later3", "urgent2", "soon1", "soon2", "later1", "later2"]
    gate.clear()
    running = q.submit("running", lambda: gate.wait(30) and "done")
    while not running.running():
        time.sleep(0.001)
    dropped = q.submit("dropped", lambda: order.append("dropped"), True)
    q.shutdown()
    gate.set()
    assert running.result(30) == "done" and dropped.cancelled() and order[-1] == "later2"


def test_a_waiting_prompt_compiles_before_the_helpers_later_jobs(model):
    """A prompt whose prefill program is not compiled waits for the helper thread; that compile runs
    before the jobs queued there for later (here a stand-in for the precompile's vocabulary-wide
    sampler, 26 s of compiles on the 270M and 88 s for E2B on a TPU, which a first short prompt used
    to wait behind), and the output equals `generate`."""
    engine = Engine(model, **PRECOMPILED)
    prompt = fx.sample_ids(1, 40, seed=63)[0].tolist()
    deadline = time.time() + 120
    while engine.decoder._compiling and time.time() < deadline:
        time.sleep(0.01)
    order, gate, run = [], threading.Event(), engine.decoder._run

    def counted(kind, fn, *args):
        order.append(kind)
        return run(kind, fn, *args)

    try:
        engine.decoder._run = counted
        held = engine.decoder._queue(("held",), lambda: gate.wait(60), failed=print)
        engine.decoder._queue(("later",), lambda: order.append("later"), failed=print)
        while not held.running():
            time.sleep(0.001)
        late = engine.submit(prompt, 5, stop_tokens=[])
        while not any(job[0] == "prefill" for job in engine.decoder._compiling):
            time.sleep(0.001)
        gate.set()
        got = late.result()[0]
    finally:
        gate.set()
        engine.close()
    assert "later" in order and "prefill (background)" in order, order
    assert order.index("prefill (background)") < order.index("later"), order
    assert got == generate(model, [prompt], 5, stop_tokens=[], max_length=96).tokens[0]


def test_one_dispatch_per_decode_step(model):
    """A decode step is one program call (`programs._step`: the decode and its draw fused, its
    `PackedDrawn` read back as one array), not two, once its fused program compiled on the helper
    thread (at a sampler's first step here: `fuse_after` 0, not the engine's `FUSE_AFTER`; meanwhile
    its steps are decode + draw). Counting the decoder's program calls by kind over a second request:
    each step is one "step" call, no "decode" or "draw" runs besides the request's first draw (after
    its prefill), and the serving thread compiled no step program. The two requests (same seed,
    penalty, alternatives) give `generate`'s tokens, and the fused steps its logprobs bit for bit."""
    engine = Engine(model, max_batch=2, max_length=96)  # the precompiled engines' decode programs
    engine.decoder.fuse_after = 0
    calls: dict[str, int] = {}
    run = engine.decoder._run

    def counted(kind, fn, *args):
        calls[kind] = calls.get(kind, 0) + 1
        return run(kind, fn, *args)

    prompt = fx.sample_ids(1, 5, seed=3)[0].tolist()
    kw = dict(stop_tokens=[], temperature=0.8, seed=2, repetition_penalty=1.3)

    def events():
        return [(e.token, e.logprob, e.top) for e in engine.submit(prompt, 9, top_logprobs=3, **kw)]

    try:
        apart = events()  # two programs a step while the fused one compiles
        while engine.decoder._compiling:
            time.sleep(0.01)
        before = engine.stats.decode_steps
        engine.decoder._run = counted
        fused = events()
    finally:
        engine.close()
    steps = engine.stats.decode_steps - before
    assert steps == 8 and calls.get("step") == steps, (steps, calls)
    assert calls.get("decode", 0) == 0 and calls.get("draw") == 1, calls
    compiles = engine.decoder.compiles
    assert compiles.get("step", 0) == 0 and compiles.get("step (background)", 0) == 1, compiles
    ref = generate(model, [prompt], 9, max_length=96, return_logprobs=True, **kw)
    assert [t for t, _, _ in fused] == [t for t, _, _ in apart] == ref.tokens[0]
    # the fused step computes the logprobs as generate's on-device loop does, bit for bit (decode and
    # draw apart round differently in the last bit)
    assert [lp for _, lp, _ in fused] == ref.logprobs[0]
    for (_, _, top), (_, _, top_apart) in zip(fused, apart, strict=True):
        assert [i for i, _ in top] == [i for i, _ in top_apart]
        # the two programs' logits differ by float32 rounding (XLA fuses the head and the draw differently):
        # ~1e-7 absolute in a logprob (measured 7e-8 at -0.032, 2e-6 relative); a wrong alternative or
        # order moves it by ~1e-1
        assert [x for _, x in top] == pytest.approx([x for _, x in top_apart], rel=0, abs=1e-6)


def test_serve_sets_a_short_gil_switch_interval(tmp_path, capsys):
    """`gemma4-serve --gil-switch-ms` (default `DEFAULT_GIL_SWITCH_MS`, well under Python's 5 ms) is the
    process's thread switch interval, set before the engine starts (here: a checkpoint that does not
    exist, so `main` stops after it); bad values are refused by name."""
    import sys

    pytest.importorskip("fastapi")
    from gemma4_nnx.serve.app import DEFAULT_GIL_SWITCH_MS, build_parser, main

    assert build_parser().parse_args(["ckpt"]).gil_switch_ms == DEFAULT_GIL_SWITCH_MS < 5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["ckpt", "--gil-switch-ms", bad])
        assert "--gil-switch-ms" in capsys.readouterr().err
    before = sys.getswitchinterval()
    try:
        assert main([str(tmp_path / "missing"), "--uds", str(tmp_path / "s.sock"), "--gil-switch-ms", "0.3"]) == 2
        assert sys.getswitchinterval() == pytest.approx(0.3e-3)
    finally:
        sys.setswitchinterval(before)


def test_server_mailbox_wakes_the_event_loop_once_per_batch_in_order():
    """The engine thread hands a step's events for every stream to the server's event loop through one
    `_Mailbox`: one `call_soon_threadsafe` (a write to the loop's self-pipe, and a wake-up) for all the
    events posted before the loop drains them, not one per stream and token, each queue getting its
    items in the order posted; a post after the drain wakes the loop again."""
    import asyncio

    from gemma4_nnx.serve.serving import _Mailbox

    loop = asyncio.new_event_loop()
    try:
        wakes = []
        plain = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), plain(*a))[1]
        box = _Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(4)]

        def step():  # one decode step's events for 64 streams, from another thread
            for i in range(64):
                box.post(queues[i % 4], i)

        t = threading.Thread(target=step)
        t.start()
        t.join()
        assert len(wakes) == 1
        loop.run_until_complete(asyncio.sleep(0))  # the loop runs the drain
        for q, queue in enumerate(queues):
            assert [queue.get_nowait() for _ in range(queue.qsize())] == list(range(q, 64, 4))
        box.post(queues[0], 64)
        assert len(wakes) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert queues[0].get_nowait() == 64
    finally:
        loop.close()


def test_streamed_chunks_written_from_a_template_equal_the_pydantic_chunks():
    """The server's plain streamed chunks (`serving._Chunks`: text or content, no logprobs, no tool
    call; the event loop writes one per token of every stream) are the very text `_sse` gives of the
    pydantic chunk: same keys in the same order, escapes (quotes, backslashes, control characters),
    non-ASCII kept as is, a delta's absent fields left out, every finish reason."""
    from gemma4_nnx.serve.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatDelta,
        CompletionChoice,
        CompletionResponse,
    )
    from gemma4_nnx.serve.serving import _Chunks, _sse

    ctx = dict(id='cmpl-\u00e9"x', created=1733580000, model='gemma "4" \\ é')
    texts = ["", "a", 'é "q" \\ \n\t\x01\x7f \u2713 \U0001f642 </s>']
    for i, reason in ((0, None), (3, "stop"), (1, "length")):
        for text in texts:
            want = _sse(CompletionResponse(**ctx, choices=[CompletionChoice(index=i, text=text, finish_reason=reason)]))
            assert _Chunks(ctx, "text_completion").completion(i, text, reason) == want
        for content, reasoning in ((texts[2], None), (None, texts[2]), ("a", "b"), (None, None)):
            delta = ChatDelta(content=content, reasoning_content=reasoning)
            choice = ChatChunkChoice(index=i, delta=delta, finish_reason=reason or "tool_calls")
            want = _sse(ChatCompletionChunk(**ctx, choices=[choice]))
            assert _Chunks(ctx, "chat.completion.chunk").chat(i, content, reasoning, reason or "tool_calls") == want


def test_a_step_waiting_for_its_fused_program_reads_no_shapes(model):
    """While a sampler's fused step program waits on the helper thread, every step asks for it again
    (`Decoder.step`); the ask must cost a set lookup, not the abstract shapes of the weights, cache and
    rows (milliseconds of the serving thread per step for E2B's arrays: the chip's 64-stream sweep ran
    its steps apart while the helper compiled). With the helper held by another job, a request of 9
    tokens reads those shapes once (the compile's queuing) and still gives `generate`'s tokens."""
    engine = Engine(model, max_batch=2, max_length=96)  # the precompiled engines' decode programs
    engine.decoder.fuse_after = 0
    hold = threading.Event()
    engine.decoder._queue(("hold",), hold.wait, lambda: None)
    reads = []
    abstract = engine.decoder._abstract_state
    engine.decoder._abstract_state = lambda: (reads.append(1), abstract())[1]
    prompt = fx.sample_ids(1, 5, seed=4)[0].tolist()
    try:
        got = [e.token for e in engine.submit(prompt, 9, stop_tokens=[])]
        steps = engine.stats.decode_steps
        ranks = [job[0] for job in engine.decoder._background._jobs]  # behind the held job
    finally:
        hold.set()
        engine.close()
    assert steps >= 8 and len(reads) == 1, (steps, len(reads))
    assert ranks == [1]  # the fused step program, queued once, wanted soon (before later-queued jobs)
    assert got == generate(model, [prompt], 9, stop_tokens=[], max_length=96).tokens[0]


def test_a_prompt_waiting_for_its_prefill_program_reads_no_shapes_per_step(model, monkeypatch):
    """A prompt whose prefill program compiles on the helper thread waits in the queue, and every step
    of the running stream asks for that program again (`Engine._prefill_ready`); the ask must cost set
    lookups, not the abstract shapes of the weights and cache (the fused step's twin, above: on the
    chip, E2B's ~450 arrays made each ask milliseconds while the server's warm-up waited for its
    prefill program, slowing the compile it waited for). With the helper held, a
    40-token prompt (a new bucket) waits through several of the stream's steps, no array's shape is
    read meanwhile (they were read when its compiles were queued), and both outputs are `generate`'s."""
    from gemma4_nnx.decode import compiles

    engine = Engine(model, **PRECOMPILED)
    deadline = time.time() + 120
    while engine.decoder._compiling and time.time() < deadline:
        time.sleep(0.01)
    stream, late_prompt = fx.sample_ids(1, 9, seed=61)[0].tolist(), fx.sample_ids(1, 40, seed=62)[0].tolist()
    hold, reads = threading.Event(), []
    abstract = compiles._abstract
    monkeypatch.setattr(compiles, "_abstract", lambda x: (reads.append(1), abstract(x))[1])
    try:
        held = engine.decoder._queue(("hold",), hold.wait, lambda: None)
        while not held.running():
            time.sleep(0.001)
        running = engine.submit(stream, 40, stop_tokens=[])
        while len(running.tokens) < 3:
            time.sleep(0.002)
        late = engine.submit(late_prompt, 5, stop_tokens=[])
        while not any(job[0] == "prefill" for job in engine.decoder._compiling):
            time.sleep(0.001)
        waited_from, queued = len(running.tokens), len(reads)
        while len(running.tokens) < waited_from + 6 and running.finish_reason is None:
            time.sleep(0.002)
        waited, read = len(running.tokens) - waited_from, len(reads) - queued
        hold.set()
        got_late, got_stream = late.result()[0], running.result()[0]
    finally:
        hold.set()
        engine.close()
    assert queued > 0 and waited >= 6 and read == 0, (queued, waited, read)
    assert got_stream == generate(model, [stream], 40, stop_tokens=[], max_length=96).tokens[0]
    assert got_late == generate(model, [late_prompt], 5, stop_tokens=[], max_length=96).tokens[0]


def test_row_keys_compile_per_power_of_two_and_equal_each_rows_own_key():
    """The sampling keys of the requests joining together (`state._row_keys`) come from one program per
    power-of-two count (not one per count: each new one compiled on the serving thread), and each row's
    key is `fold_in(key(seed), row)` computed alone."""
    import jax
    import numpy as np

    from gemma4_nnx.decode import state

    before = state._row_keys_jit._cache_size()
    for n in range(1, 10):
        seeds, rows = [3 * i + 11 for i in range(n)], [(5 * i) % 7 for i in range(n)]
        got = state._row_keys(seeds, rows)
        want = [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(s), r))) for s, r in zip(seeds, rows)]
        np.testing.assert_array_equal(got, np.stack(want))
    assert state._row_keys_jit._cache_size() - before <= 5  # counts 1, 2, 4, 8, 16


def test_greedy_steps_run_fused_from_the_first_after_a_precompile(model):
    """The precompile compiles the greedy sampler's fused step programs (one per row count) in place
    of its draws at the steps' shapes: a greedy request's every step is one "step" call from the
    first (no decode + draw pair while a fused program compiles on the helper thread, which starts
    after `FUSE_AFTER` steps and is slow on an accelerator: docs/benchmarks.md, "Start-up"), none compiled after
    the precompile, and its tokens and logprobs are `generate`'s bit for bit."""
    engine = Engine(model, **PRECOMPILED)
    calls: dict[str, int] = {}
    run = engine.decoder._run

    def counted(kind, fn, *args):
        calls[kind] = calls.get(kind, 0) + 1
        return run(kind, fn, *args)

    engine.decoder._run = counted
    prompt = fx.sample_ids(1, 5, seed=4)[0].tolist()

    def step_compiles():  # (the helper thread's later jobs, the vocabulary-wide sampler, may run meanwhile)
        return {k: v for k, v in engine.decoder.compiles.items() if k.startswith(("step", "decode"))}

    try:
        before = step_compiles()
        got = [(e.token, e.logprob) for e in engine.submit(prompt, 7, stop_tokens=[])]
        steps = engine.stats.decode_steps
    finally:
        engine.close()
    assert steps == 6 and calls.get("step") == steps and "decode" not in calls, (steps, calls)
    assert calls.get("draw") == 1, calls  # the first token's, after the prefill
    assert step_compiles() == before, (before, engine.decoder.compiles)
    ref = generate(model, [prompt], 7, stop_tokens=[], max_length=96, return_logprobs=True)
    assert [t for t, _ in got] == ref.tokens[0] and [lp for _, lp in got] == ref.logprobs[0]


def test_serving_thread_lowers_no_program_after_a_precompile(model):
    """After a precompile, a request of a precompiled prompt length runs without any program lowered on
    the engine thread: neither its steps' and draws' (precompiled, or fused on the helper thread) nor
    small ones made on the way (the row indices of a step over fewer rows than the batch, the sampling
    keys of the joining requests), each of which would stop every running stream while it compiles."""
    import traceback

    import jax

    lowered, listening = [], [True]

    def on_event(name, *args, **kwargs):
        engine_thread = threading.current_thread().name.startswith("gemma4-engine")
        if listening[0] and engine_thread and name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append("".join(traceback.format_stack(limit=12)))

    # nothing the module's other engines compiled may stand in for a program the precompile left out:
    # jax's caches cleared, this engine's precompile lowers every program again (and loads it from the
    # persistent cache: the module's shapes, compiled once)
    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(on_event)
    engine = Engine(model, **PRECOMPILED)
    prompt = fx.sample_ids(1, 7, seed=9)[0].tolist()
    try:
        got = [e.token for e in engine.submit(prompt, 6, stop_tokens=[], temperature=0.7, seed=5)]
    finally:
        listening[0] = False
        engine.close()
    assert not lowered, lowered[0]
    assert got == generate(model, [prompt], 6, stop_tokens=[], temperature=0.7, seed=5, max_length=96).tokens[0]
