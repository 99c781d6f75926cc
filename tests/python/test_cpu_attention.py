"""neo_rs.CpuAttention against torch SDPA on gathered pages; async submit; GIL release; bad input."""

import multiprocessing as mp
import threading
import time

import neo_rs
import pytest
import torch
import torch.nn.functional as F

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_case(lens, hq, hkv, d, bs, dtype, num_layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max((n + bs - 1) // bs for n in lens))
    num_blocks = sum((n + bs - 1) // bs for n in lens) + 2
    shape = (num_layers, num_blocks, hkv, bs, d)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        nb = (n + bs - 1) // bs
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    new_k = torch.randn(len(lens), hkv, d, generator=g).to(dtype)
    new_v = torch.randn(len(lens), hkv, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k, v, tables, seq_lens, new_k, new_v


def reference(q, k, v, layer, tables, seq_lens, scale):
    """Gather each sequence's pages and run torch SDPA (fp32)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, bs = k.shape[2], k.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        nb = (n + bs - 1) // bs
        blocks = tables[s, :nb].long()
        ks = k[layer, blocks].float().permute(1, 0, 2, 3).reshape(hkv, nb * bs, d)[:, :n]
        vs = v[layer, blocks].float().permute(1, 0, 2, 3).reshape(hkv, nb * bs, d)[:, :n]
        qs = q[s].float().reshape(hkv, hq // hkv, d)  # query heads of a group share a KV head
        out[s] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).reshape(hq, d)
    return out


@pytest.fixture(params=neo_rs.simd_tiers())
def attn(request):
    return neo_rs.CpuAttention(num_threads=2, simd=request.param)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 8, 64, 16), (8, 2, 128, 16), (14, 2, 80, 8), (4, 1, 256, 32)])
@pytest.mark.parametrize("append", [False, True])
def test_matches_sdpa(attn, dtype, hq, hkv, d, bs, append):
    lens = [1, 17, 70, bs, 3]
    q, k, v, tables, seq_lens, new_k, new_v = make_case(lens, hq, hkv, d, bs, dtype, seed=hq + d)
    layer, scale = 1, d**-0.5
    out = torch.empty_like(q)
    if append:
        k_ref, v_ref = k.clone(), v.clone()
        for s, n in enumerate(lens):
            blk = tables[s, (n - 1) // bs].item()
            k_ref[layer, blk, :, (n - 1) % bs] = new_k[s]
            v_ref[layer, blk, :, (n - 1) % bs] = new_v[s]
        attn.forward(q, k, v, layer, tables, seq_lens, scale, out, new_k=new_k, new_v=new_v)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), "new K/V not written where expected"
    else:
        attn.forward(q, k, v, layer, tables, seq_lens, scale, out)
    want = reference(q, k, v, layer, tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def quantize(x):
    """Rows of the last dim as the host pool stores them (rotated, symmetric int8): (int8 rows,
    float32 scales)."""
    x = x.contiguous()
    q, scale = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[:-1], dtype=torch.float32)
    neo_rs._core.quantize_rows(x, q, scale)
    return q, scale


def dequantize(q, scale):
    """``quantize``'s rows read back (float32)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    neo_rs._core.dequantize_rows(q, scale, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("append", [False, True])
def test_int8_cache_matches_sdpa_on_dequantized_rows(attn, dtype, append):
    hq, hkv, d, bs, lens = 8, 2, 128, 16, [1, 17, 70, 16, 3]
    q, k, v, tables, seq_lens, new_k, new_v = make_case(lens, hq, hkv, d, bs, dtype, seed=5)
    (k8, ks), (v8, vs) = quantize(k), quantize(v)
    layer, scale = 1, d**-0.5
    out = torch.empty_like(q)
    extra = dict(new_k=new_k, new_v=new_v) if append else {}
    attn.forward(q, k8, v8, layer, tables, seq_lens, scale, out, k_scale=ks, v_scale=vs, **extra)
    deq_k, deq_v = dequantize(k8, ks), dequantize(v8, vs)
    if attn.int8_dot:  # the kernel quantizes q per head (after the softmax scale, rotated like
        # the rows) for q·k: as a K/V row is quantized and read back
        q = dequantize(*quantize(q.float() * scale)) / scale
    if append:  # the new rows were quantized into their slots, scales beside them
        for s, n in enumerate(lens):
            blk, pos = tables[s, (n - 1) // bs].item(), (n - 1) % bs
            torch.testing.assert_close(deq_k[layer, blk, :, pos], new_k[s].float(), atol=0.02, rtol=0.01)
            torch.testing.assert_close(deq_v[layer, blk, :, pos], new_v[s].float(), atol=0.02, rtol=0.01)
    want = reference(q, deq_k, deq_v, layer, tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def interleaved(a, b):
    """``a`` and ``b`` (``[layers, blocks, kv_heads, ...]``) copied into the halves of one tensor,
    a (block, KV head)'s tiles side by side, as the engine's CPU pools are laid out."""
    both = torch.stack([a, b], dim=3)
    return both[:, :, :, 0], both[:, :, :, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("append", [False, True])
def test_interleaved_pools_match_separate_ones_bit_for_bit(attn, dtype, append):
    fdt = torch.bfloat16 if dtype == torch.int8 else dtype
    lens = [1, 17, 70, 16, 3]
    q, k, v, tables, seq_lens, new_k, new_v = make_case(lens, 8, 2, 128, 16, fdt, seed=9)
    scales = {}
    if dtype == torch.int8:
        (k, ks), (v, vs) = quantize(k), quantize(v)
        scales = dict(k_scale=ks, v_scale=vs)
    ik, iv = interleaved(k, v)
    iscales = dict(zip(scales, interleaved(*scales.values()), strict=True)) if scales else {}
    assert not ik.is_contiguous()
    extra = dict(new_k=new_k, new_v=new_v) if append else {}
    want, got = torch.empty_like(q), torch.empty_like(q)
    attn.forward(q, k, v, 1, tables, seq_lens, 0.1, want, **scales, **extra)
    attn.forward(q, ik, iv, 1, tables, seq_lens, 0.1, got, **iscales, **extra)
    assert torch.equal(got, want)
    # An append wrote the same rows (and scales) into the interleaved pool's slots.
    assert torch.equal(ik, k) and torch.equal(iv, v)
    for name, t in iscales.items():
        assert torch.equal(t, scales[name])


def test_submit_from_many_threads():
    attn = neo_rs.CpuAttention()
    cases = [make_case([5 + i, 40, 300], 8, 2, 128, 16, torch.bfloat16, seed=i) for i in range(8)]
    outs = [torch.empty_like(c[0]) for c in cases]
    errors = []

    def worker(i):
        try:
            q, k, v, tables, seq_lens, _, _ = cases[i]
            handles = [attn.submit(q, k, v, layer, tables, seq_lens, 0.1, outs[i]) for layer in (0,)]
            for h in handles:
                h.wait()
            assert handles[0].done()
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (q, k, v, tables, seq_lens, _, _), out in zip(cases, outs, strict=True):
        torch.testing.assert_close(
            out.float(), reference(q, k, v, 0, tables, seq_lens, 0.1), atol=2e-2, rtol=2e-2
        )


def test_small_submit_is_done_on_return():
    attn = neo_rs.CpuAttention(num_threads=2)
    q, k, v, tables, seq_lens, _, _ = make_case([3, 20], 4, 2, 64, 16, torch.float32)
    out = torch.full_like(q, float("nan"))
    h = attn.submit(q, k, v, 0, tables, seq_lens, 0.1, out)
    assert h.done()  # a few KiB of K/V: run on this thread, no hand-off to the pool
    h.wait()
    torch.testing.assert_close(out, reference(q, k, v, 0, tables, seq_lens, 0.1), atol=1e-4, rtol=1e-4)


def test_gil_is_released_while_kernel_runs():
    attn = neo_rs.CpuAttention(num_threads=1, simd="scalar")  # slow on purpose: one long call
    q, k, v, tables, seq_lens, _, _ = make_case([4096], 8, 8, 128, 16, torch.float32, num_layers=1)
    # 96 sequences sharing one 4096-token cache: a long kernel over a small pool.
    batch = 96
    q = q.repeat(batch, 1, 1).contiguous()
    tables = tables.repeat(batch, 1).contiguous()
    seq_lens = seq_lens.repeat(batch).contiguous()
    out = torch.empty_like(q)
    ticks = 0
    stop = threading.Event()

    def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    before = ticks
    start = time.perf_counter()
    attn.forward(q, k, v, 0, tables, seq_lens, 0.1, out)
    elapsed = time.perf_counter() - start
    during = ticks - before
    stop.set()
    t.join()
    # The kernel ran long enough for many ticks; with the GIL held there would be ~none.
    assert elapsed > 0.05
    assert during >= 0.25 * elapsed / 0.0011


def test_async_wait_returns_after_work_overlaps_python():
    # 64 MiB of K/V on one scalar thread: tens of milliseconds of kernel work.
    attn = neo_rs.CpuAttention(num_threads=1, simd="scalar")
    q, k, v, tables, seq_lens, _, _ = make_case([4096] * 4, 8, 8, 128, 16, torch.float32, num_layers=1)
    out = torch.full_like(q, float("nan"))
    h = attn.submit(q, k, v, 0, tables, seq_lens, 0.1, out)
    # Python keeps running while the kernel does: it sees the work unfinished at least once.
    rounds = 0
    while not h.done():
        rounds += 1
        sum(i * i for i in range(1000))
    h.wait()
    assert rounds > 0, "submit() returned only after the kernel had finished"
    torch.testing.assert_close(out, reference(q, k, v, 0, tables, seq_lens, 0.1), atol=1e-4, rtol=1e-4)


def _bad_calls():
    q, k, v, tables, seq_lens, nk, nv = make_case([5, 20], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(q)
    ok = dict(q=q, k_cache=k, v_cache=v, layer=0, block_tables=tables, seq_lens=seq_lens, scale=0.1, out=out)
    bad_tables = tables.clone()
    bad_tables[1, 1] = 999
    (k8, ks), (v8, _) = quantize(k), quantize(v)
    ks = ks.contiguous()
    kv, kv8 = torch.stack([k, v], dim=3), torch.stack([k8, v8], dim=3)
    return [
        ("q wrong dtype", dict(ok, q=q.double()), neo_rs.DTypeError),
        ("q bf16 vs f32 cache", dict(ok, q=q.bfloat16(), out=out.bfloat16()), neo_rs.DTypeError),
        ("tables int64", dict(ok, block_tables=tables.long()), neo_rs.DTypeError),
        ("q 2-d", dict(ok, q=q[0]), neo_rs.ShapeError),
        ("out shape", dict(ok, out=out[:1]), neo_rs.ShapeError),
        ("cache 4-d", dict(ok, k_cache=k[0]), neo_rs.ShapeError),
        ("v differs", dict(ok, v_cache=v[:, :-1].contiguous()), neo_rs.ShapeError),
        ("layer out of range", dict(ok, layer=2), neo_rs.InvalidArgumentError),
        ("block id out of range", dict(ok, block_tables=bad_tables), neo_rs.InvalidArgumentError),
        (
            "seq too long",
            dict(ok, seq_lens=torch.tensor([5, 999], dtype=torch.int32)),
            neo_rs.InvalidArgumentError,
        ),
        ("non-contiguous", dict(ok, q=q.transpose(0, 1)), neo_rs.InvalidArgumentError),
        (
            "k_cache strided",
            dict(ok, k_cache=k.transpose(3, 4).contiguous().transpose(3, 4)),
            neo_rs.InvalidArgumentError,
        ),
        # Interleaved halves only as x[:, :, :, 0] and x[:, :, :, 1] of one tensor.
        (
            "k_cache and v_cache one half",
            dict(ok, k_cache=kv[:, :, :, 0], v_cache=kv[:, :, :, 0]),
            neo_rs.InvalidArgumentError,
        ),
        (
            "halves swapped",
            dict(ok, k_cache=kv[:, :, :, 1], v_cache=kv[:, :, :, 0]),
            neo_rs.InvalidArgumentError,
        ),
        (
            "interleaved caches, separate scales",
            dict(ok, k_cache=kv8[:, :, :, 0], v_cache=kv8[:, :, :, 1], k_scale=ks, v_scale=ks),
            neo_rs.InvalidArgumentError,
        ),
        ("out aliases q", dict(ok, out=q), neo_rs.InvalidArgumentError),
        ("only new_k", dict(ok, new_k=nk), neo_rs.InvalidArgumentError),
        ("new_k shape", dict(ok, new_k=nk[:1], new_v=nv[:1]), neo_rs.ShapeError),
        ("not a tensor", dict(ok, q=[1, 2, 3]), TypeError),
        ("int8 cache without scales", dict(ok, k_cache=k8, v_cache=v8), neo_rs.DTypeError),
        ("scales for a float cache", dict(ok, k_scale=ks, v_scale=ks), neo_rs.DTypeError),
        ("int8 k, float v", dict(ok, k_cache=k8, k_scale=ks, v_scale=ks), neo_rs.DTypeError),
        ("only k_scale", dict(ok, k_cache=k8, v_cache=v8, k_scale=ks), neo_rs.InvalidArgumentError),
        (
            "scales float16",
            dict(ok, k_cache=k8, v_cache=v8, k_scale=ks.half(), v_scale=ks.half()),
            neo_rs.DTypeError,
        ),
        (
            "scales shape",
            dict(
                ok, k_cache=k8, v_cache=v8, k_scale=ks[:, :-1].contiguous(), v_scale=ks[:, :-1].contiguous()
            ),
            neo_rs.ShapeError,
        ),
    ]


@pytest.mark.parametrize("name,kwargs,exc", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_typed_error(name, kwargs, exc):
    attn = neo_rs.CpuAttention(num_threads=2)
    with pytest.raises(exc):
        attn.forward(**kwargs)
    with pytest.raises(exc):
        attn.submit(**kwargs).wait()
    # The process (and the engine) survive.
    q, k, v, tables, seq_lens, _, _ = make_case([3], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(q)
    attn.forward(q, k, v, 0, tables, seq_lens, 0.1, out)
    assert torch.isfinite(out).all()


def test_errors_share_one_root():
    for e in (neo_rs.ShapeError, neo_rs.DTypeError, neo_rs.InvalidArgumentError, neo_rs.BackendError):
        assert issubclass(e, neo_rs.NeoRsError)
    with pytest.raises(neo_rs.InvalidArgumentError):
        neo_rs.CpuAttention(simd="sse9")
    with pytest.raises(neo_rs.InvalidArgumentError):
        neo_rs.CpuAttention(num_threads=0)


def _child(conn):
    # Only neo_rs runs here: torch's own OpenMP pool is not fork-safe, ours must be.
    attn, (q, k, v, tables, seq_lens) = _child.state
    out = torch.empty_like(q)
    attn.forward(q, k, v, 0, tables, seq_lens, 0.1, out)
    conn.send(out.tolist())


def test_fork_safe():
    attn = neo_rs.CpuAttention(num_threads=2)
    q, k, v, tables, seq_lens, _, _ = make_case([50, 7], 4, 2, 64, 16, torch.float32)
    attn.forward(q, k, v, 0, tables, seq_lens, 0.1, torch.empty_like(q))  # pool threads started
    _child.state = (attn, (q, k, v, tables, seq_lens))
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child,))
    p.start()
    assert parent.poll(60), "forked child hung"
    got = torch.tensor(parent.recv())
    p.join(10)
    assert p.exitcode == 0
    torch.testing.assert_close(got, reference(q, k, v, 0, tables, seq_lens, 0.1), atol=1e-4, rtol=1e-4)


def test_stream_read_reads_every_word():
    buf = torch.arange(1 << 20, dtype=torch.int64).to(torch.float32)  # any 8-byte-sized dtype view
    words = buf.view(torch.int64)
    want = int(words.sum().item()) % (1 << 64)
    assert neo_rs.CpuAttention(num_threads=2).stream_read(buf) == want


def test_gather_read_reads_the_runs_in_order():
    words = torch.arange(4096, dtype=torch.int64)
    buf = words.view(torch.float32)  # the same bytes, in a dtype the binding takes
    runs = words.view(256, 16)  # runs of 16 words (128 bytes)
    order = torch.tensor([5, 255, 0, 5, 17], dtype=torch.int32)
    attn = neo_rs.CpuAttention(num_threads=2)
    assert attn.gather_read(buf, 128, order) == int(runs[order.long()].sum())
    with pytest.raises(neo_rs.InvalidArgumentError, match="outside"):
        attn.gather_read(buf, 128, torch.tensor([256], dtype=torch.int32))
    with pytest.raises(neo_rs.InvalidArgumentError, match="8-byte"):
        attn.gather_read(buf, 12, order)
    with pytest.raises(neo_rs.DTypeError):
        attn.gather_read(buf, 128, order.float())


def test_openmp_team_matches_the_pool_bit_for_bit():
    # 7.6 MB of K/V: far above the size that runs on the calling thread; 3000 tokens are cut
    # into chunks and merged.
    q, k, v, tables, seq_lens, _, _ = make_case([3000, 40, 700], 8, 2, 128, 16, torch.float32)
    pool = neo_rs.CpuAttention(num_threads=2)
    team = neo_rs.CpuAttention(num_threads=2, openmp_team=True)
    assert team.openmp_team and not pool.openmp_team  # torch brought an OpenMP runtime
    want = torch.empty_like(q)
    pool.forward(q, k, v, 1, tables, seq_lens, 0.1, want)
    torch.testing.assert_close(want, reference(q, k, v, 1, tables, seq_lens, 0.1), atol=1e-4, rtol=1e-4)
    got = torch.full_like(q, float("nan"))
    torch.nn.functional.linear(q[0], q[0])  # torch's team has just run
    team.forward(q, k, v, 1, tables, seq_lens, 0.1, got)
    assert torch.equal(got, want)
    # Submitted, it runs on the team too, done before submit returns (the pool's threads would
    # contend with torch's spinning ones); the pool's engine submits to its threads.
    submitted = torch.full_like(q, float("nan"))
    handle = team.submit(q, k, v, 1, tables, seq_lens, 0.1, submitted)
    assert handle.done() and torch.equal(submitted, want)
    submitted.fill_(float("nan"))
    pool.submit(q, k, v, 1, tables, seq_lens, 0.1, submitted).wait()
    assert torch.equal(submitted, want)


def test_on_a_cpu_device_one_thread_count_serves_torch_and_the_kernel(monkeypatch):
    from neo_rs.config import EngineArgs
    from neo_rs.worker.runner import cpu_attention

    monkeypatch.delenv("NEO_RS_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        attn = cpu_attention(EngineArgs(model="demo", cpu_threads=1), torch.device("cpu"))
        assert (attn.num_threads, torch.get_num_threads(), attn.openmp_team) == (1, 1, True)
        torch.set_num_threads(2)
        attn = cpu_attention(EngineArgs(model="demo"), torch.device("cpu"))  # torch's count
        assert (attn.num_threads, torch.get_num_threads()) == (2, 2)
        monkeypatch.setenv("NEO_RS_OPENMP_TEAM", "0")
        assert not cpu_attention(EngineArgs(model="demo"), torch.device("cpu")).openmp_team
        # Beside a GPU the kernel keeps threads of its own and leaves torch's alone.
        attn = cpu_attention(EngineArgs(model="demo", cpu_threads=1), torch.device("meta"))
        assert (attn.num_threads, attn.openmp_team, torch.get_num_threads()) == (1, False, 2)
    finally:
        torch.set_num_threads(before)
