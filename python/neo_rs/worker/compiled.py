"""The decoder stack compiled by Inductor on a CPU device: vLLM's ``torch.compile`` on the CPU.
One graph runs every layer, so the elementwise work between the GEMMs (RMSNorm, RoPE, SwiGLU,
residuals) runs as fused C++ loops instead of one eager op and one Python dispatch each, 30 layers
deep. Prepacked linears (``neo_rs::packed_linear``) and each layer's attention with its KV writes
(``neo_rs::layer_attention``: the runner's ``attend``) are opaque ops in the graph. That op is
also NEO's hand-off: its CPU decodes' rows go to the Rust kernel over the host pool, and the op
returns once they are back; host prefills' K/V and the layer's share of the plan's swaps are
copied there too, in eager's order.

Which iterations: every one of a single batch, prompt chunks and decodes alike (a decode
verifying drafts is a row per position, ``attention/metadata.py``), over either pool or both.
NEO's two sub-batches (its asymmetric pipeline) run one after the other, a run each, where the
kernel runs on the model's OpenMP team (the default): it is done when submitted, so interleaving
their layers would overlap nothing (SmolLM2 bf16, ``--offload neo``: 0.71-0.81x the time of an
eager pipelined iteration). Beside the kernel's own threads (``NEO_RS_OPENMP_TEAM=0``) they run
eagerly, their layers interleaved. A burst of 64 prompts of 128 tokens spent a sixth of its eager
time in the elementwise ops between the GEMMs.

Shapes: one graph takes any number of rows (``dynamic=True``), and Dynamo specializes one row on
its own: two graphs per model (``MAX_GRAPHS``; ``graphs`` counts them), both built at start-up.
The one-row graph is kept (``mark_unbacked`` would fold it into the other): single-stream decode
is 0.5 ms a token faster with it, at 3 s more start-up.

Start-up: Inductor's cache sits under ``neo_rs``'s cache folder, so a later start compiles from
it (SmolLM2: 52 s with an empty cache). Dynamo's tracing of 30 layers still took 3.5-4 s a
graph, most of a warm start; so each graph is compiled ahead of time (torch's ``aot_compile``)
and saved in Inductor's cache folder (``neo_rs_stacks/``), and a later start loads it instead of
tracing (``loaded`` counts them). A saved graph is found by a hash of everything its code depends on
but its inputs' values: torch's version, the CPU's vector ISA and thread count, ``neo_rs``'s
Python sources, the model's config, and its layers' module types, scalar attributes and
parameter shapes (the weights are inputs of the graph, not constants).

Guards: the graphs run with none checked (a traced call checked every guard of the stack's inputs,
30 layers' modules and parameters, 0.2-0.4 ms of a single stream's 10 ms token): ``serves`` picks
the graph by the row count, for hidden states of the dtype they were built for, and nothing else
about the inputs changes after start-up. Other hidden states go through Dynamo, which traces (and
counts) a graph for them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from neo_rs.attention.metadata import AttentionBatch, DecodeRows
from neo_rs.kv.layer_copies import LayerCopies
from neo_rs.model.decoder import CausalLM, DecoderLayer, DenseMlp, RMSNorm, Rope
from neo_rs.model.graph_ops import bound_linears, graph_op, number_linears
from neo_rs.model.packed import PackedLinear
from neo_rs.model.quant import GroupedInt8Linear, Int4Linear, Int8Linear
from neo_rs.timing import HostWaits, StageClock

log = logging.getLogger(__name__)

MAX_GRAPHS = 2  # one row, and any other number (Dynamo specializes one row)
# Inductor checks the size, stride and alignment of every op's output at run time by default:
# 300 checks a token, 0.4 ms of a single stream's 12.5 (1.03x, alternating A/B). Our ops' fake
# implementations are held to the real ones by ``torch.library.opcheck`` in the tests instead.
# The graph's wrapper in C++ rather than Python (``cpp_wrapper``): the calls of its fused kernels
# and the bookkeeping of its buffers leave the interpreter, one stream 0.94-0.99x the time a
# token (alternating A/B, Zen 5), for about 16 s more of a cold start and 0.5 s of a warm one.
_INDUCTOR = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False, "cpp_wrapper": True}
# Dynamo makes the layers' float attributes (RMSNorm's eps) inputs of the graph, turned into
# tensors on every call: 60 calls of ``torch.as_tensor`` a token on SmolLM2. Specialized, they
# are constants of the generated code (one stream 0.89-0.97x the time a token, alternating A/B).
# Set around our calls that may trace (Dynamo reads it then); other compiled code keeps torch's.
_DYNAMO: dict[str, Any] = {"specialize_float": True}


# Layer i's KV writes and whole attention of a batch, the plan's copies around the writes
# (``ModelRunner.attend``).
Attend = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, LayerCopies | None, StageClock],
    torch.Tensor,
]


@dataclass
class _Step:
    """What ``neo_rs::layer_attention`` needs of the iteration running in this thread."""

    attend: Attend
    batch: AttentionBatch
    copies: LayerCopies | None
    clock: StageClock
    attention_ms: float = 0.0


_current = threading.local()


def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


@graph_op("layer_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor", _attention_shape)
def _layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention, its rows' K/V written first: the pools change behind the
    graph's back, which is safe as nothing in the graph reads them."""
    step: _Step = _current.step
    t = time.perf_counter()
    out = step.attend(layer, q, k, v, step.batch, step.copies, step.clock)
    step.attention_ms += (time.perf_counter() - t) * 1e3
    return out


def _stack(layers: Sequence[DecoderLayer], x: torch.Tensor, rope: Rope) -> torch.Tensor:
    for i, layer in enumerate(layers):
        q, k, v = layer.pre_attention(x, rope)
        x = layer.post_attention(torch.ops.neo_rs.layer_attention(q, k, v, i), x)
    return x


def why_eager(model: CausalLM, device: torch.device, tp_size: int) -> str | None:
    """Why this model's decodes cannot run compiled here; None when they can."""
    if device.type != "cpu":
        return "the device is not the CPU (CUDA graphs are the GPU's)"
    if tp_size > 1:
        return "tensor parallelism"
    kinds = {type(m) for layer in model.decoder_layers for m in layer.modules()}
    other = sorted(k.__name__ for k in kinds - _TRACED)
    return f"{', '.join(other)} in the decoder layers" if other else None


# The modules whose compiled tokens are tested against eager's (test_compiled.py). A sparse MLP's
# routing has data-dependent shapes; FP8 linears are not tested compiled.
_TRACED = {
    DecoderLayer,
    DenseMlp,
    RMSNorm,
    nn.Linear,
    PackedLinear,
    Int4Linear,
    Int8Linear,
    GroupedInt8Linear,
}


class CompiledStack:
    """The compiled stack of one model, its attention ``attend`` (``run`` a batch)."""

    def __init__(self, model: CausalLM, attend: Attend) -> None:
        self.model, self.attend = model, attend
        self.linears = number_linears(model)
        self._inductor = _Inductor()
        self.runs = 0  # iterations run compiled
        self.loaded = 0  # graphs loaded from earlier starts' ``aot_compile``
        self._warm_dtype: torch.dtype | None = None  # the hidden states' dtype, once warm_up ran
        # The graphs warm_up built or loaded, by whether they take one row.
        self._graphs: dict[bool, Callable[..., torch.Tensor]] = {}
        # Dynamo keeps graphs and their guards on the function's code object: a copy of it per
        # model keeps every model's two graphs apart (one shared code object would count the
        # graphs of all the process's models against one recompile limit).
        stack = types.FunctionType(_stack.__code__.replace(), _stack.__globals__, "_stack")
        self._fn: Callable[..., torch.Tensor] = torch.compile(
            stack, backend=self._inductor, dynamic=True, fullgraph=True
        )

    @property
    def graphs(self) -> int:
        """Graphs traced or loaded so far."""
        return self._inductor.graphs + self.loaded

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build (or load) both graphs now, not in the first requests' iterations, and run each
        on one step of decodes at position 0 of block 0, which nothing holds yet (the pools are
        new)."""
        t = time.perf_counter()
        hidden = self.model.config.hidden_size
        dtype = self.model.embed_tokens.weight.dtype
        clock = StageClock(torch.device("cpu"), HostWaits(), timed=False)
        for rows in range(1, MAX_GRAPHS + 1):
            tables = torch.zeros(rows, 1, dtype=torch.int32)
            lens = torch.ones(rows, dtype=torch.int32)
            none = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
            batch = AttentionBatch(
                tokens=slice(0, rows),
                device_writes=[],
                host_writes=None,
                gpu_decodes=DecodeRows(0, rows, tables, lens, 1, tables, lens),
                cpu_decodes=DecodeRows(rows, rows, *none, 0, *none),
                prefills=[],
                append_decodes=True,
            )
            x, positions = torch.zeros(rows, hidden, dtype=dtype), torch.zeros(rows, dtype=torch.long)
            rope = self.model.rotary.at(positions, dtype)
            self._graphs[rows == 1] = self._built(rows, (self.model.decoder_layers, x, rope))
            self._warm_dtype = dtype
            self._call(x, positions, _Step(self.attend, batch, None, clock))
        log.info(
            "built the decoder stack in %.1f s (%d graphs traced, %d loaded)",
            time.perf_counter() - t,
            self._inductor.graphs,
            self.loaded,
        )

    def _built(self, rows: int, args: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
        """The graph for ``rows`` rows like ``args``: saved by an earlier start, else compiled
        ahead of time and saved; where torch has no ``aot_compile``, the traced function itself."""
        if not hasattr(self._fn, "aot_compile"):
            return self._fn  # traced by warm_up's call, its guards checked on every call
        path = _saved_graphs() / _graph_name(self.model, rows)
        if path.exists():
            try:
                with path.open("rb") as f:
                    fn: Any = torch.compiler.load_compiled_function(f)
                fn.disable_guard_check()
                self.loaded += 1
                return cast(Callable[..., torch.Tensor], fn)
            except Exception as e:  # another torch's artifact, a truncated file: trace anew
                log.warning("could not load the saved decoder stack %s, compiling it: %s", path, e)
        with bound_linears(self.linears), torch._dynamo.config.patch(_DYNAMO):
            fn = self._fn.aot_compile((args, {}))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(path))
        except Exception as e:  # a read-only cache: serve, only a slower start next time
            log.warning("could not save the decoder stack to %s: %s", path, e)
        fn.disable_guard_check()
        return cast(Callable[..., torch.Tensor], fn)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether a graph built at start-up runs hidden states ``x`` unchecked: of the dtype they
        were built for, one row or more (anything else goes through Dynamo, and may trace)."""
        rows = x.shape[0] if x.dim() == 2 else 0
        return x.dtype == self._warm_dtype and rows >= 1 and (rows == 1) in self._graphs

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        copies: LayerCopies | None,
        clock: StageClock,
    ) -> torch.Tensor:
        """The final hidden states of a single batch, the plan's ``copies`` made layer by layer;
        its attention is timed by kind (``gpu_decode``, ``prefill_attn``, the wait for CPU
        decodes) inside the op, the rest as ``linear``."""
        t = time.perf_counter()
        step = _Step(self.attend, batch, copies, clock)
        x = self._call(x, positions, step)
        clock.record_ms("linear", (time.perf_counter() - t) * 1e3 - step.attention_ms)
        self.runs += 1
        return x

    def _call(self, x: torch.Tensor, positions: torch.Tensor, step: _Step) -> torch.Tensor:
        """The stack's output, ``step``'s op calls timed in its ``attention_ms``."""
        rope = self.model.rotary.at(positions, x.dtype)
        _current.step = step
        try:
            fn = self._graphs[x.shape[0] == 1] if self.serves(x) else self._fn
            # Through Dynamo, which may trace, the float attributes are specialized.
            dynamo = torch._dynamo.config.patch(_DYNAMO) if fn is self._fn else contextlib.nullcontext()
            with bound_linears(self.linears), dynamo:
                return fn(self.model.decoder_layers, x, rope)
        finally:
            _current.step = None


class _Inductor:
    """Dynamo's backend: Inductor, counting the graphs it compiles. Dynamo keeps its backend for
    as long as the code it compiled, on the code object where the garbage collector does not
    look: it holds nothing of the stack, else every model compiled in the process, its pools and
    runner, would live as long as the process."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx  # Inductor loads only when a model compiles

        self.graphs += 1
        log.info("compiling the decoder stack: graph %d (inputs %s)", self.graphs, _shapes(inputs))
        if self.graphs > MAX_GRAPHS:
            log.warning("the decoder stack compiled %d graphs (at most %d expected)", self.graphs, MAX_GRAPHS)
        return cast(Callable[..., Any], compile_fx(gm, inputs, config_patches=_INDUCTOR))


def _saved_graphs() -> Path:
    """The folder of saved graphs: in Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``), whose
    compiled kernels they were built with, so that an empty Inductor cache is a cold start."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "neo_rs_stacks"


@functools.cache
def _sources_digest() -> bytes:
    """A hash of ``neo_rs``'s Python sources, read once a process."""
    h = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(source.read_bytes())
    return h.digest()


def _graph_name(model: CausalLM, rows: int) -> str:
    """The file of the graph for ``rows`` rows: a hash of everything its code depends on but its
    inputs' values (the module docstring lists them)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    h = hashlib.sha256(_sources_digest())
    layers = nn.ModuleList(model.decoder_layers)
    # A module's scalars are constants of the graph (an eps, a slot, a compute dtype), its
    # tensors inputs of it: their shapes and dtypes.
    scalars = (bool, int, float, str, torch.dtype, type(None))
    modules = [
        (name, type(m).__qualname__, [(k, repr(v)) for k, v in vars(m).items() if isinstance(v, scalars)])
        for name, m in layers.named_modules()
    ]
    tensors = [(name, tuple(t.shape), t.dtype) for name, t in layers.state_dict(keep_vars=True).items()]
    machine = (torch.__version__, platform.machine(), str(pick_vec_isa()), torch.get_num_threads())
    for part in (machine, rows, model.config, modules, tensors, _INDUCTOR, _DYNAMO):
        h.update(repr(part).encode())
    return f"{h.hexdigest()[:32]}-{rows}.bin"


def _shapes(inputs: list[Any]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 1)[:200]
