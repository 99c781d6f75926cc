"""The CPU emulation of CUDA's asynchronous copies: a device->host destination holds poison until
its wait, copies land in stream order, and the block and row moves into the host pool are whole
exactly at ``ready()``; the plan's layer-by-layer copies keep their order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from neo_rs.kv.groups import KvGroups
from neo_rs.kv.layer_copies import LayerCopies
from neo_rs.kv.pools import KvLayout, KvPool
from neo_rs.kv.transfer import INT_POISON, HostTransfer

CPU = torch.device("cpu")
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)


def test_destination_is_poison_until_its_wait() -> None:
    t = HostTransfer(CPU, emulate_async=True)
    src_f, src_i = torch.randn(3, 5), torch.arange(6, dtype=torch.int32)
    staged = t.to_host(src_f, src_i)
    assert not staged.immediate
    f, i = staged.tensors
    assert torch.isnan(f).all() and (i == INT_POISON).all()
    assert torch.equal(staged.ready()[0], src_f) and torch.equal(i, src_i)


def test_copies_land_in_stream_order() -> None:
    t = HostTransfer(CPU, emulate_async=True)
    first, second, third = (t.to_host(torch.full((2,), float(n))) for n in range(3))
    second.ready()  # a later wait completes every earlier copy on the stream, not later ones
    assert torch.equal(first.tensors[0], torch.zeros(2))
    assert torch.isnan(third.tensors[0]).all()


def test_without_emulation_copies_are_immediate() -> None:
    staged = HostTransfer(CPU).to_host(torch.ones(2))
    assert staged.immediate and torch.equal(staged.tensors[0], torch.ones(2))


def _pools() -> tuple[KvPool, KvPool]:
    device, host = KvPool(LAYOUT, 6, CPU), KvPool(LAYOUT, 6, CPU)
    for pool in (device, host):
        pool.k.copy_(torch.randn_like(pool.k))
        pool.v.copy_(torch.randn_like(pool.v))
    return device, host


def test_blocks_reach_the_host_pool_at_ready_and_not_before() -> None:
    t = HostTransfer(CPU, emulate_async=True)
    device, host = _pools()
    src, dst = torch.tensor([4, 1]), torch.tensor([0, 5])
    want_k, want_v = device.k[:, src].clone(), device.v[:, src].clone()
    other = host.k[:, 2].clone()
    staged = t.blocks_to_host(device, host, (src, dst))
    assert torch.isnan(host.k[:, dst]).all() and torch.isnan(host.v[:, dst]).all()
    device.k[:, src] = 0.0  # the plan may reuse the source blocks at once: the gather came first
    staged.ready()
    assert torch.equal(host.k[:, dst], want_k) and torch.equal(host.v[:, dst], want_v)
    assert torch.equal(host.k[:, 2], other)


def test_one_layer_of_blocks_and_rows_to_the_host() -> None:
    t = HostTransfer(CPU, emulate_async=True)
    device, host = _pools()
    staged = t.blocks_to_host(device, host, (torch.tensor([3]), torch.tensor([2])), layer=1)
    untouched = host.k[0, 2].clone()
    assert torch.isnan(host.k[1, 2]).all()
    staged.ready()
    assert torch.equal(host.k[1, 2], device.k[1, 3]) and torch.equal(host.k[0, 2], untouched)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = (torch.tensor([0, 0, 4]), torch.tensor([1, 2, 3]))
    rows = t.rows_to_host(host, 0, slots, k, v)
    assert torch.isnan(host.k[0, 4, :, 3]).all()
    rows.ready()
    assert torch.equal(host.k[0, 4, :, 3], k[2]) and torch.equal(host.v[0, 0, :, 1], v[0])


def test_blocks_to_device_layer_by_layer() -> None:
    t = HostTransfer(CPU, emulate_async=True)
    device, host = _pools()
    want_k, want_v = host.k[:, 5].clone(), host.v[:, 5].clone()
    gathered = t.gather_from_host(host, torch.tensor([5]))
    host.k[:, 5] = 0.0  # gathered at once: later host writes do not reach the device
    before = device.k[1, 0].clone()
    t.layer_to_device(gathered, device, torch.tensor([0]), 0)
    assert torch.equal(device.k[0, 0], want_k[0]) and torch.equal(device.v[0, 0], want_v[0])
    assert torch.equal(device.k[1, 0], before)  # one layer only
    t.layer_to_device(gathered, device, torch.tensor([0]), 1)
    assert torch.equal(device.k[1, 0], want_k[1])


@pytest.mark.parametrize("emulate", [True, False], ids=["layer by layer", "at once"])
def test_layer_copies_gather_an_evicted_block_before_a_copy_reuses_it(emulate: bool) -> None:
    # The plan evicted device block 2 into host block 3, and handed block 2 to a swap-in from
    # host block 5: each layer's gather must come before that layer's copy into block 2. (Without
    # the emulation, copies are synchronous and go at once, at layer 0.)
    t = HostTransfer(CPU, emulate_async=emulate)
    device, host = _pools()
    evicted, incoming = device.k[:, 2].clone(), host.k[:, 5].clone()
    copies = LayerCopies(
        t,
        device,
        host,
        KvGroups.of([None] * LAYOUT.num_layers),
        demote=np.array([[2, 3]]),
        incoming=np.array([[5, 2]]),
        staged=np.zeros((0, 2), dtype=np.int64),
    )
    for layer in range(LAYOUT.num_layers):
        copies.before_writes(layer)
        copies.after_writes(layer)
    assert torch.isnan(host.k[:, 3]).all() == emulate  # in flight until the runner waits
    assert len(copies.landing) == (LAYOUT.num_layers if emulate else 1)
    for staged in copies.landing:
        staged.ready()
    assert torch.equal(host.k[:, 3], evicted) and torch.equal(device.k[:, 2], incoming)
