"""CPU paged decode attention through the Python binding, side by side in one run with
(a) the machine's read bandwidth (a streaming read of a 1 GiB buffer on the kernel's own pool)
and (b) torch's CPU baseline (gather the pages into a reused workspace + SDPA). Prints GB/s of K+V
read and the ratios kernel / bandwidth and kernel / torch, and KV tokens per second (millions of
tokens x all KV heads, what matters across dtypes). `int8` rows: int8 pools with their f32 row
scales (bytes counted with the scales), q and out in bfloat16; their torch baseline runs on the
bfloat16 pages, and k/torch compares tokens per second. `tiles GB/s` reads the tiles the call
reads, in its order and four at a time as the kernel does, with no arithmetic (`gather_read`):
what the access pattern alone reaches, and `k/tiles` the kernel's share of it. Figures only; not a CI gate.
`--huge-pages` backs the pools and the read buffer with 2 MiB pages (the engine's pools are not:
see `kv/pools.py`). `--cold` gives each call blocks the caches no longer hold: the pool holds
copies of the batch's blocks, over 2 GiB in all, and the calls take them in turn, as the engine
reads a host pool far larger than the LLC (a 1-layer pool of one batch otherwise stays in a large
LLC between calls, and the kernel then outruns the streaming read).
The pools are laid out as the engine's CPU pools are (`kv/pools.py`): K and V the halves of one
tensor, a (block, KV head)'s K and V tiles side by side, so `tiles GB/s` reads one run per tile
pair. `--compare-layouts` adds the Mtok/s of separate K and V pools measured alternately with
them, and the ratio of their times. `--compare-dots` adds the Mtok/s of the widening path (no
int8/bf16 dot products) measured alternately with the default one, and their ratio.

    python benches/attn_cpu.py [--quick] [--threads 1,2] [--dtype bfloat16,float32,int8] [--huge-pages]
                               [--cold] [--compare-layouts | --compare-dots]
"""

import argparse
import functools
import itertools
import math
import mmap
import os
import statistics
import time

import neo_rs
import torch
import torch.nn.functional as F
from neo_rs._core import quantize_rows
from neo_rs.kv.pools import page_aligned_empty

MODELS = {"llama3-8b": (32, 8), "llama2-7b": (32, 32)}  # (q heads, kv heads), head_dim 128
SHAPES = [(1, 8192), (16, 2048), (64, 512), (256, 256)]
HEAD_DIM, BLOCK = 128, 16
COLD_BYTES = 2 << 30  # --cold: over 4x the LLC of the VMs we measure on (480 MiB)


def timed(fn, reps):
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_pair(f, g, reps):
    """Median seconds of `f` and of `g`, run alternately (so drifts of a shared machine hit both)."""
    f(), g()
    tf, tg = [], []
    for _ in range(reps):
        for fn, ts in ((f, tf), (g, tg)):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(tf), statistics.median(tg)


def widening_engine(threads):
    """A CpuAttention without int8/bf16 dot products (they are chosen when it is built)."""
    saved = {v: os.environ.get(v) for v in ("NEO_RS_INT8_DOT", "NEO_RS_BF16_DOT")}
    os.environ.update({v: "0" for v in saved})
    try:
        return neo_rs.CpuAttention(num_threads=threads)
    finally:
        for v, old in saved.items():
            if old is None:
                del os.environ[v]
            else:
                os.environ[v] = old


def read_bandwidth(attn, buf, reps):
    """A streaming read of `buf` on the kernel's own thread pool (same threads, same process)."""
    return buf.numel() * buf.element_size() / timed(functools.partial(attn.stream_read, buf), reps) / 1e9


def empty(shape, dtype, huge):
    if not huge:
        return page_aligned_empty(shape, dtype)  # as the engine's CPU pools are
    # An anonymous mapping advised before its first write, so that the kernel backs it with 2 MiB
    # pages where it can (THP in `madvise` mode); the tensor keeps the mapping alive.
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory gets no THP
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def setup(hq, hkv, batch, ctx, dtype, huge=False, copies=1):
    """q, a one-layer pool holding `copies` disjoint sets of the batch's blocks (the same values in
    each), one block table per set (`[copies, batch, blocks]`), and the context lengths."""
    max_blocks = ctx // BLOCK
    nb = batch * max_blocks
    g = torch.Generator().manual_seed(0)
    shape = (1, nb, hkv, BLOCK, HEAD_DIM)
    k, v = (empty((1, copies * nb, hkv, BLOCK, HEAD_DIM), dtype, huge) for _ in range(2))
    for x in (k, v):
        x.view(copies, nb, hkv, BLOCK, HEAD_DIM).copy_(torch.randn(shape, generator=g))
    tables = torch.stack([torch.randperm(nb, generator=g) + c * nb for c in range(copies)])
    tables = tables.to(torch.int32).reshape(copies, batch, max_blocks)
    q = torch.randn(batch, hq, HEAD_DIM, generator=g).to(dtype)
    return q, k, v, tables, torch.full((batch,), ctx, dtype=torch.int32)


def interleave(k, v, huge):
    """`k` and `v` copied into the halves of one tensor, as the engine's CPU pools hold them; the
    halves, and the whole (whose `[blocks, kv_heads]` entries are the runs the kernel reads)."""
    both = empty((*k.shape[:3], 2, *k.shape[3:]), k.dtype, huge)
    both[:, :, :, 0], both[:, :, :, 1] = k, v
    return both[:, :, :, 0], both[:, :, :, 1], both


def cycling(fn, tables):
    """A call of `fn` on the next block table, round robin: with `--cold`, each call reads blocks
    that the calls since its table's last turn (over 2 GiB) have pushed out of the caches."""
    turn = itertools.cycle(tables)
    return lambda: fn(next(turn))


def quantize(x):
    """Rows as the int8 host pool stores them (rotated, one f32 scale per token and KV head)."""
    q, scale = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[:-1], dtype=torch.float32)
    quantize_rows(x, q, scale)
    return q, scale


def tile_read(attn, tables, pools, hkv):
    """The call's memory accesses without its arithmetic: every (sequence, KV head) tile of each
    pool in `pools` (K, V and int8 rows' scales), in block-table order, on the table in turn."""
    heads = torch.arange(hkv, dtype=torch.int32)[None, :, None]
    orders = [(t[:, None, :] * hkv + heads).reshape(-1).contiguous() for t in tables]
    runs = [(p, p[0, 0, 0].numel() * p.element_size()) for p in pools]
    return cycling(lambda order: [attn.gather_read(p, run, order) for p, run in runs], orders)


def kernel_call(engine, q, k, v, lens, scale, out, kwargs, tables):
    """`engine`'s attention over layer 0 of the pools `k`/`v`, on the block tables in turn."""
    return cycling(lambda t: engine.forward(q, k, v, 0, t, lens, scale, out, **kwargs), tables)


def torch_baseline(q, k, v, scale):
    """Gather + SDPA per sequence into a reused workspace (the anchor's method a), as a function
    of the block table."""
    batch, hq, d = q.shape
    _, nb, hkv, bs, _ = k.shape
    kc, vc = k[0].view(nb, hkv, bs * d), v[0].view(nb, hkv, bs * d)
    wk, wv, out = None, None, torch.empty(batch, hq, d, dtype=q.dtype)

    def run(tables):
        nonlocal wk, wv
        mb, idx = tables.shape[1], tables.long()
        if wk is None:
            wk = torch.empty(hkv, mb, bs * d, dtype=k.dtype)
            wv = torch.empty_like(wk)
        for s in range(batch):
            torch.index_select(kc, 0, idx[s], out=wk.transpose(0, 1))
            torch.index_select(vc, 0, idx[s], out=wv.transpose(0, 1))
            qs = q[s].view(hkv, hq // hkv, d)
            ks, vs = wk.view(hkv, mb * bs, d), wv.view(hkv, mb * bs, d)
            out[s] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).view(hq, d)

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, two shapes, few reps")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--dtype", default="bfloat16,float32,int8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--huge-pages", action="store_true", help="2 MiB pages under pools and read buffer")
    ap.add_argument(
        "--cold", action="store_true", help="each call on blocks out of the caches (2 GiB of copies in turn)"
    )
    compare = ap.add_mutually_exclusive_group()
    compare.add_argument("--compare-layouts", action="store_true", help="also time separate K and V pools")
    compare.add_argument(
        "--compare-dots", action="store_true", help="also time the widening path (no dot products)"
    )
    a = ap.parse_args()
    threads = sorted({int(t) for t in a.threads.split(",")})
    dtypes = a.dtype.split(",")
    models, shapes, reps = MODELS, SHAPES, a.reps
    if a.quick:
        models, shapes, reps, dtypes = (
            {"llama3-8b": MODELS["llama3-8b"]},
            [(16, 2048), (64, 512)],
            5,
            dtypes[:1],
        )
    print(f"neo_rs {neo_rs.__version__}: SIMD tiers {neo_rs.simd_tiers()}")
    print(
        f"{'model':10} {'dtype':9} {'BxL':>8} {'thr':>3} {'kernel GB/s':>11} {'read GB/s':>9} "
        f"{'torch GB/s':>10} {'k/bw':>6} {'k/torch':>7} {'Mtok/s':>7} {'tiles GB/s':>10} {'k/tiles':>7}"
        + (" widen dots/widen" if a.compare_dots else "")
        + (" separate inter/sep" if a.compare_layouts else "")
    )
    buf = empty((1 << 28,), torch.float32, a.huge_pages).fill_(1.0)  # 1 GiB, touched once
    for t in threads:
        attn = neo_rs.CpuAttention(num_threads=t)
        widen = widening_engine(t) if a.compare_dots else None
        for name, (hq, hkv) in models.items():
            for dtype in dtypes:
                for batch, ctx in shapes:
                    int8 = dtype == "int8"
                    pool_dtype = torch.bfloat16 if int8 else getattr(torch, dtype)
                    per_copy = 2 * batch * ctx * hkv * HEAD_DIM * pool_dtype.itemsize
                    copies = -(-COLD_BYTES // per_copy) if a.cold else 1
                    q, k, v, tables, lens = setup(hq, hkv, batch, ctx, pool_dtype, a.huge_pages, copies)
                    out = torch.empty_like(q)
                    scale = HEAD_DIM**-0.5
                    separate, sep_kwargs = (k, v), {}
                    kv_bytes = per_copy
                    if int8:
                        (k8, ks), (v8, vs) = quantize(k), quantize(v)
                        separate, sep_kwargs = (k8, v8), dict(k_scale=ks, v_scale=vs)
                        base_bytes, kv_bytes = kv_bytes, 2 * batch * ctx * hkv * (HEAD_DIM + 4)
                    ik, iv, both = interleave(*separate, a.huge_pages)
                    pools, kwargs, read = (ik, iv), {}, (both,)
                    if int8:
                        iks, ivs, scales = interleave(ks, vs, a.huge_pages)
                        kwargs, read = dict(k_scale=iks, v_scale=ivs), (both, scales)
                    args = (q, *pools, lens, scale, out, kwargs, tables)
                    call = kernel_call(attn, *args)
                    # Measured back to back so the ratios share the machine's current state.
                    bw = read_bandwidth(attn, buf, reps)
                    secs = timed(call, reps)
                    tiles = kv_bytes / timed(tile_read(attn, tables, read, hkv), reps) / 1e9
                    torch.set_num_threads(t)
                    base_secs = timed(cycling(torch_baseline(q, k, v, scale), tables), max(3, reps // 3))
                    kern, base = kv_bytes / secs / 1e9, (base_bytes if int8 else kv_bytes) / base_secs / 1e9
                    mtok = batch * ctx / secs / 1e6
                    extra = ""
                    if widen is not None:
                        ours, theirs = timed_pair(call, kernel_call(widen, *args), reps)
                        extra = f" {batch * ctx / theirs / 1e6:5.1f} {theirs / ours:9.2f}"
                    if a.compare_layouts:
                        sep_args = (q, *separate, lens, scale, out, sep_kwargs, tables)
                        ours, theirs = timed_pair(call, kernel_call(attn, *sep_args), reps)
                        extra = f" {batch * ctx / theirs / 1e6:8.1f} {theirs / ours:9.2f}"
                    print(
                        f"{name:10} {dtype:9} {f'{batch}x{ctx}':>8} {t:>3} {kern:11.1f} {bw:9.1f} "
                        f"{base:10.1f} {kern / bw:6.2f} {base_secs / secs:7.1f} {mtok:7.1f} {tiles:10.1f} "
                        f"{kern / tiles:7.2f}{extra}",
                        flush=True,
                    )
    dots = ", ".join(name for name, on in (("int8", attn.int8_dot), ("bf16", attn.bf16_dot)) if on) or "none"
    pages = "2 MiB" if a.huge_pages else "4 KiB"
    print(f"(simd={attn.simd}, dot products: {dots}, {pages} pages)")


if __name__ == "__main__":
    main()
