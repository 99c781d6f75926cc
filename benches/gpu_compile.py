"""Every Triton kernel in ``neo_rs.attention.cuda`` and ``neo_rs.model.cuda`` compiled ahead of time
for the GPUs NEO targets, with no GPU: sm_75 (T4), sm_80 (A100), sm_86 (A10G), sm_89 (L4) and sm_90
(H100/H200). Each kernel is built with the compile-time arguments its launcher picks
(``decode_launch``, ``prefill_launch``, ``moe_launch``, ``grouped_launch``) for head dims
64/80/96/128/256, block sizes 16/32 (the MoE GEMM: 1 and 8 rows per token; the grouped GEMM: int4
in groups of 32, 64 and 128, in fp16 and float32, where it runs instead of tinygemm, and int8 in
groups of 16, 32 and 128 in every dtype; the FP8 GEMM per row, in blocks of 128 and groups of 48), the
16-bit dtype the engine
runs on that target (no bf16 before sm_80: fp16 there) and float32; the attention kernels also
with a sliding window and soft-capping (Gemma's layers) at head dims 128 and 256. The bundled ``ptxas -v``
gives registers and spills; the metadata, shared memory; occupancy follows from the target's
limits. Prints one table (a row per kernel, target and dtype: its worst case) and exits 1 on a
compile error, a spill, or shared memory over the target's limit. Results are cached by the
kernels' source and Triton's version, so a rerun with no kernel change takes a second.

    python benches/gpu_compile.py [--targets 75,80,86,89,90] [--all-rows] [--no-cache]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from neo_rs.attention.cuda import paged_decode, paged_prefill
from neo_rs.environment import cache_dir
from neo_rs.model.cuda import fp8_gemm, fused_moe, grouped_gemm, words
from neo_rs.model.cuda.fp8_gemm import fp8_launch
from neo_rs.model.cuda.grouped_gemm import grouped_launch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

# Triton 3.9 warns once per process that a default will change; the workers would print it each.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")


@dataclass(frozen=True)
class Limits:
    """Per-SM limits of one compute capability (CUDA's occupancy tables)."""

    name: str
    smem_per_block: int  # bytes a block may opt in to
    smem_per_sm: int
    warps_per_sm: int
    blocks_per_sm: int
    regs_per_sm: int = 65536


TARGETS = {
    75: Limits("T4", 65536, 65536, 32, 16),
    80: Limits("A100", 166912, 167936, 64, 32),
    86: Limits("A10G", 101376, 102400, 48, 16),
    89: Limits("L4", 101376, 102400, 48, 24),
    90: Limits("H100/H200", 232448, 233472, 64, 32),
}
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 8)  # decode: the lightest and the heaviest GQA tile; prefill's group is index math only


def engine_dtypes(arch: int) -> tuple[torch.dtype, ...]:
    """A 16-bit model runs in bfloat16 from sm_80 on, in float16 before (no bf16 on a T4)."""
    return (torch.bfloat16 if arch >= 80 else torch.float16, torch.float32)


@dataclass(frozen=True)
class Case:
    kernel: str  # "decode" | "prefill"
    arch: int
    dtype: str
    head_dim: int
    block_size: int
    group: int
    windowed: bool = False  # with a sliding window and soft-capping compiled in


@dataclass
class Built:
    registers: int
    spill_bytes: int
    smem: int
    warps: int
    occupancy: float
    error: str = ""


KERNELS = {
    "decode": (paged_decode._paged_decode_split, paged_decode.decode_launch),
    "prefill": (paged_prefill._paged_prefill, paged_prefill.prefill_launch),
    # The grouped expert GEMM: its only shape-dependent constant is the rows each token feeds
    # (``group`` stands for it: 1 for the down projection, top-k for gate/up).
    "moe": (
        fused_moe._moe_gemm,
        lambda rows, _hd, _bs, dtype: {**fused_moe.moe_launch(dtype), "ROWS_PER_TOKEN": rows},
    ),
    # The grouped weight-only GEMM, 4 and 8 bits (``group``: the quantization's group size).
    "int4": (grouped_gemm._grouped_gemm, lambda group, _hd, _bs, dt: grouped_launch(dt, group, 4)),
    "int8": (grouped_gemm._grouped_gemm, lambda group, _hd, _bs, dt: grouped_launch(dt, group, 8)),
    # The FP8 weight-only GEMM (``group``: block-wise scales' columns; 0: a scale per row).
    "fp8": (fp8_gemm._fp8_gemm, lambda group, _hd, _bs, dt: fp8_launch(dt, group or 1, per_row=not group)),
}


def signature(fn: triton.JITFunction, dtype: torch.dtype, constants: dict) -> dict[str, str]:
    """Argument types as the launchers pass them: q/k/v as the pool's words (bf16 as int16 bits),
    block tables int32 for decode and int64 for prefill, outputs and partials float32."""
    element = {torch.bfloat16: "*i16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    by_name = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "tables_ptr": "*i32"}
    by_name |= {"lens_ptr": "*i32", "table_ptr": "*i64", "scale": "fp32", "softcap": "fp32"}
    by_name |= {"a_ptr": element, "w_ptr": element, "sorted_ptr": "*i32", "block_expert_ptr": "*i32"}
    packed = "*i16" if constants.get("BITS") == 8 else "*u8"  # the grouped GEMM's pairs: words or bytes
    by_name |= {"x_ptr": element, "packed_ptr": packed, "sz_ptr": element, "weight_ptr": "*u8"}
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = by_name.get(name, "*fp32")
        else:
            sig[name] = by_name.get(name, "i32")
    return sig


def ptxas(arch: int) -> str:
    """The ptxas in Triton's wheel (newer Triton picks one per architecture, older has one)."""
    try:
        return get_ptxas(arch).path  # type: ignore[call-arg]
    except TypeError:
        return get_ptxas().path  # type: ignore[call-arg]


def occupancy(limits: Limits, registers: int, smem: int, warps: int) -> float:
    """Resident warps over the SM's maximum, from registers (allocated per warp in 256s), shared
    memory and the block and warp limits."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    blocks = min(
        limits.blocks_per_sm,
        limits.warps_per_sm // warps,
        limits.regs_per_sm // (regs_per_warp * warps),
        limits.smem_per_sm // smem if smem else limits.blocks_per_sm,
    )
    return blocks * warps / limits.warps_per_sm


def build(case: Case) -> Built:
    fn, launch = KERNELS[case.kernel]
    dtype = getattr(torch, case.dtype)
    kind = (True, True) if case.windowed else ()
    constants = launch(case.group, case.head_dim, case.block_size, dtype, *kind)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages") if k in constants}
    warps = options.setdefault("num_warps", 4)
    try:
        src = ASTSource(fn, signature(fn, dtype, constants), constants)
        compiled = triton.compile(src, target=GPUTarget("cuda", case.arch, 32), options=options)
    except Exception as e:  # noqa: BLE001 (the table reports any compile failure)
        return Built(0, 0, 0, warps, 0.0, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        gpu = target.group(1) if target else f"sm_{case.arch}"
        cmd = [ptxas(case.arch), "-v", "--gpu-name", gpu, f.name, "-o", os.devnull]
        run = subprocess.run(cmd, capture_output=True, text=True)
    report = run.stdout + run.stderr
    if run.returncode:
        return Built(0, 0, 0, warps, 0.0, f"ptxas: {report.strip().splitlines()[-1][:200]}")
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    smem = compiled.metadata.shared
    return Built(registers, spills, smem, warps, occupancy(TARGETS[case.arch], registers, smem, warps))


def cases(archs: list[int]) -> list[Case]:
    out = []
    for arch, hd, bs in itertools.product(archs, HEAD_DIMS, BLOCK_SIZES):
        for dtype in engine_dtypes(arch):
            name = str(dtype).removeprefix("torch.")
            out += [Case("decode", arch, name, hd, bs, g) for g in GROUPS]
            out.append(Case("prefill", arch, name, hd, bs, 4))
            if hd >= 128:
                out += [
                    Case("decode", arch, name, hd, bs, 8, True),
                    Case("prefill", arch, name, hd, bs, 4, True),
                ]
    for arch in archs:
        for dtype in engine_dtypes(arch):
            out += [Case("moe", arch, str(dtype).removeprefix("torch."), 0, 0, rows) for rows in (1, 8)]
        # Our int4 GEMM runs where tinygemm does not: fp16 (and float32) on every target. Grouped
        # int8 has no other kernel: every dtype, in a GGUF's groups (16, 32) and GPTQ's (128).
        for dtype, group in itertools.product(("float16", "float32"), (32, 64, 128)):
            out.append(Case("int4", arch, dtype, 0, 0, group))
        int8_dtypes = {str(d).removeprefix("torch.") for d in engine_dtypes(arch)} | {"float16"}
        for dtype, group in itertools.product(sorted(int8_dtypes), (16, 32, 128)):
            out.append(Case("int8", arch, dtype, 0, 0, group))
        # FP8 weight-only wherever _scaled_mm does not run: per row, blocks of 128, groups of 48.
        for dtype, group in itertools.product(sorted(int8_dtypes), (0, 128, 48)):
            out.append(Case("fp8", arch, dtype, 0, 0, group))
    return out


def source_key() -> str:
    """The kernels' source, this script's and Triton's version: what the results depend on."""
    h = hashlib.sha256(triton.__version__.encode())
    h.update(Path(__file__).read_bytes())
    for module in (paged_decode, paged_prefill, fused_moe, grouped_gemm, fp8_gemm, words):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:20]


def failures(results: dict[Case, Built]) -> list[str]:
    bad = []
    for c, b in results.items():
        what = f"{c.kernel} sm_{c.arch} {c.dtype} head_dim {c.head_dim} block {c.block_size} group {c.group}"
        what += " windowed" if c.windowed else ""
        if b.error:
            bad.append(f"{what}: {b.error}")
        elif b.spill_bytes:
            bad.append(f"{what}: {b.spill_bytes} bytes spilled ({b.registers} registers)")
        elif b.smem > TARGETS[c.arch].smem_per_block:
            bad.append(f"{what}: {b.smem} bytes of shared memory, over {TARGETS[c.arch].smem_per_block}")
    return bad


def table(results: dict[Case, Built], all_rows: bool) -> list[str]:
    head = f"{'kernel':<8}{'target':<16}{'dtype':<10}{'cases':>6}{'regs max':>10}{'smem max':>10}"
    lines = [head + f"{'spilled':>9}{'occupancy min':>15}{'failed':>8}"]
    groups: dict[tuple, list[tuple[Case, Built]]] = {}
    for c, b in results.items():
        key = (c.kernel, c.arch, c.dtype) + (
            (c.head_dim, c.block_size, c.group, c.windowed) if all_rows else ()
        )
        groups.setdefault(key, []).append((c, b))
    for key, rows in groups.items():
        built = [b for _, b in rows if not b.error]
        kernel, arch, dtype = key[:3]
        where = f"sm_{arch} {TARGETS[arch].name}" + (
            " hd{} bs{} g{} w{:d}".format(*key[3:]) if all_rows else ""
        )
        regs = max((b.registers for b in built), default=0)
        smem = max((b.smem for b in built), default=0)
        spilled = sum(1 for b in built if b.spill_bytes)
        occ = min((b.occupancy for b in built), default=0.0)
        failed = len(rows) - len(built)
        lines.append(
            f"{kernel:<8}{where:<16}{dtype:<10}{len(rows):>6}{regs:>10}{smem:>10}{spilled:>9}{occ:>15.0%}{failed:>8}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities, e.g. 75,90")
    ap.add_argument("--all-rows", action="store_true", help="a row per case, not per kernel and target")
    ap.add_argument("--no-cache", action="store_true", help="compile everything again")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    archs = [int(a) for a in args.targets.split(",")]
    todo = cases(archs)
    store = cache_dir() / "gpu_compile" / f"{source_key()}.json"
    cached: dict[str, dict] = {}
    if store.is_file() and not args.no_cache:
        cached = json.loads(store.read_text())
    missing = [c for c in todo if json.dumps(asdict(c)) not in cached]
    print(f"{len(todo)} kernel builds, {len(todo) - len(missing)} cached ({store})", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for c, b in zip(missing, pool.map(build, missing), strict=True):
            cached[json.dumps(asdict(c))] = asdict(b)
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached))
    tmp.replace(store)
    results = {c: Built(**cached[json.dumps(asdict(c))]) for c in todo}
    print(f"Triton {triton.__version__}, ptxas from its wheel; no GPU needed")
    print("\n".join(table(results, args.all_rows)))
    bad = failures(results)
    for line in bad:
        print("FAIL", line)
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
