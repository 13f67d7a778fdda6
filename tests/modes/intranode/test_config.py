"""A per-call ``Config`` drives normal mode's launches (programs, rows per block, rounds, ``num_warps``) and never
its results (docs/tuning.md)."""
import pytest
import torch

from tests.cases import mp as mp_cases
from tests.cases.helpers import check_round_trip_virtual, make_inputs, raise_first, virtual_dispatch
from triton_ep import Buffer, Config
from triton_ep.config import NUM_SMS_SET
from triton_ep.kernels import launch as L
from triton_ep.kernels import params as LP
from triton_ep.kernels._util import tuning
from triton_ep.testing import VirtualGroup, run_ranks

#: extreme and ordinary Configs: one row a block at two programs; 64 rows a block at 2 rows a round; odd sizes
#: with 8 warps; far more SMs and rows than any launch has
CONFIGS = [pytest.param(None, marks=pytest.mark.extended), Config(2, 1, 4096), Config(2, 64, 1), Config(6, 3, 5, num_warps=8),
           Config(1000, 64, 4096, num_warps=1)]


def _spy(monkeypatch):
    """Every launch as ``(kernel name, BLOCK_T, programs)``, in order."""
    seen, real = [], L.BoundLaunch.__call__

    def spied(self, *args):
        seen.append((self.launcher.name, self.meta.get("BLOCK_T"), self.grid[0]))
        return real(self, *args)
    monkeypatch.setattr(L.BoundLaunch, "__call__", spied)
    return seen


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: repr(c))
def test_results_are_bit_identical_whatever_the_config(config, monkeypatch):
    """dispatch, combine (weights and bias) and a cached dispatch on 2 simulated ranks with ``config`` on every
    call, bit for bit against the reference (so against every other Config), and the launches are the
    Config's: its rows per block and program bound, its rounds."""
    seen = _spy(monkeypatch)
    check_round_trip_virtual(2, 8, 2, 64, [5, 3], 7, 1 << 20, config=config)
    normal = [s for s in seen if s[0] in LP.ROW_KERNELS]
    assert normal
    if config is None:
        assert all(bt == tuning(name)["block_t"] for name, bt, _ in normal), normal
        return
    p = LP.of_config(config, 2)
    assert all(bt == p.rows_per_block and g <= config.num_sms for _, bt, g in normal), normal
    sends = sum(name == "dispatch_send" for name, _, _ in seen)
    # 2 dispatches on 2 ranks, in one round each, or several at 2 rows a round
    assert sends > 4 if p.round_rows == 2 else sends == 4, (config, sends)


def test_launch_parameters_of_a_config():
    """The mapping: programs = num_sms x programs per SM, rows = the send chunk rounded down to a power of two (at
    most 64) with the tile of the built-in entry, rounds of recv tokens x channels x ranks, the Config's warps."""
    p = LP.of_config(Config(10, 6, 128, num_warps=8), 4)
    per_sm = max(tuning("grid")["programs_per_sm"], 1)
    assert (p.max_programs, p.rows_per_block, p.round_rows, p.num_warps) == (10 * per_sm, 4, 128 * 5 * 4, 8)
    for name, wkey in LP.ROW_KERNELS.items():
        e, base = p.table[name], tuning(name)
        assert e["block_t"] == 4 and e["num_warps"] == 8
        assert e[wkey] * 4 <= base["block_t"] * base[wkey] < e[wkey] * 8, (name, e, base)
    assert p.table["grid"]["max_programs"] == 10 * per_sm
    assert LP.of_config(Config(2, 1000, 1), 16).rows_per_block == 64
    assert LP.of_config(Config(2, 1000, 1), 16).round_rows == 8        # 1 token x 1 channel x 8 ranks
    assert LP.of_config(None, 4) is None if NUM_SMS_SET.value is None else True
    for mode in LP.MIN_NUM_SMS:     # (across hosts dispatch and combine run this check before anything moves)
        with pytest.raises(ValueError, match=f"num_sms is 1, below the {mode} normal mode's minimum of 2"):
            LP.check_num_sms(Config(1), mode)
        LP.check_num_sms(Config(2), mode)


def test_set_num_sms_bounds_calls_without_a_config(monkeypatch):
    """After ``Buffer.set_num_sms(n)`` a call without a Config launches at most ``n`` x programs per SM programs (its
    own plan key); the built-in tables otherwise."""
    monkeypatch.setattr(NUM_SMS_SET, "value", None)
    assert LP.config_key(None) is None
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    Buffer.set_num_sms(4)
    assert LP.config_key(None) == ("set_num_sms", 4)
    p = LP.of_config(None, 2)
    assert p.max_programs == 4 * max(tuning("grid")["programs_per_sm"], 1) and p.rows_per_block == 0
    assert p.table["dispatch_send"] == dict(tuning("dispatch_send"))


@pytest.mark.parametrize("num_sms", [1])
def test_num_sms_below_the_minimum_raises_before_any_launch(num_sms, monkeypatch):
    """``Config(num_sms=1)``: ``ValueError`` naming 1 and the minimum 2 on every rank, for dispatch and combine,
    before anything is launched; inputs unchanged; the group goes on with a good Config."""
    E, K, H, Ts = 8, 2, 64, [4, 3]
    xs, idxs, ws = make_inputs(3, E, K, H, Ts)
    keep = [x.clone() for x in xs]
    vg = VirtualGroup(2, 1 << 20)
    seen = _spy(monkeypatch)
    layouts = [vg.buffers[r].get_dispatch_layout(idxs[r], E) for r in range(2)]
    del seen[:]
    kw = [dict(x=xs[r], num_tokens_per_rank=layouts[r][0], is_token_in_rank=layouts[r][3],
               num_tokens_per_expert=layouts[r][2], topk_idx=idxs[r], topk_weights=ws[r], config=Config(num_sms))
          for r in range(2)]
    for res in vg.call("dispatch", kw):
        assert isinstance(res, ValueError) and f"num_sms is {num_sms}" in str(res) and "minimum of 2" in str(res)
    assert not seen, seen
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(xs, keep))
    res = raise_first(virtual_dispatch(vg, xs, idxs, ws, E, config=Config(2)))
    del seen[:]
    out = vg.call("combine", [dict(x=res[r][0], handle=res[r][4], config=Config(num_sms)) for r in range(2)])
    assert all(isinstance(e, ValueError) and "minimum of 2" in str(e) for e in out), out
    assert not seen, seen


@pytest.mark.multiprocess
def test_a_new_config_replans_and_its_plan_replays():
    """Ranks as processes: a cached dispatch and combine replay their handle's plan only under the Config it was
    made for; another Config (or none) takes the general path and launches with its own rows per block, programs
    and rounds, and its plan replays on the next call (bit for bit against the reference throughout)."""
    for steps in _values(run_ranks(mp_cases.replays_follow_config, 2, 5)):
        replays = [s[0] for s in steps]
        # step: one_row (plans), one_row (replays 2), small_rounds (general), small_rounds (replays 2), None
        # (general), one_row (general: the handle keeps the last call's plan)
        assert replays == [0, 2, 2, 4, 4, 4], replays
        for k in (0, 1, 5):
            assert steps[k][1]["dispatch_send"] == (1, 2) and steps[k][1]["combine_reduce"][0] == 1, steps[k]
            assert steps[k][2] == 1, steps[k]
        for k in (2, 3):
            assert steps[k][1]["dispatch_send"][0] == 64 and steps[k][2] > 1, steps[k]
        assert steps[4][1]["dispatch_send"][0] == tuning("dispatch_send")["block_t"] and steps[4][2] == 1


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS[1:] + [Config(24, 2, 256, num_warps=8), Config(132, 4, 512, num_warps=4)],
                         ids=lambda c: repr(c))
def test_results_are_bit_identical_whatever_the_config_on_gpu(config):
    """The same round trip with compiled kernels on one GPU (2 simulated ranks), bit for bit against the reference."""
    check_round_trip_virtual(2, 8, 2, 256, [37, 5], 7, 1 << 20, device="cuda", config=config)
