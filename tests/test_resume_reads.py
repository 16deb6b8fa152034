"""A resume reads each byte once: the rules of `checkpointing/reads.py` against brute force, the byte-range reader
against torch's whole reads, and a DP2 checkpoint resumed at DP2 and at TP2 x DP1 (bit-equal to Megatron-Core's
plain load, reading the checkpoint's tensor bytes once in all)."""

import itertools
import math
import random

import pytest
import torch

from megatron_rl.checkpointing.reads import MERGE_GAP, chunk_read_ranges, read_owners, runs


def _region_bytes(shape, itemsize, offsets, lengths) -> set:
    """Every byte of the region's elements in the chunk's row-major data."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = set()
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets, lengths))):
        flat = sum(i * s for i, s in zip(index, strides))
        out.update(range(flat * itemsize, (flat + 1) * itemsize))
    return out


def test_chunk_read_ranges_cover_the_region_and_only_gaps_shorter_than_the_merge_gap():
    rng = random.Random(0)
    for _ in range(400):
        ndim = rng.randint(0, 4)
        shape = tuple(rng.choice([1, 2, 3, 5, 8, 17, 40]) for _ in range(ndim))
        offsets = tuple(rng.randint(0, s - 1) for s in shape)
        lengths = tuple(rng.randint(0 if rng.random() < 0.05 else 1, s - o) for s, o in zip(shape, offsets))
        itemsize = rng.choice([1, 2, 4, 8])
        want = _region_bytes(shape, itemsize, offsets, lengths)
        # the runs: the region's bytes exactly, contiguous pieces in order
        run_bytes = [b for s, n in runs(shape, itemsize, offsets, lengths) for b in range(s, s + n)]
        assert run_bytes == sorted(want)
        ranges = chunk_read_ranges(shape, itemsize, offsets, lengths)
        covered = [b for s, n in ranges for b in range(s, s + n)]
        assert covered == sorted(set(covered)), "ranges overlap or are out of order"
        assert want <= set(covered)
        for (s, n), (t, _) in zip(ranges, ranges[1:]):
            assert t - (s + n) >= MERGE_GAP  # ranges closer than the gap would have been merged
        for s, n in ranges:  # a range starts and ends on the region; what it reads besides are short gaps
            assert s in want and s + n - 1 in want
            extra = sorted(set(range(s, s + n)) - want)
            holes = [list(g) for _, g in itertools.groupby(enumerate(extra), lambda e: e[1] - e[0])]
            assert all(len(h) < MERGE_GAP for h in holes)


def test_read_owners_is_the_greedy_balance_order_free_and_near_the_brute_force_best():
    rng = random.Random(1)
    for _ in range(200):
        n, world = rng.randint(1, 7), rng.randint(1, 3)
        sizes = [(f"k{rng.randint(0, 3)}", (rng.randint(0, 3),), rng.choice([1, 2, 3, 5, 8, 8])) for _ in range(n)]
        sizes = list({(k, o): (k, o, b) for k, o, b in sizes}.values())  # a (key, offset) names one tensor
        owners = read_owners(sizes, world)
        assert all(0 <= o < world for o in owners)
        shuffled = sizes[:]
        rng.shuffle(shuffled)
        again = dict(zip(shuffled, read_owners(shuffled, world)))
        assert [again[s] for s in sizes] == owners  # every rank computes the same, whatever its order
        loads = [sum(b for (_, _, b), o in zip(sizes, owners) if o == r) for r in range(world)]
        best = min(max(sum(b for (_, _, b), o in zip(sizes, assign) if o == r) for r in range(world))
                   for assign in itertools.product(range(world), repeat=len(sizes)))
        assert max(loads) <= best * (4 / 3 - 1 / (3 * world)) + 1e-9  # Graham's bound for largest-first
        assert max(loads) - min(loads) <= max(b for _, _, b in sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_region_read_as_byte_ranges_equals_torchs_whole_read(tmp_path, dtype):
    """Chunks as torch.save writes them, views included: one with a storage offset in a larger storage (the fast
    path reads at the offset), a 0-d tensor, a transposed view (not contiguous: torch's whole read)."""
    import os

    from megatron_rl.checkpointing.chunk_reads import Slice as _Slice, chunk_layout as _chunk_layout
    from megatron_rl.checkpointing.chunk_reads import fast_chunk_layout as _fast_chunk_layout, read_region as _read_region

    rng = random.Random(2)
    big = (torch.randn(40, 33, 7) * 100).to(dtype)  # larger than the two header windows, even as bool
    cases = {"whole": big.clone(), "offset view": big[13:29], "0-d": big[1, 2, 3], "transposed": big[0].t()}
    blob = tmp_path / "chunks"
    spans = {}
    with open(blob, "wb") as f:
        f.write(b"x" * 13)  # chunks sit at arbitrary offsets of a .distcp file
        for name, t in cases.items():
            start = f.tell()
            torch.save(t, f)
            spans[name] = (start, f.tell() - start)
    fd = os.open(blob, os.O_RDONLY)
    try:
        for name, t in cases.items():
            layout = _chunk_layout(_Slice(fd, *spans[name]).with_headers())
            # The headers parsed without torch.load give the same layout, or leave it to torch.load (None)
            assert _fast_chunk_layout(_Slice(fd, *spans[name]).with_headers()) == layout, name
            if name == "transposed":
                assert layout is None
                continue
            assert layout.shape == tuple(t.shape) and layout.dtype == dtype
            for _ in range(20):
                offsets = tuple(rng.randint(0, s - 1) for s in t.shape)
                lengths = tuple(rng.randint(1, s - o) for s, o in zip(t.shape, offsets))
                into = torch.empty(lengths, dtype=dtype) if rng.random() < 0.5 else None  # read into place
                got, n = _read_region(_Slice(fd, *spans[name]), layout, offsets, lengths, into=into)
                want = t[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))]
                assert got.dtype == dtype and torch.equal(got, want), name
                assert into is None or got.data_ptr() == into.data_ptr()
                assert n == sum(k for _, k in chunk_read_ranges(tuple(t.shape), t.element_size(), offsets, lengths))
    finally:
        os.close(fd)


def test_a_dp2_checkpoint_resumes_at_dp2_and_tp2_bit_equal_reading_each_byte_once(tmp_path):
    """Saved at TP1 x DP2 with a KL reference; loaded at DP2 (the weights are read by one DP rank each and
    broadcast, the larger in place, the smaller coalesced) and at TP2 x DP1 (each TP rank reads only its half of
    each chunk). Every rank gets Megatron-Core's plain load bit for bit (into state poisoned with NaN), and the
    ranks together read at most 1.05x the tensor bytes the checkpoint holds, where torch's whole-chunk reads take
    more (so the bound can fail). The files read ahead of the loads (`resume_read_ahead`) are those they open: at
    the saved layout all of them, resharded the small ones only."""
    from ckpt_workers import resume_reads
    from megatron_rl.launch.spawn import run_local
    from rl_workers import random_full_state

    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    out = run_local(resume_reads, 2, str(state), str(tmp_path / "run"))
    tensor_bytes = sum(out[0]["tensor_bytes"].values())
    for layout in ("dp2", "tp2"):
        assert all(r[layout]["differences"] == [] for r in out), [r[layout]["differences"] for r in out]
        before = sum(r[layout]["before"][0] for r in out)
        after = sum(r[layout]["after"][0] for r in out)
        assert after <= 1.05 * tensor_bytes, (layout, after, tensor_bytes)
        assert before > 1.05 * tensor_bytes, (layout, before, tensor_bytes)
    assert all(r["dp2"]["received"] > 0 for r in out)  # each DP rank got the weights the other read
    # The weights of 4 KB and more went in place (as themselves), the smaller ones coalesced (as bytes).
    messages = out[0]["dp2"]["messages"]
    assert messages == out[1]["dp2"]["messages"]
    in_place = [n for dtype, n in messages if dtype != "torch.uint8"]
    assert in_place and all(n >= 4096 for n in in_place) and any(dtype == "torch.uint8" for dtype, _ in messages)
    # What a resume reads ahead of its loads: with the first, both directories' small files (which every rank
    # reads) and its own shards of the model; with the second, its own shards of the optimizer. At the layout it
    # was saved with, these are exactly the files its loads then open; resharded (TP2 x DP1), the small files only.
    small = {f"{d}/{name}" for d in ("model", "optimizer") for name in ("metadata.json", "common.pt", ".metadata")}
    for k, r in enumerate(out):
        first, second = r["dp2"]["read_ahead"]
        assert sorted(first + second) == sorted(r["dp2"]["opened"]), (k, first, second, sorted(r["dp2"]["opened"]))
        assert first[:len(small)] and set(first[:len(small)]) == small
        assert {f.split("/")[0] for f in first[len(small):]} == {"model"}
        assert {f.split("/")[0] for f in second} == {"optimizer"}
        assert all(f.split("/")[1].startswith(f"__{k}_") for f in first[len(small):] + second)
        first, second = r["tp2"]["read_ahead"]
        assert set(first) == small and second == [] and small < r["tp2"]["opened"]


def test_a_tensor_pickle_names_nothing_but_a_tensor_or_the_fast_path_declines(tmp_path):
    """`_TensorPickle` builds and calls nothing: a chunk whose pickle names any other global (here one that would
    run a command) is left to torch.load's own checks, which refuse it (weights_only)."""
    import io
    import os
    import pickle
    import zipfile

    from megatron_rl.checkpointing.chunk_reads import Slice as _Slice, chunk_layout as _chunk_layout
    from megatron_rl.checkpointing.chunk_reads import fast_chunk_layout as _fast_chunk_layout

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    buf = io.BytesIO()
    torch.save(torch.zeros(3), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(blob := io.BytesIO(), "w") as dst:
        for info in src.infolist():
            data = pickle.dumps(Evil(), protocol=2) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)
    path = tmp_path / "chunk"
    path.write_bytes(blob.getvalue())
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _fast_chunk_layout(_Slice(fd, 0, path.stat().st_size).with_headers()) is None
        with pytest.raises(pickle.UnpicklingError):
            _chunk_layout(_Slice(fd, 0, path.stat().st_size).with_headers())
    finally:
        os.close(fd)
    assert not (tmp_path / "ran").exists()


class _Events:
    """Records the order of a `ParallelLoadStrategy`'s base loads and of the read-ahead it starts and stops."""

    def __init__(self):
        self.log = []

    def base(self, fail_on=None):
        events = self

        class Base:
            def load(self, sharded_state_dict, checkpoint_dir):
                events.log.append(("base", checkpoint_dir))
                if checkpoint_dir == fail_on:
                    raise OSError("the disk")
                return {}

        return Base()

    def read_ahead(self):
        events = self

        class ReadAhead:
            def __init__(self, extents):
                events.log.append(("ahead", extents))

            def stop(self):
                events.log.append(("stop",))

        return ReadAhead


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


def test_each_loads_files_are_read_ahead_the_first_from_its_start_the_next_from_the_end_of_the_reads_before(
        monkeypatch):
    """`read_ahead`: the first load's extents are read ahead from its start (while it plans), the second's from the
    moment the first load's own reads are done (where the exchange of replicated tensors begins), each until its
    own load's reads are done; `close()` ends what runs and what would follow; a load whose reads fail starts no
    further read-ahead."""
    from megatron_rl.checkpointing import loader

    model, optimizer = [("model/__0_0.distcp", 0, 4096)], [("optimizer/__0_0.distcp", 0, 8192)]
    both = [("ahead", model), ("base", "model"), ("stop",), ("ahead", optimizer)]
    for second, want in ((True, both + [("base", "optimizer"), ("stop",)]), (False, both + [("stop",)])):
        events = _Events()
        monkeypatch.setattr(loader, "ReadAhead", events.read_ahead())
        strategy = loader.ParallelLoadStrategy(events.base(), _OneRank(), read_ahead=[model, optimizer])
        strategy.load({}, "model")
        if second:
            strategy.load({}, "optimizer")
        strategy.close()
        strategy.close()  # a second close is nothing
        assert events.log == want
    events = _Events()
    monkeypatch.setattr(loader, "ReadAhead", events.read_ahead())
    strategy = loader.ParallelLoadStrategy(events.base(fail_on="model"), _OneRank(), read_ahead=[model, optimizer])
    with pytest.raises(OSError):
        strategy.load({}, "model")
    strategy.close()
    assert events.log == [("ahead", model), ("base", "model"), ("stop",)]
