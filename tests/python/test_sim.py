"""The offload simulator: deterministic and monotonic in the hardware it is given. The shape
tests are characterisation against NEO's published findings, not the simulator's own numbers:
on A10G + Llama-3-8B the gain grows with host bandwidth and peaks at intermediate output lengths.
They assert orderings only (no margins fitted to today's output); whether ``neo`` stays above
``none`` is not asserted, since the simulated policy prices its choices with the same cost model
and would hold it by construction."""

from __future__ import annotations

import dataclasses
import json

import pytest
from neo_rs.bench import workloads
from neo_rs.bench.arrivals import arrival_times
from neo_rs.sim.__main__ import main as sim_main
from neo_rs.sim.cost import CostModel
from neo_rs.sim.profiles import GPUS, HOSTS, MODELS
from neo_rs.sim.simulate import SimResult, capacity_at_slo, simulate


def run(gpu: str, host: str, model: str, mode: str, out: int, n: int = 200, **gpu_over: float) -> SimResult:
    g = dataclasses.replace(GPUS[gpu], **gpu_over) if gpu_over else GPUS[gpu]
    cost = CostModel(g, HOSTS[host], MODELS[model])
    reqs = workloads.synthetic(n, 1000, out, seed=0)
    return simulate(cost, mode, reqs, arrival_times(n, float("inf"), 1.0, 0))


def test_deterministic() -> None:
    a = run("A10G", "g5.8xlarge", "llama-3-8b", "neo", 200, n=2000)
    b = run("A10G", "g5.8xlarge", "llama-3-8b", "neo", 200, n=2000)
    assert a == dataclasses.replace(b, scheduler_us_per_iteration=a.scheduler_us_per_iteration)
    assert a.completed == 2000 and a.rejected == 0


def test_monotonic_in_gpu_memory_and_host_bandwidth() -> None:
    base = [
        run("A10G", "g5.4xlarge", "llama-3-8b", "none", 200, mem_gib=m).output_throughput
        for m in (20, 24, 32)
    ]
    assert base == sorted(base)
    neo = [
        run("A10G", h, "llama-3-8b", "neo", 200).output_throughput
        for h in ("g5.2xlarge", "g5.8xlarge", "g5.16xlarge")
    ]
    assert neo == sorted(neo)


def test_paper_shape_on_a10g_llama3_8b() -> None:
    gains = {}
    for host in ("g5.2xlarge", "g5.16xlarge"):
        for out in (50, 200, 400):
            gains[host, out] = (
                run("A10G", host, "llama-3-8b", "neo", out).output_throughput
                / run("A10G", host, "llama-3-8b", "none", out).output_throughput
            )
    assert gains["g5.16xlarge", 200] > gains["g5.2xlarge", 200], gains  # host bandwidth pays
    assert gains["g5.16xlarge", 200] > gains["g5.16xlarge", 50], gains  # short outputs gain little


def test_gain_peaks_at_intermediate_outputs() -> None:
    # Where the host is what bounds the CPU tier (g5.8xlarge), the gain rises from short outputs
    # and falls back toward the baseline for long ones, whose CPU attention no longer hides.
    gains = {
        out: run("A10G", "g5.8xlarge", "llama-3-8b", "neo", out, n=1000).output_throughput
        / run("A10G", "g5.8xlarge", "llama-3-8b", "none", out, n=1000).output_throughput
        for out in (50, 200, 800)
    }
    assert gains[200] > gains[50] and gains[200] > gains[800], gains


def test_cli_prints_a_verdict(capsys) -> None:  # noqa: ANN001
    sim_main(
        [
            "--gpu",
            "T4",
            "--host",
            "g4dn.4xlarge",
            "--model",
            "llama-2-7b",
            "--workload",
            "osc",
            "--num-requests",
            "100",
        ]
    )
    text = capsys.readouterr().out
    assert "neo vs none" in text and "CPU offloading helps" in text


def test_calibration_recovers_known_efficiencies(tmp_path, checkpoints, capsys) -> None:  # noqa: ANN001
    from neo_rs.sim.calibrate import fit
    from neo_rs.sim.cost import Efficiency

    truth = Efficiency(gemm=0.45, gpu_mem=0.7, attn=0.3, cpu_mem=0.5, pcie=0.6, cpu_handoff_ms=0.07)
    cost = CostModel(GPUS["A10G"], HOSTS["g5.4xlarge"], MODELS["llama-3-8b"], truth)
    got = fit(dataclasses.replace(cost, eff=Efficiency()), cost.tables(4096))
    for name in ("gemm", "gpu_mem", "attn", "cpu_mem", "pcie", "cpu_handoff_ms"):
        assert abs(getattr(got, name) / getattr(truth, name) - 1) < 0.05, name
    # The CLI reads an engine profile of this machine's tiny model and prints the factors.
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(dataclasses.asdict(cost.tables(256))))
    sim_main(
        [
            "--calibrate",
            str(path),
            "--model-dir",
            str(checkpoints["llama"]),
            "--gpu",
            "A10G",
            "--host",
            "server",
        ]
    )
    fitted = json.loads(capsys.readouterr().out)
    assert set(fitted) == {f.name for f in dataclasses.fields(Efficiency)}


def test_keep_up_separates_sustained_from_overloaded_rates() -> None:
    cost = CostModel(GPUS["A10G"], HOSTS["g5.4xlarge"], MODELS["llama-3-8b"])
    reqs = workloads.synthetic(600, 1000, 100, 0)
    capacity = simulate(cost, "none", reqs, arrival_times(len(reqs), float("inf"), 1.0, 0)).request_throughput
    light = simulate(cost, "none", reqs, arrival_times(len(reqs), 0.5 * capacity, 1.0, 0))
    heavy = simulate(cost, "none", reqs, arrival_times(len(reqs), 1.5 * capacity, 1.0, 0))
    assert light.keep_up >= 0.95
    assert heavy.keep_up < 0.8


@pytest.mark.parametrize(
    ("gpu", "host", "model", "reqs", "slo_ms"),
    [
        # The device pool holds ~1,700 tokens: offloading is what scales (the paper: up to 7.5x).
        ("T4", "g4dn.4xlarge", "llama-2-7b", workloads.osc(300, seed=0), 1000),
        # A wide host: the CPU tier carries part of the decode load at the same latency (the
        # paper: up to 1.79x).
        ("A10G", "g5.16xlarge", "llama-3-8b", workloads.synthetic(1000, 1000, 300, 0), 300),
    ],
)
def test_equal_latency_capacity(gpu, host, model, reqs, slo_ms) -> None:  # noqa: ANN001
    cost = CostModel(GPUS[gpu], HOSTS[host], MODELS[model])
    neo, run_neo = capacity_at_slo(cost, "neo", reqs, slo_ms)
    none, run_none = capacity_at_slo(cost, "none", reqs, slo_ms)
    assert run_neo is not None and run_none is not None
    assert run_neo.per_token_latency_ms <= slo_ms and run_none.per_token_latency_ms <= slo_ms
    assert run_neo.keep_up >= 0.95 and run_none.keep_up >= 0.95
    assert neo > none


def test_int8_host_kv_is_read_at_its_width() -> None:
    # Llama-3-8B: 8 KV heads x 128 dims; int8 stores each row in 128 bytes plus a 4-byte scale,
    # against 256 bytes in bf16.
    auto = CostModel(GPUS["A10G"], HOSTS["g5.8xlarge"], MODELS["llama-3-8b"])
    int8 = dataclasses.replace(auto, cpu_kv_int8=True)
    assert int8.host_kv_bytes_per_token_layer() == 2 * 8 * (128 + 4)
    assert auto.host_kv_bytes_per_token_layer() == 2 * 8 * 128 * 2
    ratio = (128 + 4) / 256
    assert int8.num_cpu_blocks() == pytest.approx(auto.num_cpu_blocks() / ratio, rel=1e-3)
    assert int8.num_gpu_blocks() == auto.num_gpu_blocks()
    slope = lambda c: c.cpu_decode_ms(1, 2e6) - c.cpu_decode_ms(1, 1e6)  # noqa: E731
    assert slope(int8) == pytest.approx(slope(auto) * ratio)


def test_quantized_weights_free_their_bytes_for_kv_and_are_read_at_their_width() -> None:
    # Llama-2-7B on a T4: fp16 weights leave 16 GB less room than int4 ones take; the decoder
    # weights only (the embeddings and the LM head stay fp16).
    from neo_rs.sim.profiles import WEIGHT_BITS

    base = CostModel(GPUS["T4"], HOSTS["g4dn.4xlarge"], MODELS["llama-2-7b"])
    m = MODELS["llama-2-7b"]
    layer_bytes = m.num_layers * m.layer_params()
    for weights, bits in WEIGHT_BITS.items():
        q = dataclasses.replace(base, model=dataclasses.replace(m, weight_bits=bits))
        saved = base.rank_model.weight_bytes() - q.rank_model.weight_bytes()
        assert saved == pytest.approx(layer_bytes * (2 - bits / 8), rel=1e-6), weights
        blocks = saved / base.block_bytes()
        assert q.num_gpu_blocks() - base.num_gpu_blocks() == pytest.approx(blocks, abs=1), weights
        assert q.num_cpu_blocks() == base.num_cpu_blocks()
        # One decode row is bound by reading the layer's weights: their share of the time.
        ratio = (q.linear_ms(1) - 7 * q.eff.kernel_launch_ms) / (
            base.linear_ms(1) - 7 * base.eff.kernel_launch_ms
        )
        assert ratio == pytest.approx(bits / 16, rel=1e-6), weights


def test_cli_takes_quantized_weights(capsys) -> None:  # noqa: ANN001
    args = ["--gpu", "T4", "--host", "g4dn.4xlarge", "--model", "llama-2-7b", "--num-requests", "100"]
    sim_main([*args, "--modes", "neo,none", "--weights", "int4"])
    out = capsys.readouterr().out
    assert "llama-2-7b (int4 weights): device KV" in out and "neo vs none:" in out


def test_tensor_parallel_profiles_price_one_rank_with_the_engines_shapes() -> None:
    from neo_rs.config import ModelConfig
    from neo_rs.parallel.shards import TpShard

    m = MODELS["llama-3-70b"]
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": m.vocab,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
    }
    engine = TpShard(0, 2).local_config(ModelConfig.from_hf(hf))
    pair = CostModel(GPUS["2xH100"], HOSTS["server"], m)
    rank = pair.rank_model
    assert (rank.num_heads, rank.num_kv_heads, rank.ffn, rank.vocab) == (
        engine.num_heads,
        engine.num_kv_heads,
        engine.intermediate_size,
        engine.vocab_size,
    )
    # One rank's KV and transfers are half the model's; its pool is one GPU's memory less its
    # half of the weights.
    assert pair.block_bytes() * 2 == CostModel(GPUS["H100"], HOSTS["server"], m).block_bytes()
    assert (
        pair.transfer_bytes_per_decode() * 2
        == CostModel(GPUS["H100"], HOSTS["server"], m).transfer_bytes_per_decode()
    )
    # The all-reduces cost something, more for more tokens, and nothing on one GPU.
    assert 0 < pair.all_reduce_ms(1) < pair.all_reduce_ms(4096)
    assert CostModel(GPUS["H100"], HOSTS["server"], m).all_reduce_ms(4096) == 0
    no_link = dataclasses.replace(GPUS["2xH100"], link_gbps=0)
    with pytest.raises(ValueError, match="link_gbps"):
        CostModel(no_link, HOSTS["server"], m).linear_ms(16)


@pytest.mark.parametrize(
    ("model", "total_b", "active_b"), [("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9)]
)
def test_moe_profiles_hold_every_expert_and_multiply_the_active_ones(
    model: str, total_b: float, active_b: float
) -> None:
    m = MODELS[model]
    embeddings = 2 * m.vocab * m.hidden
    # The published parameter counts (config.json shapes), within 2%.
    assert m.weight_bytes() / m.dtype_bytes / 1e9 == pytest.approx(total_b, rel=0.02)
    active = m.num_layers * m.active_layer_params() + embeddings
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)
    # One token reads only its experts' weights; a large batch reads nearly all of them.
    reads = [m.read_layer_params(t) for t in (1, 8, 4096)]
    assert reads == sorted(reads) and reads[0] == pytest.approx(m.active_layer_params(), rel=0.01)
    assert reads[-1] == pytest.approx(m.layer_params(), rel=1e-3)
    # One rank of two holds half of every expert.
    assert m.shard(2).ffn == m.ffn // 2 and m.shard(2).experts == m.experts


def test_cli_prints_neo_against_none_for_an_moe_model(capsys) -> None:  # noqa: ANN001
    sim_main(
        [
            "--gpu",
            "2xH100",
            "--host",
            "server",
            "--model",
            "mixtral-8x7b",
            "--num-requests",
            "200",
            "--modes",
            "neo,none",
        ]
    )
    out = capsys.readouterr().out
    assert "2xH100 + server + mixtral-8x7b: device KV" in out and "neo vs none:" in out


def test_neo_never_recomputes_prompts_longer_than_the_token_budget(monkeypatch) -> None:  # noqa: ANN001
    # 5,000-token prompts over a 4,096-token budget run in two chunks. NEO once admitted such a
    # prompt on one chunk's room; the device then filled, the newest request (halfway through
    # its prompt) was recomputed, and admitted again: 840 recomputes for 100 requests, a fifth
    # of none's throughput. A chunked prompt now starts only where all of it fits.
    import neo_rs.sim.simulate as sim

    made = []
    scheduler = sim.Scheduler

    def keep(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(scheduler(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sim, "Scheduler", keep)
    cost = CostModel(GPUS["A10G"], HOSTS["g5.16xlarge"], MODELS["llama-3-8b"])
    reqs = workloads.synthetic(100, 5000, 400, seed=0)
    neo = simulate(cost, "neo", reqs, arrival_times(100, float("inf"), 1.0, 0))
    assert made[-1].stats()["num_recomputed"] == 0
    none = simulate(cost, "none", reqs, arrival_times(100, float("inf"), 1.0, 0))
    assert neo.iterations <= 1.05 * none.iterations  # no chunk run twice
