"""Disaggregated transfer: capture ranks send each micro-batch's features point-to-point to the
trainer ranks that train on it.

Trainer t (its data-parallel rank among the trainers) is served by capture rank t % N (N capture
ranks, `capture_schedule`). A message is a header [b, S, D, dtype, sample indices...] then the
features as bytes. Up to PREFETCH_DEPTH batches per trainer are in flight, so capture of step n+1
overlaps training of step n; a trainer checks that the samples it receives are the ones it is about
to train on.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque

import torch
import torch.distributed as dist

from dflash2.faults import current_timeout

PREFETCH_DEPTH = 2
HEADER_FIELDS = 4  # b, S, D (feature bytes per position), dtype code; then b sample indices
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def capture_schedule(num_capture: int, num_trainers: int) -> list[list[int | None]]:
    """rounds[j][c]: the trainer capture rank c serves in sub-round j of every micro-batch, or None
    (a padding forward: the sharded target's forward is collective, so all capture ranks run it)."""
    num_rounds = math.ceil(num_trainers / num_capture)
    return [
        [t if (t := j * num_capture + c) < num_trainers else None for c in range(num_capture)]
        for j in range(num_rounds)
    ]


class FeatureSender:
    """Capture side: non-blocking sends, at most `depth` micro-batches in flight per trainer."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        micro_batch_size: int,
        device: torch.device,
        served: list[int],
        depth: int = PREFETCH_DEPTH,
    ) -> None:
        """`served`: the ranks of the trainers this capture rank feeds; each gets an end marker at
        close(), also one this rank never sent a batch (a launch that resumes at its last step, a
        stop before the first step), whose receiver would otherwise wait until the timeout."""
        self.group, self.device, self.depth = group, device, depth
        self.header_size = HEADER_FIELDS + micro_batch_size
        self.in_flight: dict[int, deque] = {dst: deque() for dst in served}

    def _send(self, dst: int, header: list[int], payload: torch.Tensor | None) -> None:
        pending = self.in_flight.setdefault(dst, deque())
        while len(pending) >= self.depth:
            for work in pending.popleft()[0]:
                work.wait(timeout=current_timeout()[0])  # a gloo send, too, keeps its group's first timeout
        header_t = torch.full((self.header_size,), -1, dtype=torch.long, device=self.device)
        header_t[: len(header)] = torch.tensor(header, dtype=torch.long)
        works = [dist.isend(header_t, dst, group=self.group)]
        if payload is not None:
            works.append(dist.isend(payload, dst, group=self.group))
        pending.append((works, header_t, payload))  # tensors stay alive until their send completes

    def send(self, dst: int, indices: list[int], features: torch.Tensor) -> None:
        """features [b, S, K*H] for samples `indices`, sent as raw bytes (any dtype over any backend)."""
        payload = features.contiguous().view(torch.uint8)  # [b, S, K*H * itemsize]
        b, seq_len, num_bytes = payload.shape
        self._send(dst, [b, seq_len, num_bytes, DTYPE_CODES[features.dtype], *indices], payload)

    def close(self) -> None:
        """An end marker (b = 0) to every trainer, then wait for everything to be delivered."""
        for dst in list(self.in_flight):
            self._send(dst, [0, 0, 0, 0], None)
        for pending in self.in_flight.values():
            for works, *_ in pending:
                for work in works:
                    work.wait(timeout=current_timeout()[0])


class FeatureReceiver:
    """Trainer side: a thread receives features from capture rank `src` into a bounded queue
    (the prefetch); `batch(indices, seq_len)` is the same call as OfflineFeatures.batch."""

    def __init__(
        self,
        src: int,
        group: dist.ProcessGroup,
        micro_batch_size: int,
        device: torch.device,
        depth: int = PREFETCH_DEPTH,
    ) -> None:
        self.src, self.group, self.device = src, group, device
        self.header_size = HEADER_FIELDS + micro_batch_size
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.num_served = 0
        self.thread = threading.Thread(target=self._receive_all, name="feature-receiver", daemon=True)
        self.thread.start()

    def _receive_all(self) -> None:
        try:
            while True:
                header = torch.empty(self.header_size, dtype=torch.long, device=self.device)
                self._recv(header)
                b, seq_len, num_bytes, code = header[:HEADER_FIELDS].tolist()
                if b == 0:
                    self.queue.put(None)
                    return
                payload = torch.empty(b, seq_len, num_bytes, dtype=torch.uint8, device=self.device)
                self._recv(payload)
                indices = header[HEADER_FIELDS : HEADER_FIELDS + b].tolist()
                self.queue.put((indices, payload.view(CODE_DTYPES[code])))
        except Exception as error:  # handed to the training thread, which raises it
            self.queue.put(error)

    def _recv(self, tensor: torch.Tensor) -> None:
        """Receive into `tensor`, waiting at most the timeout of the phase this rank is in (a gloo
        receive keeps the timeout its group was made with: the start-up's, 30 minutes by default)."""
        dist.irecv(tensor, self.src, group=self.group).wait(timeout=current_timeout()[0])

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        self.num_served += 1
        item = self.queue.get()
        if isinstance(item, Exception):
            raise RuntimeError(f"receiving features from capture rank {self.src} failed: {item}") from item
        if item is None:
            raise RuntimeError(
                f"capture rank {self.src} has no more features for micro-batch {self.num_served}"
            )
        received, features = item
        if received != list(indices) or features.shape[1] != seq_len:
            raise RuntimeError(
                f"micro-batch {self.num_served}: capture rank {self.src} sent samples {received} "
                f"({features.shape[1]} positions), this trainer expects {list(indices)} ({seq_len}); "
                "capture and trainer ranks disagree on the data order"
            )
        return features

    def drain(self) -> None:
        """Discard what the capture rank sent beyond the trainer's last step (it ran ahead, or the run
        stopped early), up to its end marker, so that its sends complete and it can finish."""
        while (item := self.queue.get()) is not None:
            if isinstance(item, Exception):
                raise RuntimeError(
                    f"receiving features from capture rank {self.src} failed: {item}"
                ) from item
