"""``low_latency_combine(use_logfmt=True)``: the LogFMT-10 encoding (its reference in triton_ep/reference.py),
the rows that cross between ranks (records in the receiver's area, bytes on the network leg) and DeepEP's accuracy
bound; on CPU (rank processes under the interpreter, within one host and as 2 hosts over the emulated fabric) and,
marked ``gpu``, on one GPU. Rank bodies in tests/cases/logfmt.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.cases import ll as ll_cases
from tests.cases import logfmt as LC
from tests.cases.helpers import ok_results
from triton_ep import reference
from triton_ep.kernels import logfmt
from triton_ep.protocol.ll_area import Layout
from triton_ep.testing import run_ranks

_HOSTS = {"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("H", [128, 512, 7168])
def test_record_is_deepeps_logfmt10_size(H):
    """A row's record is DeepEP's ``hidden * 10 / 8 + hidden / 128 * 4`` bytes (its test's num_logfmt10_bytes);
    the area's slots are that rounded up to 16 bytes (exact at H % 512 == 0), the bf16 rows' ``2 * hidden``."""
    rec = reference.logfmt_encode(torch.zeros(2, H, dtype=torch.bfloat16))
    assert rec.shape == (2, H * 10 // 8 // 4 + H // 128) and rec.dtype == torch.int32
    lay = Layout(2, 8, H, 4)
    assert 4 * lay.logfmt_row_words == (H * 10 // 8 + H // 128 * 4 + 15) // 16 * 16
    assert lay.net_logfmt_row_words == 4 + lay.logfmt_row_words
    if H == 7168:
        assert 4 * lay.logfmt_row_words == 9184 and 2 * H == 14336


def test_log2_tables_agree():
    """The kernels' log2 table and the reference's (each computed on its own) are the same fp32 values."""
    assert torch.equal(logfmt.log2_table(torch.device("cpu")), reference._LOGFMT_LOG2)


def test_error_bounds_of_each_block():
    """Blocks of normal draws at scales from 1e-30 to 1e30, some channels 1e12 under the others: in a block of
    magnitudes under 1 (coded by their log) every channel above the block's floor (``amax * 2**-32``) comes back
    within half a step ``(2**s - 1) / 2`` of its value (at most 2.2 %), below it as 0 or near the floor; in the
    others (coded linearly) within ``amax / 1022``; each block's largest magnitude exactly, signs kept."""
    g = torch.Generator().manual_seed(5)
    scales = torch.tensor([1e-30, 1e-8, 1e-3, 0.1, 0.3, 1.0, 7.0, 300.0, 1e30])
    x = (torch.randn(len(scales) * 8, 512, generator=g) * scales.repeat_interleave(8)[:, None])
    x[::3, ::7] *= 1e-12
    x = x.to(torch.bfloat16)
    y = reference.logfmt_round_trip(x).view(-1, 4, 128)
    xf = x.float().view(-1, 4, 128)
    xf = torch.where(xf.abs() < 2.0 ** -126, torch.zeros_like(xf), xf)       # subnormals count as zero
    amax = xf.abs().amax(-1, keepdim=True)
    amin = xf.abs().amin(-1, keepdim=True)        # (a zero in the block: lmin = lmax - 32)
    logged = ((amax < 1) & (amin < amax)).expand_as(xf)
    lmin = torch.maximum(torch.log2(amin), torch.log2(amax) - 32)
    s = (torch.log2(amax) - lmin) / 510
    bound = ((torch.exp2(s) - 1) / 2 * 1.001 + 1e-6).expand_as(xf)
    above = logged & (xf.abs() >= torch.exp2(lmin) * (1 + 1e-6))
    rel = (y - xf).abs() / xf.abs()
    assert above.sum() > 10000 and (~logged).sum() > 10000
    assert (rel[above] <= bound[above]).all(), float(rel[above].max())
    assert float(rel[above].max()) <= 2 ** (16 / 510) - 1 + 1e-6
    assert (y[logged & (xf.abs() < torch.exp2(lmin - s) * 0.99)] == 0).all()
    lin = ~logged
    assert ((y - xf).abs()[lin] <= (amax / 1022 * (1 + 1e-5) + xf.abs() * 1e-6)[lin]).all()     # (+ fp32 ulps)
    assert (torch.sign(y[y != 0]) == torch.sign(xf[y != 0])).all()
    tops = xf.abs() == amax
    assert torch.equal(y[tops], xf[tops])


def test_special_blocks():
    """Zeros keep their sign; a block of equal magnitudes and every block's largest come back exact; a NaN or an
    infinity makes its whole block (only) NaN; subnormal magnitudes count as zero."""
    x = torch.randn(6, 256).to(torch.bfloat16)
    x[0, :128] = 0.0
    x[0, 5] = -0.0
    x[1, :128] = torch.tensor([2.5, -2.5]).repeat(64).to(torch.bfloat16)
    x[1, 128:] = torch.tensor([0.25, -0.25]).repeat(64).to(torch.bfloat16)
    x[2, 3] = float("nan")
    x[3, 200] = -float("inf")
    x[4, :128] = 1e-39          # subnormal in bf16 (and fp32): as 0
    x[4, 0] = 1e-30
    x[5, 128:] = torch.arange(128).to(torch.bfloat16)
    y = reference.logfmt_round_trip(x)
    assert torch.equal(y[0, :128], x[0, :128].float()) and torch.signbit(y[0, 5])
    assert torch.equal(y[1], x[1].float())
    assert torch.isnan(y[2, :128]).all() and not torch.isnan(y[2, 128:]).any()
    assert torch.isnan(y[3, 128:]).all() and not torch.isnan(y[3, :128]).any()
    assert (y[4, 1:128] == 0).all() and y[4, 0] == x[4, 0].float()
    assert y[5, 128] == 0 and y[5, 255] == 127
    assert ((y[5, 128:] - x[5, 128:].float()).abs() <= 127 / 1022).all()


def test_deepeps_bound_on_its_data_reference():
    """DeepEP's test data (tests/test_low_latency.py: constant rows with the token index in the last 128 channels,
    normal draws at random scales and at 0.1), hidden 7168, top-8, identity experts after a bf16 dispatch:
    ``calc_diff`` of ``x * sum(w)`` and the LogFMT combine is under DeepEP's 1e-5 and within 2.5x of what a model
    of DeepEP's own LogFMT (:func:`logfmt_cases.deepep_model`) gives; where DeepEP codes a channel by its log, the
    value is that model's (to 1e-5) in all but 0.1 % of channels and one step from it in the others."""
    xs, idx, w = LC.deepep_inputs(0, 2, 16, 8, 7168, 12)
    wsum = w.masked_fill(idx < 0, 0).sum(1, keepdim=True)
    n_coded = 0
    for i, x in enumerate(xs):
        ref = x.float() * wsum
        lf = LC.expected_combine(x, idx, w, 16, 2, "identity")
        model, coded = LC.deepep_model(x)
        d_lf = LC.calc_diff(ref, lf.float())
        d_model = LC.calc_diff(ref, (model * wsum.double()).to(torch.bfloat16).float())
        assert d_lf < LC.BOUND_BF16 and d_lf < 2.5 * d_model, (i, d_lf, d_model)
        ours = reference.logfmt_round_trip(x).double()
        rel = ((ours - model).abs() / model.abs().clamp_min(1e-30))[coded]
        n_coded += int(coded.sum())
        if coded.any():
            assert (rel < 1e-5).float().mean() > 0.999 and rel.max() < 2 ** (32 / 510) - 1, (i, float(rel.max()))
    assert n_coded > xs[0].numel(), n_coded


@pytest.mark.multiprocess
def test_logfmt_combine_within_one_host_split_and_hook():
    """2 ranks: after a bf16 and an FP8 dispatch, combines with and without LogFMT, without and with a receive
    hook: the LogFMT result is the oracle's bit for bit, within DeepEP's bound of the bf16 combine, and the records
    in the receiver's area are the reference encoding, one every ``logfmt_row_words``; zero_copy is refused."""
    for r in ok_results(run_ranks(LC.round_trip, 2, ["split", "hook"])):
        assert r["row_bytes"] == (336, 512)


@pytest.mark.multiprocess
def test_logfmt_combine_as_one_launch():
    """``TRITON_EP_FUSED=1``: the combine as one launch gives the same results (the oracle's, bit for bit)."""
    ok_results(run_ranks(LC.across_hosts, 2, {"TRITON_EP_FUSED": "1"}, "round_trip", ["one"]))


@pytest.mark.multiprocess
def test_logfmt_combine_across_hosts_moves_the_records():
    """2 hosts of 1 rank over the emulated fabric: the same results, and the network leg's bytes for each combine
    (``get_rdma_stats()["low_latency"]``) are the chunks' sizes with LogFMT records (``16 + 4 * logfmt_row_words``
    bytes a row) and with bf16 rows (``16 + 2 * hidden``)."""
    for r in ok_results(run_ranks(LC.across_hosts, 2, _HOSTS, "round_trip", ["split", "hook"], 4, 3, 256, (6, 5), 8,
                                  "cpu", True)):
        assert len(r["bytes"]) == 8
        for logfmt_, got, want in r["bytes"]:
            assert got == want, r["bytes"]
        lf = [g for f, g, _ in r["bytes"] if f]
        bf = [g for f, g, _ in r["bytes"] if not f]
        assert all(a < b for a, b in zip(lf, bf)), r["bytes"]


@pytest.mark.multiprocess
def test_ranks_disagreeing_on_use_logfmt_raise_value_error():
    out = ok_results(run_ranks(LC.disagree, 2))
    for me, msg in enumerate(out):
        assert msg is not None and "use_logfmt" in msg, out


@pytest.mark.multiprocess
@pytest.mark.extended
def test_deepeps_bound_on_its_data_two_ranks():
    out = ok_results(run_ranks(LC.deepep_accuracy, 2, 8, 4, 256, 8))
    assert all(len(d) == 8 for d in out), out


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["1", pytest.param("0", marks=pytest.mark.extended)])
def test_gpu_deepeps_bound_at_hidden_7168(fused):
    """Two ranks on one GPU, T 128, hidden 7168, top-8 of 32: DeepEP's test data, bf16 and FP8 dispatch; the LogFMT
    combine (one launch, or split) is the oracle's bit for bit and under DeepEP's bound. About 75 s alone on an
    H200, so the split form (which the 1,024-wide tests above also run) is in the extended tier."""
    out = ok_results(run_ranks(LC.deepep_accuracy, 2, 32, 8, 7168, 128, "cuda", fused, backend="gloo"))
    assert all(len(d) == 8 for d in out), out


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["1", "0"])
def test_gpu_round_trip_and_records(fused):
    """On the GPU as on CPU (one launch with ``TRITON_EP_FUSED=1``, split with 0, and a hook): the oracle's results
    bit for bit, the reference's records in the area."""
    forms = ["one" if fused == "1" else "split", "hook"]
    ok_results(run_ranks(LC.across_hosts, 2, {"TRITON_EP_FUSED": fused}, "round_trip", forms, 8, 4, 1024, (24, 17), 32,
                         "cuda", backend="gloo"))


@pytest.mark.gpu
def test_gpu_across_hosts_bytes():
    for r in ok_results(run_ranks(LC.across_hosts, 2, _HOSTS, "round_trip", ["split", "hook"], 8, 4, 1024, (24, 17),
                                  32, "cuda", True, backend="gloo")):
        assert all(got == want for _, got, want in r["bytes"]), r["bytes"]


@pytest.mark.gpu
@pytest.mark.parametrize("use_fp8", [False, True])
def test_gpu_graph_capture_of_a_logfmt_combine(use_fp8):
    """Dispatch, the stand-in expert and a LogFMT combine in one CUDA graph (the split launches; the eager warm-up
    under sync debug mode "error"), 20 replays of fresh routing and data, each the oracle's bit for bit."""
    out = ok_results(run_ranks(ll_cases.gpu_graph_replay, 2, use_fp8, 20, 16, 4, 512, 24, 32, True, backend="gloo"))
    assert out == [20, 20], out


# ------------------------------------------------------------------------------------------------ sm_90 compiles
def _compile_for_sm90(tmp_path, *args):
    """benchmarks/logfmt_compile.py ``--check --json`` with ``args`` in a process of its own (it compiles for sm_90:
    no interpreter; nothing is launched): its rows. Skipped where this Triton has no ptxas."""
    out_json = tmp_path / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "logfmt_compile.py"), "--check", "--json",
                          str(out_json), *args], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0 and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("no ptxas with this Triton")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return json.loads(out_json.read_text())["rows"]


def test_logfmt_reduce_compiles_for_sm90_without_spilling(tmp_path):
    """The LogFMT reduce at hidden 7168, top-8, compiled for sm_90 as two ranks sharing a GPU launch it: no spill
    and fewer than 255 registers a thread (its eight decodes unrolled took 255 and spilled 272 bytes, and 4 to 7
    times as long to compile: the k loop of kernels/ll_combine.py reduce_part)."""
    rows = _compile_for_sm90(tmp_path, "--hidden", "7168", "--kernels", "reduce", "--logfmt", "1")
    assert len(rows) == 1 and rows[0]["spill_stores"] == 0 and rows[0]["regs"] < 255, rows


@pytest.mark.extended
def test_combine_kernels_compile_for_sm90_without_spilling(tmp_path):
    """Every low-latency combine kernel (split send and reduce, one launch; with and without LogFMT) at hidden 1024
    and 7168, ranks sharing a GPU or not, compiled for sm_90: none spills; the LogFMT one-launch combine (compiled
    with ``maxnreg`` 255) fits 2 programs a multiprocessor."""
    rows = _compile_for_sm90(tmp_path, "--hidden", "1024,7168", "--max-programs", "33,none")
    assert len(rows) == 16 and all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in rows), rows
    assert all(r["resident_per_sm"] >= 2 for r in rows if "one launch" in r["kernel"]), rows
