"""Copying segments in: their rows into the column files, before they are published.

:class:`SegmentWrites` copies a block of segments into the slots claimed for them (step keys
per step slot, observations on the tail slot too, the older frames of a frame-stacked key
into its record's prefix) and computes their checksums from what the files then hold. It
touches no metadata: :meth:`~.slot_records.SlotRecords.publish` makes the segments visible.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from millpond.service.chains import Chains
from millpond.service.segment_batch import SegmentBatch, check_step_range
from millpond.spec import OBSERVATION, Key


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order, as a flat view (a copy only if it is not contiguous)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class SegmentWrites(Chains):
    """The copy of segments into their claimed slots (a base of the storage)."""

    columns: dict[Key, torch.Tensor]
    prefixes: dict[Key, torch.Tensor]
    _column_fds: dict[Key, int]
    _row_copy: dict[Key, bool]

    def write(
        self,
        layout: SegmentBatch,
        steps: dict[Key, torch.Tensor],
        tails: dict[Key, torch.Tensor],
        frames: dict[Key, torch.Tensor] | None = None,
        records: np.ndarray | None = None,
        chains: np.ndarray | None = None,
    ) -> None:
        """Copy segments into their reserved slots (no metadata is touched).

        A segment that continues another on its tail slot (:mod:`.regions`) rewrites that
        slot's observation with the same bytes and fills its step keys, which the tail's
        segment does not cover.

        ``steps`` holds every key for all steps, segment after segment; ``tails`` holds the
        observation keys, one row per segment. Frame-stacked keys come in ``frames``
        instead (``L + k`` rows per segment, see :mod:`millpond.frame_stacks`), and their
        prefixes go to ``records`` (from :meth:`take_records`), or, in a table with chains,
        to the prefix rows of ``chains`` (from :meth:`take_chains`; a segment that continues
        its chain stores none). Refuses
        (:class:`InvalidDataError`, before copying anything) segments whose steps would
        count past the int64 range.
        """
        assert self.spec is not None
        if self.stacks and records is None:
            raise ValueError("a table with frame stacks writes into records taken first")
        if self.chains is not None and chains is None:
            raise ValueError("a table with chains writes into chain rows taken first")
        check_step_range(layout.episode_ids, layout.first_steps, layout.lengths)
        # Segments lie back to back in a block, or apart (in writers' regions).
        base = int(layout.starts.min())
        n_slots = int((layout.starts + layout.lengths).max()) + 1 - base
        rel = (layout.starts - base).tolist()
        lengths = layout.lengths.tolist()
        rows = (np.cumsum(layout.lengths) - layout.lengths).tolist()
        step_rel = tail_rel = None
        own = None
        if self.stacks:
            assert records is not None
            own = self.own_prefix_rows(layout.starts, records, chains)
        for key, f in self.spec.fields.items():
            block = self.columns[key][base : base + n_slots]
            if key in self.stacks:
                self._write_frames(key, base, (frames or {})[key], rel, lengths, own)
                continue
            src = steps[key]
            if self._row_copy[key]:
                # Large rows: each segment's steps are contiguous in the block and in the
                # source, so plain slice copies (memcpy) beat index_copy_'s per-row kernel
                # by ~15x on image observations.
                # Written through the file, not the map: pwrite fills the page cache without
                # faulting each page into this process (a fresh or written-back page costs a
                # fault per 4 KiB through the map: ~0.5 GB/s, against ~10 GB/s).
                fd, row = self._column_fds[key], f.nbytes
                data = _bytes_of(src)
                for s, r, n in zip(rel, rows, lengths):
                    _pwrite(fd, data[r * row : (r + n) * row], (base + s) * row)
                if f.role == OBSERVATION:
                    tail = _bytes_of(tails[key])
                    for i, (s, n) in enumerate(zip(rel, lengths)):
                        _pwrite(fd, tail[i * row : (i + 1) * row], (base + s + n) * row)
                continue
            if step_rel is None:
                step_rel = torch.from_numpy(layout.step_slots() - base)
                tail_rel = torch.from_numpy(layout.starts + layout.lengths - base)
            block.index_copy_(0, step_rel, src)
            if f.role == OBSERVATION:
                block.index_copy_(0, tail_rel, tails[key])
        # Of what the files hold now: a copy that went wrong is caught too.
        layout.sums = self._data_sums(layout.starts, layout.lengths, records, chains)

    def _write_frames(
        self,
        key: Key,
        base: int,
        src: torch.Tensor,
        rel: list[int],
        lengths: list[int],
        prefix_rows: np.ndarray | None,
    ) -> None:
        """Copy one frame-stacked key: each segment's ``L + k`` frames, the first ``k - 1``
        to its prefix row (none for a row 0: a segment that continues its chain), the rest
        one per slot (with pwrite, as :meth:`write`)."""
        assert prefix_rows is not None
        k = self.stacks[key]
        prefix = self.prefixes[key]
        fd, row = self._column_fds[key], src[0].numel() * src.element_size()
        data = _bytes_of(src)
        at = 0
        for s, n, r in zip(rel, lengths, prefix_rows.tolist()):
            if r > 0:
                prefix[r].copy_(src[at : at + k - 1])
            first = at + k - 1
            _pwrite(fd, data[first * row : (first + n + 1) * row], (base + s) * row)
            at += n + k
