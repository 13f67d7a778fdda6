"""triton_ep.testing.LiveBytes, the measure of a call's live memory that tests/modes/internode/test_capture_path.py
bounds: bytes of new storages only (views, in-place and out= ops add nothing), each once, until freed; the peak."""
import gc

import torch

from triton_ep.testing import LiveBytes


def test_counts_each_new_storage_once_until_it_is_freed():
    before = torch.zeros(1000, dtype=torch.float32)             # made outside the block: never counted
    with LiveBytes() as m:
        a = torch.empty(1000, dtype=torch.float32)              # 4000
        b = a[10:]                                              # a view: nothing
        c = a + 1                                               # 4000 more
        before.add_(1)                                          # in place on a storage made before: nothing
        v = before.view(10, 100)                                # its view: nothing
        w = before.new_empty(0)
        w.set_(before.untyped_storage(), 0, (1000,), (1,))      # onto a storage made before: nothing
        c.mul_(2)                                               # in place: nothing
        assert m.now == 8000
        del a
        assert m.now == 8000                                    # b still holds a's storage
        del b
        assert m.now == 4000
        d = torch.index_select(before, 0, torch.arange(500, dtype=torch.int64))   # index 4000 (freed), rows 2000
        assert (m.now, m.peak) == (6000, 10000)
        e = torch.empty(0, dtype=torch.float32)
        torch.cat([c, c], out=e)                                # out= resizes a storage of the block: 8000
        assert (m.now, m.peak) == (14000, 14000)
        del c, d, e, v, w
    assert m.now == 0 and m.freed_all and m.peak == 14000
    biggest = m.largest(1)[0]
    assert biggest.nbytes == 8000 and biggest.op == "aten.empty.memory_format" and "test_live_bytes.py" in biggest.site
    assert [a.nbytes for a in m.peak_live] == [8000, 4000, 2000]


def test_a_cycle_of_the_measured_code_counts_until_collected():
    """``collect`` collects only after Triton's interpreter launches (whose reference cycles hold their arguments):
    memory the measured code itself leaves in a cycle still counts, as on a GPU until Python's collector runs."""
    from triton.runtime.interpreter import GridExecutor
    call = GridExecutor.__call__
    gc.disable()
    try:
        with LiveBytes() as m:
            assert GridExecutor.__call__ is not call
            box = [torch.empty(256, dtype=torch.uint8)]
            box.append(box)                                     # a cycle
            del box
            assert m.now == 256
            gc.collect()
            assert m.now == 0
    finally:
        gc.enable()
    assert GridExecutor.__call__ is call and m.peak == 256
