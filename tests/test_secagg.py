"""Secure aggregation (issue #25): the primitives, the master's bookkeeping, and real clusters.

The cluster tests run ``fedctl run`` (master and workers as processes over TCP loopback) with
and without ``privacy.secure_aggregation`` and compare the final models; the dropout tests
start a worker that SIGKILLs itself at a stage of a secure round (tests/secagg_dropout.py).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from common.config import ConfigError, parse_config
from common.models import ntm_secure
from common.models.ntm import NTMParams, batch_schedule, simulate_sync
from common.models.ntm_sync_bn import ABSTAIN, N_PHASES, SyncBNReducer, SyncBNStep
from common.net import errors
from common.net.errors import ProtocolError
from common.secagg import crypto, graph, shamir
from common.secagg import protocol as P
from common.secagg.params import SecAggParams
from common.secagg.ring import (
    RING_DTYPES,
    dequantize_sum,
    error_bound,
    from_sum,
    levels,
    quantize,
    to_vector,
)
from fedctl.datasets.synthetic_lda import make_federated_lda
from fedctl.launch import child_env
from master.families import make_server_family
from master.secagg import COLLECTING_SHARES, DONE, FAILED, SecureRound
from tests.conftest import ROOT, MakeConfig, Procs, config_dict, events, run_fedctl

CONTEXT = P.round_context("run", "inc", 1)


# ---------------------------------------------------------------------------- primitives
def test_shamir_any_threshold_of_the_shares_open_the_secret_fewer_do_not() -> None:
    secret = crypto.new_seed()
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3)
    for subset in ([1, 2, 3], [2, 4, 5], [1, 3, 5], [1, 2, 3, 4, 5]):
        assert shamir.combine({x: shares[x] for x in subset}) == secret
    with pytest.raises(ValueError):  # two points of a degree-2 polynomial: not the secret
        assert shamir.combine({x: shares[x] for x in (1, 2)}) != secret
    with pytest.raises(ValueError):
        shamir.split(secret, [1, 2], 3)


@pytest.mark.parametrize("bits", [64, 32, 16])
def test_quantized_sums_are_within_the_stated_bound(bits: int) -> None:
    rng = np.random.default_rng(0)
    n, clip = 7, 0.5
    L = levels(n, bits)
    values = rng.uniform(-clip, clip, size=(n, 10_000))
    total = np.zeros(10_000, dtype=RING_DTYPES[bits])
    for v in values:
        total += quantize(v, clip, L, bits)
    err = np.abs(dequantize_sum(total, n, clip, L) - values.sum(axis=0)).max()
    assert err <= error_bound(n, clip, L)
    assert err > 0  # the bound is not vacuous: quantization does cost something


def test_to_vector_weights_clips_and_from_sum_averages() -> None:
    base = {"a": np.zeros((2, 2), np.float32), "b": np.ones(3, np.float32)}
    x1 = {"a": np.full((2, 2), 0.5, np.float32), "b": np.array([1, 3, 1], np.float32)}
    v1, clipped = to_vector(x1, base, 0.25, clip=1.0)
    assert clipped == pytest.approx(1 / 7)  # b[1] moved by 2 > clip
    assert v1[-1] == 0.25 and v1[4 + 1] == 0.25  # the clipped change, weighted
    x2 = {"a": np.full((2, 2), -0.5, np.float32), "b": np.ones(3, np.float32)}
    v2, _ = to_vector(x2, base, 0.75, clip=1.0)
    avg, weights = from_sum(v1 + v2, base, clip=1.0)
    assert weights == 1.0
    np.testing.assert_allclose(avg["a"], np.full((2, 2), 0.25 * 0.5 - 0.75 * 0.5))
    assert avg["a"].dtype == np.float32
    # A clip below the largest weight (1) still carries the weights: scaled into the range.
    small = {"a": np.full((2, 2), 0.01, np.float32), "b": np.ones(3, np.float32)}
    v, _ = to_vector(small, base, 1.0, clip=0.25)
    assert np.abs(v).max() <= 0.25
    n, L = 2, levels(2, 16)
    total = dequantize_sum(quantize(v, 0.25, L, 16) * np.uint16(n), n, 0.25, L)
    avg, weights = from_sum(total, base, clip=0.25)
    assert weights == pytest.approx(2.0, abs=1e-4)
    np.testing.assert_allclose(avg["a"], 0.01, atol=1e-4)


def test_a_secure_sum_whose_weights_exceed_its_members_is_refused() -> None:
    """A member's masked input can hold any weight (about 2n - 1 at most, where an honest one
    is at most 1): the sum hides which member, but weights adding up to more than the members
    could send are refused."""
    from common.config import parse_config
    from master.families import Payload
    from master.families.mlp import MLPServer
    from master.strategies import make_strategy

    cfg = parse_config({"workers": ["w1", "w2", "w3"], "privacy": {
        "secure_aggregation": {"threshold": 2, "clip": 1.0}}}, "<test>")
    server = MLPServer(cfg, make_strategy("fedavg"))
    base = {"a": np.zeros(4, np.float32)}
    server.global_ = Payload({}, base)
    honest = [to_vector({"a": np.full(4, 0.1, np.float32)}, base, w, clip=1.0)[0]
              for w in (1.0, 0.5)]
    avg = server.secure_result(_ring_sum(honest, 1.0), n_max=10, members=2)
    np.testing.assert_allclose(avg["a"], 0.1, atol=1e-6)
    # A hand-made input: its weight's ring element past the top level an honest one reaches.
    L = levels(2, 64)
    total = quantize(honest[0], 1.0, L, 64) + quantize(honest[1], 1.0, L, 64)
    total[-1] += np.uint64(2 * L)  # two levels' widths more: weight + 4
    with pytest.raises(ValueError, match="more than 2 members can send"):
        server.secure_result(dequantize_sum(total, 2, 1.0, L), n_max=10, members=2)


def test_a_secure_sum_whose_weights_are_not_the_declared_ones_is_refused() -> None:
    """A member registered 1e9 documents (setting n_max, so the honest weight was 1e-7) and
    sent a weight of nothing beside a change at the clip: the honest weights divided its
    change, and a model of norm 1.7e9 was published, growing 50 x a round under the growth
    limit. Each update's n_samples travels in the clear: the weights must sum to them."""
    from common.config import parse_config
    from master.families import Payload
    from master.families.mlp import MLPServer
    from master.strategies import make_strategy

    cfg = parse_config({"workers": ["w1", "w2", "w3"], "privacy": {
        "secure_aggregation": {"threshold": 2, "clip": 1.0}}}, "<test>")
    server = MLPServer(cfg, make_strategy("fedavg"))
    base = {"a": np.zeros(4, np.float32)}
    server.global_ = Payload({}, base)
    n_max = 10**9
    honest = to_vector({"a": np.full(4, 0.1, np.float32)}, base, 100 / n_max, clip=1.0)[0]
    forged = honest.copy()
    forged[:-1], forged[-1] = 0.9, 0.0  # a change at the clip, weighing nothing
    total = _ring_sum([honest, forged], 1.0)
    with pytest.raises(ValueError, match="not the 1 the members' declared documents give"):
        server.secure_result(total, n_max, 2, weights_sent=(100 + n_max) / n_max,
                             tolerance=1e-6)
    honest_too = to_vector({"a": np.full(4, 0.3, np.float32)}, base, 1.0, clip=1.0)[0]
    avg = server.secure_result(_ring_sum([honest, honest_too], 1.0), n_max, 2,
                               weights_sent=(100 + n_max) / n_max, tolerance=1e-6)
    np.testing.assert_allclose(avg["a"], 0.3, atol=1e-5)


def _ring_sum(vectors: list[np.ndarray], clip: float) -> np.ndarray:
    """What the master unmasks from these inputs in the 64-bit ring (the masks cancel: tested
    above), as floats."""
    L = levels(len(vectors), 64)
    total = np.zeros(vectors[0].size, dtype=RING_DTYPES[64])
    for v in vectors:
        total += quantize(v, clip, L, 64)
    return dequantize_sum(total, len(vectors), clip, L)


@pytest.mark.parametrize("sync_batch_norm, contextual", [(True, 0), (False, 0), (True, 24)],
                         ids=["union", "per-node", "union-contextual"])
def test_synchronous_ntm_steps_from_secure_sums_are_the_plain_steps(
        sync_batch_norm: bool, contextual: int) -> None:
    # Label-skewed nodes, dropout and batch statistics on: what the master reads back from the
    # ring's sums must step the model as the workers' plain uploads do (simulate_sync); with
    # `contextual`, CombinedTM's network (document embeddings beside the counts).
    c = make_federated_lda(n_nodes=3, vocab_size=200, n_topics=6, n_shared=0,
                           docs_per_node=60, eta=0.05, random_state=0)
    rng = np.random.default_rng(0)
    shards = [(X, rng.normal(size=(60, contextual)).astype(np.float32) if contextual else None)
              for X in c.X]
    ids = [np.arange(60) + 60 * i for i in range(3)]
    params = NTMParams(n_topics=6, doc_noise=True, batch_size=16, dtype="float64",
                       sync_batch_norm=sync_batch_norm)
    steps = 12
    plain = simulate_sync(shards, params, steps, contextual_size=contextual,
                          doc_ids=ids).get_arrays()
    glob = params.model(contextual, 0).initialize(200)
    nodes = [params.model(contextual, 1 + i, noise_seed=0).initialize(200) for i in range(3)]
    orders = [batch_schedule(60, 16, 1 + i) for i in range(3)]
    reducer = SyncBNReducer(glob)
    for t in range(steps):
        arrays = glob.get_arrays()
        rows = [next(o) for o in orders]
        for node in nodes:
            node.set_arrays(arrays)
        if not sync_batch_norm:
            vecs = [ntm_secure.worker_vector(node, ntm_secure.STEP,
                                             node.gradients(X, ctx, r, i[r], step=t),
                                             len(r), arrays)
                    for node, (X, ctx), r, i in zip(nodes, shards, rows, ids, strict=True)]
            total = _ring_sum(vecs, ntm_secure.CLIPS[ntm_secure.STEP])
            glob.apply_gradients(ntm_secure.read_sum(glob, ntm_secure.STEP, total))
            continue
        syncs = [SyncBNStep(node, X, ctx, r, i[r], step=t)
                 for node, (X, ctx), r, i in zip(nodes, shards, rows, ids, strict=True)]
        published = arrays
        for phase in range(N_PHASES):
            ups = [s.upload(phase, published) for s in syncs]
            vecs = [ntm_secure.worker_vector(node, phase, u, len(r), arrays,
                                             getattr(s, "n_union", 0.0))
                    for node, u, r, s in zip(nodes, ups, rows, syncs, strict=True)]
            assert max(np.abs(v).max() for v in vecs) < ntm_secure.CLIPS[phase]
            total = _ring_sum(vecs, ntm_secure.CLIPS[phase])
            published = reducer.reduce(phase, [ntm_secure.read_sum(glob, phase, total)],
                                       [sum(len(r) for r in rows)])
    secure = glob.get_arrays()
    assert set(secure) == set(plain)
    moved = max(float(np.abs(plain[n] - a).max())
                for n, a in params.model(contextual, 0).initialize(200).get_arrays().items())
    assert moved > 1e-2
    # Agreement to 1e-7 (measured: 3e-8 at most), but for the directions batch norm leaves
    # the loss flat in, whose gradients are rounding noise that Adam scales up to steps of
    # ~lr (tests/test_ntm.py's BN_FLAT and prior mean; measured 3e-3 here, in any two runs).
    flat = {"f_mu.bias", "f_sigma.bias", "bn_mu.running_mean", "bn_sigma.running_mean",
            "prior_mean"}
    for name in plain:
        np.testing.assert_allclose(secure[name], plain[name], rtol=1e-6,
                                   atol=1e-2 if name in flat else 1e-7, err_msg=name)


def test_an_abstaining_worker_adds_nothing_to_the_secure_sum() -> None:
    # It says so in the clear instead (its `abstain` metric), where the master can tell who.
    model = NTMParams(n_topics=4).model(0, 0).initialize(50)
    for phase in (*range(N_PHASES), ntm_secure.STEP):
        shapes = ntm_secure.layout(model, phase)
        vec = ntm_secure.worker_vector(model, phase, {ABSTAIN: np.zeros(0)}, 1, {})
        assert vec.size == ntm_secure.vector_size(model, phase) == sum(
            int(np.prod(s)) for s in shapes.values())
        assert not vec.any() and ABSTAIN not in shapes
        read = ntm_secure.read_sum(model, phase, vec)  # all abstained: nothing, but finite
        assert all(np.isfinite(a).all() for a in read.values())


def _round_inputs(names: list[str], size: int, rng: np.random.Generator, bits: int = 32):
    """Each worker's quantized vector, its keys and its masked input (all paired)."""
    L = levels(len(names), bits)
    s_keys = {w: crypto.new_private_key() for w in names}
    s_pub = {w: crypto.public_bytes(k) for w, k in s_keys.items()}
    seeds = {w: crypto.new_seed() for w in names}
    plain = {w: quantize(rng.uniform(-1, 1, size), 1.0, L, bits) for w in names}
    masked = {}
    for u in names:
        pair = {v: P.mask_key(s_keys[u], s_pub[v], CONTEXT, u, v) for v in names if v != u}
        masked[u] = P.masked_input(plain[u], seeds[u], u, pair)
    return plain, masked, seeds, s_keys, s_pub


@pytest.mark.parametrize("bits", [64, 32, 16])
def test_masks_cancel_and_a_dropped_workers_masks_come_off_exactly(bits: int) -> None:
    names = ["w1", "w2", "w3", "w4"]
    plain, masked, seeds, s_keys, s_pub = _round_inputs(names, 5_000, np.random.default_rng(1),
                                                        bits)
    ring = RING_DTYPES[bits]
    assert all(y.dtype == ring for y in masked.values())  # half the bytes with 16 bits
    # Everyone's input came.
    total = P.unmask(masked, seeds, {})
    assert total.dtype == ring
    assert np.array_equal(total, sum(plain.values()).astype(ring))
    # w4 dropped after sharing: its pairwise masks in the others' inputs are undone.
    survivors = {w: masked[w] for w in names[:3]}
    pair = {(u, "w4"): P.mask_key(s_keys["w4"], s_pub[u], CONTEXT, u, "w4") for u in survivors}
    total = P.unmask(survivors, {w: seeds[w] for w in survivors}, pair)
    assert np.array_equal(total, sum(plain[w] for w in survivors).astype(ring))


def test_a_masked_input_is_uniform_on_the_ring_and_uncorrelated_with_the_update() -> None:
    names = ["w1", "w2", "w3"]
    size = 200_000
    rng = np.random.default_rng(2)
    plain, masked, *_ = _round_inputs(names, size, rng)
    y = masked["w1"]
    # Chi-square over 256 bins of the top byte, and of the low byte.
    for part in (y >> 24, y & 0xFF):
        counts = np.bincount(part.astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4
    # The update itself is far from uniform (it lives in the middle of the ring) ...
    top = np.bincount((plain["w1"] >> 24).astype(np.int64), minlength=256)
    assert stats.chisquare(top).pvalue < 1e-10
    # ... and what is sent says nothing linear about it.
    r = np.corrcoef(plain["w1"].astype(np.float64), y.astype(np.float64))[0, 1]
    assert abs(r) < 4 / np.sqrt(size)
    # On the 16-bit ring (compression float16 / int8) too.
    plain16, masked16, *_ = _round_inputs(names, size, rng, bits=16)
    for part in (masked16["w1"] >> 8, masked16["w1"] & 0xFF):
        counts = np.bincount(part.astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4
    r = np.corrcoef(plain16["w1"].astype(np.float64), masked16["w1"].astype(np.float64))[0, 1]
    assert abs(r) < 4 / np.sqrt(size)


def test_a_share_moved_to_another_recipient_round_or_sender_does_not_decrypt() -> None:
    a, b = crypto.new_private_key(), crypto.new_private_key()
    key = P.share_key(a, crypto.public_bytes(b), CONTEXT, "w1", "w2")
    ct = crypto.encrypt(key, b"share", P.share_associated(CONTEXT, "w1", "w2"))
    assert crypto.decrypt(key, ct, P.share_associated(CONTEXT, "w1", "w2")) == b"share"
    for associated in (P.share_associated(CONTEXT, "w1", "w3"),  # misaddressed
                       P.share_associated(CONTEXT, "w3", "w2"),  # forged sender
                       P.share_associated(P.round_context("run", "inc", 2), "w1", "w2")):
        with pytest.raises(crypto.ShareDecryptionError):
            crypto.decrypt(key, ct, associated)
    with pytest.raises(crypto.ShareDecryptionError):  # altered
        crypto.decrypt(key, ct[:-1] + bytes([ct[-1] ^ 1]), P.share_associated(CONTEXT, "w1",
                                                                              "w2"))


def test_the_pairing_graph_is_k_regular_and_symmetric() -> None:
    people = [f"w{i}" for i in range(11)]
    g = graph.neighbours(people, 4, random.Random(0))
    assert all(len(ns) == 4 for ns in g.values())
    assert all(u in g[v] for u in g for v in g[u])
    assert graph.neighbours(people[:4], 4, random.Random(0))["w0"] == ["w1", "w2", "w3"]


# ---------------------------------------------------------------------------- the master's side
def _keys_body(c_key, s_key, seed=b"\0" * 32) -> dict:
    import hashlib
    return {"stage": P.KEYS, "c_pk": crypto.public_bytes(c_key),
            "s_pk": crypto.public_bytes(s_key), "b_commit": hashlib.sha256(seed).digest()}


def test_the_master_refuses_misaddressed_forged_and_out_of_stage_messages() -> None:
    names = ["w1", "w2", "w3"]
    sr = SecureRound(SecAggParams(), 1, names, CONTEXT, 10, 100, deadline=0.0, seed=0)
    keys = {w: (crypto.new_private_key(), crypto.new_private_key()) for w in names}
    with pytest.raises(ProtocolError) as exc:
        sr.on_request("w9", _keys_body(*keys["w1"]))
    assert exc.value.code == errors.NOT_SELECTED
    with pytest.raises(ProtocolError) as exc:
        sr.on_request("w1", {**_keys_body(*keys["w1"]), "c_pk": b"short"})
    assert exc.value.code == errors.BAD_FIELD
    # Low-order points: every neighbour's agreement with them fails (relayed, 32 zero bytes
    # ended the honest workers with "Error computing shared key").
    for field, low in (("c_pk", bytes(32)), ("s_pk", (1).to_bytes(32, "little"))):
        with pytest.raises(ProtocolError, match=f"{field} is not a usable X25519") as exc:
            sr.on_request("w1", {**_keys_body(*keys["w1"]), field: low})
        assert exc.value.code == errors.BAD_FIELD
    for w in names[:2]:
        assert sr.on_request(w, _keys_body(*keys[w])) == {"ready": False}
    with pytest.raises(ProtocolError) as exc:  # other keys for the same round: a replay
        sr.on_request("w1", _keys_body(crypto.new_private_key(), keys["w1"][1]))
    assert exc.value.code == errors.REJECTED
    with pytest.raises(ProtocolError) as exc:  # a masked input before the shares
        sr.take_input("w1", {"secagg.masked": np.zeros(10, np.uint32)})
    assert exc.value.code == errors.STALE_ROUND
    # The last worker's keys close the stage: its reply already names its neighbours.
    assert sorted(sr.on_request("w3", _keys_body(*keys["w3"]))["peers"]) == ["w1", "w2"]
    assert sr.stage == COLLECTING_SHARES
    reply = sr.on_request("w1", _keys_body(*keys["w1"]))  # the same keys again: the peers
    assert sorted(reply["peers"]) == ["w2", "w3"]
    with pytest.raises(ProtocolError) as exc:  # misaddressed: w9 is nobody's neighbour
        sr.on_request("w1", {"stage": P.SHARES, "shares": {"w2": b"x" * 40, "w9": b"x" * 40}})
    assert exc.value.code == errors.BAD_FIELD and "w9" in str(exc.value)
    with pytest.raises(ProtocolError) as exc:
        sr.on_request("w1", {"stage": "sideways"})
    assert exc.value.code == errors.BAD_FIELD


def test_below_the_threshold_the_round_fails_and_keeps_nothing() -> None:
    names = ["w1", "w2", "w3"]
    sr = SecureRound(SecAggParams(threshold=3), 1, names, CONTEXT, 10, 100, 0.0, 0)
    for w in names[:2]:
        sr.on_request(w, _keys_body(crypto.new_private_key(), crypto.new_private_key()))
    sr.advance(1.0, alive=lambda w: w != "w3")  # w3 is dead: no need to wait for it
    assert sr.stage == FAILED and "threshold is 3" in sr.failure
    assert sr.sum_ is None and not sr.inputs
    with pytest.raises(ProtocolError) as exc:
        sr.on_request("w1", {"stage": P.UNMASK})
    assert exc.value.code == errors.STALE_ROUND


@pytest.mark.parametrize("threshold", [3, 2])
def test_forged_reveals_are_caught_by_the_commitments(threshold: int) -> None:
    """A worker that reveals a share that is not the one it was given: the rebuilt seed does
    not open the owner's commitment. With fewer genuine shares than the threshold the round
    fails rather than apply a wrong sum; with enough, a threshold of them opens the seed, the
    round's sum is exact, and the share's revealer and owner are named (it used to fail every
    round, an honest owner named, the revealer never)."""
    from worker.secagg import SecureUpload

    names = ["w1", "w2", "w3"]
    sr = SecureRound(SecAggParams(threshold=threshold), 1, names, CONTEXT, 4, 100, 1e12, 0)
    uploads = {}

    def request_for(w):
        def request(kind, body, arrays):
            class Reply:
                pass
            r = Reply()
            if kind == "update":
                sr.take_input(w, arrays)
                r.body = {"round": 1}
            else:
                body = dict(body)
                if w == "w3" and body["stage"] == P.REVEAL:
                    body["b"] = {k: bytes(shamir.SHARE_BYTES) for k in body["b"]}
                r.body = sr.on_request(w, body)
                sr.advance(1.0, alive=lambda x: True)
            return r
        return request

    import threading
    settings = {**sr.settings()}
    for w in names:
        uploads[w] = SecureUpload(w, settings, request_for(w))
    threads = [threading.Thread(target=uploads[w].run,
                                args=(1, {}, np.array([0.1, 0.2, 0.3, 1.0])), daemon=True)
               for w in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if threshold == 3:
        assert sr.stage == FAILED and "fewer than the threshold (3) are genuine" in sr.failure
        return
    # Every seed opened without the share w3 revealed of it (w3 zeroed its own too); who made
    # a share wrong, its revealer or its dealer, is not provable: both are named.
    assert sr.stage == DONE and sr.forged == {("w3", w) for w in names}, (sr.stage, sr.forged)
    assert np.allclose(sr.sum_, 3 * np.array([0.1, 0.2, 0.3, 1.0]),
                       atol=sr.error_bound() + 1e-12)


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("change, words", [
    ({"strategy": {"name": "fedmedian"}}, "must see each update"),
    ({"strategy": {"name": "krum"}}, "must see each update"),
    ({"compression": {"kind": "topk"}}, "float16 and int8 compose"),
    ({"max_weight_fraction": 0.5}, "cannot cap weights"),
    ({"model": {"family": "lda"}}, "not a model FedAvg averages"),
    ({"model": {"family": "fstc", "encoder": "finetune"}},
     "model fstc cannot take part (a fine-tuned encoder"),
    ({"strategy": {"name": "scaffold"}}, "scaffold"),
])
def test_what_cannot_be_summed_securely_is_refused_in_one_line(tmp_path: Path, change: dict,
                                                               words: str) -> None:
    raw = config_dict(tmp_path / "out", tmp_path, 3, 2,
                      privacy={"secure_aggregation": {}}, **change)
    with pytest.raises(ConfigError) as exc:
        make_server_family(parse_config(raw, source="cluster.yaml"))
    msg = str(exc.value)
    assert "privacy.secure_aggregation" in msg and words in msg and "\n" not in msg


def test_check_says_how_the_synchronous_steps_are_clipped(tmp_path: Path) -> None:
    import yaml
    from click.testing import CliRunner

    from fedctl.cli import main

    raw = config_dict(tmp_path / "out", tmp_path, 3, 10, privacy={"secure_aggregation": {}},
                      model={"family": "prodlda", "mode": "sync", "vocab_size": 300})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["check", "--config", str(path), "--no-ports"])
    assert result.exit_code == 0, result.output
    assert "64-bit ring, clipped by phase" in result.output and "clip 8" not in result.output


def test_secure_aggregation_settings_are_checked(tmp_path: Path) -> None:
    for bad in ({"neighbours": 3}, {"threshold": 1}, {"clip": 0}, {"colour": 1}):
        raw = config_dict(tmp_path / "out", tmp_path, 3, 2,
                          privacy={"secure_aggregation": bad})
        with pytest.raises(ConfigError):
            parse_config(raw, source="cluster.yaml")


# ---------------------------------------------------------------------------- real clusters
JOBS = {
    "mlp": {"model": {"family": "mlp", "local_epochs": 3}},
    "nmf": {"model": {"family": "nmf", "n_topics": 8, "vocab_size": 500},
            "strategy": {"name": "fedadam", "eta": 0.01}},
    "prodlda": {"model": {"family": "prodlda", "mode": "fedavg", "n_topics": 8,
                          "vocab_size": 500, "local_epochs": 1}},
    # Synchronous steps with batch norm per node: each round one step, its gradients and
    # batch moments summed in the 64-bit ring (common/models/ntm_secure.py).
    "prodlda-sync": {"model": {"family": "prodlda", "mode": "sync", "n_topics": 8,
                               "vocab_size": 500, "sync_batch_norm": False}},
    "fstc": {"model": {"family": "fstc", "n_clusters": 5, "iterations": 20},
             "data": {"task": "multiclass"}},
    # int8 compression composes as a 16-bit ring; a clip near the largest change keeps its
    # error small (2.3e-5 for 3 workers), and the plain twin is uncompressed.
    "mlp-int8": {"model": {"family": "mlp", "local_epochs": 3},
                 "compression": {"kind": "int8"}},
    # DP-FedAvg: the workers clip and send weight 1, the master adds the noise to the sum (a
    # noise this small leaves the two runs comparable).
    "mlp-dp": {"model": {"family": "mlp", "local_epochs": 3},
               "privacy": {"client_dp": {"clip": 0.5, "noise_multiplier": 1e-6}}},
}
#: The secure run's extra settings and the tolerances of each job (bound: the event's
#: error_bound; atol: the final models'; the plain twin runs without the `compression`).
SECURE = {"mlp-int8": ({"clip": 0.25}, 1e-4, 2e-3),
          # Each run draws its own noise (seeded by the system); small as it is, Adam turns it
          # into steps of up to ~lr where a coordinate's gradient is near zero (seen: 1.1e-4).
          "mlp-dp": ({}, 1e-7, 1e-3)}


def _model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as z:
        return {k: z[k].astype(np.float64) for k in z.files}




@pytest.fixture(scope="module")
def plain_runs() -> dict[str, Path]:
    """The plain twins already run in this module, by their job (as JSON), each one's output
    folder: a plain twin's model depends on the job, not on its ports or folder, and mlp's
    is mlp-int8's too (the plain twin runs without the compression), so it runs once."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(JOBS))
def test_a_secure_run_ends_where_the_plain_run_does(family: str, tmp_path: Path,
                                                    make_config: MakeConfig,
                                                    embed_cache: Path,
                                                    plain_runs: dict[str, Path],
                                                    tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    outs, runs = {}, {}
    secure, bound, atol = SECURE.get(family, ({}, 1e-7, 1e-5))
    plain_job = {k: v for k, v in JOBS[family].items() if k != "compression"}
    shared = json.dumps(plain_job, sort_keys=True)
    if shared in plain_runs:
        outs["plain"] = plain_runs[shared]
    for mode in ("plain", "secure"):  # side by side: each mostly waits for its processes
        if mode in outs:
            continue
        # (The plain twin in a folder of the session's, not the test's: another may read it.)
        folder = tmp_path / mode if mode == "secure" else tmp_path_factory.mktemp("plain")
        folder.mkdir(exist_ok=True)
        job = dict(JOBS[family]) if mode == "secure" else dict(plain_job)
        if mode == "secure":
            job["privacy"] = {**job.get("privacy", {}), "secure_aggregation": secure}
        cfg = make_config(folder, workers=3, rounds=2, **job)
        runs[mode] = ThreadPoolExecutor(1).submit(
            run_fedctl, "run", "--config", str(cfg), "--no-progress", timeout=300,
            cache_dir=embed_cache)
        outs[mode] = folder / "out"
    for mode, run in runs.items():
        proc = run.result()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        if mode == "plain":
            plain_runs[shared] = outs["plain"]
    rounds = events(outs["secure"], "secagg")
    assert [e["round"] for e in rounds] == [1, 2]
    assert all(e["survivors"] == ["w1", "w2", "w3"] and not e["dropped"] for e in rounds)
    assert all(e["error_bound"] < bound for e in rounds)
    clipped = [e.get("secagg_clipped", 0) for e in events(outs["secure"], "worker_round")]
    assert max(clipped) == 0, "the default clip cut this job's changes: the bound is moot"
    plain, secure = _model(outs["plain"]), _model(outs["secure"])
    assert plain.keys() == secure.keys()
    # Each round's average is off by at most error_bound (1e-9) plus float32 rounding (1e-8
    # relative). ProdLDA's encoder biases feed a batch norm, which cancels their gradient:
    # Adam then steps by lr times the sign of rounding noise, so they (and the running means
    # that follow them) may move by ~lr (2e-3) where the rest of the model agrees to 1e-7
    # (measured); its scores must agree all the same. The prior's mean is pulled by the
    # batch-normalized posterior means, which sum to zero over a batch: the same rounding noise
    # (seen once: 1.2e-5 off after two steps).
    loose = ({"f_mu.bias", "f_sigma.bias", "bn_mu.running_mean", "bn_sigma.running_mean",
              "prior_mean"} if family.startswith("prodlda") else set())
    for name in plain:
        np.testing.assert_allclose(secure[name], plain[name], rtol=1e-4,
                                   atol=1e-2 if name in loose else atol, err_msg=name)
    if "compression" in JOBS[family]:  # what travelled was the 16-bit ring: half the bytes
        sent = [e["bytes_out"] for e in events(outs["secure"], "worker_round")]
        assert max(sent) < 0.55 * 4 * _model(outs["plain"])["0.weight"].size
    scores = {m: json.loads((o / "summary.json").read_text())["comparison"]
              for m, o in outs.items()}
    for a, b in zip(scores["plain"], scores["secure"], strict=True):
        for key, value in a.items():
            if key.startswith("federated_") and value is not None:
                assert b[key] == pytest.approx(value, rel=5e-3, abs=5e-3), key


def _dying(procs: Procs, config: Path, worker: str, stage: str) -> subprocess.Popen:
    with open(procs.logs / f"{worker}.log", "wb") as fh:  # the child holds its own descriptor
        p = subprocess.Popen([sys.executable, "-m", "tests.secagg_dropout", "--config",
                              str(config), "--id", worker, "--die-after", stage, "--round",
                              "1"], cwd=ROOT, env=child_env(procs.cache_dir), stdout=fh,
                             stderr=subprocess.STDOUT)
    procs.procs[worker] = p
    return p


# (join_timeout 120: the dying and hostile members are interpreters of their own, importing
# torch three at once; the job starts as soon as every listed worker registered anyway)
FAST = {"heartbeat_timeout": 2, "join_timeout": 120, "model": {"family": "mlp",
                                                                "local_epochs": 3}}
NAMES = ["w1", "w2", "w3", "w4", "w5"]
#: Who dies in round 1, and after which stage (tests/secagg_dropout.py).
DYING = {"w3": "keys", "w4": "shares", "w5": "input"}


@pytest.mark.slow
def test_workers_killed_at_every_stage_leave_the_survivors_exact_sum(
        tmp_path: Path, make_config: MakeConfig, procs: Procs, embed_cache: Path) -> None:
    """In one round w3 SIGKILLs itself after its keys (paired, never shared: in nobody's
    masks), w4 after its shares (its pairwise masks in the others' inputs are undone from its
    key's shares), w5 after its masked input (in the sum; its self mask undone from its seed's
    shares). The sum is that of w1, w2 and w5, which a plain round of those three (w3 and w4
    never started) computes in the clear."""
    secure_dir, plain_dir = tmp_path / "secure", tmp_path / "plain"
    secure_dir.mkdir()
    plain_dir.mkdir()
    cfg = make_config(secure_dir, workers=NAMES, rounds=1, min_workers=3,
                      privacy={"secure_aggregation": {"threshold": 2}}, **FAST)
    procs.master(cfg)
    for w in NAMES[:2]:
        procs.worker(cfg, w)
    victims = {w: _dying(procs, cfg, w, stage) for w, stage in DYING.items()}
    for w, victim in victims.items():
        victim.wait(timeout=300)
        assert victim.returncode == -9, f"{w}\n{procs.logs_tail()}"
        del procs.procs[w]
    # The plain twin meanwhile (its master waits join_timeout for w3 and w4, then starts).
    plain = make_config(plain_dir, workers=NAMES, rounds=1, min_workers=3,
                        **{**FAST, "join_timeout": 3})
    twin = Procs(plain_dir / "logs", embed_cache)
    try:
        twin.master(plain)
        for w in ("w1", "w2", "w5"):
            twin.worker(plain, w)
        assert set(twin.wait_all(timeout=300).values()) == {0}, twin.logs_tail()
    finally:
        twin.stop_all()
    codes = procs.wait_all(timeout=300)
    assert set(codes.values()) == {0}, procs.logs_tail()
    (sa,) = events(secure_dir / "out", "secagg")
    assert sa["survivors"] == ["w1", "w2", "w5"]
    assert sa["dropped"] == ["w4"]  # shared, then sent nothing: its masks were undone
    secure, plain_model = _model(secure_dir / "out"), _model(plain_dir / "out")
    for name in plain_model:
        np.testing.assert_allclose(secure[name], plain_model[name], rtol=0, atol=1e-6,
                                   err_msg=name)


@pytest.mark.slow
def test_below_the_threshold_the_job_ends_in_one_line_with_nothing_applied(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    cfg = make_config(tmp_path, workers=3, rounds=3, min_workers=2,
                      privacy={"secure_aggregation": {"threshold": 3}}, **FAST)
    procs.master(cfg)
    for w in ("w1", "w2"):
        procs.worker(cfg, w)
    victim = _dying(procs, cfg, "w3", "shares")
    victim.wait(timeout=300)
    del procs.procs["w3"]
    codes = procs.wait_all(timeout=300)
    assert codes["master"] != 0, procs.logs_tail()
    out = tmp_path / "out"
    (failed,) = events(out, "secagg_failed")
    assert "threshold is 3" in failed["reason"]
    said = procs.log("master")
    assert "secure aggregation needs 3 workers a round (its threshold) and 2 are alive " \
           "(w1, w2)" in said, said
    assert not events(out, "secagg")  # no round was applied, not even in part
    assert [e["version"] for e in events(out, "round")] == [0]
    assert (out / "checkpoint.npz").exists()


@pytest.mark.parametrize("n", [14, 20])
def test_one_forged_share_at_any_point_is_found_among_many_workers(n: int) -> None:
    """Sets of shares tried in lexicographic order all held point 1's share for the first
    C(n-1, t-1) tries (1,716 at n = 14, past the cap): a forger named w1 failed every round.
    One share left out at a time comes first now."""
    import hashlib

    names = [f"w{i:02d}" for i in range(1, n + 1)]
    sr = SecureRound(SecAggParams(), 1, names, CONTEXT, 4, 100, 1e12, 0)
    secret = bytes(range(32))
    for forger in (1, n):
        shares = shamir.split(secret, list(range(1, n + 1)), sr.threshold)
        shares[forger] = bytes(shamir.SHARE_BYTES)
        sr.forged.clear()
        opened = sr._open("w02", shares,
                          lambda s: hashlib.sha256(s).digest() == hashlib.sha256(secret).digest())
        assert opened == secret and sr.forged == {(names[forger - 1], "w02")}

